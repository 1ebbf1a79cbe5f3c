"""memory/step.py: what a sample shape is (one rule for every entry point) and the example batch built from it."""
import numpy as np
import pytest
import torch

import memfit
from memfit.memory.step import ExampleBatch, is_shape, sample_shape


@pytest.mark.parametrize("x, shape", [(3, (3,)), ((3, 32, 32), (3, 32, 32)), ([4, 5], (4, 5)),
                                      ((np.int64(2), 7), (2, 7)), (torch.tensor(6), (6,))])
def test_a_sample_shape_is_ints_without_the_batch(x, shape):
    assert is_shape(x) and sample_shape(x) == shape
    assert tuple(ExampleBatch(x).at(5, torch.device("meta")).shape) == (5, *shape)


@pytest.mark.parametrize("x", [(0, 3), (-1,), (), (True, 2), (2.0, 3)])
def test_a_bad_sample_shape_is_refused_the_same_way_everywhere(x):
    with pytest.raises((ValueError, TypeError), match="sample shape"):
        sample_shape(x)
    with pytest.raises((ValueError, TypeError), match="sample shape"):
        memfit.memory_model(torch.nn.Linear(3, 2), x)


def test_an_example_batch_is_not_a_shape():
    for batch in (torch.zeros(2, 3), {"x": torch.zeros(2, 3)}, (torch.zeros(2),)):
        assert not is_shape(batch)

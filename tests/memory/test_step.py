"""memory/step.py: what a sample shape is (one rule for every entry point) and the example batch built from it."""
import dataclasses

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


def test_garbage_since_collects_what_the_block_made_and_leaves_a_freeze_of_the_process_alone():
    """The cycles made in the block are freed, the older ones wait for a full pass (not walked: the point), and
    the process's own gc.freeze() is neither undone nor joined: there every collect is a full one."""
    import gc
    import weakref

    from memfit.memory.step import garbage_since

    class Node:
        pass

    def cycle():
        a = Node()
        a.self = a
        return weakref.ref(a)
    enabled = gc.isenabled()
    gc.disable()                        # no automatic pass frees the cycles behind the test's back
    try:
        old = cycle()
        with garbage_since() as collect:
            young = cycle()
            collect()
            assert young() is None and old() is not None
        assert gc.get_freeze_count() == 0
        gc.collect()
        assert old() is None
        gc.freeze()                     # the process's own, before forking workers, say
        frozen = gc.get_freeze_count()
        try:
            old = cycle()
            with garbage_since() as collect:
                collect()
                assert old() is None    # a full collect
            assert 0 < gc.get_freeze_count() <= frozen      # not given back, nothing added (some freed since)
        finally:
            gc.unfreeze()
    finally:
        if enabled:
            gc.enable()


def test_overlapping_garbage_since_blocks_never_freeze_what_a_running_one_made():
    """Three threads' fake runs overlapping as A in, B in, A out, C in: C must not freeze B's garbage (B's collect
    would then miss it and count its bytes held). Frozen by the first block in, given back by the last out."""
    import gc
    import threading
    import weakref

    from memfit.memory.step import garbage_since

    class Node:
        pass

    step = {k: threading.Event() for k in ("a_in", "b_made", "a_out", "c_in", "b_done")}
    seen = {}

    def a():
        with garbage_since():
            step["a_in"].set()
            step["b_made"].wait(10)
        step["a_out"].set()

    def b():
        step["a_in"].wait(10)
        with garbage_since() as collect:
            n = Node()
            n.self = n
            ref = weakref.ref(n)
            del n
            step["b_made"].set()
            step["c_in"].wait(10)
            collect()
            seen["b freed its cycle"] = ref() is None
        step["b_done"].set()

    def c():
        step["a_out"].wait(10)
        with garbage_since():
            step["c_in"].set()
            step["b_done"].wait(10)

    enabled = gc.isenabled()
    gc.disable()
    try:
        threads = [threading.Thread(target=f) for f in (a, b, c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert seen == {"b freed its cycle": True}
        assert gc.get_freeze_count() == 0
    finally:
        if enabled:
            gc.enable()


def test_a_tensor_given_twice_is_one_tensor_counted_once_and_rebuilt_as_one():
    """`(ids, ids)`, `labels=ids`, `target=ids` beside `ids`: one tensor for the allocator, so for the example batch,
    and two slices alike of it (accumulate's micro-batches of a batch on the device) too; two views that differ
    (a shifted pair) are two, counted apart."""
    ids, meta = torch.zeros(2, 16, dtype=torch.long), torch.device("meta")
    pair = ExampleBatch((ids, ids))
    assert pair.bytes_per_sample() == 16 * 8 and pair.per_sample() == [16 * 8]
    a, b = pair.at(3, meta)
    assert a is b and a.shape == (3, 16)
    batch = ExampleBatch({"input_ids": ids, "mask": torch.ones(2, 16)})
    target = ExampleBatch(ids[0:2], beside=batch)                 # a slice alike: the same tensor
    assert target.bytes_per_sample() == 0 and batch.bytes_per_sample() == 16 * (8 + 4)
    x = batch.at(5, meta)
    assert target.at(5, meta, x) is x["input_ids"] and target.at(5, meta).shape == (5, 16)
    assert ExampleBatch(ids.clone(), beside=batch).bytes_per_sample() == 16 * 8      # equal values, another tensor
    assert ExampleBatch((ids[:, :-1], ids[:, 1:])).bytes_per_sample() == 2 * 15 * 8
    # made again from shapes alone (`memory.recheck`): still the batch's tensor
    assert dataclasses.replace(target, template=ids.to(meta)).bytes_per_sample() == 0

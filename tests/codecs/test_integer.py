"""memfit.codecs.integer: the integer and bit-packed codecs."""
import numpy as np
import pytest
import torch
from codec_cases import roundtrip

from memfit.codecs import make_codec


def test_int8_stores_value_minus_128():
    x = torch.tensor([[0, 128, 255]], dtype=torch.uint8)
    _, stored, _ = roundtrip("int8", x)
    assert stored.dtype == torch.int8 and stored.tolist() == [[-128, 0, 127]]


@pytest.mark.parametrize("d", [1, 7, 8, 9, 784])
def test_packing_sizes(d):
    x = torch.randint(0, 2, (3, d), dtype=torch.uint8)
    c, stored, back = roundtrip("bits1", x)
    assert stored.shape == (3, (d + 7) // 8) and torch.equal(back.to(torch.uint8), x)
    assert torch.equal(stored, torch.from_numpy(np.packbits(x.numpy().astype(bool), axis=1)))
    c, stored, _ = roundtrip("q4", x.float())
    assert stored.shape == (3, (d + 1) // 2)


@pytest.mark.parametrize("name, value, found, wider", [("int16", 40_000, "40000", "int32"),
                                                      ("int32", 3_000_000_000, r"3e\+09", "int64")])
def test_an_integer_out_of_range_names_the_next_wider_codec(name, value, found, wider):
    x = torch.tensor([[0, value]], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"codec '{name}' needs values in .*found {found} .*use codec='{wider}'"):
        make_codec(name).encode(x)

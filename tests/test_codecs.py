"""Codecs on their own: exactness, error bounds, packing sizes, and the values each rejects."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.codecs import CODECS, auto_name, available, make_codec


def roundtrip(codec, x):
    c = make_codec(codec)
    c.fit(x)
    stored = c.encode(x)
    a, b = c.affine()
    shape = (1, -1) + (1,) * (x.dim() - 2)
    back = c.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
    return c, stored, back


@pytest.mark.parametrize("codec", ["uint8", "int8", "q8", "float32"])
def test_lossless_on_8bit_values(codec):
    x = torch.arange(256, dtype=torch.float32).view(4, 1, 8, 8)
    c, stored, back = roundtrip(codec, x)
    assert torch.equal(back.float(), x)
    assert c.max_abs_error == 0


def test_int8_stores_value_minus_128():
    x = torch.tensor([[0, 128, 255]], dtype=torch.uint8)
    _, stored, _ = roundtrip("int8", x)
    assert stored.dtype == torch.int8 and stored.tolist() == [[-128, 0, 127]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 9), st.floats(-1e3, 1e3), st.floats(1e-3, 1e3),
       st.sampled_from(["q8", "q4"]), st.integers(0, 2**31))
def test_quantised_error_within_half_a_step(n, c, d, loc, scale, codec, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, d, generator=g, dtype=torch.float64).float() * scale + loc
    cod, stored, back = roundtrip(codec, x)
    err = (back - x.double()).abs()
    step = cod.step.view(1, -1, 1)
    assert (err <= step / 2 * (1 + 1e-9) + 1e-12).all()
    assert err.max().item() <= cod.max_abs_error + 1e-12          # the reported bound is the real worst
    ulp = 1e-15 * x.abs().max().item()                               # float64 rounding at |x| >> step
    assert cod.max_abs_error <= cod.step.max().item() / 2 * (1 + 1e-9) + ulp


def test_constant_channel_is_exact():
    x = torch.full((5, 2, 3), 7.25)
    x[:, 1] = torch.linspace(-1, 1, 15).view(5, 3)
    c, _, back = roundtrip("q8", x)
    assert torch.equal(back[:, 0].float(), x[:, 0])


@pytest.mark.parametrize("d", [1, 7, 8, 9, 784])
def test_packing_sizes(d):
    x = torch.randint(0, 2, (3, d), dtype=torch.uint8)
    c, stored, back = roundtrip("bits1", x)
    assert stored.shape == (3, (d + 7) // 8) and torch.equal(back.to(torch.uint8), x)
    assert torch.equal(stored, torch.from_numpy(np.packbits(x.numpy().astype(bool), axis=1)))
    c, stored, _ = roundtrip("q4", x.float())
    assert stored.shape == (3, (d + 1) // 2)


def test_fp16_and_bf16_report_their_error():
    x = torch.tensor([[1 / 3, 1000.1, -2.5]], dtype=torch.float32)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c, stored, back = roundtrip(name, x)
        assert stored.dtype == dtype
        assert c.max_abs_error == pytest.approx((x.double() - x.to(dtype).double()).abs().max().item())


@pytest.mark.parametrize("codec, value, match", [
    ("uint8", 300.0, r"codec 'uint8' needs values in \[0, 255\], found 300 at sample 1, channel 0; use codec='q8'"),
    ("uint8", -1.0, r"found -1"),
    ("uint8", 2.5, r"needs integer values, found 2.5"),
    ("int8", 256.0, r"codec 'int8' needs values in \[0, 255\]"),
    ("bits1", 2.0, r"codec 'bits1' needs values in \[0, 1\], found 2 .*binarise"),
    ("q8", float("nan"), r"codec 'q8' needs finite values; found 1 NaN/inf"),
    ("q4", float("inf"), r"needs finite values"),
    ("fp16", 1e6, r"codec 'fp16' holds values up to 65504, found 1e\+06; use codec='bf16'"),
])
def test_bad_values_are_named(codec, value, match):
    x = torch.zeros(3, 2, 4)
    x[1, 0, 2] = value
    c = make_codec(codec)
    with pytest.raises(ValueError, match=match):
        c.fit(x)
        c.encode(x)


def test_registry_and_auto():
    assert set(CODECS) == {"uint8", "int8", "q8", "q4", "bits1", "fp16", "bf16", "float32"}
    assert available()[0] == "auto"
    assert auto_name(np.zeros(1, np.uint8)) == "uint8"
    assert auto_name(np.zeros(1, np.float32)) == "q8"
    assert auto_name(torch.zeros(1, dtype=torch.bool)) == "bits1"
    with pytest.raises(ValueError, match=r"unknown codec 'jpeg'; expected one of \['auto', 'uint8'"):
        make_codec("jpeg")


def test_unfitted_quantiser_says_so():
    with pytest.raises(ValueError, match="not fitted"):
        make_codec("q8").encode(torch.zeros(1, 1))

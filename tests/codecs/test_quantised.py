"""memfit.codecs.quantised: q8 and q4 within half a quantisation step."""
import pytest
import torch
from codec_cases import roundtrip
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.codecs import make_codec


@settings(max_examples=40, deadline=None, derandomize=True)
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
    # the bound is half a step plus the float32 decode's worst rounding, nothing more
    assert cod.max_abs_error <= cod.step.max().item() / 2 * (1 + 1e-9) + ulp + cod.decode_rounding().max().item()


def test_constant_channel_is_exact():
    x = torch.full((5, 2, 3), 7.25)
    x[:, 1] = torch.linspace(-1, 1, 15).view(5, 3)
    c, _, back = roundtrip("q8", x)
    assert torch.equal(back[:, 0].float(), x[:, 0])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 20), st.floats(-1e4, 1e4), st.floats(1e-3, 1e4), st.sampled_from(["q8", "q4"]),
       st.integers(0, 2**31))
def test_quantised_bound_holds_for_the_float32_decode(channels, loc, max_scale, codec, seed):
    """The advertised max_abs_error bounds what the dataset really hands out (float32 arithmetic),
    with per-channel scales up to 1e4 (20 channels: the two-pass decode of many channels too)."""
    from memfit.compact import CompactDataset
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(channels, generator=g, dtype=torch.float64) * max_scale
    x = (torch.randn(16, channels, 3, generator=g, dtype=torch.float64) * scales.view(1, -1, 1) + loc).float()
    ds = CompactDataset.from_arrays(x, codec=codec, device="cpu")
    err = (ds.batch(slice(None))[0].double() - x.double()).abs().max().item()
    assert err <= ds.codec.max_abs_error
    assert ds.codec.max_abs_error <= ds.codec.step.max().item() * 0.5 * 1.01 + 1e-6 * (abs(loc) + max_scale * 6)
    assert "LOSSY" in ds.codec.describe() and "LOSSY" in repr(ds)


def test_unfitted_quantiser_says_so():
    with pytest.raises(ValueError, match="not fitted"):
        make_codec("q8").encode(torch.zeros(1, 1))

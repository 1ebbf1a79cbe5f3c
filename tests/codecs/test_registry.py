"""memfit.codecs.registry: make_codec, available and auto_codec (the narrowest exact codec, bit-exact round trips)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.codecs import CODECS, Codec, auto_codec, available, make_codec


def test_registry_and_auto():
    assert available() == ["auto", *CODECS]
    for name, cls in CODECS.items():                # each entry is the codec of that name, and makes one
        assert issubclass(cls, Codec) and cls.name == name and make_codec(name).name == name
    assert auto_codec(np.zeros(1, np.uint8)).name == "uint8"
    assert auto_codec(torch.zeros(1, dtype=torch.bool)).name == "bits1"
    with pytest.raises(ValueError, match=r"unknown codec 'jpeg'; expected one of \['auto', 'uint8'"):
        make_codec("jpeg")


@pytest.mark.parametrize("x, name", [
    (np.array([[0.0, 255.0]], np.float32), "uint8"),            # integer-valued floats: exact in a byte
    (np.array([[-0.0, 1.0]], np.float32), "fp16"),              # -0.0 is not a byte value
    (np.array([[0.5, 1e4]], np.float32), "fp16"),
    (np.array([[1 + 2**-7, 2.0**100]], np.float32), "bf16"),
    (np.array([[1 / 3, 2.0]], np.float32), "float32"),
    (np.array([[1 / 3, 2.0]], np.float64), "float64"),
    (np.array([[0.25, 2.0]], np.float64), "fp16"),
    (np.array([[0, 30521]], np.int64), "int16"),               # BERT token ids (q8 erred by 59.7 here)
    (np.array([[-5, 100]], np.int64), "int8"),
    (np.array([[0, 70000]], np.int32), "int32"),
    (np.array([[0, 2**40]], np.int64), "int64"),
    (np.array([[0, 65535]], np.uint16), "int32"),
])
def test_auto_picks_the_narrowest_exact_codec(x, name):
    c = auto_codec(x)
    assert c.name == name and "lossless" in c.describe()


INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32]
FLOAT_DTYPES = [np.float16, np.float32, np.float64]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(INT_DTYPES + FLOAT_DTYPES + [np.bool_]))
    shape = (draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    g = np.random.default_rng(draw(st.integers(0, 2**31)))
    if dtype == np.bool_:
        return g.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        lo = draw(st.integers(int(info.min), int(info.max)))
        hi = draw(st.integers(lo, int(info.max)))
        return g.integers(lo, hi, shape, dtype=dtype, endpoint=True)
    kind = draw(st.sampled_from(["bytes", "halves", "wide", "tiny", "signed zeros"]))
    if kind == "bytes":
        x = g.integers(0, 256, shape).astype(dtype)
    elif kind == "halves":
        x = (g.integers(-2048, 2048, shape) / 8).astype(dtype)
    elif kind == "signed zeros":
        x = np.where(g.random(shape) < 0.5, -0.0, 1.0).astype(dtype)
    else:
        scale = draw(st.floats(1e-30, 1e30)) if kind == "wide" else 1e-6
        x = (g.standard_normal(shape) * min(scale, float(np.finfo(dtype).max) / 10)).astype(dtype)
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a, b) and (not a.is_floating_point() or torch.equal(a.signbit(),
                                                                                                 b.signbit()))


@settings(max_examples=80, deadline=None, derandomize=True)
@given(arrays())
def test_auto_round_trips_bit_exactly(x):
    """Whatever the dtype and range, auto stores x so that decoding in x's own precision gives x back."""
    from memfit.compact import CompactDataset
    ref = torch.from_numpy(x.astype(np.int64) if x.dtype.kind in "iu" and x.dtype != np.uint8 else x)
    wide = torch.int64 if x.dtype.kind in "iu" and x.dtype != np.uint8 else torch.float64
    ds = CompactDataset.from_arrays(x, device="cpu", dtype=wide)
    assert "lossless" in ds.codec.describe() and ds.codec.max_abs_error == 0
    back = ds.batch(slice(None))[0]
    assert same_bits(back, ref.to(wide))
    if wide == torch.int64:                      # the default for integer data: int64 out, bit-exact
        assert same_bits(CompactDataset.from_arrays(x, device="cpu").batch(slice(None))[0], ref)
    else:      # the default: float32 where it holds every value (then equal to a plain cast), else float64: exact
        out = CompactDataset.from_arrays(x, device="cpu").batch(slice(None))[0]
        exact32 = ref.dtype != torch.float64 or torch.equal(ref.float().double(), ref)
        assert same_bits(out, ref.float() if exact32 else ref.double())

"""Codecs on their own: exactness, error bounds, packing sizes, and the values each rejects."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.codecs import CODECS, Codec, auto_codec, available, make_codec


def roundtrip(codec, x):
    c = make_codec(codec)
    c.fit(x)
    stored = c.encode(x)
    a, b = c.affine()
    shape = (1, -1) + (1,) * (x.dim() - 2)
    back = c.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
    return c, stored, back


# Candidate inputs, widest first; each codec is tested on every one it accepts (its own `check` says), so a
# new codec in CODECS is tested without being listed here.
def _candidates() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "wide floats": torch.randn(5, 3, 7, generator=g, dtype=torch.float64) * 300 + 20,
        "int64": torch.randint(-2**40, 2**40, (5, 3, 7), generator=g),
        "int32": torch.randint(-2**31, 2**31, (5, 3, 7), generator=g),
        "int16": torch.randint(-2**15, 2**15, (5, 3, 7), generator=g),
        "signed bytes": torch.randint(-128, 128, (5, 3, 7), generator=g),
        "bytes": torch.randint(0, 256, (5, 3, 7), generator=g).float(),
        "bits": torch.randint(0, 2, (5, 3, 7), generator=g).float(),
    }


def accepted(codec: str) -> list[tuple[str, torch.Tensor]]:
    out = []
    for kind, x in _candidates().items():
        c = make_codec(codec)
        try:
            c.fit(x)
            c.check(x)
        except ValueError:
            continue
        out.append((kind, x))
    return out


@pytest.mark.parametrize("codec", list(CODECS))
def test_every_codec_round_trips_within_its_reported_bound(codec):
    inputs = accepted(codec)
    assert inputs, f"codec {codec!r} accepts none of {list(_candidates())}: add an input it takes"
    for kind, x in inputs:
        c, stored, back = roundtrip(codec, x)
        err = (back - x.double()).abs().max().item()
        assert err <= c.max_abs_error + 1e-12 * x.double().abs().max().item(), (kind, err, c.max_abs_error)
        if c.lossless or c.max_abs_error == 0:          # what describe() calls lossless is bit-exact
            assert torch.equal(back, x.double()), kind
            assert "lossless" in c.describe()
        else:
            assert "LOSSY" in c.describe() and f"{c.max_abs_error:.4g}" in c.describe()


@pytest.mark.parametrize("codec", list(CODECS))
@pytest.mark.parametrize("sample_shape", [(1,), (3, 7), (2, 3, 5), (9,)])
def test_every_codec_stores_the_shape_and_dtype_it_declares(codec, sample_shape):
    x = torch.randint(0, 2, (4, *sample_shape)).float()      # 0/1: every codec takes it
    c = make_codec(codec)
    c.fit(x)
    stored = c.encode(x)
    assert stored.shape == (4, *c.stored_shape(sample_shape)) and stored.dtype == c.stored_dtype
    codes = c.unpack(stored, sample_shape)
    assert codes.shape == (4, *sample_shape) and codes.device == stored.device
    width = c.unpacked_width(tuple(stored.shape[1:]))
    if width:                                  # unpacking into a given buffer gives the same codes
        out = torch.empty(4 * width, dtype=torch.uint8)
        assert torch.equal(c.unpack(stored, sample_shape, out=out), codes)


@pytest.mark.parametrize("codec", list(CODECS))
def test_every_codec_decodes_within_its_bound_through_a_dataset(codec):
    """What a CompactDataset hands out (float64 output here: the codec's error alone) is within the bound."""
    from memfit.compact import CompactDataset
    for kind, x in accepted(codec):
        ds = CompactDataset.from_arrays(x.numpy(), codec=codec, device="cpu", dtype=torch.float64)
        back = ds.batch(slice(None))[0]
        err = (back - x.double()).abs().max().item()
        assert err <= ds.codec.max_abs_error + 1e-12 * x.double().abs().max().item(), (kind, err)


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
    ("uint8", 300.0, r"codec 'uint8' needs values in \[0, 255\], found 300 at sample 1, channel 0; use codec='auto'"),
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


@pytest.mark.parametrize("name, value, found, wider", [("int16", 40_000, "40000", "int32"),
                                                      ("int32", 3_000_000_000, r"3e\+09", "int64")])
def test_an_integer_out_of_range_names_the_next_wider_codec(name, value, found, wider):
    x = torch.tensor([[0, value]], dtype=torch.int64)
    with pytest.raises(ValueError, match=rf"codec '{name}' needs values in .*found {found} .*use codec='{wider}'"):
        make_codec(name).encode(x)

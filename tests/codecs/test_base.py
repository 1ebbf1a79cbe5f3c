"""The Codec contract (memfit.codecs.base), over every entry of CODECS: round trips within the reported bound,
the stored shape and dtype, bad values named."""
import pytest
import torch
from codec_cases import roundtrip

from memfit.codecs import CODECS, make_codec


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

"""Codecs: how a dataset's samples are stored compactly and decoded just before use.

Each codec turns input values into a stored tensor (`encode`) and back into codes (`unpack`);
the codes become real values through a per-channel affine `codes * a + b` (`affine`), which the
dataset folds together with normalisation into one multiply-add (integer outputs: `codes + offset`).

| codec   | stored as                  | bytes / value | exact for                              |
|---------|----------------------------|---------------|----------------------------------------|
| uint8   | the 8-bit values           | 1             | integers in [0, 255]                   |
| int8    | value - offset (128 or 0)  | 1             | integers in [0, 255] (or [-128, 127])  |
| int16/int32/int64 | the integers     | 2, 4, 8       | integers in the type's range           |
| bits1   | packed bits, 8/B           | 1/8           | 0 / 1 images                           |
| fp16/bf16/float32/float64 | casts    | 2, 2, 4, 8    | values the type holds exactly          |
| q8      | per-channel affine uint8   | 1             | LOSSY: error <= half a step (+ float32 rounding) |
| q4      | per-channel 4-bit, 2/B     | 1/2           | LOSSY: error <= half a step (+ float32 rounding) |

`auto_codec(x)` picks only codecs that reproduce x exactly (the narrowest integer type that holds
its range, a half type where every value is exact, else float32/float64). A lossy codec is used
only when named, and reports a bound on its error (`max_abs_error`, `describe()`).

Example:
    >>> import torch
    >>> auto_codec(torch.tensor([[0, 30521], [101, 2]])).name      # token ids: exact in int16
    'int16'
    >>> c = make_codec("q8")
    >>> x = torch.tensor([[0.0, 1.0], [0.5, 0.25]])      # (N=2, C=2)
    >>> c.fit(x); stored = c.encode(x)
    >>> stored.dtype, c.lossless, bool(c.max_abs_error <= c.step.max() / 2 * 1.001)
    (torch.uint8, False, True)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from memfit.arrays import by_channel, channel_min_max, iter_chunks

__all__ = ["Array", "BFloat16Codec", "Bits1Codec", "CODECS", "CastCodec", "Codec", "Float16Codec", "Float32Codec",
           "Float64Codec", "Int16Codec", "Int32Codec", "Int64Codec", "Int8Codec", "IntCodec", "Q4Codec", "Q8Codec",
           "QuantCodec", "UInt8Codec", "auto_codec", "available", "check_finite", "check_range", "make_codec"]

Array = torch.Tensor | np.ndarray


def _where(mask: torch.Tensor) -> str:
    """'sample 3, channel 1' for the first True of a (N, C, ...) mask."""
    first = torch.nonzero(mask)[0].tolist()
    return f"sample {first[0]}, channel {first[1]}" if len(first) > 1 else f"sample {first[0]}"


def check_finite(x: torch.Tensor, codec: str) -> None:
    if x.is_floating_point():
        bad = ~torch.isfinite(x)
        if bad.any():
            raise ValueError(f"codec {codec!r} needs finite values; found {int(bad.sum())} NaN/inf values "
                             f"(first at {_where(bad)}); clean the data (e.g. np.nan_to_num) first")


def check_range(x: torch.Tensor, lo: float, hi: float, codec: str, hint: str, integral: bool = True) -> None:
    """Raise a ValueError naming the worst value and where it is when x leaves [lo, hi]."""
    check_finite(x, codec)
    if x.dtype == torch.bool or (x.dtype == torch.uint8 and lo <= 0 and hi >= 255):
        return
    xmin, xmax = x.min().item(), x.max().item()
    if xmin < lo or xmax > hi:
        worst = xmax if xmax > hi else xmin
        raise ValueError(f"codec {codec!r} needs values in [{lo:g}, {hi:g}], found {worst:g} at "
                         f"{_where(x == worst)}; {hint}")
    if integral and x.is_floating_point() and not torch.equal(x, x.round()):
        frac = x != x.round()
        raise ValueError(f"codec {codec!r} needs integer values, found {x[frac].flatten()[0].item():g} at "
                         f"{_where(frac)}; {hint}")


class Codec:
    """Base class. Subclasses set `name` and `lossless`; `stored_shape`/`stored_dtype` say what is stored."""
    name = "?"
    lossless = True
    offset: int | None = None       # integer codecs: value = stored + offset exactly (integer outputs need it)

    def __init__(self) -> None:
        self.max_abs_error = 0.0          # a bound on |decoded - original| over everything encoded
        self.channels: int | None = None

    def fit(self, x: torch.Tensor) -> None:
        """Learn parameters from (a chunk of) the data; call once per chunk before `encode`."""
        if self.channels is None:
            self.channels = x.shape[1]

    def check(self, x: torch.Tensor) -> None:
        """Raise ValueError when x cannot be stored by this codec."""
        check_finite(x, self.name)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(n, *sample_shape) CPU tensor -> (n, *stored_shape) stored tensor."""
        raise NotImplementedError

    def unpack(self, stored: torch.Tensor, sample_shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, *stored_shape) -> (n, *sample_shape) codes (integers or floats) on the same device.

        Codecs that unpack into new memory (`unpacked_width` > 0) write into `out` when given: a
        contiguous uint8 buffer of at least n * unpacked_width elements (loaders reuse one)."""
        return stored

    def unpacked_width(self, stored_shape: tuple[int, ...]) -> int:
        """Bytes per sample `unpack` writes into new memory (0: it returns the stored rows or a view)."""
        return 0

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel (a, b), float64 (C,): value = code * a + b."""
        c = self.channels or 1
        return torch.ones(c, dtype=torch.float64), torch.full((c,), float(self.offset or 0), dtype=torch.float64)

    def stored_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sample_shape)

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8

    def describe(self) -> str:
        """'uint8 (lossless)' or 'q8 (LOSSY: |decoded - x| <= 0.0118)': what a user must know about it."""
        if self.lossless or self.max_abs_error == 0:
            return f"{self.name} (lossless)"
        return f"{self.name} (LOSSY: |decoded - x| <= {self.max_abs_error:.4g} in the units of x)"

    def __repr__(self) -> str:
        extra = "" if self.lossless else f", max_abs_error={self.max_abs_error:.4g}"
        if self.offset:
            extra += f", offset={self.offset}"
        return f"{type(self).__name__}(name={self.name!r}{extra})"


class IntCodec(Codec):
    """Integers stored as they are in a narrower integer type (value = stored + offset), exactly."""
    dtype = torch.int16
    offset = 0

    def __init__(self, offset: int | None = None) -> None:
        super().__init__()
        if offset is not None:
            self.offset = offset

    @property
    def range(self) -> tuple[int, int]:
        info = torch.iinfo(self.dtype)
        return info.min + self.offset, info.max + self.offset

    @property
    def stored_dtype(self):
        return self.dtype

    def check(self, x):
        lo, hi = self.range
        wider = next((n for n, c in CODECS.items() if issubclass(c, IntCodec) and c.dtype.itemsize
                      > self.dtype.itemsize), "int64")
        check_range(x, lo, hi, self.name, f"use codec='{wider}' or codec='auto' (the narrowest exact type)")

    def encode(self, x):
        self.check(x)
        if self.offset:
            return (x.to(torch.int64) - self.offset).to(self.dtype)
        return x.to(self.dtype)


class UInt8Codec(IntCodec):
    """8-bit values stored as they are: the cheapest decode (one convert plus one multiply-add)."""
    name, dtype = "uint8", torch.uint8

    def check(self, x):
        check_range(x, 0, 255, self.name, "use codec='auto' (lossless) or 'q8' (lossy) for float data, "
                    "or scale to 0..255")


class Int8Codec(IntCodec):
    """int8 storage: 0..255 values as x - 128 (the default offset: 8-bit images centred on zero),
    or signed values in [-128, 127] with offset 0 (what `auto_codec` picks for such data)."""
    name, dtype, offset = "int8", torch.int8, 128

    def check(self, x):
        lo, hi = self.range
        check_range(x, lo, hi, self.name, "use codec='q8' for float data, or scale to 0..255"
                    if self.offset else "use codec='int16' or codec='auto'")


class Int16Codec(IntCodec):
    name, dtype = "int16", torch.int16


class Int32Codec(IntCodec):
    name, dtype = "int32", torch.int32


class Int64Codec(IntCodec):
    name, dtype = "int64", torch.int64


class QuantCodec(Codec):
    """Float data quantised per channel (axis 1) to `levels + 1` codes between the channel's min and max."""
    lossless = False
    levels = 255

    def __init__(self) -> None:
        super().__init__()
        self.lo: torch.Tensor | None = None   # (C,) float64 channel minimum
        self.hi: torch.Tensor | None = None   # (C,) float64 channel maximum

    def fit(self, x):
        super().fit(x)
        if x.shape[0] == 0:
            return
        check_finite(x, self.name)
        lo, hi = channel_min_max(x)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    @property
    def step(self) -> torch.Tensor:
        """(C,) quantisation step; 1 for constant channels (any step is exact there)."""
        if self.lo is None:
            raise ValueError(f"codec {self.name!r} was not fitted: call fit(x) before encode")
        span = self.hi - self.lo
        return torch.where(span > 0, span / self.levels, torch.ones_like(span))

    def affine(self):
        return self.step, self.lo.clone()

    def _track_error(self, x: torch.Tensor, stored: torch.Tensor) -> None:
        """Raise `max_abs_error` to a bound on |decoded - x| that holds for the float32 decode.

        Two parts, per channel: the quantisation error |code * a + b - x| (at most half a step),
        measured exactly in float64, plus the worst rounding of the float32 decode of any code
        (`decode_rounding`). The first part alone understates the error of what a user gets (by 2e-4
        with per-channel scales of 1e3).
        """
        if not x.numel():
            return
        a, b = self.affine()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        back = self.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
        quant = (back - x.double()).abs()                                            # (n, C, ...)
        per_channel = by_channel(quant).amax(1)                                      # (C,)
        bound = per_channel * (1 + 2**-40) + self.decode_rounding()
        self.max_abs_error = max(self.max_abs_error, float(bound.max()))

    def decode_rounding(self) -> torch.Tensor:
        """(C,) worst |float32 decode - exact value| over every code, for the ways a float32 decode can
        round: a and b rounded to float32, then one rounding (fused) or two (multiply, then add)."""
        a, b = self.affine()                                          # float64 (C,)
        codes = torch.arange(self.levels + 1, dtype=torch.float64)    # every code a value can have
        exact = codes[None, :] * a[:, None] + b[:, None]              # (C, L)
        a32, b32 = a.float().double()[:, None], b.float().double()[:, None]
        fused = (codes * a32 + b32).float().double()
        fused_wide = (codes * a[:, None] + b32).float().double()      # alpha passed as a float64 scalar
        two = ((codes * a32).float().double() + b32).float().double()
        worst = torch.stack([fused, fused_wide, two]).sub_(exact).abs_().amax((0, 2))
        return worst

    def quantise(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        step = self.step                     # raises when the codec was not fitted
        shape = (1, -1) + (1,) * (x.dim() - 2)
        q = ((x.double() - self.lo.view(shape)) / step.view(shape)).round_()
        return q.clamp_(0, self.levels).to(torch.uint8)


class Q8Codec(QuantCodec):
    """float -> uint8 with a per-channel scale and zero point; error at most half a step."""
    name = "q8"

    def encode(self, x):
        q = self.quantise(x)
        self._track_error(x, q)
        return q


class Q4Codec(QuantCodec):
    """float -> 16 levels per channel, two values per byte (high nibble first)."""
    name = "q4"
    levels = 15

    def stored_shape(self, sample_shape):
        return ((math.prod(sample_shape) + 1) // 2,)

    def encode(self, x):
        q = self.quantise(x).reshape(x.shape[0], -1)          # (n, D) codes 0..15
        if q.shape[1] % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        packed = (q[:, 0::2] << 4) | q[:, 1::2]               # (n, ceil(D/2))
        self._track_error(x, packed)
        return packed

    def unpacked_width(self, stored_shape):
        return 2 * stored_shape[0]

    def unpack(self, stored, sample_shape, out=None):
        n, w = stored.shape[0], 2 * stored.shape[1]
        out = (torch.empty((n, w), dtype=torch.uint8, device=stored.device) if out is None
               else out.reshape(-1)[:n * w].view(n, w))
        torch.bitwise_right_shift(stored, 4, out=out[:, 0::2])
        torch.bitwise_and(stored, 15, out=out[:, 1::2])
        return out[:, :math.prod(sample_shape)].reshape(n, *sample_shape)


class Bits1Codec(Codec):
    """Binary images, eight values per byte (most significant bit first, as np.packbits)."""
    name = "bits1"
    offset = 0

    def check(self, x):
        check_range(x, 0, 1, self.name, "bits1 stores 0/1 images; binarise first, e.g. (x > 127)")

    def stored_shape(self, sample_shape):
        return ((math.prod(sample_shape) + 7) // 8,)

    def encode(self, x):
        self.check(x)
        bits = x.reshape(x.shape[0], -1).to(torch.uint8)            # (n, D) of 0/1
        bits = torch.nn.functional.pad(bits, (0, -bits.shape[1] % 8)).view(x.shape[0], -1, 8)
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=x.device)
        return (bits * weights).sum(-1, dtype=torch.uint8)           # (n, ceil(D/8)), as np.packbits

    def unpacked_width(self, stored_shape):
        return 8 * stored_shape[0]

    def unpack(self, stored, sample_shape, out=None):
        n = stored.shape[0]
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=stored.device)
        if out is None:
            bits = (stored.unsqueeze(-1) >> shifts) & 1            # (n, P, 8)
        else:
            bits = out.reshape(-1)[:n * 8 * stored.shape[1]].view(n, -1, 8)
            torch.bitwise_right_shift(stored.unsqueeze(-1), shifts, out=bits).bitwise_and_(1)
        return bits.view(n, -1)[:, :math.prod(sample_shape)].reshape(n, *sample_shape)


class CastCodec(Codec):
    """A plain cast: lossless where the type holds every value exactly (what `auto_codec` checks),
    else the measured worst rounding is reported in `max_abs_error`."""
    dtype = torch.float32
    limit = float("inf")
    lossless = False

    @property
    def stored_dtype(self):
        return self.dtype

    def check(self, x):
        check_finite(x, self.name)
        if self.limit < float("inf") and x.numel():
            big = x.abs().max().item()
            if big > self.limit:
                raise ValueError(f"codec {self.name!r} holds values up to {self.limit:g}, found {big:g}; "
                                 "use codec='bf16' or 'float32', or normalise first")

    def _exact(self) -> CastCodec:
        """This codec, declared lossless: the caller checked that every value is exact in `dtype`."""
        self.lossless = True
        return self

    def encode(self, x):
        self.check(x)
        stored = x.to(self.dtype)
        if not self.lossless and x.numel():
            # the cast back to float64 is exact, so this is the true worst error of what is stored
            err = (stored.double() - x.double()).abs().max().item()
            self.max_abs_error = max(self.max_abs_error, err)
        return stored


class Float64Codec(CastCodec):
    name, dtype, lossless = "float64", torch.float64, True


class Float32Codec(CastCodec):
    name, dtype = "float32", torch.float32


class Float16Codec(CastCodec):
    name, dtype, limit = "fp16", torch.float16, 65504.0


class BFloat16Codec(CastCodec):
    name, dtype = "bf16", torch.bfloat16


CODECS: dict[str, type[Codec]] = {c.name: c for c in (
    UInt8Codec, Int8Codec, Int16Codec, Int32Codec, Int64Codec, Q8Codec, Q4Codec, Bits1Codec, Float16Codec,
    BFloat16Codec, Float32Codec, Float64Codec)}


def available() -> list[str]:
    """Names accepted by `make_codec` and `CompactDataset.from_arrays(codec=...)`."""
    return ["auto", *CODECS]


def _torch_dtype(x: Array) -> torch.dtype:
    return x.dtype if isinstance(x, torch.Tensor) else torch.from_numpy(np.empty(0, x.dtype)).dtype


def _exact_in(chunk: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(chunk.to(dtype).to(chunk.dtype), chunk))


def _int_codec(lo: int, hi: int) -> Codec:
    """The narrowest integer codec that holds [lo, hi] exactly."""
    if 0 <= lo and hi <= 255:
        return UInt8Codec()
    if -128 <= lo and hi <= 127:
        return Int8Codec(offset=0)
    for cls in (Int16Codec, Int32Codec):
        info = torch.iinfo(cls.dtype)
        if info.min <= lo and hi <= info.max:
            return cls()
    return Int64Codec()


def auto_codec(x: Array) -> Codec:
    """A fresh codec that reproduces every value of x exactly, in the fewest bytes (one pass over x).

    bool -> bits1; integers -> the narrowest integer type holding their range (uint8, int8, int16,
    int32, int64); floats -> uint8 when every value is an integer in [0, 255] (no -0.0), else fp16 or
    bf16 when every value is exact there, else float32 (float64 data not exact in float32: float64).
    Lossy codecs (q8, q4, fp16 on other data) are never chosen: name them to use them.
    """
    dtype = _torch_dtype(x)
    if dtype == torch.bool:
        return Bits1Codec()          # 0/1 data: eight values per byte
    if dtype == torch.uint8:
        return UInt8Codec()
    if not dtype.is_floating_point:
        lo, hi = 0, 0                # exact Python ints: float64 statistics would round int64 beyond 2**53
        for i, (_, chunk) in enumerate(iter_chunks(x)):   # bounded reads: a memmap is never read whole
            if chunk.numel():
                clo, chi = int(chunk.min()), int(chunk.max())
                lo, hi = (clo, chi) if i == 0 else (min(lo, clo), max(hi, chi))
        return _int_codec(lo, hi)
    byte, half, brain, single = True, True, True, True
    for _, chunk in iter_chunks(x):
        if not bool(torch.isfinite(chunk).all()):
            return Float64Codec() if dtype == torch.float64 else Float32Codec()   # encode names the bad value
        if byte:
            byte = bool(((chunk >= 0) & (chunk <= 255) & (chunk == chunk.round()) & ~chunk.signbit()).all())
        half = half and _exact_in(chunk, torch.float16)
        brain = brain and _exact_in(chunk, torch.bfloat16)
        single = single and _exact_in(chunk, torch.float32)
    if byte:
        return UInt8Codec()
    if half:
        return Float16Codec()._exact()
    if brain:
        return BFloat16Codec()._exact()
    return Float32Codec()._exact() if single else Float64Codec()


def make_codec(name: str | Codec) -> Codec:
    """A fresh codec instance by name (a Codec instance passes through)."""
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {available()}")
    return CODECS[name]()

"""Codecs: how a dataset's samples are stored compactly and decoded just before use.

Each codec turns float or 8-bit input into a stored tensor (`encode`) and back into codes
(`unpack`); the codes become real values through a per-channel affine `codes * a + b`
(`affine`), which the dataset folds together with normalisation into one multiply-add.

| codec   | stored as               | bytes / value | exact for                  |
|---------|-------------------------|---------------|----------------------------|
| uint8   | the 8-bit values        | 1             | integers in [0, 255]       |
| int8    | value - 128 (seed 000)  | 1             | integers in [0, 255]       |
| q8      | per-channel affine uint8| 1             | (max error <= half a step) |
| q4      | per-channel 4-bit, 2/B  | 1/2           | (max error <= half a step) |
| bits1   | packed bits, 8/B        | 1/8           | 0 / 1 images               |
| fp16/bf16/float32 | casts         | 2, 2, 4       | float32: everything        |

Example:
    >>> import torch
    >>> c = make_codec("q8")
    >>> x = torch.tensor([[0.0, 1.0], [0.5, 0.25]])      # (N=2, C=2)
    >>> c.fit(x); stored = c.encode(x)
    >>> stored.dtype, bool(c.max_abs_error <= c.step.max() / 2)
    (torch.uint8, True)
"""

from __future__ import annotations

import math

import numpy as np
import torch

Array = torch.Tensor | np.ndarray


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (axis 1) min and max of (N, C, ...) as float64 (C,) tensors."""
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    return flat.amin(1).double(), flat.amax(1).double()


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
    """Base class. Subclasses set `name`, `bits` (stored bits per value) and `lossless`."""
    name = "?"
    bits = 8
    lossless = True

    def __init__(self) -> None:
        self.max_abs_error = 0.0          # worst |decoded - original| over everything encoded
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

    def unpack(self, stored: torch.Tensor, sample_shape: tuple[int, ...]) -> torch.Tensor:
        """(n, *stored_shape) -> (n, *sample_shape) codes (integers or floats) on the same device."""
        return stored

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel (a, b), float64 (C,): value = code * a + b."""
        c = self.channels or 1
        return torch.ones(c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64)

    def stored_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sample_shape)

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8

    def param_bytes(self) -> int:
        """Bytes of per-channel parameters the dataset keeps beside the data."""
        return 0

    def nbytes(self, n: int, sample_shape: tuple[int, ...]) -> int:
        """Bytes n samples take when stored (data plus parameters)."""
        per = math.prod(self.stored_shape(sample_shape)) * torch.empty((), dtype=self.stored_dtype).element_size()
        return n * per + self.param_bytes()

    def _track_error(self, x: torch.Tensor, stored: torch.Tensor) -> None:
        if self.lossless:
            return
        a, b = self.affine()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        back = self.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
        err = (back - x.double()).abs().max().item() if x.numel() else 0.0
        self.max_abs_error = max(self.max_abs_error, err)

    def __repr__(self) -> str:
        extra = "" if self.lossless else f", max_abs_error={self.max_abs_error:.4g}"
        return f"{type(self).__name__}(name={self.name!r}{extra})"


class UInt8Codec(Codec):
    """8-bit values stored as they are: the cheapest decode (one convert plus one multiply-add)."""
    name = "uint8"

    def check(self, x):
        check_range(x, 0, 255, self.name, "use codec='q8' for float data, or scale to 0..255")

    def encode(self, x):
        self.check(x)
        return x.to(torch.uint8)


class Int8Codec(Codec):
    """Seed 000's scheme: 0..255 values stored as x - 128 in int8; decode adds the offset back."""
    name = "int8"

    def check(self, x):
        check_range(x, 0, 255, self.name, "use codec='q8' for float data, or scale to 0..255")

    def encode(self, x):
        self.check(x)
        return (x.to(torch.int16) - 128).to(torch.int8)

    @property
    def stored_dtype(self):
        return torch.int8

    def affine(self):
        a, _ = super().affine()
        return a, torch.full_like(a, 128.0)


class QuantCodec(Codec):
    """Float data quantised per channel (axis 1) to 2**bits levels between the channel's min and max."""
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
        lo, hi = _channel_stats(x)
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

    def param_bytes(self):
        return 2 * 4 * (self.channels or 0)   # scale and zero point per channel, float32

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
    bits = 4
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

    def unpack(self, stored, sample_shape):
        n = stored.shape[0]
        out = torch.empty((n, 2 * stored.shape[1]), dtype=torch.uint8, device=stored.device)
        torch.bitwise_right_shift(stored, 4, out=out[:, 0::2])
        torch.bitwise_and(stored, 15, out=out[:, 1::2])
        return out[:, :math.prod(sample_shape)].reshape(n, *sample_shape)


class Bits1Codec(Codec):
    """Binary images, eight values per byte (most significant bit first, as np.packbits)."""
    name = "bits1"
    bits = 1

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

    def unpack(self, stored, sample_shape):
        n = stored.shape[0]
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=stored.device)
        bits = (stored.unsqueeze(-1) >> shifts) & 1                # (n, P, 8)
        return bits.view(n, -1)[:, :math.prod(sample_shape)].reshape(n, *sample_shape)


class CastCodec(Codec):
    """A plain cast, for comparison and for data that must stay float."""
    dtype = torch.float32
    limit = float("inf")

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

    def encode(self, x):
        self.check(x)
        stored = x.to(self.dtype)
        if self.lossless:
            return stored
        err = (stored.double() - x.double()).abs().max().item() if x.numel() else 0.0
        self.max_abs_error = max(self.max_abs_error, err)
        return stored


class Float32Codec(CastCodec):
    name, dtype, bits = "float32", torch.float32, 32

    def __init__(self) -> None:
        super().__init__()
        self.lossless = True


class Float16Codec(CastCodec):
    name, dtype, bits, lossless, limit = "fp16", torch.float16, 16, False, 65504.0


class BFloat16Codec(CastCodec):
    name, dtype, bits, lossless = "bf16", torch.bfloat16, 16, False


CODECS: dict[str, type[Codec]] = {c.name: c for c in (
    UInt8Codec, Int8Codec, Q8Codec, Q4Codec, Bits1Codec, Float16Codec, BFloat16Codec, Float32Codec)}


def available() -> list[str]:
    """Names accepted by `make_codec` and `CompactDataset.from_arrays(codec=...)`."""
    return ["auto", *CODECS]


def auto_name(x: Array) -> str:
    """The codec 'auto' picks: uint8 for uint8 data, bits1 for bool, q8 for anything else."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else torch.from_numpy(np.empty(0, x.dtype)).dtype
    if dtype == torch.bool:
        return "bits1"          # 0/1 data: eight values per byte
    if dtype == torch.uint8:
        return "uint8"
    return "q8"


def make_codec(name: str | Codec) -> Codec:
    """A fresh codec instance by name (a Codec instance passes through)."""
    if isinstance(name, Codec):
        return name
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {available()}")
    return CODECS[name]()

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

One module per family: `base` (the `Codec` class, range checks), `integer` (exact integer types, bits1),
`quantised` (q8, q4), `casts` (float types), `registry` (names, `auto_codec`, `make_codec`); every name is
imported from here (`memfit.codecs.make_codec`).

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

from memfit.codecs.base import Array, Codec, check_finite, check_range
from memfit.codecs.casts import BFloat16Codec, CastCodec, Float16Codec, Float32Codec, Float64Codec
from memfit.codecs.integer import (
    Bits1Codec,
    Int8Codec,
    Int16Codec,
    Int32Codec,
    Int64Codec,
    IntCodec,
    UInt8Codec,
)
from memfit.codecs.quantised import Q4Codec, Q8Codec, QuantCodec
from memfit.codecs.registry import CODECS, auto_codec, available, make_codec

__all__ = ["Array", "BFloat16Codec", "Bits1Codec", "CODECS", "CastCodec", "Codec", "Float16Codec", "Float32Codec",
           "Float64Codec", "Int16Codec", "Int32Codec", "Int64Codec", "Int8Codec", "IntCodec", "Q4Codec", "Q8Codec",
           "QuantCodec", "UInt8Codec", "auto_codec", "available", "check_finite", "check_range", "make_codec"]

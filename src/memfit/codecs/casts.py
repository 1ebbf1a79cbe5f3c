"""Floating-point casts (`fp16`, `bf16`, `float32`, `float64`): lossless where the type holds every value (what
`auto_codec` checks), else the measured worst rounding is reported.
"""

from __future__ import annotations

import torch

from memfit.codecs.base import Codec, check_finite

__all__ = ["BFloat16Codec", "CastCodec", "Float16Codec", "Float32Codec", "Float64Codec"]

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

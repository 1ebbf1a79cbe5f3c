"""Exact integer storage: integers in a narrower integer type (`uint8`, `int8`, `int16`, `int32`, `int64`,
value = stored + offset) and 0/1 images packed eight to a byte (`bits1`).
"""

from __future__ import annotations

import math

import torch

from memfit.codecs.base import Codec, check_range

__all__ = ["Bits1Codec", "Int16Codec", "Int32Codec", "Int64Codec", "Int8Codec", "IntCodec", "UInt8Codec"]

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
        wider = next((c.name for c in (UInt8Codec, Int8Codec, Int16Codec, Int32Codec, Int64Codec)
                      if c.dtype.itemsize > self.dtype.itemsize), "int64")
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

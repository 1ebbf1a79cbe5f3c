"""Codecs by name (`CODECS`, `make_codec`, `available`) and `auto_codec`, the exact choice: the fewest bytes
that reproduce every value.
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.arrays import iter_chunks
from memfit.codecs.base import Array, Codec
from memfit.codecs.casts import BFloat16Codec, Float16Codec, Float32Codec, Float64Codec
from memfit.codecs.integer import Bits1Codec, Int8Codec, Int16Codec, Int32Codec, Int64Codec, UInt8Codec
from memfit.codecs.quantised import Q4Codec, Q8Codec

__all__ = ["CODECS", "auto_codec", "available", "make_codec"]

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

"""Turning user arrays into what a CompactDataset stores: dtypes, bounded chunked reads (memory-mapped
files are never read whole), per-channel statistics and normalisation. Pure functions; `memfit.compact`,
`memfit.targets` and the loaders' file source use them.

Example:
    >>> import numpy as np
    >>> [(start, len(chunk)) for start, chunk in iter_chunks(np.zeros((5, 2)), rows=2)]
    [(0, 2), (2, 2), (4, 1)]
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "DTYPES", "as_array", "by_channel", "channel_mean_std", "channel_min_max",
           "is_integer_data", "iter_chunks", "no_normalisation", "normalisation", "release_pages", "resolve_dtype",
           "to_tensor"]

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
          "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "int": torch.int32}
CHUNK_BYTES = 32 * 2**20   # encode in chunks of about this many input bytes: bounded temporaries


def is_integer_data(x: np.ndarray | torch.Tensor) -> bool:
    """Integer data other than 8-bit images (uint8) and bool: token ids, class ids, counts."""
    dtype = x.dtype if isinstance(x, torch.Tensor) else np.dtype(x.dtype)
    if isinstance(dtype, torch.dtype):
        return not dtype.is_floating_point and not dtype.is_complex and dtype not in (torch.uint8, torch.bool)
    return dtype.kind in "iu" and dtype != np.uint8


def resolve_dtype(dtype: torch.dtype | str | None, x: np.ndarray | torch.Tensor | None = None) -> torch.dtype:
    """The decoded dtype: the one asked for, or (None) int64 for integer data and float32 otherwise."""
    if dtype is None:
        return torch.int64 if x is not None and is_integer_data(x) else torch.float32
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in set(DTYPES.values()):
        return dtype
    raise ValueError(f"expected an output dtype float32, float16, bfloat16, float64, int64 or int32 (or one of "
                     f"{sorted(DTYPES)}); found {dtype!r}")


def release_pages(x: object) -> None:
    """Drop the pages a memory-mapped array has read from this process's resident memory.

    The data stays in the OS page cache (it is file-backed and clean), but no longer counts as
    memory this process holds, so iterating a file larger than RAM does not grow our RSS.
    """
    mm = getattr(x, "_mmap", None)          # np.memmap and its slices share the parent's map
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):   # a closed map or an OS without madvise: nothing to drop
            return


def as_array(x: object, what: str = "x") -> np.ndarray | torch.Tensor:
    """numpy arrays (memmaps too) and tensors pass through; lists become arrays."""
    if isinstance(x, (np.ndarray, torch.Tensor)):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise TypeError(f"expected {what} as a numpy array or torch tensor of shape (N, ...); "
                    f"found {type(x).__name__}")


def to_tensor(chunk: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(chunk, torch.Tensor):
        return chunk
    if chunk.dtype.byteorder == ">":
        chunk = chunk.astype(chunk.dtype.newbyteorder("="))
    if chunk.dtype.kind == "u" and chunk.dtype.itemsize > 1:    # torch has no arithmetic on uint16/32/64
        if chunk.dtype.itemsize == 8 and chunk.size and chunk.max() > np.iinfo(np.int64).max:
            raise ValueError(f"uint64 values above {np.iinfo(np.int64).max} do not fit int64; found {chunk.max()}")
        chunk = chunk.astype(np.int64)
    # read-only (memmap) rows are copied: this is the one read from disk, and torch needs writable memory
    chunk = np.ascontiguousarray(chunk)
    if not chunk.flags.writeable:
        chunk = chunk.copy()
    return torch.from_numpy(chunk)


def iter_chunks(x: np.ndarray | torch.Tensor, rows: int | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, rows as a tensor) over x in chunks of about CHUNK_BYTES; memmap pages are released."""
    n = x.shape[0]
    if rows is None:
        row_bytes = max(1, math.prod(x.shape[1:]) * x.dtype.itemsize if isinstance(x, np.ndarray)
                        else x[:1].nbytes)
        rows = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, n, rows):
        yield start, to_tensor(x[start:start + rows])
        release_pages(x)


def by_channel(x: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (C, N * prod(...)): every value of channel c (axis 1) in row c."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def channel_min_max(x: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (axis 1) minimum and maximum of all of x, float64 (C,), one streaming pass."""
    lo = hi = None
    for _, chunk in iter_chunks(x):
        c = by_channel(chunk)
        clo, chi = c.amin(1).double(), c.amax(1).double()
        lo, hi = (clo, chi) if lo is None else (torch.minimum(lo, clo), torch.maximum(hi, chi))
    return lo, hi


def channel_mean_std(x: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (axis 1) mean and (population) std of all of x, float64 (C,), one streaming pass.

    Chunks are merged with Chan's parallel formula, so float data of any magnitude stays exact.
    """
    count, mean, m2 = 0, None, None
    for _, chunk in iter_chunks(x):
        c = by_channel(chunk).double()                  # (C, rows*spatial)
        k = c.shape[1]
        cm = c.mean(1)
        cm2 = ((c - cm[:, None]) ** 2).sum(1)
        if mean is None:
            count, mean, m2 = k, cm, cm2
        else:
            delta = cm - mean
            total = count + k
            mean = mean + delta * k / total
            m2 = m2 + cm2 + delta**2 * count * k / total
            count = total
    return mean, (m2 / max(count, 1)).sqrt()


def no_normalisation(normalize: object) -> bool:
    """None and 'none' (the command line's spelling, accepted by the API too) both mean raw values."""
    return normalize is None or (isinstance(normalize, str) and normalize == "none")


def normalisation(normalize: object, x: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Resolve `normalize` into per-channel float64 (mean, std) in raw units, or None (None or 'none')."""
    channels = x.shape[1]
    if no_normalisation(normalize):
        return None
    if isinstance(normalize, str):
        if normalize != "dataset":
            raise ValueError(f"normalize must be None (or 'none'), 'dataset' or (mean, std); found {normalize!r}")
        mean, std = channel_mean_std(x)
        return mean, torch.where(std > 0, std, torch.ones_like(std))   # constant channels: no scaling
    if not (isinstance(normalize, (tuple, list)) and len(normalize) == 2):
        raise ValueError(f"normalize must be None (or 'none'), 'dataset' or a pair (mean, std) of per-channel "
                         f"sequences; found {normalize!r}")
    out = []
    for name, value in zip(("mean", "std"), normalize, strict=True):
        t = torch.as_tensor(value, dtype=torch.float64).flatten()
        if t.numel() == 1:
            t = t.expand(channels).clone()
        if t.numel() != channels:
            raise ValueError(f"normalize {name} has {t.numel()} values but x has {channels} channels "
                             f"(axis 1 of shape {tuple(x.shape)}); give one value per channel or a single value")
        out.append(t)
    if (out[1] == 0).any() or not torch.isfinite(out[1]).all():
        raise ValueError(f"normalize std must be finite and non-zero in every channel; found {out[1].tolist()}")
    return out[0], out[1]

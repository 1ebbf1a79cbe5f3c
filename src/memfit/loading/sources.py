"""Host sources: where a loader's compact rows come from, and how a block of them is gathered.

- `CompactSource`: a `CompactDataset` (CPU, pinned CPU, or already on the device). A block is one
  gather into a preallocated buffer (`CompactDataset.rows`: 8-byte words when the row size allows).
- `FileSource`: (x, y) where x is a memory-mapped `.npy` (possibly larger than RAM). x stays on disk;
  a block is read in chunks of about `READ_BYTES` (sorted indices: sequential reads when the block is
  contiguous), encoded on the way, and the pages read are dropped from this process's memory.
- In-memory (x, y) arrays are encoded once into a CPU `CompactDataset` (`make_source`).

Every source decodes through a `template` CompactDataset, so batches are bit-identical whichever
source or strategy produced them.

Example:
    >>> import numpy as np, torch
    >>> src = make_source((np.arange(40, dtype=np.uint8).reshape(10, 4), np.arange(10)))
    >>> x, y = torch.empty(3, 4, dtype=torch.uint8), torch.empty(3, *src.y_stored_shape, dtype=src.y_dtype)
    >>> src.fill(torch.tensor([7, 0, 2]), x, y); x[:, 0].tolist(), y.tolist()
    ([28, 0, 8], [7, 0, 2])
"""

from __future__ import annotations

import copy
import math
import threading

import numpy as np
import torch

from memfit.arrays import as_array, no_normalisation, release_pages, resolve_dtype
from memfit.codecs import Codec
from memfit.compact import (
    CompactDataset,
    check_encoding,
    decoded_batch_nbytes,
    prepare_encoding,
    stored_row_nbytes,
)
from memfit.distributed import shard_data, shard_sizes
from memfit.targets import IGNORE_INDEX, Targets, check_count

__all__ = ["CompactSource", "FileSource", "READ_BYTES", "Source", "is_file_backed", "make_source"]

READ_BYTES = 2**20          # raw bytes per file read: bounds the host temporaries of a FileSource


class Source:
    """A host source of compact rows. Subclasses set the attributes and implement `fill`."""
    template: CompactDataset      # decodes rows; its codec, sample_shape, dtype, mean/std are the data's
    n: int
    stored_shape: tuple[int, ...]
    stored_dtype: torch.dtype
    targets: Targets | None       # how the stored targets decode; None: no targets
    y_dtype: torch.dtype | None   # the stored targets' dtype; None: no targets
    y_stored_shape: tuple[int, ...] = ()   # one sample's stored targets
    read_nbytes = 0               # host temporaries of one fill beyond the output buffers
    sequential = False            # True: reads are cheaper in contiguous blocks (a file)

    @property
    def row_nbytes(self) -> int:
        """Stored bytes of one sample, its targets included."""
        return stored_row_nbytes(self.stored_shape, self.stored_dtype,
                                 0 if self.targets is None else self.targets.stored_nbytes)

    def batch_nbytes(self, m: int) -> int:
        """One decoded batch of m samples: x in the output dtype, the targets decoded."""
        return decoded_batch_nbytes(m, self.template.sample_shape, self.template.dtype,
                                    0 if self.targets is None else self.targets.decoded_nbytes)

    def _set_targets(self, targets: Targets | None) -> None:
        self.targets = targets
        self.y_dtype = None if targets is None else targets.stored_dtype
        self.y_stored_shape = () if targets is None else tuple(targets.stored_shape)

    def fill(self, idx: torch.Tensor, x_out: torch.Tensor, y_out: torch.Tensor | None) -> None:
        """Write the rows `idx` (CPU int64, (m,)) into x_out[:m] and their stored targets into y_out[:m]."""
        raise NotImplementedError

    def dataset(self, device: torch.device) -> CompactDataset:
        """The whole source as a CompactDataset on `device` (the `resident` strategy)."""
        raise NotImplementedError

    def shard(self, rank: int, world_size: int) -> tuple[Source, range, int]:
        """(this rank's part, its positions in the whole, the whole's size). The part decodes with the
        whole's template: the codec, normalisation and class count are the same on every rank."""
        raise NotImplementedError


class CompactSource(Source):
    """A CompactDataset used as it is (no copy) for `resident` on its own device, else gathered from."""

    def __init__(self, ds: CompactDataset):
        self.original = self.template = ds
        self.n = len(ds)
        self.stored_shape = tuple(ds.x.shape[1:])
        self.stored_dtype = ds.x.dtype
        self._set_targets(None if ds.y is None else ds.targets)
        self._host: CompactDataset | None = None

    def host(self) -> CompactDataset:
        """The rows in host memory (a dataset on a CUDA device is copied back once, when first needed)."""
        if self._host is None:
            self._host = self.original if self.original.device.type == "cpu" else self.original.to("cpu")
        return self._host

    def fill(self, idx, x_out, y_out):
        m, ds = idx.shape[0], self.host()
        ds.rows(idx, out=x_out[:m])                  # one gather (as 8-byte words when the rows allow it)
        if y_out is not None:
            torch.index_select(ds.y, 0, idx, out=y_out[:m])

    def dataset(self, device):
        return self.original if self.original.device == device else self.original.to(device)

    def shard(self, rank, world_size):
        part, members, n = shard_data(self.original, rank, world_size)
        return _not_empty(CompactSource(part), rank, world_size, n), members, n


class FileSource(Source):
    """x memory-mapped on disk (never read whole), targets in memory; blocks are encoded as they are read."""
    sequential = True

    def __init__(self, x: np.ndarray, y: object, codec: str | Codec, normalize: object,
                 dtype: torch.dtype | str | None, y_dtype=None, ignore_index: int = IGNORE_INDEX):
        row_raw = max(1, math.prod(x.shape[1:]) * x.dtype.itemsize)
        self.chunk_rows = max(1, READ_BYTES // row_raw)
        # the same set-up as CompactDataset.from_arrays: the same codes, values and explain()
        prep = prepare_encoding(x, y, codec, normalize, dtype, self.chunk_rows, y_dtype, ignore_index)
        check_encoding(prep, self.chunk_rows)     # one streaming pass where a value could fail or a bound is due
        self.x, self.n, self.codec, self.y = x, x.shape[0], prep.codec, prep.y
        self.stored_shape = tuple(self.codec.stored_shape(prep.sample_shape))
        self.stored_dtype = self.codec.stored_dtype
        self._set_targets(prep.targets)
        empty = torch.empty((0, *self.stored_shape), dtype=self.stored_dtype)
        self.template = CompactDataset(empty, None, self.codec, prep.sample_shape, prep.dtype, prep.mean, prep.std,
                                       targets=prep.targets)
        self.template.num_classes = None if prep.targets is None else prep.targets.num_classes
        # the reused raw read buffer and one encoded chunk (uint8 codecs encode without a copy)
        enc = self.chunk_rows * math.prod(self.stored_shape) * self.stored_dtype.itemsize
        self.read_nbytes = self.chunk_rows * row_raw + enc
        self._raw: np.ndarray | None = None
        self._lock = threading.Lock()

    def fill(self, idx, x_out, y_out):
        m = idx.shape[0]
        if y_out is not None:
            torch.index_select(self.y, 0, idx, out=y_out[:m])
        # sorted reads: a block from a block-shuffled order is one contiguous range of the file
        order = idx.argsort()
        sidx = idx[order].numpy()
        with self._lock:                                 # one read buffer, reused: no allocation per read
            if self._raw is None:
                self._raw = np.empty((self.chunk_rows, *self.x.shape[1:]), dtype=self.x.dtype.newbyteorder("="))
            for a in range(0, m, self.chunk_rows):
                s = sidx[a:a + self.chunk_rows]
                raw = self._raw[:len(s)]
                lo, hi = int(s[0]), int(s[-1])
                if hi - lo + 1 == len(s):
                    raw[...] = self.x[lo:hi + 1]         # one sequential read
                else:
                    np.take(self.x, s, axis=0, out=raw)
                enc = self.codec.encode(torch.from_numpy(raw))   # checks every value: a bad one raises here
                x_out.index_copy_(0, order[a:a + len(s)], enc)
                release_pages(self.x)                    # the pages stay in the OS cache, not in our RSS

    def dataset(self, device):
        x = torch.empty((self.n, *self.stored_shape), dtype=self.stored_dtype, device=device)
        step = self.chunk_rows
        buf = torch.empty((min(step, self.n), *self.stored_shape), dtype=self.stored_dtype)
        for a in range(0, self.n, step):
            idx = torch.arange(a, min(a + step, self.n))
            self.fill(idx, buf, None)
            x[a:a + len(idx)].copy_(buf[:len(idx)])
        y = None if self.y is None else self.y.to(device)
        t = self.template
        return CompactDataset(x, y, self.codec, t.sample_shape, t.dtype, t.mean, t.std, targets=self.targets)


    def shard(self, rank, world_size):
        sizes = shard_sizes(self.n, world_size)
        a = sum(sizes[:rank])
        part = copy.copy(self)                   # the same codec and template
        part.x, part.n = self.x[a:a + sizes[rank]], sizes[rank]          # a memory map of the part
        part.y = None if self.y is None else self.y[a:a + sizes[rank]].clone()   # the whole's labels are freed
        part._raw, part._lock = None, threading.Lock()
        return _not_empty(part, rank, world_size, self.n), range(a, a + part.n), self.n


def _not_empty(part: Source, rank: int, world_size: int, n: int) -> Source:
    if part.n:
        return part
    raise ValueError(f"rank {rank} of {world_size} holds no sample: the data has {n}; use at most {n} processes")


def is_file_backed(x: object) -> bool:
    """A numpy memmap (or a view of one): read block by block instead of encoded whole."""
    return isinstance(x, np.memmap) or isinstance(getattr(x, "base", None), np.memmap)


def make_source(data: object, *, codec: str | Codec = "auto", normalize: object = None,
                dtype: torch.dtype | str | None = None, y_dtype=None, ignore_index: int = IGNORE_INDEX) -> Source:
    """A Source for a CompactDataset or an (x, y) pair (a memmapped x stays on disk); `y_dtype` and
    `ignore_index` say how y's targets are kept (`CompactDataset.from_arrays`)."""
    if isinstance(data, CompactDataset):
        if codec != "auto" or not no_normalisation(normalize):
            raise ValueError("codec and normalize apply to (x, y) arrays; this CompactDataset is already encoded "
                             f"(codec {data.codec.name!r}); pass codec='auto', normalize=None, or the raw arrays")
        if dtype is not None and resolve_dtype(dtype) not in (torch.float32, data.dtype):
            raise ValueError(f"dtype {dtype} differs from the dataset's {data.dtype}; a CompactDataset decodes to "
                             "its own dtype: build it with CompactDataset.from_arrays(..., dtype=...)")
        if len(data) == 0:
            raise ValueError("the dataset is empty; a loader needs at least one sample")
        return CompactSource(data)
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], dict):
        # several inputs per sample: packed into one byte row each, which every strategy moves as it is
        return CompactSource(CompactDataset.from_arrays(data[0], data[1], codec=codec, normalize=normalize,
                                                        device="cpu", dtype=dtype, y_dtype=y_dtype,
                                                        ignore_index=ignore_index))
    if isinstance(data, tuple) and len(data) == 2:
        x, y = as_array(data[0], "x"), data[1]
        if y is not None:
            check_count(y, len(x))
        if is_file_backed(x):
            return FileSource(x, y, codec, normalize, dtype, y_dtype, ignore_index)
        return CompactSource(CompactDataset.from_arrays(x, y, codec=codec, normalize=normalize, device="cpu",
                                                        dtype=dtype, y_dtype=y_dtype, ignore_index=ignore_index))
    raise TypeError(f"expected data as a CompactDataset or an (x, y) tuple of arrays (x may be a memory-mapped "
                    f".npy: memfit.readers.load_array); found {type(data).__name__}")

"""Decoded-batch buffers reused once the consumer no longer holds the batch handed out from them.

Why: a fresh batch-sized allocation per batch (6 MiB for 512 CIFAR images in float32) is served by
glibc's malloc from the heap once its dynamic mmap threshold has risen; small tensors the consumer
keeps (each batch's labels) then land in the freed holes and the heap never shrinks: host memory grew
by GBs over an epoch while the loader held only two batches. Reused buffers allocate nothing per batch
(and run faster: no page faults, the batch stays in cache).

A buffer is free when nothing but the pool references its storage: every tensor made from a batch
(views, slices, tensors autograd saved, a numpy array of it) holds the storage, so a batch the user
still holds, in any form, is never overwritten. When every buffer is held, a new one replaces the one
handed out longest ago, which then belongs to whoever holds it (batches the consumer keeps are its memory).

Example:
    >>> import torch
    >>> pool = BatchPool((2,), torch.float32, torch.device("cpu"), rows=4)
    >>> a = pool.take(4); b = pool.take(3)
    >>> a.data_ptr() == b.data_ptr()          # a is still held: b comes from the other buffer
    False
    >>> ptr = a.data_ptr(); del a
    >>> pool.take(4).data_ptr() == ptr        # a was dropped: its buffer is reused
    True
"""

from __future__ import annotations

import math

import torch

from memfit.compact import CompactDataset
from memfit.device.torch_private import storage_use_count

__all__ = ["BatchPool", "Decoder"]

def _holders(t: torch.Tensor) -> int:
    """References to t's storage (each tensor sharing it, each Python storage object)."""
    return storage_use_count(t.untyped_storage())


class BatchPool:
    """`count` buffers of `rows` x `shape` in `dtype` on `device`, allocated on first use."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rows: int,
                 count: int = 2):
        self.shape, self.dtype, self.device, self.rows, self.count = tuple(shape), dtype, device, rows, count
        self._bufs: list[torch.Tensor] = []
        self._idle = 0                 # the storage's use count while only the pool holds it

    def take(self, m: int) -> torch.Tensor:
        """A (m, *shape) tensor to decode into: a view of a free buffer, else of a new one."""
        if m > self.rows:
            return torch.empty((m, *self.shape), dtype=self.dtype, device=self.device)
        for i, buf in enumerate(self._bufs):
            if _holders(buf) == self._idle:
                self._bufs.append(self._bufs.pop(i))     # most recently handed out last
                return buf[:m]                           # a view: it holds the storage while the batch lives
        # every buffer is held: a new one; the least recently handed out leaves the pool and stays with
        # whoever holds it (a batch kept for good must not pin a buffer the next batches need). Never an
        # inference tensor (a first batch read under torch.inference_mode, by evaluate): one could not be
        # written again outside it, by the training epochs
        with torch.inference_mode(False):
            t = torch.empty((self.rows, *self.shape), dtype=self.dtype, device=self.device)
        self._idle = _holders(t)
        self._bufs = self._bufs[-(self.count - 1):] + [t] if self.count > 1 else [t]
        return t[:m]



class Decoder:
    """Decodes compact rows with `template` (augmented by an `Augmenter` where one is given): into reused
    buffers on the CPU, into new tensors on CUDA (its caching allocator already reuses device blocks without
    growing the host heap)."""

    def __init__(self, template: CompactDataset, batch_size: int, device: torch.device, augmenter=None):
        self.template, self.augmenter = template, augmenter
        self.batch_size, self.device = batch_size, device
        # a dataset of fields decodes to a dict of new tensors (small: token ids and masks), not reused
        self.reuse = device.type == "cpu" and template.fields is None
        self._pools: dict[tuple[int, ...], tuple[BatchPool, BatchPool | None]] = {}   # by the decoded shape
        width = self.unpacked_width(template)                 # q4, bits1 unpack into new memory
        self.codes = BatchPool((width,), torch.uint8, device, batch_size, count=1) if self.reuse and width else None

    @staticmethod
    def unpacked_width(template: CompactDataset) -> int:
        return 0 if template.fields is not None else template.codec.unpacked_width(tuple(template.x.shape[1:]))

    @staticmethod
    def scratch_nbytes(template: CompactDataset, batch_size: int, sample_shape=None) -> int:
        """Bytes of one batch of intermediates: unpacked codes, float32 for half types (held on every device:
        reused on the CPU, fresh per batch on CUDA); `sample_shape`: the decoded one, where augmentation cuts it."""
        if template.fields is not None:         # fields decode straight to new tensors
            return 0
        width = Decoder.unpacked_width(template)
        half = template.dtype in (torch.float16, torch.bfloat16)
        shape = template.sample_shape if sample_shape is None else sample_shape
        return batch_size * (width + (4 * math.prod(shape) if half else 0))

    def _take(self, shape: tuple[int, ...], m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(out, work) buffers for m samples of `shape`: reused ones on the CPU (None elsewhere)."""
        if not self.reuse:
            return None, None
        if shape not in self._pools:
            dtype = self.template.dtype
            half = dtype in (torch.float16, torch.bfloat16)     # half types are decoded in float32 first
            self._pools[shape] = (BatchPool(shape, dtype, self.device, self.batch_size),
                                  BatchPool(shape, torch.float32, self.device, self.batch_size, count=1) if half
                                  else None)
        out, work = self._pools[shape]
        return out.take(m), None if work is None else work.take(m)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """(m, *stored_shape) rows -> (m, *sample_shape) samples, unaugmented."""
        m = rows.shape[0]
        codes = None if self.codes is None else self.codes.take(m)
        if not self.reuse:
            return self.template.decode(rows, codes=codes)
        out, work = self._take(tuple(self.template.sample_shape), m)
        return self.template.decode(rows, out=out, work=work, codes=codes)

    def batch(self, rows: torch.Tensor, y_rows: torch.Tensor | None, params=None):
        """(x, y) of stored rows and stored targets; augmented with `params` (this batch's, from
        `EpochParams.take`) where given. The rows may be written over."""
        t = self.template
        y = None if y_rows is None else t.targets.decode(y_rows)
        if params is None:
            return self(rows), y
        m = rows.shape[0]
        codes = t.codec.unpack(rows, t.sample_shape, out=None if self.codes is None else self.codes.take(m))
        out, work = self._take(self.augmenter.sample_shape, m)
        return self.augmenter.batch(codes, y, params, out=out, work=work)

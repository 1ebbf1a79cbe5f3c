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
from collections.abc import Callable

import torch

from memfit.compact import CompactDataset, as_words, run_affine
from memfit.device.torch_private import storage_use_count

__all__ = ["BatchPool", "Decoder"]


# A full batch of more than this many bytes of output is decoded in pieces of 1-2x this size, so that the
# multiply-add finds what the convert just wrote in the core's L2 cache (2 MiB here; 1-2 MiB on current x86 server
# cores) rather than in memory. Measured at one thread against a hand-written loop that decodes the whole batch at
# once (paired rounds on the 2-core EPYC VM): 512 CIFAR-shaped images (6 MiB of float32) went from 0.74-0.79x to
# 0.95-0.97x the loop's images/s in pieces of 2 MiB (0.84-0.86x in pieces of 1.5 MiB: more kernel calls), 2048
# MNIST-shaped ones from 0.75x to 0.88x; batches of 3 MiB gained nothing, and stay one piece.
PIECE_BYTES = 2**21


class BatchPool:
    """`count` buffers of `rows` x `shape` in `dtype` on `device`, allocated on first use. `prepare` (optional) makes,
    once per buffer, what its user reuses with it (views of it: `take_prepared`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rows: int,
                 count: int = 2, prepare: Callable[[torch.Tensor], object] | None = None):
        self.shape, self.dtype, self.device, self.rows, self.count = tuple(shape), dtype, device, rows, count
        self.prepare = prepare
        # per buffer: (the buffer, its storage kept (its use count is read without a storage object made per
        # batch), that use count while only the pool holds it (the prepared views count), what `prepare` made)
        self._bufs: list[tuple[torch.Tensor, torch.UntypedStorage, int, object]] = []

    def take(self, m: int) -> torch.Tensor:
        """A (m, *shape) tensor to decode into: a view of a free buffer, else of a new one."""
        return self.take_prepared(m)[0]

    def take_prepared(self, m: int) -> tuple[torch.Tensor, object]:
        """`take(m)`, and what `prepare` made of the whole buffer it is a view of (None without `prepare`)."""
        if m > self.rows:
            t = torch.empty((m, *self.shape), dtype=self.dtype, device=self.device)
            return t, None if self.prepare is None else self.prepare(t)
        bufs = self._bufs
        for i, (buf, storage, idle, prepared) in enumerate(bufs):
            if storage_use_count(storage) == idle:
                if i != len(bufs) - 1:
                    bufs.append(bufs.pop(i))             # most recently handed out last
                return buf[:m], prepared                 # a view: it holds the storage while the batch lives
        # every buffer is held: a new one; the least recently handed out leaves the pool and stays with
        # whoever holds it (a batch kept for good must not pin a buffer the next batches need). Never an
        # inference tensor, nor views of one (a first batch read under torch.inference_mode, by evaluate): one
        # could not be written again outside it, by the training epochs
        with torch.inference_mode(False):
            t = torch.empty((self.rows, *self.shape), dtype=self.dtype, device=self.device)
            prepared = None if self.prepare is None else self.prepare(t)
        storage = t.untyped_storage()
        entry = (t, storage, storage_use_count(storage), prepared)
        self._bufs = bufs[-(self.count - 1):] + [entry] if self.count > 1 else [entry]
        return t[:m], prepared


class Decoder:
    """Decodes compact rows with `template` (augmented by an `Augmenter` where one is given): into reused
    buffers on the CPU, into new tensors on CUDA (its caching allocator already reuses device blocks without
    growing the host heap). On the CPU a full batch of a plain decode (a convert, a multiply-add per channel)
    runs on views of its buffer made once (`_decode_full`). `resident`: the template is the data itself, and
    `gather` decodes rows of it."""

    def __init__(self, template: CompactDataset, batch_size: int, device: torch.device, augmenter=None,
                 resident: bool = False):
        self.template, self.augmenter = template, augmenter
        self.batch_size, self.device = batch_size, device
        # a dataset of fields decodes to a dict of new tensors (small: token ids and masks), not reused
        self.reuse = device.type == "cpu" and template.fields is None
        self._pools: dict[tuple[int, ...], tuple[BatchPool, BatchPool | None]] = {}   # by the decoded shape
        width = self.unpacked_width(template)                 # q4, bits1 unpack into new memory
        self.codes = BatchPool((width,), torch.uint8, device, batch_size, count=1) if self.reuse and width else None
        self._full = self._full_batch_pool()
        # resident on the CPU: a batch's rows are gathered into one buffer, decoded out of it, never handed out
        self.rows = self._gather = self._rows_codes = None
        if resident and self.reuse:
            with torch.inference_mode(False):          # written again by every epoch, whichever mode it runs in
                self.rows = torch.empty((batch_size, *template.x.shape[1:]), dtype=template.x.dtype, device=device)
            words = as_words(template.x)               # 8-byte words: 8x fewer elements to move (`as_words`)
            self._gather = (template.x, self.rows) if words is None else (words, as_words(self.rows))
            self._rows_codes = None if self._full is None else template.codec.unpack(self.rows, template.sample_shape)

    def _full_batch_pool(self) -> BatchPool | None:
        """The output pool of full batches decoded in `_pieces` (views of each buffer made once), or None where the
        decode is more than a convert and the multiply-adds (CUDA, fields, codes unpacked into new memory, half or
        integer outputs, many channels)."""
        t = self.template
        if not self.reuse or self.codes is not None or t.dtype not in (torch.float32, torch.float64):
            return None
        shape = tuple(t.sample_shape)
        if t.affine_steps(torch.empty((0, *shape), dtype=t.dtype)) is None:
            return None
        pool = BatchPool(shape, t.dtype, self.device, self.batch_size, prepare=self._pieces)
        self._pools[shape] = (pool, None)              # the other batches (the last, smaller one) share its buffers
        return pool

    def _pieces(self, buf: torch.Tensor) -> list[tuple[slice | None, torch.Tensor, list]]:
        """A full batch's decode into `buf` as (its samples, the output piece, its multiply-adds): one piece, or
        pieces of `PIECE_BYTES` to twice that for a larger batch (each multiply-add then reads what the convert
        just wrote from the core's L2 cache rather than from memory)."""
        m = buf.shape[0]
        k = -(-m // max(1, buf.nbytes // PIECE_BYTES))                    # samples per piece, equal pieces
        if k >= m:
            return [(None, buf, self.template.affine_steps(buf))]
        return [(slice(a, a + k), buf[a:a + k], self.template.affine_steps(buf[a:a + k])) for a in range(0, m, k)]

    def _decode_full(self, codes: torch.Tensor) -> torch.Tensor:
        """A full batch of codes (batch_size, *sample_shape) decoded into a reused buffer: per piece, the convert
        and one multiply-add per channel, on views made once per buffer (little Python, no allocation)."""
        x, pieces = self._full.take_prepared(self.batch_size)
        for part, out, steps in pieces:
            out.copy_(codes if part is None else codes[part])
            run_affine(steps)
        return x

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
        if m == self.batch_size and self._full is not None:
            return self._decode_full(self.template.codec.unpack(rows, self.template.sample_shape))
        codes = None if self.codes is None else self.codes.take(m)
        if not self.reuse:
            return self.template.decode(rows, codes=codes)
        out, work = self._take(tuple(self.template.sample_shape), m)
        return self.template.decode(rows, out=out, work=work, codes=codes)

    def rows_of(self, idx: torch.Tensor) -> torch.Tensor:
        """The stored rows `idx` of the resident data: one gather (into the reused buffer on the CPU)."""
        return self.template.rows(idx, out=None if self.rows is None else self.rows[:idx.shape[0]])

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """The decoded samples of rows `idx` (on this device) of the resident data, unaugmented: `self(rows_of(idx))`,
        a full batch on the CPU as one gather into the rows buffer and `_decode_full` out of it."""
        if self._rows_codes is None or idx.shape[0] != self.batch_size:
            return self(self.rows_of(idx))
        src, dst = self._gather
        torch.index_select(src, 0, idx, out=dst)
        return self._decode_full(self._rows_codes)

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

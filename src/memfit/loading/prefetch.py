"""Double-buffered block copies: host gather -> (pinned staging -> side CUDA stream) -> device buffer.

`Slots` holds the reusable buffers of one epoch and knows how to fill one and hand it to the consumer
safely; `Prefetcher` runs the fills on a background thread one block ahead of the consumer;
`Inline` does the same work in the consumer's thread (`prefetch=False`).

The slot protocol (two slots, double buffering):

    thread:   take a free slot -> [CUDA: wait until this slot's previous host->device copy finished]
              -> gather the block's rows on the host into the slot (CPU) or its pinned staging (CUDA)
              -> [CUDA: on the side stream, wait until the consumer's kernels no longer read the
                 slot (`freed` event), copy non_blocking, record `copied`] -> hand the slot over
    consumer: take a ready slot -> [CUDA: the current stream waits on `copied`] -> decode the
              micro-batches (new tensors) -> [CUDA: record `freed` on the current stream] -> give the
              slot back
    (on CUDA each `freed` is first recorded when the slots are made: the first copy into a slot waits for
    the consumer's kernels queued before its allocation)

A free/ready queue pair orders the two threads, so a slot is never written while it is read. An
exception in the thread is handed over as the next item and re-raised in the consumer with its
original traceback; `close()` stops and joins the thread (it is also called on break and on error).

Example:
    >>> import torch
    >>> from memfit.loading.sources import make_source
    >>> src = make_source((torch.arange(12, dtype=torch.uint8).reshape(6, 2), None))
    >>> slots = Slots(src, capacity=4, device=torch.device("cpu"))
    >>> blocks = [torch.tensor([5, 4, 3, 2]), torch.tensor([1, 0])]
    >>> with Prefetcher(slots, blocks) as pf:
    ...     firsts = []
    ...     for _ in blocks:
    ...         s = pf.get()
    ...         firsts.append(slots.x[s][0, 0].item())
    ...         pf.release(s)
    >>> firsts
    [10, 2]
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable, Iterable

import torch

from memfit.loading.sources import Source

__all__ = ["Inline", "JOIN_TIMEOUT_S", "Prefetcher", "Slots", "one_openmp_thread"]

JOIN_TIMEOUT_S = 60.0


class Slots:
    """`count` buffers of up to `capacity` compact rows on `device` (plus pinned staging on CUDA)."""

    def __init__(self, source: Source, capacity: int, device: torch.device, count: int = 2,
                 decode: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.source, self.device, self.count = source, device, count
        self.decode = decode or source.template.decode       # a `pool.Decoder` reuses the decoded buffers
        self.ids: list[torch.Tensor | None] = [None] * count  # each slot's block: positions in the source (CPU)
        self.cuda = device.type == "cuda"
        shape = (capacity, *source.stored_shape)

        def alloc(dev, pin=False):
            xs = [torch.empty(shape, dtype=source.stored_dtype, device=dev, pin_memory=pin) for _ in range(count)]
            ys = [None if source.targets is None
                  else torch.empty((capacity, *source.y_stored_shape), dtype=source.y_dtype, device=dev,
                                   pin_memory=pin) for _ in range(count)]
            return xs, ys

        self.x, self.y = alloc(device)                       # what the consumer decodes from
        if self.cuda:
            # compact rows cross the bus from page-locked memory: the copy is a true async DMA
            self.host_x, self.host_y = alloc("cpu", pin=True)
            self.stream = torch.cuda.Stream(device)
            self.copied = [torch.cuda.Event() for _ in range(count)]
            self.freed = [torch.cuda.Event() for _ in range(count)]
            for t in self.x + self.y:
                if t is not None:
                    t.record_stream(self.stream)             # written on the side stream: free only after it
            # The slots' blocks were handed out on this (the consumer's) stream, maybe blocks it freed with
            # kernels still queued that use them: the side stream's first copy into a slot waits for them as
            # later copies wait for the consumer's reads (`freed`), else it could overwrite, or be overwritten by, them
            here = torch.cuda.current_stream(device)
            for e in self.freed:
                e.record(here)

    def fill(self, slot: int, idx: torch.Tensor) -> None:
        """Gather rows `idx` into `slot` (runs on the background thread)."""
        m = idx.shape[0]
        y = self.y[slot]
        self.ids[slot] = idx
        if not self.cuda:
            self.source.fill(idx, self.x[slot], y)
            return
        self.copied[slot].synchronize()                      # the last copy out of this staging buffer is done
        hy = self.host_y[slot]
        self.source.fill(idx, self.host_x[slot], hy)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.freed[slot])         # the consumer's kernels no longer read the slot
            self.x[slot][:m].copy_(self.host_x[slot][:m], non_blocking=True)
            if y is not None:
                y[:m].copy_(hy[:m], non_blocking=True)
            self.copied[slot].record(self.stream)

    def ready(self, slot: int) -> None:
        """Make the consumer's stream wait for the slot's copy (consumer thread)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])

    def done(self, slot: int) -> None:
        """The consumer has queued its last read of the slot (consumer thread)."""
        if self.cuda:
            self.freed[slot].record(torch.cuda.current_stream(self.device))

    def batch(self, slot: int, start: int, m: int, params=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoded micro-batch rows [start, start + m) of the slot (never a view of the slot itself), augmented
        with `params` (a `pool.Decoder`'s augmentation, which may write over the slot's rows) where given."""
        rows, y = self.x[slot][start:start + m], self.y[slot]
        if params is not None:
            return self.decode.batch(rows, None if y is None else y[start:start + m], params)
        # targets decode into new memory (`Target.decode`): the slot itself is never handed out
        return self.decode(rows), None if y is None else self.source.targets.decode(y[start:start + m])


def _openmp_libraries() -> list[str]:
    """Paths of the OpenMP runtimes loaded in this process (libgomp, libiomp5, libomp; other packages,
    scikit-learn's among them, may bring their own beside torch's), torch's own first."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "omp" in line and ".so" in line}
    except OSError:                          # no /proc (macOS, Windows): leave the thread as it is
        return []
    runtimes = [p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp"))]
    here = os.path.dirname(torch.__file__)
    return sorted(runtimes, key=lambda p: (not p.startswith(here), p))


def one_openmp_thread() -> bool:
    """Limit the calling thread's own OpenMP team to one thread; True when torch's count here is then 1.

    Not torch.set_num_threads(1): besides this thread's OpenMP setting it stores a process-wide count
    that every thread started later takes (autograd's, a DataLoader's, the user's), so a loader would
    slow down work it has nothing to do with. omp_set_num_threads changes only the calling thread's;
    it is called on each loaded runtime until torch's own reports 1 thread.
    """
    torch.get_num_threads()                  # torch's lazy per-thread init first: it would undo the setting
    for path in _openmp_libraries():
        if torch.get_num_threads() == 1:
            break
        try:
            ctypes.CDLL(path).omp_set_num_threads(1)      # already loaded: the same library, no second runtime
        except (OSError, AttributeError):
            continue
    return torch.get_num_threads() == 1


def _run(slots: Slots, blocks: Iterable[torch.Tensor], free: queue.Queue, ready: queue.Queue,
         stop: threading.Event) -> None:
    try:
        if slots.cuda:
            torch.cuda.set_device(slots.device)
        else:
            # one core for the copy (a memory-bound gather): with the consumer's own intra-op threads on
            # the same cores, a second OpenMP team would oversubscribe them (measured 3.5x slower)
            one_openmp_thread()
        for idx in blocks:
            slot = free.get()
            if slot is None or stop.is_set():
                return
            slots.fill(slot, idx)
            ready.put((slot, None))
    except BaseException as e:            # handed to the consumer, raised there with this traceback
        ready.put((None, e))


class Prefetcher:
    """Fills `slots` for each block of `blocks` on a background thread, one block ahead."""

    def __init__(self, slots: Slots, blocks: Iterable[torch.Tensor], name: str = "memfit-prefetch"):
        self.slots = slots
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        for s in range(slots.count):
            self._free.put(s)
        self._thread = threading.Thread(target=_run, args=(slots, blocks, self._free, self._ready, self._stop),
                                        name=name, daemon=True)
        self._thread.start()

    def get(self) -> int:
        """The next filled slot; re-raises the thread's exception (original traceback) and stops."""
        slot, err = self._ready.get()
        if err is not None:
            self.close()
            raise err
        self.slots.ready(slot)
        return slot

    def release(self, slot: int) -> None:
        self.slots.done(slot)
        self._free.put(slot)

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes at most the block it is filling)."""
        self._stop.set()
        self._free.put(None)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError(f"memfit: the prefetch thread did not stop within {JOIN_TIMEOUT_S:.0f} s")

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Inline:
    """The same protocol without a thread: each block is filled when the consumer asks for it."""

    def __init__(self, slots: Slots, blocks: Iterable[torch.Tensor]):
        self.slots, self._blocks, self._k = slots, iter(blocks), 0

    def get(self) -> int:
        slot = self._k % self.slots.count
        self.slots.fill(slot, next(self._blocks))
        self._k += 1
        self.slots.ready(slot)
        return slot

    def release(self, slot: int) -> None:
        self.slots.done(slot)

    def close(self) -> None:
        pass

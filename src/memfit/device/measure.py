"""Measure the bytes the allocator holds while code runs: the one figure predictions are compared with.

On the CPU the allocator's own events: memory profiling of `torch.profiler` reports every allocation and free
the CPU allocator (c10's `ProfiledCPUMemoryReporter`) serves on this thread, with its running total; inside a
kernel too (mkldnn convolution's `out=` variant allocates its result and copies it out, oneDNN's weight
reorders and scratchpads), which no count of op outputs sees. On CUDA the caching allocator's statistics:
`torch.cuda.max_memory_allocated` above the start, and `max_memory_reserved` (its segments) above the start;
those peaks are the process's, so a reset of them inside a block goes through `reset_cuda_peak`, which keeps what
every open block has seen (blocks nest on CUDA too).

`track_op_outputs` keeps the other count, each ATen op's new output storages through a dispatch mode, for
where it is the point: which op's outputs hold what (it misses what a kernel allocates inside).

Known limitations: on the CPU, allocations on other threads (a data loader's workers) are not counted, and the
profiler cannot run twice at once: `track_memory` inside a user's `torch.profiler.profile` raises (one inside another
`track_memory` pauses the outer one's profiler and resumes it after: both see the inner block's bytes). A free counts
only where the block's allocation was seen: inside this `with`, or inside an enclosing `track_memory` before it began.
A block allocated before (the gradients of the step before, which `accumulate` lets go before the optimizer's step)
is not counted freed, so the peak then errs high (`MemoryTrace.unseen_frees` says how many): c10 learns a block's size
only when it is allocated under a profiler and looks it up by address at the free, so the size it reports for an older
block may be that of another block that sat at the address under an earlier profiler (freed since, outside one), and
would make the peak err low. Allocate what the measured code frees inside an enclosing `track_memory` to have it
counted: run the step before the measured one under it. (`every_thread=True` reads c10's running total instead,
every free by c10's size: see there.)

Example:
    >>> import torch
    >>> from memfit.device.measure import track_memory
    >>> with track_memory("cpu") as mem:
    ...     y = torch.ones(1000).exp()      # two float32 buffers of 4000 bytes, both live at once
    >>> mem.peak
    8000
"""
from __future__ import annotations

import gc
import os
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from memfit.device.torch_private import (
    ProfilerEventType,
    TorchDispatchMode,
    cpu_total_kept_for_every_thread,
    profiler_running,
    storage_key,
    tree_flatten,
)

__all__ = ["MemoryTrace", "held_bytes", "reset_cuda_peak", "track_memory", "track_op_outputs", "unique_bytes"]


@dataclass
class MemoryTrace:
    """Bytes allocated above the start of the `with` block: `peak` is the most live at once.

    Attributes:
        current: bytes allocated inside and still held at the end.
        allocations: allocations counted.
        peak_op: on the CPU, the ops running when the peak was reached, outermost first
            ("aten::conv2d > ... > aten::mkldnn_convolution > aten::empty"; "" outside any op).
        reserved_peak: on CUDA, the caching allocator's reserved bytes (its segments) above the start at most.
        events: on the CPU, (ops that allocated the block, bytes allocated (> 0) or freed (< 0), bytes live
            after) per allocator event.
        unseen_frees: on the CPU, blocks this thread freed inside that it was not seen allocating inside (or
            inside an enclosing `track_memory`): not counted, their size is not known for sure (see the module's
            text); with `every_thread`, counted by c10's size (another thread may have allocated them inside).
    """
    device: torch.device
    current: int = 0
    peak: int = 0
    allocations: int = 0
    peak_op: str | None = None
    reserved_peak: int | None = None
    unseen_frees: int = 0
    events: list[tuple[str, int, int]] = field(default_factory=list, repr=False)

    def peak_by_op(self) -> dict[str, int]:
        """Bytes each outermost op (by name) had allocated and still held at the peak, largest first (CPU):
        where the peak's bytes come from."""
        held: dict[str, int] = {}
        for ops, delta, live in self.events:
            op = ops.split(" > ")[0]
            held[op] = held.get(op, 0) + delta
            if live == self.peak:
                at_peak = dict(held)
        if not self.events or self.peak == 0:
            return {}
        return dict(sorted(((k, v) for k, v in at_peak.items() if v > 0), key=lambda kv: -kv[1]))

    def peak_within(self, name: str) -> int:
        """(CPU) The most bytes live, above the start of the `with` block, from the first to the last allocation
        made inside the `torch.profiler.record_function(name)` range (the bytes live as it began included):
        the peak of one part of the measured code, counted with what the code before it left."""
        inside = [i for i, (ops, delta, _) in enumerate(self.events) if delta > 0 and ops.split(" > ")[0] == name]
        if not inside:
            raise ValueError(f"expected allocations inside a record_function({name!r}) range of the measured "
                             f"code; found none among {len(self.events)} allocator events")
        return max(live for _, _, live in self.events[max(inside[0] - 1, 0):inside[-1] + 1])
def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):      # sparse or wrapper tensors own no plain storage
        return None
    # the storage object's own address, not its data pointer: fake tensors (memfit.memory.step_model) have none
    return (storage_key(s), s.nbytes()) if s.nbytes() else None


def unique_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage once (tied weights and views share one);
    entries that are not tensors are skipped."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and (k := _storage_key(t)) is not None:
            seen[k[0]] = k[1]
    return sum(seen.values())


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, grads: bool = False) -> int:
    """Bytes the model holds now: its parameters and buffers (with `grads`, the parameters' `.grad` too; with an
    optimizer, its state), each storage counted once: an embedding and an output layer sharing one weight
    hold it once.

    Example:
        >>> import torch
        >>> emb = torch.nn.Embedding(10, 4)
        >>> model = torch.nn.Sequential(emb, torch.nn.Linear(4, 10, bias=False))
        >>> model[1].weight = emb.weight                 # tied: 10 x 4 float32 once
        >>> held_bytes(model)
        160
    """
    tensors = [*model.parameters(), *model.buffers()]
    if grads:
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
    return unique_bytes(tensors + optimizer_state(optimizer))


def optimizer_state(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The tensors an optimizer keeps (AdamW: two per parameter once it has stepped); [] for None."""
    if optimizer is None:
        return []
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class _OutputCounter(TorchDispatchMode):
    """Counts live storages: each new storage once, and its bytes off when the last tensor on it is freed."""

    def __init__(self, trace: MemoryTrace):
        super().__init__()
        self.trace = trace
        self.live: dict[int, list[int]] = {}         # storage key -> [bytes, tensors alive on it]

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.trace.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {k[0] for k in (_storage_key(a) for a in tree_flatten((args, kwargs))[0]
                                 if isinstance(a, torch.Tensor)) if k}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device != self.trace.device:
                continue
            key = _storage_key(t)
            if key is None:
                continue
            ptr, nbytes = key
            if ptr in self.live:
                self.live[ptr][1] += 1
            elif ptr in inputs:                        # a view of (or in-place write to) a tensor made outside
                continue
            else:
                self.live[ptr] = [nbytes, 1]
                self.trace.current += nbytes
                self.trace.allocations += 1
                self.trace.peak = max(self.trace.peak, self.trace.current)
            weakref.finalize(t, self._release, ptr)
        return out



class track_op_outputs:  # noqa: N801  (used as a context manager, reads like a function)
    """Context manager counting the storages ATen ops return on `device` while they live: which op's outputs
    hold what. Not the allocator's figure: what a kernel allocates inside is not an output (see
    `track_memory`).

    Example:
        >>> import torch
        >>> with track_op_outputs("cpu") as mem:
        ...     y = torch.ones(1000).exp()
        >>> mem.peak
        8000
    """

    def __init__(self, device="cpu"):
        self.trace = MemoryTrace(torch.device(device))
        self._mode: _OutputCounter | None = None

    def __enter__(self) -> MemoryTrace:
        self._mode = _OutputCounter(self.trace)
        self._mode.__enter__()
        return self.trace

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None


@contextmanager
def _quiet_stderr():
    """Kineto prints two lines (`USDT ... profiler_start`, `profiler_stop`) to the C-level stderr at every
    profiler start and stop, whatever its log level: silenced for those two calls only (no user code runs)."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


_active = threading.local()          # `.stack`: the CPU trackers running on this thread, innermost last
_cuda_open: list = []                # the CUDA trackers inside their `with` (the allocator's peaks are per process)


def reset_cuda_peak(device) -> None:
    """`torch.cuda.reset_peak_memory_stats(device)`, keeping for every `track_memory` open on `device` the peak it
    has seen so far: a reset inside one (another `track_memory`, evaluate's chunk loop) would otherwise lose the
    bytes its block reached before the reset, and its `peak` would come out low."""
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    peak, reserved = torch.cuda.max_memory_allocated(dev), torch.cuda.max_memory_reserved(dev)
    for t in _cuda_open:
        if t.trace.device == dev:
            t._seen = (max(t._seen[0], peak), max(t._seen[1], reserved))
    torch.cuda.reset_peak_memory_stats(dev)


def _raw_events(result) -> list[tuple[int, int, int, str, int]]:
    """(time ns, bytes, allocator total after, ops, address) of the CPU allocator's events, in time order; ops: the
    names of the events it happened in, outermost first ("aten::conv2d > ... > aten::mkldnn_convolution"), carried
    down the tree as it is walked (each attribute read of an event costs 0.1-0.7 us: a step has thousands)."""
    out = []
    stack = [(e, ()) for e in reversed(result.experimental_event_tree())]
    while stack:                                      # depth first, in recorded order
        e, above = stack.pop()
        if e.tag == ProfilerEventType.Allocation:
            extra = e.extra_fields
            if extra.device.type == "cpu":
                out.append((e.start_time_ns, extra.alloc_size, extra.total_allocated, " > ".join(above), extra.ptr))
        else:
            children = e.children
            if children:
                names = (*above, e.name)
                stack.extend((c, names) for c in reversed(children))
    out.sort(key=lambda ev: ev[0])                    # stable: events at one ns keep the recorded order
    return out


def _attributed(raw) -> list[tuple[int, int, int, str]]:
    """`raw` events with each free given the ops that allocated its block (when that was seen)."""
    made: dict[int, str] = {}                         # address -> the ops that allocated the block there
    out = []
    for ns, nbytes, total, ops, ptr in raw:
        if nbytes > 0:
            made[ptr] = ops
        out.append((ns, nbytes, total, made.pop(ptr, ops) if nbytes < 0 else ops))
    return out


def allocator_events(result) -> list[tuple[int, int, int, str]]:
    """The CPU allocator's events in a profiler result: (time ns, bytes (+ allocated, - freed), the allocator's
    running total after it, the ops it happened in (outermost first, "" outside any op; for a free, the ops that
    allocated the block when that was seen)), in time order."""
    return _attributed(_raw_events(result))


@contextmanager
def _no_collection(outer: list):
    """Python's cycle collector off, while an outer tracker is open, for the moment between two profilers: a tensor
    it freed there would be freed unseen, and a block allocated at the same address next would be taken for it."""
    was = bool(outer) and gc.isenabled()
    if was:
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _blocks_live(known: dict[int, int], raw) -> dict[int, int]:
    """The blocks (address -> bytes) of `known` and those allocated in `raw`, less those `raw` freed."""
    live = dict(known)
    for _, nbytes, _, _, ptr in raw:
        if nbytes > 0:
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
    return live


class track_memory:  # noqa: N801  (used as a context manager, reads like a function)
    """Context manager measuring the bytes the allocator serves inside it on `device`, above the start.

    On the CPU one may run inside another (a prediction that measures a kernel, inside a measured step): the
    outer one's profiler pauses while the inner one runs, and the outer one counts the inner one's events too.

    Args:
        device: where to measure ("cpu", "cuda", "cuda:1", a torch.device).
        every_thread: CPU only. False: the bytes this thread's allocations and frees add up to. True: the
            allocator's running total of every thread (read at this thread's events), above the start: what a
            process holds when other threads allocate or free its tensors (a process group's worker threads).
            Every free there counts by c10's size, so a block allocated before the `with` and freed inside may
            count with the size of another block that sat at its address under an earlier profiler: start the
            `with` before the measured code's tensors are made (as `measure_rank_step` does). It sets c10's
            flag `caffe2_report_cpu_memory_usage` while open (`memfit.device.torch_private`); where that cannot be
            reached it raises RuntimeError saying what failed.
    """

    def __init__(self, device="cpu", *, every_thread: bool = False):
        self.trace = MemoryTrace(torch.device(device))
        self.every_thread = every_thread
        self._flag = None
        if self.trace.device.type == "cuda" and self.trace.device.index is None:
            self.trace.device = torch.device("cuda", torch.cuda.current_device())
        self._prof = None
        self._raw: list = []
        self._known: dict[int, int] = {}    # CPU: address -> bytes of the blocks enclosing trackers saw allocated
        self._base = self._seen = (0, 0)    # CUDA: allocated and reserved bytes at the start; the peaks before a reset

    def _start(self) -> None:
        self._prof = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
        with _quiet_stderr():
            self._prof.__enter__()

    def _stop(self, *exc) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*(exc or (None, None, None)))
        self._raw += _raw_events(self._prof.kineto_results)
        self._prof = None

    def __enter__(self) -> MemoryTrace:
        dev = self.trace.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            reset_cuda_peak(dev)                      # the outer ones keep what they saw: they may nest
            self._base = self._seen = (torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev))
            _cuda_open.append(self)
            return self.trace
        if dev.type != "cpu":
            raise ValueError(f"track_memory measures 'cpu' or 'cuda', found device {dev}; "
                             "use track_op_outputs for an op-output count on other devices")
        stack = _active.__dict__.setdefault("stack", [])
        if not stack and profiler_running():
            raise RuntimeError("track_memory on the CPU needs the profiler, which is already running (a "
                               "torch.profiler.profile around it); measure outside the profiled block")
        if self.every_thread:                         # first: a refusal leaves every tracker as it was
            self._flag = cpu_total_kept_for_every_thread()
            self._flag.__enter__()
        with _no_collection(stack):
            if stack:
                stack[-1]._stop()                     # paused: the profiler runs once at a time
                self._known = _blocks_live(stack[-1]._known, stack[-1]._raw)
            self._start()
        stack.append(self)
        return self.trace

    def __exit__(self, *exc) -> None:
        dev, t = self.trace.device, self.trace
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            _cuda_open.remove(self)
            t.peak = max(self._seen[0], torch.cuda.max_memory_allocated(dev)) - self._base[0]
            t.current = torch.cuda.memory_allocated(dev) - self._base[0]
            t.reserved_peak = max(self._seen[1], torch.cuda.max_memory_reserved(dev)) - self._base[1]
            return
        if self._prof is None:
            return
        stack = _active.stack
        with _no_collection(stack[:-1]):
            self._stop(*exc)
            if self._flag is not None:
                self._flag.__exit__(None, None, None)
                self._flag = None
            stack.pop()
            if stack:                                 # the outer one counts these events too, and goes on
                stack[-1]._raw += self._raw
                stack[-1]._start()
        live, t.peak, t.peak_op = 0, 0, ""
        base = self._raw[0][2] - self._raw[0][1] if self._raw else 0   # every thread's total before the first
        known, made = dict(self._known), {}           # address -> bytes, ops of the blocks seen allocated
        for _, nbytes, total, op, ptr in self._raw:
            if nbytes > 0:
                known[ptr], made[ptr] = nbytes, op
            elif ptr in known:
                op = made.pop(ptr, op)
                nbytes = -known.pop(ptr)
            else:                 # allocated before (or, every thread counted, maybe by another thread inside)
                t.unseen_frees += 1
                if not self.every_thread:             # c10's size may be another block's: not counted
                    nbytes = 0
            live = total - base if self.every_thread else live + nbytes
            t.events.append((op, nbytes, live))
            t.allocations += nbytes > 0
            if live > t.peak:
                t.peak, t.peak_op = live, op
        t.current = live

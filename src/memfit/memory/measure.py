"""Measure the live tensor bytes of running code: the figure the planner and `evaluate` compare with.

On CUDA this is the caching allocator's own count (`torch.cuda.max_memory_allocated` above the
start). On CPU there is no allocator statistic, so a `TorchDispatchMode` sees every ATen op's
outputs, counts each new storage once and subtracts it when the last tensor on it is freed.

Example:
    >>> import torch
    >>> from memfit.memory.measure import track_memory
    >>> with track_memory("cpu") as mem:
    ...     y = torch.ones(1000) * 2        # two float32 buffers of 4000 bytes, both live at once
    >>> mem.peak
    8000
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTrace", "held_bytes", "track_memory", "unique_bytes"]


@dataclass
class MemoryTrace:
    """Bytes allocated above the start of the `with` block: `peak` is the most live at once."""
    device: torch.device
    current: int = 0
    peak: int = 0
    allocations: int = 0


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):      # sparse or wrapper tensors own no plain storage
        return None
    # the storage object's own address, not its data pointer: fake tensors (memfit.memory.step_model) have none
    return (s._cdata, s.nbytes()) if s.nbytes() else None


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


class _Tracker(TorchDispatchMode):
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


class track_memory:  # noqa: N801  (used as a context manager, reads like a function)
    """Context manager measuring the live tensor bytes allocated inside it on `device`.

    Args:
        device: where to measure ("cpu", "cuda", "cuda:1", a torch.device).
    """

    def __init__(self, device="cpu"):
        self.trace = MemoryTrace(torch.device(device))
        if self.trace.device.type == "cuda" and self.trace.device.index is None:
            self.trace.device = torch.device("cuda", torch.cuda.current_device())
        self._mode: _Tracker | None = None
        self._base = 0

    def __enter__(self) -> MemoryTrace:
        dev = self.trace.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self._base = torch.cuda.memory_allocated(dev)
        else:
            self._mode = _Tracker(self.trace)
            self._mode.__enter__()
        return self.trace

    def __exit__(self, *exc) -> None:
        dev = self.trace.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            self.trace.peak = torch.cuda.max_memory_allocated(dev) - self._base
            self.trace.current = torch.cuda.memory_allocated(dev) - self._base
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

"""Bytes a batch of n needs, from plans at two small batch sizes: no run at full size.

The planner lays out the graph at batch 2 and batch 4 (only shapes are traced; nothing runs).
Each tensor's size is affine in the batch, `a + b * n`, so the sizes at any n follow exactly, and
the same offset algorithm places them again (a fraction of a second, cached per n). When the two
graphs differ in structure the totals are extrapolated linearly with 25% head-room instead, and
`MemoryModel.method` says so.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).eval()
    >>> mm = memory_model(model, (64,))
    >>> mm.total_bytes(1000) > mm.total_bytes(10) > mm.param_bytes
    True
    >>> max_batch_size(model, (64,), "1MiB") > 0
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from memfit.budget import check_count, parse_bytes
from memfit.planner.arena import Buffer, assign_offsets, live_profile
from memfit.planner.planned import ALIGNMENT, layout

__all__ = ["MemoryModel", "activation_bytes", "max_batch_size", "memory_model"]

PROBES = (2, 4)     # batch 1 is avoided: export specialises size-1 dimensions


@dataclass
class MemoryModel:
    """Bytes for a batch of n: parameters + inputs + planned arena + unplanned (see `total_bytes`).

    Attributes:
        param_bytes: parameters and buffers the graph reads.
        method: how sizes at other batch sizes are computed ("affine per tensor" or the fallback).
    """
    param_bytes: int
    input_bytes_per_sample: int
    method: str
    algorithm: str
    _arena: list[tuple[int, int, int, int]]          # (a, b, first, last): size a + b*n
    _outside: list[tuple[int, int, int, int]]
    _fallback: tuple[float, float] | None = None     # (a, b) of the total without params and inputs
    _cache: dict[int, tuple[int, int]] = field(default_factory=dict)

    def _parts(self, n: int) -> tuple[int, int]:
        if n not in self._cache:
            if self._fallback is not None:
                a, b = self._fallback
                self._cache[n] = (int(1.25 * (a + b * n)) + 1, 0)
            else:
                arena = [Buffer(str(i), max(0, a + b * n), f, la) for i, (a, b, f, la) in enumerate(self._arena)]
                outside = [Buffer(str(i), max(0, a + b * n), f, la) for i, (a, b, f, la) in enumerate(self._outside)]
                self._cache[n] = (assign_offsets(arena, self.algorithm, ALIGNMENT)[1],
                                  max(live_profile(outside, 1), default=0))
        return self._cache[n]

    def arena_bytes(self, n: int) -> int:
        """The planned arena for a batch of n."""
        return self._parts(_batch(n))[0]

    def unplanned_bytes(self, n: int) -> int:
        """The most bytes live outside the arena at one op for a batch of n."""
        return self._parts(_batch(n))[1]

    def total_bytes(self, n: int) -> int:
        """Parameters + the batch of inputs + arena + unplanned, for a batch of n (bytes)."""
        n = _batch(n)
        return self.param_bytes + self.input_bytes_per_sample * n + sum(self._parts(n))


def _batch(n) -> int:
    return check_count("the batch size", n, 1)


def _sample_shape(sample_shape) -> tuple[int, ...]:
    if isinstance(sample_shape, int):
        sample_shape = (sample_shape,)
    try:
        return tuple(check_count("sample_shape", s, 1) for s in sample_shape)   # numpy ints too
    except (TypeError, ValueError):
        raise ValueError(f"expected sample_shape as positive ints without the batch dimension, e.g. (3, 32, 32); "
                         f"found {sample_shape!r}") from None


def _device(model: torch.nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def memory_model(model: torch.nn.Module, sample_shape: Sequence[int], dtype: torch.dtype = torch.float32, *,
                 algorithm: str = "greedy_by_size") -> MemoryModel:
    """The bytes `model` needs per batch size, from layouts at batch 2 and 4.

    Args:
        model: an eval-mode module torch.export can capture (on its own device).
        sample_shape: one sample's shape, without the batch dimension.
        dtype: the input dtype.
        algorithm: the offset algorithm, as in `plan`.

    Raises:
        CaptureError: torch.export cannot capture the model.

    Example:
        >>> import torch
        >>> mm = memory_model(torch.nn.Linear(8, 4), (8,))
        >>> mm.param_bytes, mm.total_bytes(2) - mm.param_bytes      # inputs 64 + output 32
        (144, 96)
    """
    shape = _sample_shape(sample_shape)
    dev = _device(model)
    lays = [layout(model, (torch.empty((n, *shape), dtype=dtype, device=dev),), algorithm=algorithm)
            for n in PROBES]
    per_sample = math.prod(shape) * dtype.itemsize
    params = lays[0].report.param_bytes
    (n1, n2), (l1, l2) = PROBES, lays
    kinds = [[(r.name, r.kind, r.first, r.last) for r in lay.graph.roots.values()] for lay in lays]
    if kinds[0] != kinds[1]:
        r1, r2 = l1.report, l2.report
        t1, t2 = r1.arena_bytes + r1.unplanned_bytes, r2.arena_bytes + r2.unplanned_bytes
        b = max(0.0, (t2 - t1) / (n2 - n1))
        return MemoryModel(params, per_sample, "linear in the batch from totals at 2 and 4, +25% (graphs differ)",
                           algorithm, [], [], (max(0.0, t1 - b * n1), b))
    arena, outside = [], []
    end = len(l1.graph.steps)
    for r, q in zip(l1.graph.roots.values(), l2.graph.roots.values(), strict=True):
        b = (q.nbytes - r.nbytes) // (n2 - n1)
        item = (r.nbytes - b * n1, b, max(r.first, 0), min(r.last, end))
        if r.kind == "arena":
            arena.append(item)
        elif r.kind in ("call", "output"):
            outside.append(item)
    return MemoryModel(params, per_sample, "affine per tensor from layouts at batch 2 and 4", algorithm,
                       arena, outside)


def activation_bytes(model: torch.nn.Module, sample_shape: Sequence[int], batch_sizes: Sequence[int],
                     dtype: torch.dtype = torch.float32) -> list[int]:
    """Bytes for each batch size: parameters + inputs + planned arena + unplanned (a list, in order).

    Example:
        >>> import torch
        >>> a, b = activation_bytes(torch.nn.Linear(8, 4), (8,), [10, 20])
        >>> b - a                # 10 more samples: inputs 320 + outputs 160 bytes
        480
    """
    mm = memory_model(model, sample_shape, dtype)
    return [mm.total_bytes(n) for n in batch_sizes]


def max_batch_size(model: torch.nn.Module, sample_shape: Sequence[int], budget: int | str, *,
                   extra_bytes_per_sample: int = 0, dtype: torch.dtype = torch.float32,
                   limit: int = 2**31) -> int:
    """The largest batch n whose `activation_bytes` + `extra_bytes_per_sample * n` fit `budget`.

    Returns 0 when not even one sample fits (callers print it or raise `BudgetExceeded`).

    Args:
        budget: bytes, or a string such as "64MiB".
        extra_bytes_per_sample: anything else held per sample (a compact copy of the batch, say).
        limit: the largest batch considered.

    Example:
        >>> import torch
        >>> max_batch_size(torch.nn.Linear(8, 4), (8,), 144 + 48 * 10)      # params + 48 bytes a sample
        10
    """
    budget = parse_bytes(budget)
    extra_bytes_per_sample = check_count("extra_bytes_per_sample", extra_bytes_per_sample, 0)
    mm = memory_model(model, sample_shape, dtype)
    fits = lambda n: mm.total_bytes(n) + extra_bytes_per_sample * n <= budget
    if not fits(1):
        return 0
    lo = 1
    while lo < limit and fits(min(2 * lo, limit)):
        lo = min(2 * lo, limit)
    hi = min(2 * lo, limit)
    while lo < hi:                           # fits(lo) holds; the answer is below hi + 1
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo

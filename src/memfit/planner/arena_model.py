"""The memory of the planned forward (`memfit.plan`'s module, the one `evaluate` runs planned): the planner's arena
at any batch size. Not the user's own `model(x)`: that is `memfit.memory_model`'s default (an eager forward on fake
tensors); this is `memfit.memory_model(..., planned=True)`.

One capture with a symbolic batch gives the placement at any n with every tensor's exact size (nothing
runs; cached per n). Where the capture is static, placements at batch 2 and 4 give each tensor's size as
the exact line `a + b * n` (rationals, rounded up).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memfit.budget import check_count, format_bytes, model_device
from memfit.device.allocators import CPU_ALIGNMENT, cpu_margin
from memfit.device.cuda_blocks import round_size
from memfit.device.cuda_caching import replay
from memfit.memory.cuda_held import prelude
from memfit.memory.cuda_step import STEPS
from memfit.memory.cuda_target import cuda_device
from memfit.memory.fit import exact_line_at
from memfit.memory.kinds import MemoryKind, summary
from memfit.planner.arena import Buffer, assign_offsets, live_profile
from memfit.planner.capture import CaptureError
from memfit.planner.planned import capture_model, place, place_at

__all__ = ["PROBES", "GraphsDiffer", "PlannedMemoryModel", "planned_memory_model"]


def _batch(n) -> int:
    return check_count("the batch size", n, 1)


PROBES = (2, 4)     # batch 1 is avoided: export specialises size-1 dimensions


@dataclass
class PlannedMemoryModel:
    """Bytes for a batch of n: parameters + inputs + planned arena + unplanned (see `total_bytes`).

    Implements `memfit.memory.kinds.MemoryModel`, as `StepMemoryModel` does.

    Attributes:
        param_bytes: parameters and buffers the graph reads.
        method: how sizes at other batch sizes are computed.
    """
    param_bytes: int
    input_bytes_per_sample: int
    method: str
    algorithm: str
    _arena: list[tuple[int, int, int, int]]          # (bytes at n1, bytes at n2, first, last)
    _outside: list[tuple[int, int, int, int]]
    device: torch.device = torch.device("cpu")
    train: bool = False
    _cache: dict[int, tuple[int, int]] = field(default_factory=dict)
    _cap: object = None                               # a capture with a symbolic batch: exact placements at any n
    # n -> a capture at batch n below the symbolic range, made when first asked (None once the model is gone). Batch
    # 1 is planned from a capture of its own, whose graph may differ: BERT's attention mask computed once for both
    # layers there, once per layer in the symbolic graph (0.9998x the allocator from the symbolic graph's sizes)
    _capture_below: Callable = field(default=lambda n: None, repr=False)
    _blocks: list = field(default_factory=list)      # CUDA: (kind, bytes) of each parameter storage in `.to` order
    _rows: dict = field(default_factory=dict)        # n -> [(bytes, first op, last op)] of the tensors outside it

    def __repr__(self) -> str:
        return summary(self, "the planned forward")

    def _parts(self, n: int) -> tuple[int, int]:
        if n not in self._cache and self._cap is not None:
            own = self._capture_below(n) if n < self._cap.batch_range[0] else None
            if own is not None:     # below the symbolic range (batch 1): its own capture, as `plan` makes it
                rep = place_at(own, n, algorithm=self.algorithm).report
            else:                   # (the model is gone: the symbolic graph's sizes at n, an estimate)
                rep = place_at(self._cap, n, algorithm=self.algorithm, _below_range=True).report
            self._cache[n] = (rep.arena_bytes, rep.unplanned_bytes)
            self._rows[n] = [(r.bytes, *r.lifetime) for r in rep.rows if r.offset is None]
        if n not in self._cache:
            arena = [Buffer(str(i), _size(s1, s2, n), f, pl) for i, (s1, s2, f, pl) in enumerate(self._arena)]
            outside = [Buffer(str(i), _size(s1, s2, n), f, pl) for i, (s1, s2, f, pl) in enumerate(self._outside)]
            self._cache[n] = (assign_offsets(arena, self.algorithm, CPU_ALIGNMENT)[1],
                              max(live_profile(outside, 1), default=0))
            self._rows[n] = [(b.size, b.first, b.last) for b in outside]
        return self._cache[n]

    def arena_bytes(self, n: int) -> int:
        """The planned arena for a batch of n."""
        return self._parts(_batch(n))[0]

    def unplanned_bytes(self, n: int) -> int:
        """The most bytes live outside the arena at one op for a batch of n."""
        return self._parts(_batch(n))[1]

    def breakdown(self, n: int) -> dict[str, int]:
        """Bytes by kind for a batch of n (they sum to `total_bytes(n)`)."""
        n = _batch(n)
        arena, outside = self._parts(n)
        out = {MemoryKind.PARAMETERS.value: self.param_bytes, MemoryKind.INPUTS.value: self.input_bytes_per_sample * n,
               MemoryKind.ARENA.value: arena, MemoryKind.OUTSIDE_ARENA.value: outside}
        if self.device.type == "cuda":
            return self._cuda_parts(n, out)
        out[MemoryKind.ALLOCATOR_MARGIN.value] = cpu_margin()   # the CPU (a model on meta runs there too)
        return out

    def _cuda_parts(self, n: int, out: dict[str, int]) -> dict[str, int]:
        """On CUDA: the caching allocator replayed over STEPS planned forwards (the parameters' blocks, then per
        forward the input, the arena as one block, the tensors outside it from their first op to their last), the
        cuBLAS workspace of the first matmul and the context (`memfit.memory.cuda_target`): what it reserves
        beyond the blocks (rounded as c10 rounds them) is its own term. Not yet compared with a GPU."""
        cuda = cuda_device(self.device)
        costs = cuda.costs(1)
        events, arena, rows = [("p", i) for i in range(len(self._blocks))], out[MemoryKind.ARENA.value], self._rows[n]
        events = [(k, b) for k, (_, b) in zip(events, self._blocks, strict=True)]
        for step in range(STEPS):
            events += [((step, "x"), out[MemoryKind.INPUTS.value]), ((step, "arena"), arena)]
            for op in range(max((last for _, _, last in rows), default=-1) + 2):
                events += [((step, i), -b) for i, (b, _, last) in enumerate(rows) if last == op - 1]
                events += [((step, i), b) for i, (b, first, _) in enumerate(rows) if first == op]
            events += [((step, "arena"), -arena), ((step, "x"), -out[MemoryKind.INPUTS.value])]
            if step == 0:
                events += [(("workspace", c.name), c.nbytes) for c in costs if c.in_allocator]
        r = replay([e for e in events if e[1]], cuda.config)
        held = sum(round_size(b, cuda.config) for _, b in self._blocks) + sum(
            round_size(v, cuda.config) for k, v in out.items() if v and k != MemoryKind.PARAMETERS.value)
        out = {**out, **{c.name: c.nbytes for c in costs if c.in_allocator}}
        out[MemoryKind.RESERVED_BEYOND.value] = max(0, r.peak_reserved - held - sum(
            c.nbytes for c in costs if c.in_allocator))
        return {**out, **{c.name: c.nbytes for c in costs if not c.in_allocator}}

    def total_bytes(self, n: int) -> int:
        """Parameters + the batch of inputs + arena + unplanned, for a batch of n (bytes)."""
        return sum(self.breakdown(n).values())

    def explain(self, n: int = 1) -> str:
        """What the figure is, how it was computed, and the bytes by kind at a batch of n."""
        lines = [f"memory of the planned forward (memfit.plan's module, not an eager model(x)) on {self.device}, by "
                 f"{self.method}.",
                 f"batch {n}: {format_bytes(self.total_bytes(n))}:"]
        lines += [f"  {k:<32} {format_bytes(v):>12}" for k, v in self.breakdown(n).items()]
        if self.device.type == "cuda":
            lines.append("CUDA: the caching allocator replayed over the planned forwards (parameters, input, the "
                         "arena as one block, the tensors outside it), and the fixed costs (cuBLAS workspace, CUDA "
                         "context).")
        return "\n".join(lines)


def _capture_at(model, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> Callable:
    """n -> the capture of `model` at batch n (once), or None when the model is gone: a weak reference, so that a
    memory model kept per model (`memory.cache`) does not keep its model alive."""
    ref, made = weakref.ref(model), {}

    def at(n: int):
        if n not in made:
            m = ref()
            if m is None:
                return None
            made[n] = capture_model(m, (torch.zeros((n, *shape), dtype=dtype, device=dev),))
        return made[n]
    return at


def _size(s1: int, s2: int, n: int) -> int:
    """Bytes at batch n of a tensor of s1 bytes at PROBES[0] and s2 at PROBES[1]."""
    return exact_line_at(s1, s2, *PROBES, n)


class GraphsDiffer(CaptureError):
    """The captured graphs at two batch sizes differ: sizes cannot be fitted per tensor."""

    def __init__(self, message: str = "the graphs captured at batch 2 and 4 differ: tensor sizes cannot be fitted "
                                      "per tensor"):
        super().__init__(message, "graphs differ")


def planned_memory_model(model, shape: tuple[int, ...], dtype: torch.dtype, algorithm: str) -> PlannedMemoryModel:
    """The planned forward's bytes at any batch, from one capture (or two static ones)."""
    dev = model_device(model)
    per_sample = math.prod(shape) * dtype.itemsize
    cap = capture_model(model, (torch.zeros((PROBES[0], *shape), dtype=dtype, device=dev),))
    if cap.dynamic:           # one export; the placement at any n has every tensor's exact size
        rep = place_at(cap, PROBES[0], algorithm=algorithm).report
        how = ("planned arena: exact placements at any batch from one capture with a symbolic batch (batch 1 from a "
               "capture of its own, as planned)")
        return PlannedMemoryModel(rep.param_bytes, per_sample, how, algorithm, [], [], dev, _cap=cap,
                                  _capture_below=_capture_at(model, shape, dtype, dev),
                                  _blocks=prelude(model, None, False))
    # a static capture: placements at 2 and 4, each tensor's size the exact line through its two sizes
    placements = [place(model, (torch.zeros((n, *shape), dtype=dtype, device=dev),), algorithm=algorithm)
                  for n in PROBES]
    params = placements[0].report.param_bytes
    l1, l2 = placements
    kinds = [[(r.name, r.kind, r.first, r.last) for r in pl.graph.roots.values()] for pl in placements]
    if kinds[0] != kinds[1]:
        raise GraphsDiffer
    arena, outside = [], []
    end = len(l1.graph.ops)
    for r, q in zip(l1.graph.roots.values(), l2.graph.roots.values(), strict=True):
        item = (r.nbytes, q.nbytes, max(r.first, 0), min(r.last, end))
        if r.kind == "arena":
            arena.append(item)
        elif r.kind in ("call", "output"):
            outside.append(item)
    if [w.name for w in l1.workspaces] != [w.name for w in l2.workspaces]:
        raise GraphsDiffer
    outside += [(w.size, q.size, w.first, w.last) for w, q in zip(l1.workspaces, l2.workspaces, strict=True)]
    how = f"planned arena: sizes per tensor affine from placements at batch 2 and 4 (the capture is static: " \
          f"{cap.static_reason})"
    return PlannedMemoryModel(params, per_sample, how, algorithm, arena, outside, dev,
                              _blocks=prelude(model, None, False))

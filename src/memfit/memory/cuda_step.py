"""A step's bytes on CUDA (`CudaStep`): the caching allocator replayed over every allocation and free of the step
(`memfit.device.cuda_caching.replay`), plus the fixed costs no tensor accounts for (`memfit.device.cuda_costs`):
what `StepMemoryModel` answers with on CUDA, reserved bytes (`torch.cuda.max_memory_reserved`) with the allocated
bytes (`max_memory_allocated`) beside them.

The sequence at a batch of n comes from the fake runs (`memfit.memory.fake_run._Run.events` / `sizes`):
- where the runs allocate and free the same storages at the same ops, each allocation's bytes are a line in the
  batch, a + b*n, through two runs: exact where the runs are proportional (each size the same in both or scaled
  with the batch) or every other run lies on it; else a + b*n + c*n^2 through three runs, exact where every other
  (at least one) lies on it (`event_lines`);
- a run that ran other ops (batch 1, where broadcast parameters need no reduction) is its own exact sequence;
- otherwise (the ops change with the batch, or the sizes are neither) the replays of the runs made give the
  allocator's bytes beyond allocated as a fraction of the allocated ones, applied to the fitted allocated bytes
  at n: APPROXIMATE, said in `method`.

The sequence replayed (`CudaStep.trace`) is a training loop's steady state as c10 sees it:
1. the parameters and buffers, one block per storage, in the order `model.to("cuda")` allocates them
   (`Module._apply`: a module's children before its own), then the optimizer state and gradients held before
   the step;
2. `STEPS` steps, each: the batch's tensors, the step's events (the optimizer step's, run once at batch 4, put
   in at the end of backward), then what the step leaves live and does not keep freed (the batch, garbage of
   reference cycles); the cuBLAS workspaces (one per thread and stream) at the first matmul of the first forward
   and of the first backward (autograd's device thread runs backward: a handle of its own); what a step keeps
   (optimizer state made at the first step, gradients zero_grad keeps, tensors cached on a module) is allocated
   by the first step only.
Its peak reserved is `max_memory_reserved` of such a loop run in a fresh process; the CUDA context (outside the
allocator) is added.

Known limitations: one stream (side streams and `record_stream` are not modelled); cuDNN's convolution workspaces
and memory-efficient attention's backward workspace are not counted (`method` names such ops where the step has
them); the batch is allocated before each step and freed after it (a loop holding the next batch while the last
is alive holds two).

Example:
    >>> lines = event_lines({n: _Run([], np.zeros((1, 6)), {}, {}, np.array([[0, 1, 0, 0, 0]]), np.array([100 * n]))
    ...                      for n in (1, 4)})
    >>> lines.at(7).tolist()
    [700]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memfit.device.cuda_alloc_conf import AllocatorConfig
from memfit.device.cuda_blocks import round_size
from memfit.device.cuda_caching import Replay, replay
from memfit.device.cuda_costs import FixedCost
from memfit.memory.cuda_held import INPUTS, PARAMETERS, WORKSPACES, prelude
from memfit.memory.fake_run import _Run
from memfit.memory.fit import proportional
from memfit.memory.kinds import STEP_KINDS, MemoryKind

__all__ = ["CUBLAS", "STEPS", "CudaPeak", "CudaStep", "EventLines", "cuda_step", "event_lines"]

STEPS = 3                # steps replayed: the first makes what a step keeps, the later ones reuse the cache
# ops whose CUDA kernels call cuBLAS (or cuBLASLt, which shares its workspace): their first call on a thread makes
# the handle's workspace (aten/src/ATen/cuda/CublasHandlePool.cpp)
CUBLAS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "addr",
                    "_addmm_activation", "_scaled_mm", "_int_mm"})
# ops whose CUDA kernels allocate inside what this model does not count, named in `method`
UNCOUNTED = {"convolution": "cuDNN's convolution workspaces", "convolution_backward": "cuDNN's convolution workspaces",
             "_efficient_attention_backward": "memory-efficient attention's backward workspace",
             "_scaled_dot_product_efficient_attention_backward": "memory-efficient attention's backward workspace",
             "mkldnn_rnn_layer": "cuDNN's RNN workspace (the CPU's oneDNN LSTM ran instead)"}


@dataclass(frozen=True)
class EventLines:
    """Each allocation's bytes at a batch of n, per event of the runs' `events`: a + b*n (+ c*n^2)."""
    a: np.ndarray
    b: np.ndarray
    c: np.ndarray | None
    how: str

    def at(self, n: int) -> np.ndarray:
        s = self.a + self.b * n + (self.c * n * n if self.c is not None else 0)
        return np.ceil(np.round(s, 6)).astype(np.int64)      # exact rationals: only float noise is rounded off


def event_lines(runs: dict[int, _Run]) -> EventLines | None:
    """Each allocation's bytes as a line (or quadratic) in the batch through the runs that allocate and free the
    same storages at the same ops as batch 4's, where it is exact (see the module doc); None where it is not."""
    base = runs[4]
    same = sorted(n for n, r in runs.items() if r.ops == base.ops and np.array_equal(r.events, base.events))
    s = {n: runs[n].sizes.astype(np.float64) for n in same}
    holds = lambda line, ns: all(np.array_equal(line.at(n), runs[n].sizes) for n in ns)
    if 1 in same and proportional(runs[1], 1, base, 4):
        b = (s[4] - s[1]) / 3
        return EventLines(s[1] - b, b, None, "each allocation a line in the batch through batch 1 and 4 (the same "
                                             "bytes in both, or 4 times as many)")
    if 2 not in same:
        return None
    b = (s[4] - s[2]) / 2
    others = [n for n in same if n not in (2, 4)]
    line = EventLines(s[2] - 2 * b, b, None, "each allocation a line in the batch through batch 2 and 4, " + (
        f"exact at {others}" if others else "the same bytes in both or twice as many"))
    if holds(line, others) and (others or proportional(runs[2], 2, base, 4)):
        return line
    checks = [n for n in same if n not in (2, 4, 8)]
    if 8 in same and checks:
        c = ((s[8] - s[4]) / 4 - (s[4] - s[2]) / 2) / 6
        b = (s[4] - s[2]) / 2 - 6 * c
        quad = EventLines(s[2] - 2 * b - 4 * c, b, c, f"each allocation a quadratic in the batch through batch 2, "
                                                      f"4 and 8, exact at {checks}")
        if holds(quad, checks):
            return quad
    return None


@dataclass(frozen=True)
class _Source:
    """One sequence of events: the lines' (any n), or a run's own (its n only)."""
    events: list                          # rows of `_Run.events`
    sizes: Callable[[int], list]          # n -> bytes of each event
    step: tuple[list, list]               # the optimizer step's events and bytes ([] without one)
    step_at: int                          # where in `events` the step's go
    cublas_at: tuple[int, ...]            # where the cuBLAS workspaces are made (the first step only)


def _cublas_at(run: _Run) -> tuple[int, ...]:
    """The event indices right after the first cuBLAS op of the forward and of the backward: each thread's first
    matmul makes its handle's workspace, after the op's output (at::mm allocates its result, then calls cuBLAS)."""
    ends, found = run.phase_ends, []
    forward = ends.get("forward", len(run.ops))
    for lo, hi in ((0, forward), (forward, ends.get("backward", forward))):
        first = next((i for i in range(lo, hi) if _name(run.ops[i]) in CUBLAS), None)
        if first is not None:
            found.append(int(np.searchsorted(run.events[:, 0], first, side="right")))
    return tuple(found)


def _name(op) -> str:
    return getattr(getattr(op, "overloadpacket", None), "__name__", "")


def _source(run: _Run, sizes: Callable[[int], np.ndarray], step_run: _Run) -> _Source:
    step = ([], []) if step_run.step_events is None else (step_run.step_events.tolist(), step_run.step_sizes.tolist())
    return _Source(run.events.tolist(), lambda n: sizes(n).tolist(), step, run.step_at, _cublas_at(run))


@dataclass(frozen=True)
class CudaPeak:
    """The allocator's figures of a step at one batch size, in bytes (from a replay)."""
    reserved: int          # torch.cuda.max_memory_reserved
    allocated: int         # torch.cuda.max_memory_allocated
    outside: int           # fixed costs outside the allocator (the CUDA context)
    segments: int          # segments held when reserved peaked
    largest_free: int      # the largest cached free block then
    exact: bool            # False: the sequence at this size is not known exactly (APPROXIMATE)

    @property
    def total(self) -> int:
        """Reserved plus what lies outside the allocator: the device memory the process needs."""
        return self.reserved + self.outside


@dataclass
class CudaStep:
    """A step's bytes on CUDA at any batch size, from the caching allocator replayed (see the module doc)."""
    how: str                                   # how the sequences are known, in words
    sources: dict                              # None -> the lines' source (any n); n -> a run's own (exact at n)
    held: list[tuple[int, int]]                # (kind, bytes) of the blocks before the first step (`prelude`)
    inputs: list[int]                          # bytes per sample of each tensor of the batch (and target)
    workspaces: list[FixedCost]                # in the allocator, one block each per thread (count: how many)
    outside: list[FixedCost]                   # outside it: the CUDA context
    config: AllocatorConfig
    train: bool
    fallback: Callable[[int], dict] | None = None   # n -> the fitted allocated bytes by kind (no exact sequence)
    named: tuple[str, ...] = ()                # kinds of held blocks after the workspaces' (DDP's buckets)
    _replays: dict = field(default_factory=dict, repr=False)
    _traces: dict = field(default_factory=dict, repr=False)

    def exact_at(self, n: int) -> bool:
        """Whether the sequence at batch n is known exactly (a line per event, or a run of its own)."""
        return n in self.sources or None in self.sources

    def trace(self, n: int) -> tuple[list, list]:
        """(events for `replay`, the kind of each) of the loop at batch n (see the module doc)."""
        if n in self._traces:
            return self._traces[n]
        src = self.sources[n] if n in self.sources else self.sources[None]
        sizes, (step_events, step_sizes) = src.sizes(n), src.step
        events, kinds, live = [], [], {}
        tables = {"e": (src.events, sizes), "s": (step_events, step_sizes)}

        def alloc(key, nbytes: int, kind: int) -> None:
            if nbytes > 0:                     # 0 bytes: no block (c10 hands out nullptr)
                events.append((key, nbytes))
                kinds.append(kind)
                live[key] = nbytes

        def free(key) -> None:
            nbytes = live.pop(key, None)
            if nbytes is not None:
                events.append((key, -nbytes))
                kinds.append(-1)

        for j, (kind, nbytes) in enumerate(self.held):
            alloc(("held", j), nbytes, kind)
        per_thread = [(i, c.nbytes // c.count) for i, c in enumerate(self.workspaces)]

        def emit(tag: str, i: int, step: int, mine: list) -> None:
            rows, nbytes = tables[tag]
            _, sign, ref, kind, kept = rows[i]
            if sign > 0:
                if kept and step:              # made by the first step and kept
                    return
                key = ("kept", tag, i) if kept else (step, tag, i)
                alloc(key, nbytes[i], kind)
                if not kept:
                    mine.append(key)
                return
            # a free: of an allocation in the same list (ref >= 0) or in the other one (-3 - index)
            tag, ref = (tag, ref) if ref >= 0 else ("s" if tag == "e" else "e", -3 - ref) if ref <= -3 else (None, -1)
            if tag is not None:
                free(("kept", tag, ref) if tables[tag][0][ref][4] else (step, tag, ref))

        for step in range(STEPS):
            mine = []                           # what this step allocates and does not keep, in order
            for j, per_sample in enumerate(self.inputs):
                alloc((step, "x", j), per_sample * n, INPUTS)
                mine.append((step, "x", j))
            for i in range(len(src.events) + 1):
                if i == src.step_at:
                    for j in range(len(step_events)):
                        emit("s", j, step, mine)
                if step == 0 and i in src.cublas_at:
                    for w, nbytes in per_thread:
                        alloc(("workspace", i, w), nbytes, WORKSPACES + w)
                if i < len(src.events):
                    emit("e", i, step, mine)
            for key in mine:                   # the batch, and garbage of reference cycles (the next collection)
                free(key)
        self._traces[n] = events, kinds
        return events, kinds

    def replay(self, n: int, **options) -> Replay:
        """The replay of the loop at batch n (`options`: capacity, device_total, memory_fraction of
        `memfit.device.cuda_caching.replay`; without them, cached)."""
        if options:
            return replay(self.trace(n)[0], self.config, **options)
        if n not in self._replays:
            self._replays[n] = replay(self.trace(n)[0], self.config)
        return self._replays[n]

    def peak(self, n: int) -> CudaPeak:
        """The allocator's figures at batch n (where the sequence is not exact: those of the fallback's parts)."""
        outside = sum(c.nbytes for c in self.outside)
        if not self.exact_at(n):
            parts = self.breakdown(n)
            allocated = sum(v for k, v in parts.items() if k != MemoryKind.RESERVED_BEYOND.value) - outside
            return CudaPeak(sum(parts.values()) - outside, allocated, outside, 0, 0, False)
        r = self.replay(n)
        return CudaPeak(r.peak_reserved, r.peak_allocated, outside, len(r.segments_at_peak), r.largest_free_at_peak,
                        True)

    def breakdown(self, n: int) -> dict[str, int]:
        """Bytes by kind at batch n when reserved is at its peak and the blocks handed out are the most (each
        rounded as c10 rounds it), what the allocator reserves beyond them, and the fixed costs outside it: they
        sum to the device memory the step needs."""
        if not self.exact_at(n):
            return self.around(n, self.fallback(n))
        r = self.replay(n)
        events, kinds = self.trace(n)
        parts = np.zeros(WORKSPACES + len(self.workspaces) + len(self.named), dtype=np.int64)
        best, owner, live = parts.copy(), {}, 0
        for i, ((key, nbytes), kind) in enumerate(zip(events, kinds, strict=True)):
            if nbytes > 0:
                owner[key] = kind, round_size(nbytes, self.config)
                parts[kind] += owner[key][1]
                live += owner[key][1]
            else:
                kind, size = owner.pop(key)
                parts[kind] -= size
                live -= size
            # reserved holds its peak from its event on (an unbounded replay never gives segments back)
            if i >= r.peak_reserved_event and live > best.sum():
                best = parts.copy()
        parts = best
        out = {MemoryKind.PARAMETERS.value: int(parts[PARAMETERS]), MemoryKind.INPUTS.value: int(parts[INPUTS])}
        for i, kind in enumerate(STEP_KINDS):
            if parts[i] or kind is MemoryKind.ACTIVATIONS or (self.train and kind is not MemoryKind.KEPT_BY_MODEL):
                out[kind.value] = int(parts[i])
        for i, name in enumerate([c.name for c in self.workspaces] + list(self.named)):
            out[name] = int(parts[WORKSPACES + i])
        out[MemoryKind.RESERVED_BEYOND.value] = r.peak_reserved - int(parts.sum())
        return {**out, **{c.name: c.nbytes for c in self.outside}}

    def around(self, n: int, parts: dict[str, int]) -> dict[str, int]:
        """Allocated bytes by kind fitted at batch n (`parts`, of the whole step or some of its phases) with the
        fixed costs, and what the allocator reserves beyond allocated: that of the replay at n (reserved less
        allocated, at their peaks), or where the sequence at n is not exact, the largest fraction of allocated seen
        in the replays of the runs, of these parts (APPROXIMATE)."""
        out = {**parts, **{c.name: c.nbytes for c in self.workspaces}}
        for j, name in enumerate(self.named):          # held blocks the fit does not know of (DDP's buckets)
            out[name] = sum(b for k, b in self.held if k == WORKSPACES + len(self.workspaces) + j)
        if self.exact_at(n):
            r = self.replay(n)
            beyond = r.peak_reserved - r.peak_allocated
        else:
            ratios = [(r.peak_reserved - r.peak_allocated) / r.peak_allocated
                      for r in (self.replay(m) for m in self.sources if m is not None) if r.peak_allocated]
            beyond = int(np.ceil(max(ratios, default=0.0) * sum(out.values())))
        out[MemoryKind.RESERVED_BEYOND.value] = max(0, beyond)
        return {**out, **{c.name: c.nbytes for c in self.outside}}

    def total(self, n: int) -> int:
        return sum(self.breakdown(n).values())

    def serves(self, n: int, budget: int | None, **limits) -> bool:
        """Whether a batch of n runs in `budget` bytes of device memory: the fixed costs outside the allocator and
        the replay within the rest, with c10's retry after freeing its cache (the out-of-memory boundary); `limits`:
        `memory_fraction` and `device_total` of the replay (budget None: those alone); where the sequence at n is
        not exact, whether `total(n)` fits (and reserved within the fraction)."""
        if not self.exact_at(n):
            fraction, total = limits.get("memory_fraction"), limits.get("device_total")
            reserved = self.total(n) - sum(c.nbytes for c in self.outside)
            return (budget is None or self.total(n) <= budget) and (
                fraction is None or total is None or reserved <= fraction * total)
        capacity = None if budget is None else budget - sum(c.nbytes for c in self.outside)
        return (capacity is None or capacity > 0) and self.replay(n, capacity=capacity, **limits).fits

    def explain(self, n: int) -> str:
        """The CUDA figures at batch n in words (for `StepMemoryModel.explain`)."""
        p = self.peak(n)
        costs = "; ".join(f"{c.name} {c.nbytes / 2**20:.1f} MiB ({c.source})" for c in self.workspaces + self.outside)
        conf = "" if self.config == AllocatorConfig() else f"; allocator settings {self.config}"
        return (f"CUDA: the caching allocator replayed over {STEPS} steps of a training loop ({self.how}"
                f"{'' if p.exact else '; APPROXIMATE at this size'}): peak reserved {p.reserved:,} B "
                f"(torch.cuda.max_memory_reserved), peak allocated {p.allocated:,} B (max_memory_allocated), "
                f"{p.segments} segments and a largest free block of {p.largest_free:,} B when reserved peaked; "
                f"fixed costs: {costs}{conf}.")


def cuda_step(runs: dict[int, _Run], spec, costs: Callable[[int], list[FixedCost]], config: AllocatorConfig,
              fallback: Callable[[int], dict]) -> CudaStep:
    """The CUDA figures of a step from its fake runs (`runs`, batch 4's with the optimizer step) and what
    `spec` (a `memfit.memory.fake_run.StepSpec`) holds before it; `costs(threads)`: the fixed costs with the
    workspaces of that many cuBLAS threads (`memfit.device.cuda_costs.fixed_costs`)."""
    lines = event_lines(runs)
    full = runs[4]
    threads = len(_cublas_at(full))
    fixed = costs(max(threads, 1))
    workspaces = [c for c in fixed if c.in_allocator] if threads else []
    outside = [c for c in fixed if not c.in_allocator]
    if lines is not None:
        sources = {None: _source(full, lines.at, full)}
        how = lines.how
        for n, r in runs.items():              # a run of other ops (batch 1) is its own exact sequence
            if not (r.ops == full.ops and np.array_equal(r.events, full.events)):
                sources[n] = _source(r, lambda m, s=r.sizes: s, full)
                how += f"; batch {n} runs other ops: its own run"
    else:
        sources = {n: _source(r, lambda m, s=r.sizes: s, full) for n, r in runs.items()}
        how = (f"APPROXIMATE: exact at the batch sizes run ({sorted(runs)}); elsewhere the allocated bytes fitted, "
               "with the most reserved beyond allocated seen in those runs' replays, as a fraction")
    inputs = [*spec.batch.per_sample(), *(spec.target.per_sample() if spec.target is not None else ())]
    ops = {_name(op) for r in runs.values() for op in r.ops}
    uncounted = sorted({v for k, v in UNCOUNTED.items() if k in ops})
    if uncounted:
        how += "; not counted: " + ", ".join(uncounted)
    kernels = sorted({k for r in runs.values() for k in r.sdpa})
    if kernels:
        how += f"; attention routed as the GPU runs it: {', '.join(kernels)}"
    return CudaStep(how, sources, prelude(spec.model, spec.optimizer, spec.grads_held), inputs, workspaces, outside,
                    config, spec.train, fallback)


"""The search behind `memfit.fit`, as pure functions: alternatives (micro-batch x checkpoint set x precision),
their predicted step time from a cost model, and the choice (the fastest that fits the budget) with its reason.

Nothing here touches a model. The caller supplies `bytes_of(setting)` (the memory model of the step with
those modules checkpointed: peak bytes for every micro-batch size) and the costs (`Cost`, per sample and per
micro-batch, from fake tensors, `memfit.fitting.costs`). Bytes are the expensive part (fake-tensor runs of the
whole step, one set of runs per checkpoint set), so `search` evaluates them lazily: alternatives are taken
fastest first, and a checkpoint set's bytes are computed only when an alternative using it is the fastest
not yet ruled out. The first that fits wins; every faster one was computed and did not fit.

Example:
    >>> sizes = micro_batch_sizes(8)
    >>> sizes
    [1, 2, 4, 8]
    >>> checkpoint_sets(["b0", "b1", "b2", "b3"])
    [(), ('b0',), ('b0', 'b1'), ('b0', 'b1', 'b2'), ('b0', 'b1', 'b2', 'b3')]
    >>> step = Cost(ops=100, flops=(0.0, 1e6), bytes=(0.0, 1e4))
    >>> block = Cost(ops=10, flops=(0.0, 1e5), bytes=(0.0, 1e3))
    >>> machine = Machine(op_seconds=1e-3, flop_rate=1e9, byte_rate=1e10)     # launches dominate
    >>> settings = [Setting(s) for s in checkpoint_sets(["b0", "b1"])]
    >>> peak = {(): lambda m: 100 * m, ("b0",): lambda m: 80 * m, ("b0", "b1"): lambda m: 60 * m}
    >>> choice = search(settings, sizes, 8, step, {"b0": block, "b1": block}, machine,
    ...                 lambda s: peak[s.checkpoint], budget=500)
    >>> choice.best.micro_batch, choice.best.setting.checkpoint
    (8, ('b0', 'b1'))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from memfit.budget import format_bytes

__all__ = ["Alternative", "Choice", "Cost", "Machine", "Setting", "checkpoint_sets", "micro_batch_sizes",
           "search", "step_seconds"]

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)     # of the candidate blocks checkpointed: the grid the issue names


@dataclass(frozen=True)
class Cost:
    """The work of a forward (of a block) or of a whole step (forward, loss, backward) at a micro-batch of m:
    `ops` kernel launches (the same at every m), `flops` and `bytes` written as lines (a, b): a + b * m."""
    ops: int
    flops: tuple[float, float]
    bytes: tuple[float, float]

    def at(self, m: int, machine: Machine) -> float:
        """Predicted seconds at a micro-batch of m: launch overhead + arithmetic + memory traffic (a roofline
        sum: an upper estimate, which ranks alternatives the same way as the max would where one term rules)."""
        return (self.ops * machine.op_seconds + (self.flops[0] + self.flops[1] * m) / machine.flop_rate
                + (self.bytes[0] + self.bytes[1] * m) / machine.byte_rate)


@dataclass(frozen=True)
class Machine:
    """What a kernel costs on the device: seconds per launch of a tiny op, flop/s of a matmul, bytes/s of a copy."""
    op_seconds: float
    flop_rate: float
    byte_rate: float


@dataclass(frozen=True)
class Setting:
    """What a plan changes besides the micro-batch: the modules checkpointed (qualified names) and the autocast
    dtype name ('bfloat16', or None: the step's own precision)."""
    checkpoint: tuple[str, ...] = ()
    autocast: str | None = None

    def describe(self, blocks: int | None = None) -> str:
        what = f"{len(self.checkpoint)}" + (f"/{blocks}" if blocks is not None else "") + " checkpointed"
        return what + (f", {self.autocast} autocast" if self.autocast else "")


@dataclass
class Alternative:
    """One point of the search: predicted peak bytes (None: not computed, a faster alternative fits) and
    predicted step time relative to the plain step (the whole batch at once, nothing checkpointed)."""
    micro_batch: int
    setting: Setting
    time: float
    bytes: int | None = None

    def fits(self, budget: int) -> bool | None:
        return None if self.bytes is None else self.bytes <= budget


@dataclass
class Choice:
    """The search's answer: `best` (None when nothing fits), every alternative, and why."""
    best: Alternative | None
    alternatives: list[Alternative] = field(default_factory=list)
    reason: str = ""


def micro_batch_sizes(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself: the micro-batch sizes searched for a batch of n."""
    if n < 1:
        raise ValueError(f"expected a batch of at least 1 sample; found {n}")
    sizes = [1 << i for i in range(n.bit_length()) if 1 << i < n]
    return sizes + [n]


def checkpoint_sets(blocks: Sequence[str], fractions: Sequence[float] = FRACTIONS) -> list[tuple[str, ...]]:
    """The first round(f * len(blocks)) of `blocks` (ranked best first) for each fraction f, without repeats."""
    out: list[tuple[str, ...]] = []
    for f in fractions:
        s = tuple(blocks[:round(f * len(blocks))])
        if s not in out:
            out.append(s)
    return out


def step_seconds(n: int, m: int, step: Mapping[str | None, Cost] | Cost, blocks: Mapping[str, Cost],
                 setting: Setting, machine: Machine) -> float:
    """Predicted seconds of a step on n samples in micro-batches of m (the last one what is left) with the
    setting's modules checkpointed: each micro-batch runs the step, and each checkpointed block's forward again.
    `step` may map autocast names to costs (the step under bf16 autocast writes fewer bytes)."""
    if not 1 <= m <= n:
        raise ValueError(f"expected a micro-batch in [1, {n}]; found {m}")
    if isinstance(step, Mapping):
        step = step[setting.autocast]
    full, last = divmod(n, m)
    sizes = [m] * full + ([last] if last else [])
    once = lambda s: step.at(s, machine) + sum(blocks[b].at(s, machine) for b in setting.checkpoint)
    return sum(once(s) for s in sizes) if len(set(sizes)) > 1 else once(m) * len(sizes)


def search(settings: Sequence[Setting], sizes: Sequence[int], n: int, step: Mapping[str | None, Cost] | Cost,
           blocks: Mapping[str, Cost], machine: Machine, bytes_of: Callable[[Setting], Callable[[int], int]],
           budget: int, *, exhaustive: bool = False) -> Choice:
    """The fastest alternative (micro-batch in `sizes` x setting) whose predicted peak fits `budget`.

    Times come first (cheap); `bytes_of(setting)` is called at most once per setting, in the order of the
    fastest alternative not yet ruled out, and never for a setting whose every alternative is slower than one
    that fits (unless `exhaustive`). Once one fits, a slower alternative's bytes are filled in (for `explain`)
    only where `bytes_of(setting).ready(m)` says they need no further fake run (a function without `ready` is
    always ready). Ties in time go to fewer checkpointed modules, then the larger micro-batch.
    """
    base = step_seconds(n, n, step, blocks, Setting(), machine)
    alts = [Alternative(m, s, step_seconds(n, m, step, blocks, s, machine) / base) for s in settings for m in sizes]
    alts.sort(key=lambda a: (a.time, len(a.setting.checkpoint), -a.micro_batch))
    peaks: dict[Setting, Callable[[int], int]] = {}
    best = None
    for a in alts:
        if best is not None and not exhaustive and not (a.setting in peaks and _ready(peaks[a.setting], a.micro_batch)):
            continue                      # slower than the choice and its bytes would need fake runs of their own
        if a.setting not in peaks:
            peaks[a.setting] = bytes_of(a.setting)
        a.bytes = int(peaks[a.setting](a.micro_batch))
        if best is None and a.bytes <= budget:
            best = a                      # the first that fits in time order is the fastest that fits
    return Choice(best, alts, _reason(best, alts, budget, n))


def _ready(peak: Callable[[int], int], m: int) -> bool:
    """Whether peak(m) is at hand without a fake run that has not run (`peak.ready(m)` where it says so)."""
    ready = getattr(peak, "ready", None)
    return True if ready is None else bool(ready(m))


def _reason(best: Alternative | None, alts: list[Alternative], budget: int, n: int) -> str:
    if best is None:
        smallest = min((a for a in alts if a.bytes is not None), key=lambda a: a.bytes, default=None)
        least = f"; the least any needs is {format_bytes(smallest.bytes)} ({_name(smallest, n)})" if smallest else ""
        return f"nothing fits the budget {format_bytes(budget)}{least}"
    faster = [a for a in alts if a.time < best.time and a.bytes is not None]
    plain = next((a for a in alts if a.micro_batch == n and a.setting == Setting()), None)
    if best is plain:
        return f"the plain step fits: {format_bytes(best.bytes)} <= {format_bytes(budget)}"
    head = f"the fastest that fits: {_name(best, n)} at {best.time:.2f}x the plain step's time, " \
           f"{format_bytes(best.bytes)} <= {format_bytes(budget)}"
    if faster:
        over = min(faster, key=lambda a: a.time)
        head += f"; every faster alternative needs more (the fastest, {_name(over, n)}, {format_bytes(over.bytes)})"
    return head


def _name(a: Alternative, n: int) -> str:
    parts = math.ceil(n / a.micro_batch)
    return f"micro-batch {a.micro_batch} ({parts} part{'s' if parts > 1 else ''}), {a.setting.describe()}"

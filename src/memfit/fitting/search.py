"""The search behind `memfit.fit`, as pure functions: alternatives (micro-batch x checkpoint set x precision),
their predicted step time from a cost model, and the choice (the fastest that fits the budget) with its reason.

Nothing here touches a model. The caller supplies `bytes_of(setting)` (the memory model of the step with
those modules checkpointed: peak bytes for every micro-batch size) and the costs (`Cost`: for the step, each
block's forward and the optimizer step, the ops dispatched and the seconds their kernels take at each micro-batch
size, `memfit.fitting.costs`; the host's seconds per op and per checkpointed call, `Machine`). Bytes are the
expensive part (fake-tensor runs of the whole step, one set of runs per checkpoint set), so `search` evaluates
them lazily: alternatives are taken fastest first, and a checkpoint set's bytes are computed only when an
alternative using it is the fastest not yet ruled out (or, for at most `new_after` sets, one worth timing beside
the winner: `Choice.leading`). The first that fits wins; every faster one was computed and did not fit.

The time of one micro-batch of m samples: the host's work (its ops by who dispatches them, at `Machine`'s seconds
per op: Python, the dispatcher, autograd; the same at every m) and the kernels' (`Cost.kernels`, measured at m),
summed on the CPU (one thread does both) and the larger of the two where the device runs the kernels while the host
goes on (`Machine.overlap`, CUDA). A checkpointed block adds its forward again and torch.utils.checkpoint's own host
work: `Machine.checkpoint_seconds` per call and `Machine.saved_seconds` per tensor its forward saves for backward
(each goes through checkpoint's hooks). The optimizer step (`once`) is the same in every alternative; every
micro-batch after the first adds each gradient into the one held (`later`).

Example:
    >>> sizes = micro_batch_sizes(8)
    >>> sizes
    [1, 2, 4, 8]
    >>> checkpoint_sets(["b0", "b1", "b2", "b3"])
    [(), ('b0',), ('b0', 'b1'), ('b0', 'b1', 'b2'), ('b0', 'b1', 'b2', 'b3')]
    >>> step = Cost(ops=50, backward_ops=50, kernels=((1, 1e-3), (8, 8e-3)))    # 1 ms of kernels per sample
    >>> block = Cost(ops=10, kernels=((1, 1e-4), (8, 8e-4)), saved=5)
    >>> machine = Machine(op_seconds=1e-4, backward_op_seconds=1e-4)   # 10 ms of host work per micro-batch
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

__all__ = ["NEW", "Alternative", "Choice", "Cost", "Machine", "Setting", "checkpoint_sets", "confirm", "interpolate",
           "keep_plain", "micro_batch_sizes", "micro_step_seconds", "search", "step_seconds", "trial_order",
           "wide_lead"]

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)     # of the candidate blocks checkpointed: the grid the issue names
LEAD = 1.15      # alternatives predicted within this of the fastest that fits are timed for real beside it ...
LEADING = 3      # ... at most this many (the fastest that fits included)
CLEAR = 0.95     # another plan replaces a plain step that fits only when measured at most this fraction of its time
CLOSE = 1.04     # timed within this of the fastest timed, the simplest is taken (`_simplest`): the same choice in
#                  repeated fits, where timings move a little; the fewest micro-batches before the fewest checkpointed:
#                  trials lean toward more micro-batches (`bench fit --quick`'s BERT, Llama and GPT-2, micro-batch 4
#                  unchecked against 8 with 1 of 2 checkpointed: trials 0.95-1.10x from process to process, the grid
#                  0.90-0.96x; not accumulate's own work, alike in a plain loop; cause not pinned); the other order,
#                  or 2% here, took the slower in 2-4 fits of 5. Pairs whose gap is about the trials' noise (the
#                  issue's Llama, micro-batch 1 unchecked against 2 with 2 checkpointed: 3.8-6.7% apart) split still
WIDE = 1.5       # `LEAD` where trials cost next to nothing (`wide_lead`): the time model's error on a model of a
CHEAP = 0.05     # few ms a step is 20-30% (`bench fit`'s GPT-2: 4 unchecked predicted beyond 1.15x 8 with 1 block
#                  in one fit of five, alike for real); seconds of a plain micro-step (predicted) at most for that
NEW = 2          # settings whose memory models `memfit.fit` may build for the leading alone (beyond those the
#                  fastest that fits needed): GPT-2 768x12 between budgets, micro-batches 2 and 4 without checkpointing
#                  predicted ~1.00x the plain step's time led alone (their setting's bytes were the only ones at hand);
#                  2 took 28.7 s a step, 8 with 6 of 12 blocks checkpointed 16-19 s, never timed


@dataclass(frozen=True)
class Cost:
    """The work of a step's forward, loss and backward, of a block's forward (its recomputation) or of the
    optimizer step: the ops it dispatches (the host's work, the same at every micro-batch size), by who dispatches
    them: `ops` from Python with autograd recording (a forward), `backward_ops` autograd's engine, `optimizer_ops`
    Python without autograd (an optimizer's step); `kernels` the seconds its kernels take at micro-batch sizes
    ((m, seconds) pairs, measured); `saved` the tensors it saves for backward; `written` its bytes written as a
    line (a, b): a + b * m (ranks blocks for checkpointing); `dropped` (a block's) the part of it its Dropout
    modules run, which `memfit.fitting.trials` leaves out (Dropout at p = 0 there)."""
    ops: int
    kernels: tuple[tuple[int, float], ...] = ()
    saved: int = 0
    written: tuple[float, float] = (0.0, 0.0)
    backward_ops: int = 0
    optimizer_ops: int = 0
    unsteady: tuple[int, int] = (0, 0)   # (kernels timed in samples far apart, kernels timed): `timing.unsteady`
    dropped: Cost | None = None

    def kernel_seconds(self, m: int) -> float:
        """The kernels' seconds at m: measured there, else `interpolate`d between the sizes measured."""
        return interpolate(self.kernels, m)

    def host_seconds(self, machine: Machine) -> float:
        """The host's seconds for these ops (the same at every micro-batch size)."""
        return (self.ops * machine.op_seconds + self.backward_ops * machine.backward_op_seconds
                + self.optimizer_ops * machine.optimizer_op_seconds)

    def at(self, m: int, machine: Machine, host: float = 0.0) -> float:
        """Predicted seconds at a micro-batch of m (with `host` seconds of host work besides the ops')."""
        cpu = self.host_seconds(machine) + host
        device = self.kernel_seconds(m)
        return max(cpu, device) if machine.overlap else cpu + device

    def recomputed(self, m: int, machine: Machine) -> float:
        """Predicted seconds a checkpointed block adds at m: its forward again, and checkpoint's own host work (per
        call, and per tensor the forward saves)."""
        return self.at(m, machine, machine.checkpoint_seconds + self.saved * machine.saved_seconds)


def interpolate(points: Sequence[tuple[int, float]], m: float) -> float:
    """Seconds at m from (size, seconds) points: linear between the two sizes around m; past the largest, along the
    last two points' line (a kernel past a few rows grows by its rows); below the smallest (or with one point),
    in proportion to m; 0 with no points."""
    pts = sorted(points)
    if not pts:
        return 0.0
    for (a, ta), (b, tb) in zip(pts, pts[1:], strict=False):
        if a <= m <= b:
            return ta + (tb - ta) * (m - a) / (b - a)
    (a, ta), (b, tb) = pts[0], pts[-1]
    if m < a or len(pts) == 1:
        return ta * m / a if m < a else tb * m / b
    (a, ta) = pts[-2]
    return max(0.0, tb + (tb - ta) * (m - b) / (b - a))


@dataclass(frozen=True)
class Machine:
    """What the host pays on this device beyond the kernels: seconds per op dispatched from Python with autograd
    recording (`op_seconds`: a forward's Python, module calls, the dispatcher, autograd), per op autograd's engine
    runs in backward, per op an optimizer calls under no_grad, per call of a checkpointed block and per tensor it
    saves (torch.utils.checkpoint's hooks); whether the device runs kernels while the host goes on (CUDA: a
    micro-batch takes the larger of the two)."""
    op_seconds: float
    backward_op_seconds: float = 0.0
    optimizer_op_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    saved_seconds: float = 0.0
    overlap: bool = False


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
    predicted step time relative to the plain step (the whole batch at once, nothing checkpointed); `measured`:
    the step's seconds from real micro-steps (`memfit.fitting.trials`), None where not timed."""
    micro_batch: int
    setting: Setting
    time: float
    bytes: int | None = None
    measured: float | None = None

    def fits(self, budget: int) -> bool | None:
        return None if self.bytes is None else self.bytes <= budget


@dataclass
class Choice:
    """The search's answer: `best` (None when nothing fits), every alternative, and why; `leading`: the
    alternatives that fit and are predicted within `search`'s `lead` of the best (it first; one per setting before
    a second of any, the plain step wherever it fits), to be timed for real (`confirm`)."""
    best: Alternative | None
    alternatives: list[Alternative] = field(default_factory=list)
    reason: str = ""
    leading: list[Alternative] = field(default_factory=list)


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


def _per_micro_batch(step: Mapping[str | None, Cost] | Cost, blocks: Mapping[str, Cost], setting: Setting,
                     machine: Machine) -> Callable[[int], float]:
    """Predicted seconds of one micro-batch of s samples with the setting: the step's work and each checkpointed
    block's forward again."""
    if isinstance(step, Mapping):
        step = step[setting.autocast]
    return lambda s: step.at(s, machine) + sum(blocks[b].recomputed(s, machine) for b in setting.checkpoint)


def micro_step_seconds(m: int, step: Mapping[str | None, Cost] | Cost, blocks: Mapping[str, Cost], setting: Setting,
                       machine: Machine) -> float:
    """Predicted seconds of one micro-batch of m samples (forward, loss, backward; no optimizer step) with the
    setting's modules checkpointed: what a trial of it takes (`memfit.fitting.trials`)."""
    return _per_micro_batch(step, blocks, setting, machine)(m)


def step_seconds(n: int, m: int, step: Mapping[str | None, Cost] | Cost, blocks: Mapping[str, Cost],
                 setting: Setting, machine: Machine, once: Cost | None = None, later: Cost | None = None) -> float:
    """Predicted seconds of a step on n samples in micro-batches of m (the last one what is left) with the
    setting's modules checkpointed: each micro-batch runs the step, and each checkpointed block's forward again;
    `once` (the optimizer step) runs once; `later` (each parameter's gradient added into the one held, what
    AccumulateGrad does in a micro-batch after the first) runs in every micro-batch but one. `step` may map
    autocast names to costs (the step under bf16 autocast runs other kernels)."""
    if not 1 <= m <= n:
        raise ValueError(f"expected a micro-batch in [1, {n}]; found {m}")
    full, last = divmod(n, m)
    per = _per_micro_batch(step, blocks, setting, machine)
    fixed = (once.at(n, machine) if once is not None else 0.0) + _adds(full + (last > 0), n, later)
    return full * per(m) + (per(last) if last else 0.0) + fixed


def _adds(parts: int, n: int, later: Cost | None) -> float:
    """Predicted seconds of the gradients' adds in a step on n samples in `parts` micro-batches (none in the
    first): their kernels, which do not depend on the batch (priced at n, a size timed). No host work: each add
    takes the place of the `detach` AccumulateGrad runs where it takes a gradient over, counted in the step."""
    return (parts - 1) * later.kernel_seconds(n) if later is not None else 0.0


def search(settings: Sequence[Setting], sizes: Sequence[int], n: int, step: Mapping[str | None, Cost] | Cost,
           blocks: Mapping[str, Cost], machine: Machine, bytes_of: Callable[[Setting], Callable[[int], int]],
           budget: int, *, exhaustive: bool = False, once: Cost | None = None, later: Cost | None = None,
           lead: float = 1.0,
           leading: int = 1, new_after: int = 0, clear: float = CLEAR) -> Choice:
    """The fastest alternative (micro-batch in `sizes` x setting) whose predicted peak fits `budget`.

    Times come first (cheap); `bytes_of(setting)` is called at most once per setting, in the order of the fastest
    alternative not yet ruled out, and never for a setting whose every alternative is slower than one that fits
    (unless `exhaustive`, or for the leading, below). Once one fits, a slower alternative's bytes are filled in (for
    `explain`) only where `bytes_of(setting).ready(m)` says they need no further fake run (a function without
    `ready` is always ready), or, for `Choice.leading`, where it is predicted within `lead` times the best's time
    and not slower by construction than one already leading (the same micro-batch with its modules checkpointed and
    more; its bytes may need `new_after` more settings' models at most); `leading` caps how many that fit are kept,
    one per setting first (a setting already leading gets another micro-batch only where slots are left: the time
    model errs alike on one setting's micro-batches, so a trial of another setting says more); the same with or
    without `exhaustive` (the memory models it builds for `explain` let nothing else lead). The plain step, where it
    fits, is the best unless another is predicted at most `clear` of its time (then both are leading; 0: the plain
    step wherever it fits, for times that are a stand-in for another device's). Ties in time go to the simplest,
    as in `confirm` (`_simplest`). `once`: the optimizer step's cost (in every alternative
    alike: it changes the relative times, not the order); `later`: the gradients' adds of a micro-batch after the
    first (`step_seconds`).
    """
    base = step_seconds(n, n, step, blocks, Setting(), machine, once, later)
    alts = [Alternative(m, s, step_seconds(n, m, step, blocks, s, machine, once, later) / base)
            for s in settings for m in sizes]
    alts.sort(key=lambda a: (a.time, *_simplest(a)))
    plain = next((a for a in alts if a.micro_batch == n and a.setting == Setting()), None)
    peaks: dict[Setting, Callable[[int], int]] = {}
    # settings that may lead: those built before the best was found, and those built for an alternative wanted
    # (not those `exhaustive` builds for explain(): the leading, and so the plan, are the same either way)
    may_lead: set[Setting] = set()
    best, fitting, built, later = None, [], 0, []
    full = lambda: len(fitting) >= leading + (plain in fitting)

    def fits(a: Alternative) -> bool:         # a deferred one's bytes (its setting built: it leads) when first asked
        if a.bytes is None:
            a.bytes = int(peaks[a.setting](a.micro_batch))
        return a.bytes <= budget

    def near(a: Alternative) -> bool:        # worth timing beside the best: the plain step, or close and not slower
        if best is None or best is plain:
            return False
        if a is plain:
            return True                       # the plain step wherever it fits, a slot of its own beside the leading
        # (not one slower by construction than one already leading, or deferred and fitting: GPT-2 768x12's
        # micro-batch 4 with 6 blocks checkpointed beside 4 with 3, a trial of half a step for nothing)
        if full() or a.time > lead * best.time or any(_dominated(a, f) for f in fitting) \
                or any(_dominated(a, f) and fits(f) for f in later):
            return False
        if any(f.setting == a.setting for f in fitting):
            later.append(a)                   # its setting leads already: a slot only where every other had its turn
            return False
        return a.setting in may_lead or built < new_after
    for a in alts:
        wanted = near(a)
        if best is not None and not exhaustive and not wanted \
                and not (a.setting in peaks and _ready(peaks[a.setting], a.micro_batch)):
            continue                      # slower than the choice and its bytes would need fake runs of their own
        if a.setting not in peaks:
            peaks[a.setting] = bytes_of(a.setting)
        if a.setting not in may_lead and (best is None or wanted):
            built += best is not None
            may_lead.add(a.setting)
        a.bytes = int(peaks[a.setting](a.micro_batch)) if a.bytes is None else a.bytes
        if a.bytes <= budget and (best is None or wanted):
            fitting.append(a)
        if best is None and a.bytes <= budget:
            best = a                      # the first that fits in time order is the fastest that fits
    for a in later:                       # slots left: the settings already leading, at other micro-batches
        if not full() and not any(_dominated(a, f) for f in fitting) and fits(a):
            fitting.append(a)
    if plain in fitting and best is not plain and best.time > clear:
        best, fitting = plain, [plain]    # the plain step fits, and nothing is predicted clearly faster
    return Choice(best, alts, _reason(best, alts, budget, n), fitting)


def _dominated(a: Alternative, best: Alternative) -> bool:
    """`a` is slower than `best` (another alternative) by construction: the same micro-batch and precision, with
    `best`'s modules checkpointed and more (checkpoint sets are prefixes of one ranking: more of the same forwards
    run again)."""
    return (a is not best and a.micro_batch == best.micro_batch and a.setting.autocast == best.setting.autocast
            and len(a.setting.checkpoint) >= len(best.setting.checkpoint)
            and a.setting.checkpoint[:len(best.setting.checkpoint)] == best.setting.checkpoint)


def confirm(choice: Choice, seconds: Mapping[tuple[int, Setting], float], n: int,
            step: Mapping[str | None, Cost] | Cost, blocks: Mapping[str, Cost], machine: Machine,
            once: Cost | None = None, later: Cost | None = None) -> Choice:
    """The choice among the leading alternatives timed for real: `seconds[(m, setting)]` one micro-step of m
    samples (`memfit.fitting.trials.micro_steps`); a step's seconds are its micro-batches' (the uneven last one
    scaled by the time model's ratio to the one timed) plus the optimizer step's (`once`, predicted: the same in
    every alternative), the gradients' adds of every micro-batch after the first (`later`, predicted: a trial
    holds no gradient) and the Dropout modules of each checkpointed block run again in each micro-batch
    (`Cost.dropped`, predicted: a trial runs them at p = 0), set as `Alternative.measured`. The plain step, where
    it fits and was timed, stays unless another is measured at most `CLEAR` of its time; else the simplest (bf16
    last, then the fewest micro-batches, then the fewest checkpointed) among those within `CLOSE` of the fastest
    timed. Fewer than two timed: the choice as it was."""
    timed = [a for a in choice.leading if (a.micro_batch, a.setting) in seconds]
    if len(timed) < 2:
        return choice
    fixed = once.at(n, machine) if once is not None else 0.0
    for a in timed:
        per = _per_micro_batch(step, blocks, a.setting, machine)
        full, last = divmod(n, a.micro_batch)
        t = seconds[(a.micro_batch, a.setting)]
        # a trial runs Dropout at p = 0: the dropouts of the checkpointed blocks' forwards run again, predicted
        again = lambda s, a=a: sum(blocks[b].dropped.at(s, machine) for b in a.setting.checkpoint
                                   if blocks[b].dropped is not None)
        a.measured = full * (t + again(a.micro_batch)) + ((t * per(last) / per(a.micro_batch) + again(last))
                                                          if last else 0.0) + fixed + _adds(full + (last > 0), n, later)
    fastest = min(timed, key=lambda a: a.measured)
    plain = next((a for a in timed if a.micro_batch == n and a.setting == Setting()), None)
    if plain is not None:
        best = fastest if fastest.measured <= CLEAR * plain.measured else plain
        why = (f"the plain step fits, and {_name(best, n) if best is not plain else 'no other'} was measured faster "
               f"by {1 - CLEAR:.0%} or more" if best is not plain else
               f"the plain step fits, and no other plan was measured faster by {1 - CLEAR:.0%} or more")
    else:
        close = [a for a in timed if a.measured <= CLOSE * fastest.measured]
        best = min(close, key=_simplest)
        why = f"the fastest of the {len(timed)} leading alternatives timed for real" + (
            f", or one measured within {CLOSE - 1:.0%} of it {_simpler(best, fastest)}: {_name(best, n)} measured "
            f"{best.measured / fastest.measured - 1:.1%} slower than {_name(fastest, n)}"
            if best is not fastest else "")
    said = "; ".join(f"{_name(a, n)} {a.measured:.3g} s a step" for a in sorted(timed, key=lambda a: a.measured))
    reason = f"{why}: {_name(best, n)}, {format_bytes(best.bytes)} <= the budget (measured: {said})"
    return Choice(best, choice.alternatives, reason, choice.leading)


def _simpler(a: Alternative, b: Alternative) -> str:
    """What makes `a` simpler than `b` by `_simplest`, in words."""
    if (a.setting.autocast is None) != (b.setting.autocast is None):
        return "without bf16 autocast (it changes numerics)"
    if a.micro_batch != b.micro_batch:
        return "with fewer micro-batches (trials lean a few % toward more micro-batches)"
    return "with fewer checkpointed modules"


def _simplest(a: Alternative) -> tuple:
    """The order among plans timed within `CLOSE` of each other: bf16 last, then the fewest micro-batches (the
    largest micro-batch), then the fewest checkpointed modules."""
    return a.setting.autocast is not None, -a.micro_batch, len(a.setting.checkpoint)


def wide_lead(plain_micro_step: float) -> float:
    """How far behind the fastest that fits an alternative may be predicted and still be timed beside it: `LEAD`,
    or `WIDE` where a plain micro-step is predicted at most `CHEAP` seconds (the trials' floor of a second then
    times every leading one: what decides between them is measured, not the time model's noise)."""
    return WIDE if plain_micro_step <= CHEAP else LEAD


def trial_order(leading: Sequence[Alternative], n: int) -> list[Alternative]:
    """The leading alternatives in the order they are worth timing: the best predicted, then the plain step where it
    is among them (it stays unless measured clearly slower than another: the comparison the choice turns on), then
    the rest, fastest predicted first, those of a setting not yet ordered before those of one that is (the time
    model errs alike on one setting's micro-batches: micro-batches 2 and 4 of GPT-2 768x12 without checkpointing
    both predicted 1.3x too fast)."""
    plain = [a for a in leading if a.micro_batch == n and a.setting == Setting()]
    rest = sorted((a for a in leading if all(a is not p for p in plain)), key=lambda a: a.time)
    order = rest[:1] + plain
    pool = rest[1:]
    while pool:
        nxt = min(pool, key=lambda a: (any(o.setting == a.setting for o in order), a.time))
        order.append(nxt)
        pool.remove(nxt)
    return order


def keep_plain(choice: Choice, n: int, budget: int, why: str) -> Choice:
    """The choice where the leading alternatives could not be timed for real (`why`): the plain step wherever it is
    known to fit, since no measurement shows another faster (the time model's predictions alone drift between
    identical calls: micro-batch 2 or 4 chosen over a plain step that fits in 3 of 9 fits of GPT-2 768x2); else the
    choice as it was."""
    plain = next((a for a in choice.alternatives if a.micro_batch == n and a.setting == Setting()), None)
    if plain is None or choice.best is plain or plain.bytes is None or plain.bytes > budget:
        return choice
    reason = (f"the plain step fits: {format_bytes(plain.bytes)} <= {format_bytes(budget)}, and no other plan was "
              f"measured faster ({_name(choice.best, n)} was predicted at {choice.best.time:.2f}x its time, not "
              f"timed for real: {why})")
    return Choice(plain, choice.alternatives, reason, [plain])


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

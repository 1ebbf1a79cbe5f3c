"""The leading alternatives of `memfit.fit` timed for real: a few micro-steps (forward, loss, backward) of each, on
the user's device, at the thread count the caller runs, by the clock kernels are timed by
(`memfit.fitting.timing.clock`: the thread's CPU time on a CPU at one intra-op thread, else the wall clock).

The time model (`memfit.fitting.search`) ranks every alternative from kernels timed alone; its figures move with
the machine's load (+-30% between fits of one model at one thread; on a busy VM at two threads a plan at 0.8x
its plain step came out "0.17x"). Whole micro-steps of the few alternatives that matter, timed in turn (a busy
moment falls on all of them), decide between them instead (`memfit.fitting.search.confirm`).

What they may cost: a round (one micro-step of each point) is a forward and backward of the largest point's samples
and of every other's, more than a whole step where the points split one batch, whatever the model (GPT-2 768x12 on
a 2-core CPU: micro-batch 8 with 6 blocks checkpointed, 4 with 3 and 4 with 6, one micro-step each, 46 s of CPU
time against a real step's 23 s). So the trials keep to an `allowance`, `TRIALS` times the plain step's forward and
backward as the time model predicts it (`memfit.fitting.finder`), counted in the time model's seconds: the points
are taken in the order they matter, the first two always (a comparison needs two), each further one only where the
first micro-steps of all so far are predicted within it; a round after the first runs only where the rounds so far
and one more as long as their mean stay within it, the measured seconds brought to the time model's by the first
round's measured over predicted seconds (or within `FLOOR` seconds of the clock): the ratio, not the seconds (on a
busy VM the time model put GPT-2 768x12's step at about 1.4x its real time, on a quieter one about 1x). Rounds past
the usual ones (up to `SHORT`) run where all of them stay within `FLOOR`: a small model's micro-steps of a few ms,
whose least over three runs moved a choice between two plans alike for real. Where one
round is all there is, each point's figure is its first micro-step: the kernel timing before it ran every kernel at
these shapes, so little set-up is left in it (GPT-2 768x2 at one thread, three fresh processes: first runs
0.97-1.09x the least of the three after; 768x12: 0.94-1.14x, within the runs' own spread of 10-15%), once an
untimed micro-step of one sample has opened the trials (`_openers`: the process's first micro-step pays for memory
touched for the first time, 1.2-1.3x at BERT 768x12, and fell on the smallest point alone).

The micro-steps run on a structural copy of the model (`memfit.memory.isolation.structural_copy`: the same
parameters, its own module objects) that holds copies of the buffers (BatchNorm's running statistics are not
updated) and whose `torch.nn.Dropout` modules draw nothing (p = 0: their masks' kernels are left out of the figures;
a checkpointed block runs its Dropout modules again, the time model's figure for which is added,
`memfit.fitting.search.confirm`: a checkpointed plan's real time over an unchecked one's rose by 0.05-0.13 from
dropout 0 to 0.1, MLP and TransformerEncoderLayer blocks); the gradients are returned by `torch.autograd.grad`, so
no `.grad` is touched. The first micro-step of each alternative is a warm-up, run where a random op would draw from
generators of its own (`memfit.memory.isolation.own_draw`); where a model draws outside its Dropout modules (a
functional dropout in T5's attention: `Timed.drawn` names the ops), every later micro-step runs inside
`memfit.memory.isolation.own_rng`, its draws from generators of its own (a dispatch mode: a few % on each figure at
training widths, as on the warm-ups', but 1.2-1.8x on micro-steps of 8-17 ms), and fit says so. Nothing of the
model, its gradients, its optimizer or torch's generators changes.

Known limitations: the optimizer's step is not run (the time model's figure, the same in every alternative, is
added), nor the gradients' adds of a micro-batch after the first (a micro-step holds no gradient: the time model's
figure for each is added, `memfit.fitting.search.confirm`); the uneven last micro-batch is priced as the micro-batch
timed, scaled by the time model's ratio of the two; accumulate's own work per micro-batch (about 0.1 ms) is left
out.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    >>> x, y = torch.randn(4, 8), torch.randn(4, 8)
    >>> points = [(2, Setting()), (4, Setting())]
    >>> timed = micro_steps(model, torch.nn.functional.mse_loss, x, y, points, rounds=2)
    >>> [m for m, _ in timed.seconds], all(s > 0 for s in timed.seconds.values())
    ([2, 4], True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from memfit.accumulation.checks import batch_dependent_modules, part_of
from memfit.batches import forward
from memfit.budget import is_oom, model_device
from memfit.device.torch_private import DropoutBase, TorchDispatchMode, op_schema, own_buffers
from memfit.fitting.checkpointing import checkpointed
from memfit.fitting.search import Setting
from memfit.fitting.timing import STEADY, clock
from memfit.messages import first_line

__all__ = ["FLOOR", "LEAST", "ROUNDS", "SHORT", "TRIALS", "Timed", "draws", "micro_steps", "within"]

ROUNDS = 3            # micro-steps of each alternative: a warm-up, then the least of the others is its figure (of
#                       the first and the warm-up where the two came within `timing.STEADY`)
FLOOR = 1.0           # seconds of rounds and points any trials may take, whatever their allowance (short micro-steps
#                       get every round and every leading point: a small model's are a few ms)
TRIALS = 1.0          # the trials' allowance, in plain steps' forward and backward (predicted): beyond the first two
#                       points (GPT-2 768x12 between budgets: 1.4 steps) a third or a second round only within it
LEAST = 2             # points timed whatever the allowance: a comparison needs two
SHORT = 9             # rounds of fit's trials at most where they all stay within FLOOR (`bench fit`'s GPT-2,
#                       steps of 20 ms: two plans alike for real measured 4.2% apart in one fit of six at 3 rounds)


@dataclass
class Timed:
    """Real micro-steps timed: `seconds[(m, setting)]` a micro-step of m samples takes with the setting's modules
    checkpointed, under its autocast (the least of its timed runs), `runs` how many each was timed at most, `clock`
    what timed them; `why_not` says why nothing was timed (empty when the micro-steps ran)."""
    seconds: dict = field(default_factory=dict)
    runs: int = 0           # timed micro-steps of each point after its warm-up; 0: its first micro-step is its figure
    steady: int = 0         # points whose first timed run came within `timing.STEADY` of the warm-up: it is the second
    clock: str = ""
    why_not: str = ""
    failed: tuple | None = None     # the point (m, setting) whose micro-step raised, where one did
    left_out: list = field(default_factory=list)    # points not timed: their first micro-steps past the allowance
    drawn: tuple = ()       # random ops the model drew outside its Dropout modules: from generators of memfit's own


class _Draws(TorchDispatchMode):
    """Notes the random ops a warm-up runs, each drawing from generators of its own (torch's are untouched)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from memfit.memory.isolation import own_draw
        if torch.Tag.nondeterministic_seeded in func.tags and draws(func, args, kwargs or {}):
            self.seen.append(str(func.overloadpacket))
            return own_draw(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


def draws(func, args, kwargs) -> bool:
    """Whether a random op (tagged `nondeterministic_seeded`) draws on this call: an attention kernel with
    `dropout_p` 0 does not (torch's generator is left as it was: the CPU's flash and math kernels, every attention
    of a transformers model in eval or with attention dropout 0, which were never timed for it); any other does (a
    `native_dropout` at p 0 still draws)."""
    schema = op_schema(func)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    given = kwargs.get("dropout_p", args[i] if i < len(args) else None)
    p = schema.arguments[i].default_value if given is None else given
    return p is None or p != 0


def _copy_for_timing(module: torch.nn.Module) -> torch.nn.Module:
    """A structural copy with buffers of its own and Dropout modules that draw nothing."""
    from memfit.memory.isolation import structural_copy
    copy = structural_copy(module)
    for m in copy.modules():
        buffers = own_buffers(m)
        for name, b in list(buffers.items()):
            if b is not None:
                buffers[name] = b.detach().clone()
        if isinstance(m, DropoutBase):
            m.p = 0.0
    return copy


def within(points: Sequence[tuple], predicted: Mapping[tuple, float], allowance: float) -> tuple[list, list]:
    """(the points to time, those left out): the first `LEAST` in the order given, then each further one while the
    predicted seconds of one micro-step of every point taken so far and its own stay within `allowance` (the first
    that would pass it ends the list: the points come in the order they matter)."""
    keyed = list(dict.fromkeys(points))
    keep, total = keyed[:LEAST], sum(predicted[k] for k in keyed[:LEAST])
    for i, k in enumerate(keyed[LEAST:], LEAST):
        if total + predicted[k] > allowance:
            return keep, keyed[i:]
        keep.append(k)
        total += predicted[k]
    return keep, []


def micro_steps(module: torch.nn.Module, loss_fn: Callable, x, y, points: Sequence[tuple[int, Setting]],
                rounds: int = ROUNDS, allowance: float | None = None,
                predicted: Mapping[tuple, float] | None = None) -> Timed:
    """Time real micro-steps of each point (m, setting): the first m samples of (x, y) forward, `loss_fn`, backward,
    under the point's checkpointing and autocast, `rounds` times each in turn (ABBA order, the smallest micro-batch
    first; the first run of each a warm-up). A point whose first timed run came within `timing.STEADY` of its
    warm-up takes no second: the warm-up is it (BERT 768x2 at one thread: warm-ups 0.99-1.07x the run after, a
    third of the trials' time; `Timed.steady` counts them).

    `allowance`: what the trials may take (at least `FLOOR` seconds of their clock). With `predicted` (the time
    model's seconds of one micro-step of each point), in the time model's seconds: `points` come in the order they
    matter, and those after the first `LEAST` are timed only `within` it (`Timed.left_out` the others); a round
    after the first runs only where the rounds so far and one more as long as their mean, brought to the time
    model's seconds by the first round's measured over predicted seconds, stay within it. Without `predicted`, in
    the clock's seconds, every point timed. Where only the first round ran, each point's first micro-step is its
    figure (`Timed.runs` 0). An out-of-memory error or any other failure stops the timing: `Timed.why_not` says
    why, and nothing is kept."""
    from memfit.memory.isolation import own_rng
    device = model_device(module)
    now = clock(device)
    what = "the thread's CPU time" if device.type == "cpu" and torch.get_num_threads() == 1 else "the wall clock"
    threads = f", {torch.get_num_threads()} torch thread{'s' if torch.get_num_threads() > 1 else ''}" \
        if device.type == "cpu" else ""
    timed = Timed(clock=f"{what} on {device.type}{threads}")
    copy = _copy_for_timing(module)
    params = [p for p in copy.parameters() if p.requires_grad]
    if not params:
        timed.why_not = "no parameter requires a gradient"
        return timed
    chosen = list(dict.fromkeys(points))
    if predicted is not None and allowance is not None:
        # at least FLOOR: a small model's points, a few ms each, are all timed (which ones run then does not turn on
        # the time model's noise: the CLI and the Python API chose differently on a loaded VM)
        chosen, timed.left_out = within(chosen, predicted, max(allowance, FLOOR))
    # the smallest micro-step first (the warm-ups note which random ops a model draws outside its Dropout modules)
    keyed = sorted(chosen, key=lambda k: k[0])
    samples: dict[tuple, list[float]] = {k: [] for k in keyed}
    warm: dict[tuple, float] = {}
    key, ran, limit, drawn = None, 0, allowance, set()
    for key in _openers(copy, keyed[0]):       # untimed: the process's first micro-step
        try:
            with _Draws() as opened:
                _run(copy, params, loss_fn, x, y, key, device)
            drawn.update(opened.seen)
            break
        except Exception as e:
            if key != keyed[0] and not is_oom(e):
                continue                            # one sample the model cannot take: the point itself opens
            timed.why_not = "out of memory" if is_oom(e) else f"a micro-step failed ({first_line(e)})"
            timed.failed = key if key == keyed[0] else None     # a point that failed, not one sample of it
            return timed
    start = now()
    # fit's trials (the predicted seconds given): more rounds while all of them stay within FLOOR (micro-steps of a
    # few ms: the least of more runs, steadier between fits)
    most = max(rounds, SHORT) if predicted is not None and allowance is not None else rounds
    try:
        for r in range(most):
            spent = now() - start
            if r >= rounds and spent * (r + 1) / r > FLOOR:
                break                   # a round past the usual ones only within FLOOR of the clock
            if r == 1 and predicted is not None and allowance is not None:
                # the allowance in the clock's seconds: the time model's, scaled as the first round came out
                limit = allowance * spent / max(sum(predicted[k] for k in keyed), 1e-12)
            if r and limit is not None and spent * (r + 1) / r > max(limit, FLOOR):
                break                   # another round as long as the mean of those so far: past the allowance
            ran = r + 1
            for key in (keyed if r % 2 == 0 else keyed[::-1]):
                if r == 0:
                    draws = _Draws()
                    t0 = now()
                    with draws:
                        _run(copy, params, loss_fn, x, y, key, device)
                    warm[key] = now() - t0
                    drawn.update(draws.seen)
                    continue
                got = samples[key]
                if r == 2 and max(warm[key], got[0]) <= STEADY * min(warm[key], got[0]):
                    got.append(warm[key])           # steady: the warm-up is the second
                    timed.steady += 1
                    continue
                t0 = now()
                with own_rng() if drawn else contextlib.nullcontext():   # its draws from generators of its own
                    _run(copy, params, loss_fn, x, y, key, device)
                got.append(now() - t0)
    except Exception as e:
        timed.why_not = "out of memory" if is_oom(e) else f"a micro-step failed ({first_line(e)})"
        timed.failed = key
        return timed
    timed.drawn = tuple(sorted(drawn))
    # only the first round ran: each point's first micro-step is its figure
    timed.seconds = {k: min(v) if v else warm[k] for k, v in samples.items()}
    timed.runs = ran - 1
    return timed


def _openers(copy: torch.nn.Module, smallest: tuple) -> list[tuple]:
    """The untimed micro-step that opens the trials, and the one to run instead where it fails: one sample under the
    smallest point's setting, then that point itself (at once where the model has batch statistics: BatchNorm does
    not train on one sample). The first micro-step a process runs pays for memory it touches for the first time:
    BERT 768x12 at one thread, micro-batch 2 as the trials' first point came out 1.21-1.30x its later runs by CPU
    time (the second point, 8 with 3 blocks checkpointed, 1.04-1.08x); after one sample first, 1.11-1.16x (8: 1.04x).
    Where one round is all the trials run, each point's figure is its first micro-step."""
    m, setting = smallest
    return [smallest] if m == 1 or batch_dependent_modules(copy) else [(1, setting), smallest]


def _run(copy, params, loss_fn, x, y, key: tuple, device: torch.device) -> None:
    """One micro-step of key = (m, setting) on the copy: its gradients computed, not kept."""
    m, setting = key
    names, dtype = setting.checkpoint, getattr(torch, setting.autocast) if setting.autocast else None
    xs, ys = part_of(x, 0, m, device), part_of(y, 0, m, device)
    cast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with checkpointed(copy, names, preserve_rng=False):
        with cast:
            out = forward(copy, xs)
            loss = loss_fn(out, ys)
            loss = loss.sum() if loss.dim() else loss
            del out
        if dtype is not None:
            torch.clear_autocast_cache()
        # backward outside autocast, as accumulate runs it
        with torch.autocast(device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
            torch.autograd.grad(loss, params, allow_unused=True)

"""The search behind `memfit.fit` wired to a model: the cost model's inputs (`memfit.fitting.costs`), the
candidate blocks ranked, the checkpoint sets and precisions, and each setting's bytes from the fake-tensor memory
model of accumulate's step with those modules checkpointed (`Peaks`: each micro-batch size computed only when the
search asks for it); `find` returns what was found, `agree` makes every rank take one plan.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
    ...                             torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(4, 8), torch.randn(4, 8)
    >>> peaks = Peaks(model, model, opt, torch.nn.functional.mse_loss, x, y, Setting(("1",)))
    >>> peaks.ready(2), peaks(4) > 0, peaks.ready(2)      # micro-batches of 2 need the memory model of a later one
    (False, True, False)
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from memfit.accumulation.checks import batch_dependent_modules
from memfit.budget import model_device
from memfit.fitting.checkpointing import checkpointed
from memfit.fitting.costs import step_costs
from memfit.fitting.host import machine
from memfit.fitting.layout import optimizer_options
from memfit.fitting.nothing_fits import nothing_fits
from memfit.fitting.search import (
    CLEAR,
    LEAD,
    LEADING,
    NEW,
    Alternative,
    Setting,
    checkpoint_sets,
    confirm,
    keep_plain,
    micro_batch_sizes,
    micro_step_seconds,
    search,
    trial_order,
    wide_lead,
)
from memfit.fitting.timing import BUSY_SHARE, STEADY, UNSTEADY, clock, timing_device
from memfit.fitting.trials import TRIALS, micro_steps
from memfit.memory.cache import ModelCache
from memfit.memory.micro_batch import _signature, training_peak
from memfit.progress import progress_bar

__all__ = ["LEVERS", "TIE", "Peaks", "agree", "find", "prediction"]

LEVERS = {"bf16": torch.bfloat16}        # levers that change numerics: used only when named
PROGRESS_AFTER = 2.0                     # seconds a search runs before its progress line shows (on a terminal)
# model -> {what the costs depend on: (step, blocks, optimizer step)}: a fit at another budget counts and times nothing
# again (dropped when the model changes, as memory models are)
_COSTS = ModelCache()


def _costs_key(x, y, loss_fn, candidates, autocast, sizes, optimizer, device) -> tuple:
    """What `step_costs` depends on besides the model: the batch's layout, the loss, the blocks, the precision, the
    sizes timed, the optimizer (its kind, options, parameters), the device and the intra-op threads."""
    from memfit.memory.step_model import _callable_key
    return (_signature(x), _signature(y), _callable_key(loss_fn), tuple(candidates), autocast, tuple(sizes),
            type(optimizer), id(optimizer), optimizer_options(optimizer), device, torch.get_num_threads())


class Peaks:
    """peak(m) of one setting's step (`training_peak` with the setting's modules checkpointed, under its autocast):
    each size computed when first asked for, with the modules checkpointed again (the memory models of a later
    micro-batch run only then), and kept. `ready(m)`: m is known or needs no fake run that has not run (the whole
    batch needs the first micro-batch's model, built here; a smaller m a later one's, built on the first m < n).
    `entry_grads`: the gradients held on entry are kept through the micro-batches (`restore_grads=True`);
    `predict`: the device the bytes are for (`device=`, `gpu=` of `training_peak`; none: the model's); `steps`: one
    dict for the settings of one search, the first setting's optimizer step kept there for the others'
    (`training_peak`)."""

    def __init__(self, model, module, optimizer, loss_fn, x, y, setting: Setting, entry_grads: bool = False,
                 predict: dict | None = None, steps: dict | None = None):
        from memfit.batches import batch_len
        self.module, self.setting, self.predict = module, setting, predict or {}
        self.dtype = next((d for d in LEVERS.values() if _name(d) == setting.autocast), None)
        self.n = batch_len(x)
        with self._on():
            self.peak, self.what = training_peak(model, optimizer, loss_fn, x, y, entry_grads=entry_grads,
                                                 autocast=self.dtype, steps=steps, **self.predict)
        self.known: dict[int, int] = {}

    def _on(self):
        stack = contextlib.ExitStack()
        stack.enter_context(checkpointed(self.module, self.setting.checkpoint))
        if self.dtype is not None and not self.predict:   # (for another device: `autocast=` names it)
            stack.enter_context(torch.autocast(model_device(self.module).type, dtype=self.dtype))
        return stack

    def __call__(self, m: int) -> int:
        if m not in self.known:
            with self._on():            # the memory models run lazily: with the modules checkpointed
                self.known[m] = int(self.peak(m))
        return self.known[m]

    def ready(self, m: int) -> bool:
        return m in self.known or m >= self.n or any(k < self.n for k in self.known)


def _dropped(timed, blocks) -> bool:
    """Whether a plan timed checkpoints a block with Dropout modules (their work in its recomputation is predicted:
    a trial runs them at p = 0)."""
    return any(blocks[b].dropped is not None and blocks[b].dropped.ops > 0
               for _, setting in timed.seconds for b in setting.checkpoint)


def prediction(module, device, gpu, distributed: bool) -> dict:
    """training_peak's `device=`, `gpu=` where the bytes are for another device than the model's or for a named GPU
    ({} for the model's own)."""
    if device is None and gpu is None:
        return {}
    if distributed and device is not None and torch.device(device).type != model_device(module).type:
        raise ValueError(f"memfit.fit: distributed=True plans on each rank's own device; found device={str(device)!r} "
                         f"with the model on {model_device(module)}: call fit on the ranks' machines without device=")
    return {"device": device, "gpu": gpu}


@dataclass
class _Found:
    """What a search found, kept per model (no references to the model or optimizer)."""
    best: Alternative
    alternatives: list[Alternative]
    reason: str
    candidates: list[str]
    how_bytes: str
    how_time: str
    seconds: float
    relative_time: float | None = None     # measured over the plain step where both were timed, else best.time




TIE = 1.25          # blocks' worths within this of the most worth left rank alike (forward order): the time
#                     model's noise on a block's recomputation (`bench fit`'s CNN, fits in turn: its first block at
#                     0.94x, 0.97x and 1.11x the others' worth, so 2 of 4 checkpointed were ('0', '1') or ('1', '2'))


def _ranked(blocks: dict, machine_now) -> list[str]:
    """Blocks by activation bytes written per second of recomputation, most first: the blocks within `TIE` of the
    most worth left, in forward order, then the same among the rest (the same ranking in repeated fits, where the
    timed seconds move a little)."""
    worth = {b: c.written[1] / max(c.recomputed(1, machine_now), 1e-12) for b, c in blocks.items()}
    left, out = list(blocks), []
    while left:
        top = max(worth[b] for b in left)
        alike = [b for b in left if worth[b] * TIE >= top]
        out += alike
        left = [b for b in left if b not in alike]
    return out


def find(model, module, optimizer, loss_fn, x, y, n, budget, levers, candidates, allow, exhaustive, *,
         entry_grads: bool = False, predict: dict | None = None) -> _Found:
    """The fastest alternative that fits `budget` (`memfit.fitting.search.search` over this model's settings, its
    costs and its memory models); raises BudgetExceeded (`nothing_fits`) when none does. `entry_grads`: the
    gradients held on entry are counted (`fit(restore_grads=True)`). `predict`: the bytes are for another device
    than the model's (`device=`, `gpu=`: CUDA from a machine without one); no kernel of it can be timed here, so the
    times are the ones predicted from this machine's kernels, none confirmed by timing (`how_time` says so)."""
    with progress_bar(None, "memfit.fit", unit="phase", leave=False, delay=PROGRESS_AFTER) as bar:
        return _find(model, module, optimizer, loss_fn, x, y, n, budget, levers, candidates, allow, exhaustive,
                     entry_grads, bar, predict or {})


def _find(model, module, optimizer, loss_fn, x, y, n, budget, levers, candidates, allow, exhaustive, entry_grads,
          bar, predict) -> _Found:
    t0 = time.perf_counter()
    device = model_device(module)
    # bytes for another device than the model's: its kernels are not here to time
    elsewhere = predict.get("device") is not None and torch.device(predict["device"]).type != device.type
    dependent = batch_dependent_modules(module)
    sizes = micro_batch_sizes(n) if not dependent or allow else [n]
    precisions = [None] + [LEVERS[v] for v in levers]
    # kernels timed at every micro-batch size a step runs: the sizes searched and the uneven last ones
    timed_at = sorted({*sizes, *(n % m for m in sizes if n % m)})
    costs = {}
    for p in precisions:
        bar.set_postfix_str(f"the step's ops counted, its kernels timed at {len(timed_at)} micro-batch sizes"
                            + (f" ({_name(p)})" if p else ""))
        costs[p] = _COSTS.get(module, _costs_key(x, y, loss_fn, candidates, p, timed_at, optimizer, device),
                              lambda p=p: step_costs(module, x, y, loss_fn, candidates, autocast=p, sizes=timed_at,
                                                     optimizer=optimizer))
        bar.update()
    bar.set_postfix_str("the host's work per op")
    rates = machine(timing_device(device))
    bar.update()
    ranked = _ranked(costs[None][1], rates)
    # bf16 autocast is not combined with checkpointing: the memory model undercounts that pair (predicted about
    # half the real peak on the CPU, torch 2.13), and a plan must never be below the real peak
    settings = [Setting(s, _name(p)) for p in precisions for s in (checkpoint_sets(ranked) if p is None else [()])]
    step = {_name(p): costs[p][0] for p in precisions}       # each precision's kernels, timed at its dtypes
    once = costs[None][2]                                    # the optimizer step: the same in every alternative
    later = costs[None][3]                                   # the gradients' adds of a micro-batch after the first
    blocks = costs[None][1]
    how: list[str] = []
    tables: dict[Setting, Peaks] = {}      # each setting's memory models once, across both searches
    steps: dict = {}                       # the optimizer step, run in the first setting's model, for the others'

    def bytes_of(setting: Setting) -> Peaks:
        if setting not in tables:
            bar.set_postfix_str(f"memory model, {setting.describe(len(ranked))}")
            tables[setting] = Peaks(model, module, optimizer, loss_fn, x, y, setting, entry_grads, predict, steps)
            how.append(tables[setting].what)
            bar.update()
        return tables[setting]

    # levers change numerics: their settings are searched only when nothing at the step's own precision fits
    # times for another device's bytes are this machine's, a stand-in: the plain step wherever it fits
    # (nothing is timed for another device's bytes or on meta: no memory model is built for the leading alone there)
    trials = not elsewhere and device.type != "meta"
    window = wide_lead(micro_step_seconds(n, step, blocks, Setting(), rates)) if trials else LEAD
    lead = dict(lead=window, leading=LEADING, clear=0.0 if elsewhere else CLEAR, new_after=NEW if trials else 0)
    choice = search([s for s in settings if s.autocast is None], sizes, n, step, blocks, rates, bytes_of,
                    budget, exhaustive=exhaustive, once=once, later=later, **lead)
    if levers and (choice.best is None or exhaustive):
        cast = search(settings, sizes, n, step, blocks, rates, bytes_of, budget, exhaustive=exhaustive, once=once,
                      later=later, **lead)
        if choice.best is None and cast.best is not None:
            cast.reason = (f"nothing at the step's own precision fits, so the levers asked for are used: "
                           f"{cast.reason}")
            choice = cast
        else:       # explain()'s table: the cast search's alternatives, the leading (to be timed) among them
            by = {(a.micro_batch, a.setting): a for a in cast.alternatives}
            for a in choice.leading:
                by[(a.micro_batch, a.setting)].bytes = a.bytes
            choice.leading = [by[(a.micro_batch, a.setting)] for a in choice.leading]
            choice.best = by[(choice.best.micro_batch, choice.best.setting)] if choice.best is not None else None
            choice.alternatives = cast.alternatives
    r, plain = rates, costs[None][0]
    how_time = (f"the step's ops counted on fake tensors at micro-batches 2 and 4 ({plain.ops} in forward and loss, "
                f"{plain.backward_ops} in backward, {once.optimizer_ops} in the optimizer step, {later.backward_ops} "
                "gradients added into those held in a micro-batch after the first), each distinct kernel "
                f"run for real on ones of its shapes at each micro-batch size and timed (the step's kernels "
                f"{_ms(plain.kernel_seconds(n))} at {n} samples, {_ms(plain.kernel_seconds(1))} at 1; the optimizer "
                f"step's {_ms(once.kernel_seconds(n))}; the adds {_ms(later.kernel_seconds(n))}), and the host's "
                "work per op measured on a small chain here "
                f"({r.op_seconds * 1e6:.1f} us in forward, {r.backward_op_seconds * 1e6:.1f} in backward, "
                f"{r.optimizer_op_seconds * 1e6:.1f} in the optimizer step); a checkpointed block adds its forward "
                f"again, {r.checkpoint_seconds * 1e6:.0f} us per call and {r.saved_seconds * 1e6:.1f} us per tensor it "
                "saves" + ("; host and device overlap (a micro-batch takes the longer)" if r.overlap else "")
                + _busy([costs[p][0].unsteady for p in precisions], timing_device(device))
                + ("; a meta-device model: every kernel and the host's costs timed on the CPU as a stand-in"
                   if device.type == "meta" else "")
                + (f"; the bytes are for {predict['device']} but its kernels cannot run here: every kernel and the "
                   f"host's costs timed on this machine's {device.type} as a stand-in, and no alternative timed for "
                   "real: the plain step is taken wherever it fits (on a GPU the whole batch at once, nothing "
                   "recomputed, is the fastest as a rule), else the fastest predicted here" if elsewhere else ""))
    # the leading alternatives timed for real decide between them (not on meta: no kernel runs there; nor for
    # another device's bytes: its kernels are not here)
    if len(choice.leading) > 1 and trials:
        bar.set_postfix_str(f"{len(choice.leading)} alternatives timed for real")
        # the trials take about one plain step's forward and backward, as predicted (two alternatives at least)
        order = trial_order(choice.leading, n)
        predicted = {(a.micro_batch, a.setting): micro_step_seconds(a.micro_batch, step, blocks, a.setting, rates)
                     for a in order}
        allowance = TRIALS * micro_step_seconds(n, step, blocks, Setting(), rates)
        timed = micro_steps(module, loss_fn, x, y, list(predicted), allowance=allowance, predicted=predicted)
        bar.update()
        if timed.seconds:
            choice = confirm(choice, timed.seconds, n, step, blocks, rates, once, later)
            how_time += (f"; then {len(timed.seconds)} of the {len(choice.leading)} leading alternatives that fit "
                         f"(predicted within {window - 1:.0%} of the fastest, or the plain step) timed for real, in "
                         f"turn, by {timed.clock}: " + (
                             f"{timed.runs} micro-step{'s' if timed.runs > 1 else ''} of each after a warm-up, the "
                             "least taken"
                             + (f" ({timed.steady} with the warm-up as the second: their first came within "
                                f"{STEADY - 1:.0%} of it)" if timed.steady else "") if timed.runs else
                             "one micro-step of each, its figure (a second round would have taken the trials past "
                             f"{TRIALS:g} plain step{'s' if TRIALS != 1 else ''} as predicted; the kernels had run at "
                             "these shapes)")
                         + (f"; {len(timed.left_out)} left out, predicted slower than the fastest (a micro-step of "
                            f"each would have taken the trials past {TRIALS:g} plain step{'s' if TRIALS != 1 else ''})"
                            if timed.left_out else "")
                         + (f"; the model draws random numbers outside its Dropout modules ({', '.join(timed.drawn)}): "
                            "its micro-steps drew from generators of memfit's own, torch's untouched (through a "
                            "dispatch mode: a few % on each figure)" if timed.drawn else "")
                         + "; the optimizer step's time and the gradients' adds of each micro-batch after the first"
                         + (", and the Dropout modules a checkpointed block runs again," if _dropped(timed, blocks)
                            else "") + " predicted (no trial runs them)")
        else:
            how_time += f"; the leading alternatives were not timed for real: {timed.why_not}"
            if timed.failed != (n, Setting()):        # a plain step that failed for real is not kept
                choice = keep_plain(choice, n, budget, timed.why_not)
    elif len(choice.leading) > 1 and device.type == "meta":
        choice = keep_plain(choice, n, budget, "a meta-device model runs no kernel")
    elif trials and choice.best is not None:
        how_time += (f"; nothing timed for real: no other alternative that fits was predicted within {window - 1:.0%} "
                     "of the fastest, so the time model's choice stands")
    how_bytes = (how[0] if how else "not computed") + " (one memory model per checkpoint set tried)"
    if dependent and not allow:
        choice.reason += (f"; micro-batches not considered: {dependent[0]} (batch statistics; "
                          "allow_batch_dependent=True allows them)")
    if choice.best is None:
        raise nothing_fits(model, module, optimizer, loss_fn, x, y, budget, choice, levers, bytes_of, entry_grads,
                           predict)
    best = choice.best
    plain = next((a for a in choice.leading if a.micro_batch == n and a.setting == Setting()), None)
    relative = 1.0 if best is plain else best.measured / plain.measured \
        if plain is not None and plain.measured and best.measured else best.time
    return _Found(best, choice.alternatives, choice.reason, ranked, how_bytes, how_time, time.perf_counter() - t0,
                  relative)




def _busy(counts: list[tuple[int, int]], device) -> str:
    """The time model's warning where many kernels' samples came out far apart (`timing.unsteady`), or where the
    CPU's load average passed its cores while kernels were timed by the wall clock, else ""."""
    apart, timed = (sum(c[i] for c in counts) for i in (0, 1))
    if clock(device) is time.thread_time:
        return ""                 # the thread's CPU time: other processes' turns on the core are not counted
    threads = torch.get_num_threads()
    advice = " or with torch.set_num_threads(1)" if device.type == "cpu" and threads > 1 else ""
    if timed >= 8 and apart > BUSY_SHARE * timed:
        return (f". THE MACHINE WAS BUSY while the kernels were timed: {apart} of {timed} kernels' samples came out "
                f"more than {UNSTEADY}x apart ({threads} torch threads), so the predicted times, and the choice made "
                f"from them, may be far off; fit again on a quiet machine{advice}")
    load, cores = _load()
    if device.type == "cpu" and threads > 1 and load > cores:
        # torch's threads wait for each other where a core is taken: a 64-wide MLP's plain step of 8 samples
        # (2 threads, load 4.6 on 2 cores) timed 50-60 ms, 0.2 ms on a quiet machine: micro-batch 1 taken at 0.03x
        return (f". THE MACHINE WAS BUSY: load average {load:.1f} on {cores} cores while fit timed by the wall clock "
                f"({threads} torch threads); a kernel whose threads wait for a taken core can run many times slower "
                f"than on a quiet machine, so the times measured, and the choice made from them, may not hold there; "
                f"fit again on a quiet machine{advice}")
    return ""


def _load() -> tuple[float, int]:
    """(the last minute's load average, the cores this process may run on); (0, 1) where the system says neither."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return load, cores


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _name(dtype) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")




def agree(found: _Found, world: int) -> _Found:
    """Under torch.distributed, every rank takes the same plan: the ranks' choices gathered, the slowest
    (the one that spends most time to save memory) taken, so that each rank's budget, equal or not, is respected
    as far as any rank's own choice did."""
    if world <= 1:
        return found
    import json

    from memfit.distributed import all_gather_text
    mine = json.dumps([found.best.micro_batch, list(found.best.setting.checkpoint), found.best.setting.autocast,
                       found.best.time])
    choices = [json.loads(t) for t in all_gather_text(mine, "fit plan")]
    m, ckpt, cast, _ = max(choices, key=lambda c: c[3])
    pick = next(a for a in found.alternatives if a.micro_batch == m and a.setting == Setting(tuple(ckpt), cast))
    if pick is not found.best:
        found = _Found(pick, found.alternatives, found.reason + f"; the slowest plan over {world} ranks is used",
                       found.candidates, found.how_bytes, found.how_time, found.seconds)
    return found

"""A training step with every gradient held before it (a later micro-batch of `memfit.accumulate`), derived from the
plain step's fake runs where those runs show that it is the same (`held_probes`): no fake runs of its own.

The two steps run the same ops but where backward stores a parameter's gradient. The plain step's AccumulateGrad
steals the incoming gradient (`aten.detach`: its storage becomes `.grad`, kept until zero_grad frees it, or to the
end); the held step's adds it into the `.grad` already there (`aten.add_`, in place), and the incoming gradient's
storage is freed as AccumulateGrad returns. So the held run's log is the plain one's with, at each AccumulateGrad,
the detach an add_ and the gradient's storage freed there, and no gradient storage tagged or kept; the gradients held
before the step are held bytes, as the held run counts them (`fake_run.fake_run(grads_held=True)`). `_timeline`
turns that log into live bytes per op and kind as it does any run's, and the memory model's ladder fits the derived
runs as it fits the real ones (`fit_ladder.fit_runs`): every op's bytes per kind, the gradients' bytes and `method`
come out the same.

A plain run notes each AccumulateGrad call (`fake_run.RunLog.stored`); the derivation is declined, with its reason,
unless they show all of:
- each trainable parameter gets its gradient from one AccumulateGrad call (a parameter without a gradient is left
  alone by the plain step's optimizer, stepped by the held one's; a second call adds in place in both steps), and
  no hook on it (`register_hook`, `register_post_accumulate_grad_hook`) runs ops around that call;
- which stole it: the op before is `aten.detach` (a copy, `clone_obey_contract`, or a sparse gradient is not);
- into a storage of its own, allocated in this run: dense, the parameter's strides, offset 0, no larger than the
  gradient (a slice of torch.cat's buffer is freed with the last slice), referenced by `.grad` and the note alone
  (`storage_use_count` 2): nothing else holds it, so the held run frees it as AccumulateGrad returns;
- the derived fit is exact (an APPROXIMATE model rechecks sizes with runs of the held step itself).
A CUDA step (predicted or on a GPU: its allocator replayed over the events) keeps its own runs; so does a step
whose runs noted nothing (`RunLog` is made by plain training steps on the CPU only).

Known limitations: hooks a user put on parameters are not run by any fake run (`fake_model.FakeModel` fakes them
anew), derived or not.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from memfit.memory.fake_run import _Run, _timeline
from memfit.memory.fit import with_step
from memfit.memory.fit_ladder import Fit, fit_runs
from memfit.memory.probes import StepProbes

__all__ = ["Declined", "held_probes", "held_run"]

_STEAL = torch.ops.aten.detach.default      # AccumulateGrad taking the incoming gradient as `.grad`
_ADD = torch.ops.aten.add_.Tensor           # ... adding it into the `.grad` there (`variable_grad += new_grad`)


class Declined(Exception):
    """The plain runs do not show that the held step is the plain one with its gradients added in place."""


def held_run(raw: _Run) -> _Run:
    """The run of the step with every gradient held, from the plain step's run `raw` as it ran (its optimizer step
    in or skipped, as there), or `Declined` saying why not."""
    src = raw.source
    if src is None:
        raise Declined("the plain run noted no gradients (a CUDA step, or no training step)")
    calls: dict[int, object] = {}
    for g in src.stored:
        if g.param in calls:
            raise Declined("a parameter's AccumulateGrad ran twice in one backward")
        calls[g.param] = g
    if set(calls) != set(src.trainable):
        missing = len(set(src.trainable) - set(calls))
        raise Declined(f"{missing} trainable parameter(s) get no gradient in the step (the held step's optimizer "
                       "steps them, the plain one's skips them)")
    for g in src.stored:
        if g.hooks:
            raise Declined("a parameter has a hook on its gradient (its ops around AccumulateGrad are not shown)")
        if raw.ops[g.ops - 1] is not _STEAL:
            raise Declined(f"a gradient was copied, not stolen, by AccumulateGrad (op {raw.ops[g.ops - 1]})")
        if not g.whole or g.refs != 2:
            raise Declined("a gradient is a view of a larger or shared storage (a slice of torch.cat's buffer, "
                           "say): the held step frees it later than its AccumulateGrad")
    alloc, free = _lifetimes(src.log, src.stored)
    # the held log: each gradient's storage freed as its AccumulateGrad returns (the op after it), not later
    inserts: dict[int, list] = defaultdict(list)
    for g in src.stored:
        inserts[g.at].append((g.ops, g.key, -src.log[alloc[g.key]][2]))
    drop = set(free.values())
    log, position = [], {}
    for i in range(len(src.log) + 1):
        log += inserts.get(i, ())
        position[i] = len(log)              # a mark here follows the frees put in here: they come before it
        if i < len(src.log) and i not in drop:
            log.append(src.log[i])
    marks = {phase: (op, position[at]) for phase, (op, at) in src.marks.items()}
    ops = list(raw.ops)
    for g in src.stored:
        ops[g.ops - 1] = _ADD
    samples = {**src.samples, "gradients": set()}      # the held .grad storages were made before the log
    live_at_end = src.live_at_end - set(alloc)
    held_bytes = sum(src.trainable.values())
    live, events, sizes, step_kept, step = _timeline(log, len(ops), marks, samples, live_at_end, src.pad)
    return _Run(ops, live, {k: v[0] for k, v in marks.items()}, {**raw.held, "gradients": held_bytes}, events, sizes,
                step_kept, held_bytes, raw.scratch, *step, sdpa=raw.sdpa, stood_in=raw.stood_in)


def _lifetimes(log: list, stored: list) -> tuple[dict[int, int], dict[int, int]]:
    """(gradient storage key -> log position of its allocation, -> of its first free after its AccumulateGrad, if
    any); `Declined` where a gradient's storage was not allocated in the run or is another gradient's too."""
    at = defaultdict(list)
    for g in stored:
        at[g.at].append(g.key)
    live: dict[int, int] = {}
    alloc: dict[int, int] = {}
    free: dict[int, int] = {}
    for i in range(len(log) + 1):
        for key in at.get(i, ()):
            if key not in live or key in alloc:
                raise Declined("a gradient's storage was not allocated in the run, or holds two gradients")
            alloc[key] = live[key]
        if i == len(log):
            break
        _, key, delta = log[i]
        if delta > 0:
            live[key] = i
        else:
            live.pop(key, None)
            if key in alloc and key not in free:
                free[key] = i
    return alloc, free


class HeldProbes:
    """`probes.StepProbes` of the held step, each run derived from the plain step's (`held_run`): the same sizes at
    the start (4, then 1, or 2 where batch 1 cannot train), any other made by a plain run at it. Where the plain
    run at 4 took its optimizer step from another model's (`StepProbes.step_from`: its own raw run has none), the
    held run at 4 takes the step of that run's held run."""

    def __init__(self, plain: StepProbes):
        self.plain = plain
        self.spec = dataclasses.replace(plain.spec, grads_held=True)
        self.once, self.single = plain.once, plain.single
        self.step_from, self.declined = plain.step_from, plain.declined
        self.runs: dict[int, _Run] = {}
        self.at(4)
        self.at(1 if 1 in plain.runs else 2)

    def at(self, n: int) -> _Run:
        if n not in self.runs:
            self.plain.at(n)
            r = held_run(self.plain.raw[n])
            if n == 4 and self.step_from is not None:      # its step skipped: the source's, held as this one is
                r = with_step(r, held_run(self.step_from))
            self.runs[n] = with_step(r, self.runs[4]) if self.once and n != 4 else r
        return self.runs[n]


def held_probes(plain: StepProbes | None) -> tuple[HeldProbes, Fit]:
    """The held step's runs and their fit, derived from the plain step's runs `plain`, or `Declined`."""
    if plain is None:
        raise Declined("the plain step's runs are not at hand (its model was kept from before, or it is a CUDA step)")
    probes = HeldProbes(plain)
    fit = fit_runs(probes)
    if "APPROXIMATE" in fit.how:
        raise Declined("the fit is approximate: its sizes are rechecked by runs of the held step itself")
    return probes, fit

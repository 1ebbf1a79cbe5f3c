"""The fake runs of one prediction (`StepProbes`, by batch size) and the fit of the memory model's lines over them
(`probed`), made again without reading any value where a value read depends on the batch size.

The optimizer step runs once per prediction, at batch 4, and is put into the other sizes' runs (`fit.with_step`). With
`steps` (a dict one `memfit.fit` call keeps across its checkpoint settings and precisions) it runs once per fit: the
first plain step's run at 4 is the step's source for the later models' runs at 4 too, where they show the same
parameters, optimizer state and gradient bytes (`step_differs`): checkpointing and autocast change forward and backward
only, and the step reads and writes parameters, gradients and its state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import torch

from memfit.memory.fake_failure import explain_fake_failure
from memfit.memory.fake_run import FakeRunError, StepSpec, _Run, fake_run
from memfit.memory.fit import with_step
from memfit.memory.fit_ladder import Fit, fit_runs
from memfit.memory.known_values import DataDependentOnBatchSize
from memfit.memory.storage_log import LoggingFakeMode
from memfit.messages import first_line

__all__ = ["StepProbes", "answered_or_again", "optimizer_groups", "probed", "step_differs", "step_how"]

T = TypeVar("T")


def answered_or_again(make: Callable[[bool], T], answering: bool = True) -> tuple[T, str]:
    """(make(answers), what to add to `why`): made with value reads answered (`answers`: `StepSpec.answers`), or, where
    a value read depends on the batch size, made again without answering any read, as before values were known
    (transformers' mask questions left unasked: the mask counts); a read that then has no answer is refused, saying
    both. answering=False: made without answering at once."""
    if not answering:
        return make(False), ""
    try:
        return make(True), ""
    except DataDependentOnBatchSize as e:
        try:
            return make(False), f"values not read: {e}"
        except Exception as again:
            raise FakeRunError(f"{e}; and without reading values: {first_line(again)}") from again


def probed(spec: StepSpec, why: str, steps: dict | None = None) -> tuple[StepProbes, Fit, StepSpec, str]:
    """(the runs, their fit, the spec they ran with, why as it is now): `answered_or_again` over the runs of `spec`
    (an all-ones mask made from the batch's shape asks a question made otherwise at each size); `steps`: as for
    `StepProbes`."""
    def make(answers: bool):
        ran = dataclasses.replace(spec, answers=answers)
        probes = StepProbes(ran, steps)
        return probes, fit_runs(probes), ran
    (probes, fit, ran), note = answered_or_again(make, spec.answers)
    return probes, fit, ran, f"{why}; {note}" if why and note else why or note


def optimizer_groups(optimizer) -> tuple:
    """The optimizer's class and each group's parameters (by identity) and hyper-parameters: what its step does."""
    groups = tuple((tuple(map(id, g["params"])), tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params")))
                   for g in (optimizer.param_groups if optimizer is not None else ()))
    return type(optimizer), groups


def step_differs(r: _Run, source: _Run) -> str:
    """Why the optimizer step of `source` (a run at the same batch size with its step) cannot be put into `r` (one
    whose step was skipped), or "": the step reads and writes the parameters, the gradients and its state, so they
    must hold the same bytes in both (the same module, optimizer and device: `StepProbes`'s key)."""
    held = lambda run: {k: v for k, v in run.held.items() if k != "inputs"}     # noqa: E731
    if r.grad_bytes != source.grad_bytes:
        return f"its gradients take {r.grad_bytes} bytes, the source's {source.grad_bytes}"
    if held(r) != held(source):
        return f"it holds {held(r)} before the step, the source {held(source)}"
    return ""


def step_how(probes) -> str:
    """Where the optimizer step of `probes` (`StepProbes`, `held_grads.HeldProbes`) came from, for `method`, and the
    values it read that no fake run knows (`known_values.stand_in`)."""
    run = probes.step_from if probes.step_from is not None else probes.runs.get(4)
    if run is not None and run.stood_in:
        return _step_source(probes) + (
            f"; the optimizer step read {run.stood_in} value{'s' if run.stood_in > 1 else ''} of its tensors "
            "(`.item()`, "
            "a comparison) that fake tensors do not have: each answered a stand-in, taken as a scalar of the "
            "update (Adafactor's step and norms: 1; ASGD's eta and mu: 0.5, so that the copy of each parameter it "
            "makes once mu is below 1, after t0 steps, counts)")
    return _step_source(probes)


def _step_source(probes) -> str:
    if probes.step_from is not None:
        return ("; the optimizer step did not run here: put in at every batch size from the first memory model's run "
                "at 4 in this fit, whose parameters, optimizer state and gradient bytes are the same (the step reads "
                "and writes those; the batch size, checkpointing and autocast change forward and backward only)")
    if not probes.once:
        return ""
    return ("; the optimizer step ran once, at batch 4: it reads and writes parameters, gradients and its state, none "
            "of which depends on the batch") + (f" (its own, not the fit's first memory model's: {probes.declined})"
                                                  if probes.declined else "")


class StepProbes:
    """The fake runs of one prediction by batch size (`fit_ladder.Probes`): batch 4, which alone runs the
    optimizer step (the others get its step put in), and batch 1, or 2 where batch 1 cannot train.

    `steps`: a dict of the caller's, kept across the memory models of one `memfit.fit` (on the CPU: a CUDA step's
    replay reads the step's events beside the others'): the first training step's run at 4 goes there, under what
    the step depends on in `spec` (the module, the optimizer's groups, the device, whether gradients are held); a
    later one under the same key skips its step at 4 too and gets that run's put in (`step_from`), unless its run
    at 4 shows other gradient or held bytes (`step_differs`: then it runs at 4 again with its step, `declined` says
    why)."""

    def __init__(self, spec: StepSpec, steps: dict | None = None):
        self.spec = spec
        self.once = spec.train and spec.optimizer is not None     # the optimizer step runs at batch 4 only
        self.single = ""                              # why there is no run at 1, for `method`
        self.key = (id(spec.model), optimizer_groups(spec.optimizer), spec.device, spec.grads_held) \
            if self.once and spec.cuda is None and steps is not None else None
        self.steps = steps if self.key is not None else None
        self.step_from: _Run | None = None            # the run at 4 whose step this one's got (another model's)
        self.declined = ""                            # why this one's run at 4 ran its own step where it could not
        self._start()
        try:
            self.at(1)
        except ValueError as e:        # BatchNorm training on one sample: the real step fails the same way
            if not spec.train or "more than 1 value per channel" not in str(e):
                raise
            self._start()              # afresh: the failed run left fakes behind
            self.at(2)
            self.single = "; batch 1 cannot train (batch statistics need 2 samples): no run at 1"
        if self.steps is not None and self.step_from is None:      # made whole: a source for the models after it
            self.steps.setdefault(self.key, self.raw[4])

    def _start(self) -> None:
        self.mode = LoggingFakeMode(allow_non_fake_inputs=True)    # plain tensors a forward makes are converted
        self.fakes: dict[int, torch.Tensor] = {}      # shared by the runs: the fake mode's op cache serves them
        self.runs: dict[int, _Run] = {}
        self.raw: dict[int, _Run] = {}               # each run as it ran (before the optimizer step is put in)
        self.at(4)

    def at(self, n: int) -> _Run:
        if n not in self.runs:
            self.runs[n] = self._run(n)
        return self.runs[n]

    def _run(self, n: int) -> _Run:
        source = self.steps.get(self.key) if n == 4 and self.steps is not None else None
        r = self._fake(n, not self.once or n == 4 and source is None)
        if source is not None:
            self.declined = step_differs(r, source)
            if not self.declined:
                self.raw[4], self.step_from = r, source
                return with_step(r, source)
            r = self._fake(4, True)       # the rare mismatch: its own step, in a second run at 4
        self.raw[n] = r
        return with_step(r, self.runs[4]) if self.once and n != 4 else r

    def _fake(self, n: int, step: bool) -> _Run:
        try:
            return fake_run(self.spec, n, mode=self.mode, fakes=self.fakes, optimizer_step=step)
        except (ValueError, TypeError, DataDependentOnBatchSize):   # our own argument errors, the user's, and a
            raise                                                    # read to ask again without values (`_fit`)
        except Exception as e:
            raise FakeRunError(explain_fake_failure(e, self.spec.model, self.spec.optimizer, self.spec.train, n)) from e

"""The fake runs of one prediction (`StepProbes`, by batch size) and the fit of the memory model's lines over them
(`probed`), made again without reading any value where a value read depends on the batch size."""

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

__all__ = ["StepProbes", "answered_or_again", "probed"]

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


def probed(spec: StepSpec, why: str) -> tuple[StepProbes, Fit, StepSpec, str]:
    """(the runs, their fit, the spec they ran with, why as it is now): `answered_or_again` over the runs of `spec`
    (an all-ones mask made from the batch's shape asks a question made otherwise at each size)."""
    def make(answers: bool):
        ran = dataclasses.replace(spec, answers=answers)
        probes = StepProbes(ran)
        return probes, fit_runs(probes), ran
    (probes, fit, ran), note = answered_or_again(make, spec.answers)
    return probes, fit, ran, f"{why}; {note}" if why and note else why or note


class StepProbes:
    """The fake runs of one prediction by batch size (`fit_ladder.Probes`): batch 4, which alone runs the
    optimizer step (the others get its step put in), and batch 1, or 2 where batch 1 cannot train."""

    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.once = spec.train and spec.optimizer is not None     # the optimizer step runs at batch 4 only
        self.single = ""                              # why there is no run at 1, for `method`
        self._start()
        try:
            self.at(1)
        except ValueError as e:        # BatchNorm training on one sample: the real step fails the same way
            if not spec.train or "more than 1 value per channel" not in str(e):
                raise
            self._start()              # afresh: the failed run left fakes behind
            self.at(2)
            self.single = "; batch 1 cannot train (batch statistics need 2 samples): no run at 1"

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
        try:
            r = fake_run(self.spec, n, mode=self.mode, fakes=self.fakes, optimizer_step=not self.once or n == 4)
        except (ValueError, TypeError, DataDependentOnBatchSize):   # our own argument errors, the user's, and a
            raise                                                    # read to ask again without values (`_fit`)
        except Exception as e:
            raise FakeRunError(explain_fake_failure(e, self.spec.model, self.spec.optimizer, self.spec.train, n)) from e
        self.raw[n] = r
        return with_step(r, self.runs[4]) if self.once and n != 4 else r

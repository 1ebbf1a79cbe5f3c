"""Which line through which fake runs: the ladder of fitters `memfit.memory.step_model` climbs (`fit_runs`).

A fake run costs Python work per op whatever the batch, so the ladder starts with the fewest runs and climbs
only where a rung's own check fails; every rung but the last is exact, and each says how in `Fit.how`
(the words `StepMemoryModel.method` shows):

1. `line_from_1_and_4`: batch 1 and 4 allocate and free the same storages at the same ops, each the same
   size or 4 times as large: every size is constant or proportional to the batch (two runs).
2. `line_from_2_and_4`: the same check between 2 and 4; batch 1 is its own exact run where it differs
   (broadcast parameters need no reduction over a batch of one).
3. `checked_line_from_2_and_4`: sizes affine but not proportional (n + 1 rows): the line through 2 and 4,
   checked at 1 (or at 8 where batch 1 runs other ops or cannot run), else
4. `quadratic_from_2_4_8`: an n x n similarity matrix: a quadratic per op from 2, 4 and 8, checked at 1
   (or 16), else
5. `upper_envelope`: neither affine nor quadratic: the steepest slope per op between the runs. APPROXIMATE.

Off the ladder, where 2 and 4 run different ops (a branch on the batch size), `line_above_peaks`: one line
above the peak of every run, with the steepest slope. APPROXIMATE.

A rung asks for the runs it needs (`Probes.at`); the runs made so far are `Probes.runs` (batch 4 always,
batch 1 where it can train).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from memfit.memory.fake_run import _Run
from memfit.memory.fit import affine, envelope, proportional, quadratic
from memfit.memory.kinds import STEP_KINDS

__all__ = ["Fit", "Probes", "fit_runs"]


class Probes(Protocol):
    """The fake runs of one prediction, by batch size, made as the ladder asks for them."""
    runs: dict[int, _Run]                             # made so far: 4, and 1 unless batch 1 cannot train

    def at(self, n: int) -> _Run:
        """The run at batch n, made (and kept in `runs`) if it is not there."""


@dataclass
class Fit:
    """Live bytes after each op, per kind, at a batch of n: a + b*n (+ c*n^2), except at the sizes in
    `measured`, which are their own exact runs."""
    a: np.ndarray                                     # (ops, kinds)
    b: np.ndarray                                     # (ops, kinds)
    how: str                                          # how, in words (for `StepMemoryModel.method`)
    c: np.ndarray | None = None                       # (ops, kinds) where sizes grow faster than n
    measured: dict[int, np.ndarray] = field(default_factory=dict)     # n -> (ops, kinds)


def fit_runs(probes: Probes) -> Fit:
    """The first rung of the ladder (see the module doc) that holds for these runs."""
    runs = probes.runs
    one = runs.get(1)                                 # None when batch 1 cannot train
    if one is not None and proportional(one, 1, runs[4], 4):
        return line_from_1_and_4(runs)
    two = probes.at(2)
    if two.ops != runs[4].ops:
        return line_above_peaks(probes)
    if proportional(two, 2, runs[4], 4):
        return line_from_2_and_4(runs, one)
    fit = checked_line_from_2_and_4(probes, one)
    if one is not None and one.ops != two.ops:
        fit.how += "; batch 1 runs other ops and is its own exact run"
    return fit


def line_from_1_and_4(runs: dict[int, _Run]) -> Fit:
    a, b = affine(runs, 1, 4)
    return Fit(a, b, "affine per op and kind from sizes 1 and 4 (every storage the same size in both, or 4 times "
                     "as large)")


def line_above_peaks(probes: Probes) -> Fit:
    """The op sequence changes with the batch: one line above the peaks of 1 (where it ran), 2, 4 and 8, in
    the activations' column alone (no per-op rows)."""
    probes.at(8)
    runs = probes.runs
    peaks = [(n, runs[n].live.sum(axis=1).max()) for n in sorted(runs)]
    slope = max(max((p2 - p1) / (n2 - n1) for (n1, p1), (n2, p2) in zip(peaks, peaks[1:], strict=False)), 0)
    top = max(p - slope * n for n, p in peaks)
    a = np.zeros((1, len(STEP_KINDS)))
    b = np.zeros((1, len(STEP_KINDS)))
    a[0, 0], b[0, 0] = top, slope
    return Fit(a, b, f"APPROXIMATE: line above the peaks at sizes {sorted(runs)} with the steepest slope (the ops "
                     "change with the batch size)")


def line_from_2_and_4(runs: dict[int, _Run], one: _Run | None) -> Fit:
    """2 and 4 proportional: their line is exact; batch 1 is on it, or its own exact run."""
    a, b = affine(runs, 2, 4)
    how = "affine per op and kind from sizes 2 and 4 (every storage the same size in both, or twice as large)"
    if one is None:
        return Fit(a, b, how)
    if one.ops != runs[2].ops:
        return Fit(a, b, how + "; batch 1 runs other ops and is its own exact run", measured={1: one.live})
    if not np.array_equal(a + b, one.live):
        return Fit(a, b, how + "; batch 1 is its own exact run", measured={1: one.live})
    return Fit(a, b, how + ", exact at 1")


def checked_line_from_2_and_4(probes: Probes, one: _Run | None) -> Fit:
    """The line through 2 and 4 where it holds at a third size: 1, or 8 where batch 1 runs other ops (then its
    own exact run) or cannot run; else a quadratic or the envelope."""
    runs = probes.runs
    a, b = affine(runs, 2, 4)
    check = 1 if one is not None and one.ops == runs[2].ops else 8
    measured = {}
    if check == 8:
        probes.at(8)
        if one is not None:
            measured[1] = one.live
    if runs[check].ops == runs[2].ops and np.array_equal(a + b * check, runs[check].live):
        return Fit(a, b, f"affine per op and kind from sizes 2 and 4, exact at {check}", measured=measured)
    return quadratic_from_2_4_8(probes, one, measured)


def quadratic_from_2_4_8(probes: Probes, one: _Run | None, measured: dict[int, np.ndarray]) -> Fit:
    """Some size grows faster than the batch (an n x n similarity matrix, say): a quadratic per op from 2, 4
    and 8, checked at a fourth size (1, else 16); else the envelope."""
    for n in (8, 16):
        probes.at(n)
    runs = probes.runs
    check = 1 if one is not None and one.ops == runs[2].ops else 16
    if all(runs[n].ops == runs[2].ops for n in (4, 8, check)):
        a, b, c = quadratic(runs, 2, 4, 8)
        if np.allclose(a + b * check + c * check * check, runs[check].live, rtol=0, atol=0.5):
            return Fit(a, b, f"quadratic per op and kind from sizes 2, 4 and 8, exact at {check}", c=c,
                       measured=measured)
    return upper_envelope(runs, one, measured)


def upper_envelope(runs: dict[int, _Run], one: _Run | None, measured: dict[int, np.ndarray]) -> Fit:
    """Neither affine nor quadratic: the steepest slope per op between the runs above 1, never below any.

    Batch 1 is its own exact run, not a point of the envelope: a kernel may take another path there (oneDNN's
    convolution: 9x the bytes inside at batch 1 for a small layer), which would steepen the slope at every
    size."""
    sizes = sorted(n for n in runs if n > 1 and runs[n].ops == runs[2].ops)
    a, b = envelope(runs, sizes)
    how = (f"APPROXIMATE: upper envelope of the sizes {sizes} (neither affine nor quadratic in the batch: steepest "
           "slope per op)")
    if one is not None:
        measured[1] = one.live
        how += "; batch 1 is its own exact run"
    return Fit(a, b, how, measured=measured)

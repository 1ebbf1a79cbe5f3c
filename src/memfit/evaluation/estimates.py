"""The peak bytes of an evaluation chunk of n samples, and the largest chunk that fits a memory budget.

The peak bytes of a chunk of n samples come from the activation planner (`memfit.plan`'s memory
model) when it can capture the model, else from a fake-tensor run of the eager forward
(`memfit.memory.step_model`: nothing allocated, no export), else from two small measured runs. Each is
an affine-in-n estimate; `largest_fitting` bisects it against the budget.

Example:
    >>> largest_fitting(lambda n: 1000 + 10 * n, budget=2000, upper=500)
    100
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from memfit.batches import batch_nbytes, forward
from memfit.budget import BudgetExceeded, format_bytes, largest_fitting
from memfit.device.measure import held_bytes, track_memory
from memfit.evaluation.chunks import Chunks
from memfit.memory.fit import line_through
from memfit.memory.isolation import predicting
from memfit.messages import first_line

__all__ = ["MAX_AUTO_CHUNK", "Estimate", "Source", "choose_chunk", "eager_peak"]

log = logging.getLogger("memfit.evaluate")


class Source(Enum):
    """Where a chunk's peak estimate comes from."""
    PLANNER = "the planner's arena"                      # exact; the planned forward runs
    FAKE_FORWARD = "fake-tensor forward"                 # exact for the eager forward, nothing allocated
    MEASURED = "measured runs at 2 sizes, APPROXIMATE"  # extrapolated, with 10% head-room


def _planned_peak(model, sample_shape, dtype) -> tuple[Callable[[int], int] | None, str, Source | None]:
    """(peak(n) of the planned forward, "planner", PLANNER), or (None, why not, None) when the planner cannot
    capture the model (the caller then sizes the eager forward)."""
    try:
        from memfit.planner.kept import planned_model_of
        mm = planned_model_of(model, sample_shape, dtype)
    except Exception as e:     # export failures are expected for some models; the runner says why
        return None, f", as the planner could not capture the model ({first_line(e)})", None
    return mm.total_bytes, "planner", Source.PLANNER


def _fake_peak(model, chunks: Chunks, why: str) -> tuple[Callable[[int], int] | None, str]:
    """peak(n) of an eager forward from fake-tensor runs (`memfit.memory.step_model`; no export, nothing allocated,
    kept per model); (None, why) when even that fails."""
    try:
        from memfit.memory.step_model import step_memory_model
        x, _ = chunks.get(0, 1)
        mm = step_memory_model(model, x, train=False)
    except Exception as e:     # a model fake tensors cannot run: measure real runs instead
        return None, f"{why}; fake-tensor estimate failed: {first_line(e)}"
    return mm.total_bytes, f"fake-tensor forward{why}"


def _measured_peak(model, runner, chunks: Chunks, sizes=(4, 16)) -> Callable[[int], int]:
    """Fit peak(n) = a + b*n from two small measured runs (live bytes above the start)."""
    points = []
    for n in sorted({min(s, chunks.n) for s in sizes}):
        x, _ = chunks.get(0, n)
        with torch.inference_mode(), track_memory(chunks.device) as mem:
            out = forward(runner, x)
            del out
        points.append((n, mem.peak + batch_nbytes(x)))
        del x
    a, b = line_through(points)
    base = held_bytes(model)
    # 10% head-room on the slope: extrapolating from small sizes tends to under-estimate
    return lambda n: int(base + a + 1.1 * b * n)


# Beyond a few hundred samples a chunk only holds more memory and runs slower on a CPU (its activations
# leave the caches): against a loop of 512-sample batches, a small transformer took 2.1x in chunks of
# 4,096 and 1.23-1.26x in chunks of 1,024, a 4-layer CNN 1.08-1.11x in chunks of 1,024 (bench evaluate,
# contenders timed in turn). Whether a GPU wants larger chunks is not measured here. chunk_size=int
# forces a larger one.
MAX_AUTO_CHUNK = 512


@dataclass
class Estimate:
    """peak(n) + extra * n bytes for a chunk of n, and where peak(n) comes from."""
    peak: Callable[[int], int]
    extra: int                   # the compact rows of a chunk on the device, per sample
    source: Source

    @property
    def planned(self) -> bool:
        """Sized for the planned forward (which must then run)."""
        return self.source is Source.PLANNER

    def __call__(self, n: int) -> int:
        return self.peak(n) + self.extra * n


def eager_peak(model, runner, chunks: Chunks, why: str) -> tuple[Callable[[int], int], str, Source]:
    """peak(n) of the eager forward: from fake tensors, else (APPROXIMATE, logged) from two measured runs."""
    peak, how = _fake_peak(model, chunks, why)
    if peak is not None:
        return peak, how, Source.FAKE_FORWARD
    # an extrapolation, not an exact count: say so where the user reads the choice
    log.warning("memfit.evaluate: the chunk size is APPROXIMATE (extrapolated from runs at 4 and 16 "
                "samples with 10%% head-room): %s", how)
    how = f"APPROXIMATE, extrapolated from runs at 2 sizes{how}"
    return _measured_peak(model, runner, chunks), how, Source.MEASURED


@predicting()          # one sizing at a time; every RNG as found (a measured run draws from it)
def choose_chunk(model, chunks, budget: int, runner, use_plan: bool | None = True) -> tuple[int, Estimate, str]:
    """(chunk size, peak estimate, how it was chosen) for the largest chunk within the budget,
    at most MAX_AUTO_CHUNK samples.

    use_plan: True sizes from the planner (when it captures the model); None captures only where it
    pays: when the eager forward's estimate cannot fit the chunk it would run (min(n, MAX_AUTO_CHUNK)),
    since the planner's arena then fits more; False never captures.
    """
    extra, target = chunks.compact_per_sample, min(chunks.n, MAX_AUTO_CHUNK)
    peak, how, source, eager = None, "", None, None
    if chunks.fields:
        use_plan, how = False, ", as the planner takes one input tensor and this data has several fields"
    if use_plan is None:           # the eager estimate first: capture costs seconds, and pays only when memory binds
        eager = eager_peak(model, runner, chunks, "")
        if eager[0](target) + extra * target <= budget:
            peak, how, source = eager[0], eager[1] + f"; no capture: {target} samples fit eagerly", eager[2]
        else:
            use_plan = True
    if use_plan:
        peak, how, source = _planned_peak(model, chunks.sample_shape, chunks.dtype)
        if peak is None and eager is not None:      # no capture: the eager estimate it is
            peak, how, source = eager[0], eager[1] + how, eager[2]
    if peak is None:
        peak, how, source = eager_peak(model, runner, chunks, how)
    total = Estimate(peak, extra, source)
    n = largest_fitting(total, budget, chunks.n)
    if n == 0:
        raise BudgetExceeded(f"one sample needs {format_bytes(total(1))} ({how}: parameters "
                             f"{format_bytes(held_bytes(model))} included) but the budget is {format_bytes(budget)}; "
                             "raise the budget or use a smaller model", needed=total(1), budget=budget)
    if n > MAX_AUTO_CHUNK:
        return MAX_AUTO_CHUNK, total, (f"{MAX_AUTO_CHUNK} samples (estimated peak ({how}) "
                                       f"{format_bytes(total(MAX_AUTO_CHUNK))}): {n} would fit the budget "
                                       f"{format_bytes(budget)}, but larger chunks hold more memory and run no faster")
    return n, total, (f"largest chunk whose estimated peak ({how}) {format_bytes(total(n))} fits the budget "
                      f"{format_bytes(budget)}")

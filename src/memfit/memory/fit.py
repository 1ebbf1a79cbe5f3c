"""Fitting bytes measured at a few batch sizes into bytes at any size: the one home for those lines.

Per op and kind of memory for fake runs (`memfit.memory.step_model`; a run is a `memfit.memory.fake_run._Run`,
(ops, kinds) live bytes), per tensor for the planner's static captures (`exact_line_at`), and for a peak
measured at two sizes (`line_through`, evaluate's measured estimate)."""

from __future__ import annotations

import numpy as np

from memfit.memory.fake_run import _Run

__all__ = ["affine", "envelope", "exact_line_at", "gradient_line", "line_through", "proportional", "quadratic",
           "with_step"]


def proportional(r1: _Run, n1: int, r2: _Run, n2: int) -> bool:
    """Whether the two runs (outside the optimizer step) allocate and free the same storages at the same ops,
    each either the same size in both or scaled with the batch (n2 / n1): then every op's live bytes are
    a + b*n, and the line through the two runs is exact."""
    skip = lambda r: r.ops[:r.phase_ends["backward"]] + r.ops[r.phase_ends["step"] - 1:] \
        if "step" in r.phase_ends else r.ops
    if skip(r1) != skip(r2) or r1.events.shape != r2.events.shape or not np.array_equal(r1.events, r2.events):
        return False
    return bool(np.all((r1.sizes == r2.sizes) | (r1.sizes * n2 == r2.sizes * n1)))


def with_step(r: _Run, full: _Run) -> _Run:
    """Run `r` (forward, backward and zero_grad, the optimizer step skipped) with the step of `full` put in.

    The step reads and writes parameters, gradients and its state, none of which depends on the batch: what
    it adds above the bytes live when backward ends is the same at every batch size."""
    b, s = r.phase_ends["backward"], r.phase_ends["step"]            # s == b + 1: the step's marker alone
    fb, fs = full.phase_ends["backward"], full.phase_ends["step"]
    assert s == b + 1, "the step was not skipped"
    keep = full.step_kept
    rise = full.live[fb:fs - 1] - full.live[fb - 1]                  # the step's ops, above the end of backward
    left = full.live[fs - 1] - full.live[fb - 1]                    # what it leaves and does not keep: none
    live = np.concatenate([r.live[:b] + keep, r.live[b - 1] + keep + rise, r.live[b:] + keep + left])
    ops = r.ops[:b] + full.ops[fb:fs - 1] + r.ops[b:]
    ends = {**r.phase_ends, "step": s + fs - 1 - fb}
    # the ops whose scratch is measured, at their rows here: the step's (half-precision state, say) among them
    scratch = [x for x in r.scratch if x[0] < b] + [(i - fb + b, *x) for i, *x in full.scratch if fb <= i < fs - 1] \
        + [(i + fs - 1 - fb, *x) for i, *x in r.scratch if i >= b]
    return _Run(ops, live, ends, r.held, r.events, r.sizes, keep, r.grad_bytes, scratch, full.step_events,
                full.step_sizes, r.step_at, r.sdpa, stood_in=full.stood_in)


def affine(runs: dict[int, _Run], n1: int, n2: int):
    l1, l2 = runs[n1].live.astype(np.float64), runs[n2].live.astype(np.float64)
    b = (l2 - l1) / (n2 - n1)
    return l1 - b * n1, b


def quadratic(runs: dict[int, _Run], n1: int, n2: int, n3: int):
    """a, b, c of a + b*n + c*n^2 through the live bytes at three sizes (per op and kind)."""
    l1, l2, l3 = (runs[n].live.astype(np.float64) for n in (n1, n2, n3))
    s12, s23 = (l2 - l1) / (n2 - n1), (l3 - l2) / (n3 - n2)
    c = (s23 - s12) / (n3 - n1)
    b = s12 - c * (n1 + n2)
    return l1 - b * n1 - c * n1 * n1, b, c


def envelope(runs: dict[int, _Run], sizes: list[int]):
    """The steepest slope between probes and the smallest intercept above every probe: never below them."""
    lives = [runs[n].live.astype(np.float64) for n in sizes]
    b = np.max([(lives[i + 1] - lives[i]) / (sizes[i + 1] - sizes[i]) for i in range(len(sizes) - 1)], axis=0)
    b = np.maximum(b, 0)
    a = np.max([lv - b * n for lv, n in zip(lives, sizes, strict=True)], axis=0)
    return a, b


def gradient_line(runs: dict[int, _Run]) -> tuple[float, float]:
    """(a, b): bytes a + b*n of the gradients' storages, never below a probe (exact where they are affine).
    Batch 1 is left out where there are two other probes: a gradient reduced over a broadcast batch is a view
    of its input's gradient at batch 1 only (no sum to make), so batch 1 is its own exact probe."""
    probes = sorted(runs) if len(runs) < 3 else sorted(k for k in runs if k > 1)
    g = [runs[k].grad_bytes for k in probes]
    slope = max([0.0, *((g[i + 1] - g[i]) / (probes[i + 1] - probes[i]) for i in range(len(probes) - 1))])
    return max(gi - slope * k for gi, k in zip(g, probes, strict=True)), slope


def exact_line_at(s1: int, s2: int, n1: int, n2: int, n: int) -> int:
    """Bytes at n on the exact line through s1 bytes at n1 and s2 at n2 (rationals, rounded up, never negative).

    Example:
        >>> exact_line_at(100, 180, 2, 4, 3), exact_line_at(100, 180, 2, 4, 5)
        (140, 220)
    """
    return max(0, -(-(s1 * (n2 - n1) + (s2 - s1) * (n - n1)) // (n2 - n1)))


def line_through(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of bytes a + b*n through one or two measured (n, bytes) points, slope and intercept not
    negative; one point gives the line through the origin.

    Example:
        >>> line_through([(4, 100.0), (16, 220.0)]), line_through([(4, 100.0)])
        ((60.0, 10.0), (0.0, 25.0))
    """
    if len(points) == 1:
        n, p = points[0]
        return 0.0, p / n
    (n1, p1), (n2, p2) = points
    b = max((p2 - p1) / (n2 - n1), 0.0)
    return max(p1 - b * n1, 0.0), b

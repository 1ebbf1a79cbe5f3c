"""Shared pieces of the benchmarks: timing by median (with the spread across repeats watched), the
machine header, tables and CSV."""

from __future__ import annotations

import csv
import io
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Collection, Sequence

import torch

from memfit.budget import format_bytes
from memfit.device.machine import cpu_name

# Above this relative spread of repeated timings ((upper quartile - lower quartile) / median, or
# (max - min) / median for fewer than 4 repeats) a figure is noise rather than a measurement; a
# quiet machine stays well below it.
SPREAD_LIMIT = 0.25
_spreads: list[tuple[float, str]] = []         # (spread, what) of every median taken since the last report


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work so that a timer measures it (a no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def spread(times: Sequence[float]) -> float:
    """Relative spread of repeated timings: interquartile range / median (range / median below 4)."""
    if len(times) < 2:
        return 0.0
    mid = statistics.median(times)
    if len(times) >= 4:
        q1, _, q3 = statistics.quantiles(times, n=4)
        width = q3 - q1
    else:
        width = max(times) - min(times)
    return width / mid if mid > 0 else 0.0


def median(times: Sequence[float], what: str = "a timing") -> float:
    """The median of repeated timings, noting their spread for `spread_warning`."""
    if len(times) > 1:                                # one run says nothing about the spread
        _spreads.append((spread(times), what))
    return statistics.median(times)


def spread_warning(limit: float = SPREAD_LIMIT) -> str | None:
    """One line warning that timings varied too much to trust (None when they did not); resets the record.

    Benchmarks print it under their table, so that a figure measured on a busy machine says so.
    """
    noisy = sorted((s, w) for s, w in _spreads if s > limit)
    total = len(_spreads)
    _spreads.clear()
    if not noisy:
        return None
    worst, what = noisy[-1]
    return (f"WARNING: {len(noisy)} of {total} timings varied by more than {limit:.0%} across repeats (worst "
            f"{worst:.0%}, {what}): the machine is probably busy; the ratios above are unreliable, rerun on a "
            "quiet machine")


def in_turn(fns: dict[str, Callable[[], object]], repeat: int, warmup: int,
             device: torch.device | str | None, clock: Callable[[], float] | None = None) -> dict[str, list[float]]:
    """Seconds of every timed call of each `fns[k]()`, the contenders run in turn in every round, in the
    reverse order every other round: on a shared VM the call made second in a round ran up to 6% faster
    (measured: plain / accumulate 0.93 with plain first, 0.87 with it second), and ABBA order cancels that.
    `clock`: what is read around each call (default the wall clock, `time.perf_counter`)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns.items())
    for r in range(warmup + repeat):
        for k, fn in (order if r % 2 == 0 else order[::-1]):
            now = clock or time.perf_counter
            sync(device)
            t0 = now()
            fn()
            sync(device)
            if r >= warmup:
                times[k].append(now() - t0)
    return times


def alternating_medians(fns: dict[str, Callable[[], object]], *, repeat: int = 5, warmup: int = 1,
                        device: torch.device | str | None = None, what: str = "") -> dict[str, float]:
    """Median seconds of each `fns[k]()`, the contenders run in turn in every round (after `warmup` rounds):
    drift on a shared machine, and whatever one run leaves behind for the next (allocator state, caches,
    clock boost), then hit all of them alike instead of whichever was timed second."""
    times = in_turn(fns, repeat, warmup, device)
    return {k: median(ts, f"{k} {what}".strip()) for k, ts in times.items()}


def _pairs(base: Sequence[float], other: Sequence[float]) -> list[float]:
    """other / base over each pair of rounds (the two rounds of a pair ran the two in opposite orders)."""
    return [(other[i] + other[i + 1]) / (base[i] + base[i + 1]) for i in range(0, len(base) - 1, 2)]


def paired_ratios(base: Callable[[], object], other: Callable[[], object], *, repeat: int = 6, warmup: int = 1,
                  device: torch.device | str | None = None, what: str = "",
                  clock: Callable[[], float] | None = None) -> list[float]:
    """other / base over each ABBA pair of rounds (`repeat` rounds, rounded up to whole pairs): the two rounds of
    a pair run the two in opposite orders, so the advantage of running second cancels inside each ratio. (One
    ratio per round leaves it in: with an odd number of rounds the median lands on the order that came up more
    often; a plan against the same plan measured 1.06 that way.) A ratio of two calls made back to back sees the
    same machine: a busy phase that slows a whole stretch of rounds (another process, a clock change) cancels out
    of each pair's ratio, where it shifts the two medians by different amounts when it falls on more calls of one
    than of the other. The ratios' median and spread are noted as `median` notes them."""
    times = in_turn({"base": base, "other": other}, repeat + repeat % 2, warmup, device, clock)
    ratios = _pairs(times["base"], times["other"])
    median(ratios, what or "a ratio")
    return ratios


def median_interval(ratios: Sequence[float]) -> tuple[float, float]:
    """A distribution-free ~95% confidence interval of the median of `ratios` (order statistics: the ranks
    n/2 -+ 0.98 sqrt(n)); the whole range below 6 values, too few to say more."""
    xs, n = sorted(ratios), len(ratios)
    if n < 6:
        return (xs[0], xs[-1]) if xs else (math.nan, math.nan)
    k = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    return xs[k], xs[min(n - 1, n - 1 - k)]


def paired_ratios_until(base: Callable[[], object], other: Callable[[], object], threshold: float, *,
                        repeat: int, at_most: int, warmup: int = 1, device: torch.device | str | None = None,
                        what: str = "", clock: Callable[[], float] | None = None) -> list[float]:
    """`paired_ratios`, `repeat` rounds first, then more in steps of as many, up to `at_most` rounds, while the
    median's confidence interval (`median_interval`) still holds `threshold`: a ratio near a target gets the
    rounds it needs to be judged, one clearly on either side stops early. The same rule whichever side the
    median lies on, so a verdict is not helped by measuring misses only."""
    ratios: list[float] = []
    step = max(2, repeat + repeat % 2)
    while True:
        times = in_turn({"base": base, "other": other}, step, warmup if not ratios else 0, device, clock)
        ratios += _pairs(times["base"], times["other"])
        lo, hi = median_interval(ratios)
        if not lo <= threshold <= hi or 2 * len(ratios) + step > at_most:
            median(ratios, what or "a ratio")      # the spread noted once, of every pair measured
            return ratios


def paired_ratio(base: Callable[[], object], other: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
                 device: torch.device | str | None = None, what: str = "",
                 clock: Callable[[], float] | None = None) -> tuple[float, float, float]:
    """(median seconds of base, of other, median over ABBA pairs of rounds of other / base): `paired_ratios`
    (`repeat` rounded up to whole pairs), with the two medians beside it. Only the ratio's spread is noted: the
    medians may spread in a busy stretch that the ratio cancels."""
    times = in_turn({"base": base, "other": other}, repeat + repeat % 2, warmup, device, clock)
    ratio = median(_pairs(times["base"], times["other"]), what or "a ratio")
    return statistics.median(times["base"]), statistics.median(times["other"]), ratio


def rounds_for(fn: Callable[[], object], *, seconds: float, at_least: int, at_most: int,
               device: torch.device | str | None = None) -> int:
    """How many timed rounds give about `seconds` of calls of `fn` (one warm call timed), within
    [at_least, at_most]: fast calls need many rounds for a stable median, slow ones a few."""
    once = median_time(fn, repeat=1, warmup=1, device=device)
    return max(at_least, min(at_most, int(seconds / max(once, 1e-6))))


def median_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
                device: torch.device | str | None = None, what: str = "a timing") -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` runs (spread noted, see `spread_warning`)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return median(times, what)


def commit() -> str:
    """Short git commit of the working tree memfit runs from, or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=5).stdout.splitlines()
        # a results file being written (`memfit bench ... > benchmarks/results/x.txt`) is not a change to the code
        dirty = [line for line in changed if not line[3:].startswith("benchmarks/results/")]
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_header(device: torch.device | str = "cpu") -> str:
    """One line naming the machine, the device, torch and the commit, printed above every table."""
    dev = torch.device(device)
    what = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"{cpu_name()}, {os.cpu_count()} cores, "
                 f"{torch.get_num_threads()} torch threads")
    return (f"# machine: {platform.node()} ({platform.system()} {platform.machine()}); device: {dev} ({what}); "
            f"torch {torch.__version__}; python {platform.python_version()}; memfit commit {commit()}")


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def column_format(values: Sequence[object], as_bytes: bool = False) -> Callable[[object], str]:
    """One number format for a whole column, so that its figures line up and compare at a glance.

    Bytes print human-readable ('1.50 MiB'); ints with thousands separators; floats with the same
    number of decimals in every row: enough for 3 significant digits of the smallest non-zero value,
    at most 3 (a column of 0.031, 0.25 and 1.0 prints 0.031, 0.250, 1.000), with thousands
    separators when the values are large. Anything else prints as str().
    """
    numbers = [v for v in values if _is_number(v)]
    if as_bytes:
        return lambda v: format_bytes(v) if _is_number(v) else str(v)
    if all(isinstance(v, int) for v in numbers):
        return lambda v: f"{v:,}" if _is_number(v) else str(v)
    nonzero = [abs(v) for v in numbers if v and math.isfinite(v)]
    decimals = min(3, max(0, 2 - math.floor(math.log10(min(nonzero))))) if nonzero else 0
    return lambda v: f"{v:,.{decimals}f}" if _is_number(v) else str(v)


def table(rows: Sequence[dict], columns: Sequence[str] | None = None, bytes_columns: Collection[str] = ()) -> str:
    """Fixed-width text table of dict rows, one number format per column (`column_format`);
    the columns named in `bytes_columns` hold byte counts and print human-readable."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    formats = {c: column_format([r.get(c) for r in rows], c in bytes_columns) for c in columns}
    cells = [[formats[c](r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def to_csv(rows: Sequence[dict], path: str) -> None:
    """Write rows to CSV (the grid, for plotting elsewhere); a column some rows lack (a contender measured at one
    batch only) is empty in those."""
    if not rows:
        return
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
    w.writeheader()
    w.writerows(rows)
    with open(path, "w", newline="") as f:
        f.write(buf.getvalue())


def _measured_with_spreads(fn, *args):
    return fn(*args), list(_spreads)


def in_own_process(fn, *args):
    """fn(*args) in a fresh process, with the spreads of its timings noted here. A model measured after
    others in one process inherits their allocator state: after GPT-2, eager ViT at batch 8 ran 10% faster
    and planned ViT 15% slower (1.02x eager), with the same per-op times under the profiler; a user's
    process runs its own model."""
    import multiprocessing
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out, spreads = pool.apply(_measured_with_spreads, (fn, *args))
    _spreads.extend(spreads)
    return out

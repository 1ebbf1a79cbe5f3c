"""Shared pieces of the benchmarks: timing by median, the machine header, tables and CSV."""

from __future__ import annotations

import csv
import io
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

import torch

from memfit.budget import cpu_name


def sync(device: torch.device | str | None = None) -> None:
    """Wait for queued device work so that a timer measures it (a no-op on the CPU)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], *, repeat: int = 5, warmup: int = 1,
                device: torch.device | str | None = None) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def commit() -> str:
    """Short git commit of the working tree memfit runs from, or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
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


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Fixed-width text table of dict rows; floats get 3 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def to_csv(rows: Sequence[dict], path: str) -> None:
    """Write rows to CSV (the grid, for plotting elsewhere)."""
    if not rows:
        return
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
    with open(path, "w", newline="") as f:
        f.write(buf.getvalue())

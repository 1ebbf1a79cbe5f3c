"""`memfit bench planner --held-out`: the planner against torch.compile on models it was not tuned to
(`memfit.testing.held_out.HELD_OUT`: two found by an issue, then mended on, and models written down before the planner
was measured on them), reported as they come out, PASS or MISS, in a table of their own.

Each model in a process of its own, at one batch size (8): the planned call's peak (arena + what it allocates beyond
it, by the allocator: `memfit.device.measure.track_memory`), eager's and torch.compile's (inductor, static shapes,
`contenders.compiled_columns`) measured the same way, and the latency of each against eager (paired rounds). A plan
that runs every op eagerly (no arena: torch's one pool peaks lower) says so.

Run:
    OMP_NUM_THREADS=1 memfit bench planner --held-out           # every held-out model, batch 8, torch.compile beside
    memfit bench planner --held-out --models mixer,llama --no-compile
"""

from __future__ import annotations

import json
import time

from memfit import plan
from memfit.budget import format_bytes
from memfit.cli.bench.common import in_own_process, machine_header, spread_warning, table, to_csv
from memfit.cli.bench.contenders import compiled_columns, compiled_verdicts
from memfit.cli.bench.planner_rows import planned_row
from memfit.messages import first_line, whole_words

__all__ = ["measure_held_out", "run_held_out"]


def measure_held_out(name: str, batch: int, repeat: int, compiled: bool) -> dict:
    """The row of one held-out model at `batch`: `bench planner`'s columns (`planner_rows.planned_row`),
    torch.compile's beside them with `compiled`."""
    from memfit.testing.held_out import ISSUE, build_held_out
    model, make_input = build_held_out(name)
    x = make_input(batch)
    t0 = time.perf_counter()
    pm = plan(model, (x,))
    row = planned_row(name, model, pm, x, repeat, time.perf_counter() - t0)
    row["set"] = "issue" if name in ISSUE else "held out"
    row["runs"] = "eagerly (no arena)" if not row["arena"] else "arena"
    if compiled:
        row.update(compiled_columns(model, x, row["planned_total"], repeat))
    return row


def run_held_out(models, batch: int = 8, repeat: int = 3, csv: str | None = None, as_json: bool = False,
                 compiled: bool = True) -> list[dict]:
    """Measure every held-out model (each in a fresh process); print the table and the verdict; return the rows."""
    if not as_json:
        print(machine_header("cpu"))
    rows = []
    for name in models:
        try:
            row = in_own_process(measure_held_out, name, batch, repeat, compiled)
        except Exception as e:              # a model that fails is a line of the output, not the end of the run
            print(f"# {name}: FAILED {whole_words(first_line(e), 200)}", flush=True)
            continue
        rows.append(row)
        if not as_json:
            vs = (f", planned / compiled peak {row['planned/compiled']:.3f} {row['vs compiled']}"
                  if "planned/compiled" in row else f", compiled {row.get('compiled', 'not run')}")
            print(f"# {name} batch {batch}: planned {format_bytes(row['planned_total'])} ({row['runs']}), eager "
                  f"{format_bytes(row['eager_peak'])}{vs}, latency {row['latency_ratio']:.2f}x eager", flush=True)
    lines = compiled_verdicts(rows)
    warning = spread_warning()
    if warning:
        lines.append(warning)
    if as_json:
        print(json.dumps({"machine": machine_header("cpu"), "rows": rows, "targets": lines}))
    else:
        print("# planned = arena + unplanned, peaks by the allocator; runs: 'eagerly' where every op runs by torch\n"
              "# (one pool peaks lower than an arena beside torch's tensors)")
        print(table(rows, ["set", "model", "batch", "eager_peak", "planned_total", "compiled_peak",
                           "planned/compiled", "vs compiled", "total/eager", "runs", "order", "latency_ratio",
                           "compiled_latency", "compiled"],
                    bytes_columns={"eager_peak", "planned_total", "compiled_peak"}))
        print("\n".join(lines))
    if csv:
        to_csv(rows, csv)
    return rows

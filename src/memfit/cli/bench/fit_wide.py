"""`memfit bench fit --wide`: what `memfit.fit` costs at the widths people train, as a ratio to one real step.

Per model (`train_cases.cost_cases`' transformers: BERT-base and GPT-2 small shapes, 768
wide, 12 layers, sequence 128, batch 8; with `--quick` 2 layers and an 8,000-token vocabulary), at two budgets (1
TiB: the plain step fits; halfway between the fewest bytes any alternative needs and the plain step's predicted
peak: micro-batching or checkpointing must; left out, and said, where no alternative needs less), `memfit.fit`
runs in a process of its own that has fitted nothing (`common.in_own_process`: no kernel timing, memory model or
host chain kept), at the default thread count, and its seconds are set against one real plain step there (the median
of three after a warm-up), by the wall clock and by the process's CPU time (on a shared machine the wall clock
counts other processes' turns); "timed": how many alternatives fit timed for real (0: the time model's choice was
clear, no trial ran; the trials are most of fit's cost where they run). Target: fit at most 3x one real step, by CPU
time.

Run:
    memfit bench fit --wide --quick
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

import memfit
from memfit.budget import format_bytes
from memfit.cli.bench.common import in_own_process, table
from memfit.cli.bench.train_cases import cost_cases
from memfit.cli.bench.train_steps import adamw, plain_step

TARGET = 3.0       # fit's seconds over one real step's, at most


def _cases(quick: bool):
    """The transformers of the cost table (its CNN is one flat Sequential with BatchNorm: no block to checkpoint and
    no micro-batch without allow_batch_dependent, so half its plain step fits nothing)."""
    return [(case, n) for case, n, _ in cost_cases(quick) if not case.name.startswith("cnn")]


def _case(name: str, quick: bool):
    return next((c, n) for c, n in _cases(quick) if c.name == name)


def _fit_and_step(name: str, quick: bool, budget: int | None) -> dict:
    """In a fresh process: fit's seconds (from nothing kept) at `budget` (None: 1 TiB) and one real plain step's
    seconds."""
    warnings.simplefilter("ignore")
    case, n = _case(name, quick)
    x, y = case.batch(n)
    model = case.make()
    opt = adamw(model)
    t0, c0 = time.perf_counter(), time.process_time()
    plan = memfit.fit(model, opt, (x, y), case.loss, budget if budget is not None else "1TiB")
    fit_s, fit_cpu = time.perf_counter() - t0, time.process_time() - c0
    ref = case.make()
    ref_opt = adamw(ref)
    plain_step(ref, ref_opt, x, y, case.loss)            # warm-up: AdamW's state, the allocator
    steps, cpu = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        plain_step(ref, ref_opt, x, y, case.loss)
        steps.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {"fit s": fit_s, "step s": statistics.median(steps), "fit cpu s": fit_cpu,
            "step cpu s": statistics.median(cpu), "plan": f"m={plan.micro_batch} ckpt "
            f"{len(plan.checkpoint)}/{len(plan.candidates)}", "peak": plan.peak_bytes, "n": n,
            "timed": sum(a.measured is not None for a in plan.alternatives),
            "least": _least(model, opt, x, y, case.loss) if budget is None else None}


def _least(model, opt, x, y, loss) -> int:
    """The fewest bytes any alternative needs (every alternative's memory model: `exhaustive=True`, not timed)."""
    every = memfit.fit(model, opt, (x, y), loss, "1TiB", exhaustive=True)
    return min(a.bytes for a in every.alternatives if a.bytes is not None)


def wide_rows(quick: bool, line) -> list[dict]:
    """Rows of fit's cost at training widths, and a PASS/MISS line (`line(ok, text)`)."""
    rows = []
    for case, _ in _cases(quick):
        first = in_own_process(_fit_and_step, case.name, quick, None)       # the plain step fits
        runs = [("plain fits", first)]
        if first["least"] < first["peak"]:        # a budget between: micro-batching or checkpointing must
            runs.append(("between", in_own_process(_fit_and_step, case.name, quick,
                                                   (first["least"] + first["peak"]) // 2)))
        else:
            print(f"{case.name}: no alternative needs less than the plain step ({format_bytes(first['peak'])}: its "
                  "peak is where no micro-batch or checkpoint reaches, e.g. the optimizer step)")
        for what, got in runs:
            rows.append({"model": case.name, "batch": got["n"], "budget": what, "plan": got["plan"],
                         "timed": got["timed"], "fit s": got["fit s"], "step s": got["step s"],
                         "fit/step": got["fit s"] / got["step s"],
                         "fit cpu s": got["fit cpu s"], "step cpu s": got["step cpu s"],
                         "cpu fit/step": got["fit cpu s"] / got["step cpu s"]})
    print(table(rows, ["model", "batch", "budget", "plan", "timed", "fit s", "step s", "fit/step", "fit cpu s",
                       "step cpu s", "cpu fit/step"]))
    # judged by CPU time: the process's own work (the wall clock counts other processes' turns on a shared machine)
    worst = max(rows, key=lambda r: r["cpu fit/step"])
    wall = max(r["fit/step"] for r in rows)
    threads = torch.get_num_threads()
    line(worst["cpu fit/step"] <= TARGET, f"fit's cost at training widths, from nothing kept, {threads} torch threads: "
                                          f"at most {worst['cpu fit/step']:.2f}x one real step by CPU time "
                                          f"({worst['model']} {worst['budget']}; target <= {TARGET:.0f}x; by the wall "
                                          f"clock at most {wall:.2f}x)")
    return rows

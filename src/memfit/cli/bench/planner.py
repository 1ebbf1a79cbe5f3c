"""Planner benchmark: the activation arena against naive, eager and the lower bound, on memfit's
model zoo and on real architectures from `transformers` configs; and a long differential fuzz run.

For every model and batch size: naive bytes (every planned tensor its own region), the eager
peak (bytes the allocator serves to eager PyTorch under `torch.inference_mode`, inside kernels
too: `memfit.device.measure.track_memory`), the planned arena, the lower bound (most bytes live at
one op), the unplanned bytes the planned run still allocates (measured the same way as eager), and
the latency of both, side by side in one
process (eager and planned called in turn, medians after warm-up), each model in a process of its own. Real models
are captured once and planned at both batch sizes from that one capture. `torch.compile` (inductor) runs beside
the zoo and the real models alike: its peak by the allocator (planned <= compiled: PASS or MISS per row),
latency, and its compile time in fresh processes, fully cold and with its C++ kernels on disk, against the first
plan of a fresh process (`memfit.cli.bench.contenders`); `--no-compile` leaves it out.

Run:
    memfit bench planner --quick        # zoo images at 64x64, batch 1 and 8; torch.compile beside them at batch 8
                                        # (minutes a model on 2 cores: its cold compiles; --no-compile: seconds)
    memfit bench planner --real --quick # 14 transformers architectures, tiny configs, batch 2 and 8; torch.compile
                                        # (inductor) beside them at batch 8
    memfit bench planner --real         # moderate configs (BERT hidden 256, images 128x128), batch 1 and 8
    memfit bench planner --fuzz 500     # 500 random graphs, every algorithm, bit for bit against eager
    memfit bench planner  # zoo images at full size, batch 1 and 32
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import tempfile
import time

import torch

from memfit import memory_model, plan
from memfit.budget import format_bytes
from memfit.cli.bench.common import (
    in_own_process,
    machine_header,
    spread_warning,
    sync,
    table,
    to_csv,
)
from memfit.cli.bench.contenders import (
    compile_times,
    compiled_columns,
    compiled_table,
    compiled_verdicts,
    with_compile_times,
)
from memfit.cli.bench.planner_rows import planned_row
from memfit.memory.kinds import MemoryKind
from memfit.messages import first_line, whole_words
from memfit.testing.zoo import MODELS, build

TARGETS = {"geo_ratio": 1.02, "worst_ratio": 1.10, "naive_over_planned": 5.0, "latency": 1.10}


def zoo_model(name: str, image: int | None, device="cpu"):
    """(model, make_input(batch)) of a zoo entry on `device`: what `measure` and a compile in a fresh process build."""
    model, shape = build(name, image=image)
    dev = torch.device(device)
    return model.to(dev), lambda n: torch.randn(n, *shape, device=dev)


def measure(name: str, batch: int, image: int | None, repeat: int, device="cpu", compiled: bool = False) -> dict:
    """One row of the zoo table: bytes and latency of one model at one batch size; with `compiled`, torch.compile's
    beside them."""
    model, make_input = zoo_model(name, image, device)
    x = make_input(batch)
    t0 = time.perf_counter()
    pm = plan(model, (x,))
    sync(x.device)
    row = planned_row(name, model, pm, x, repeat, time.perf_counter() - t0)
    if compiled:
        row.update(compiled_columns(model, x, row["planned_total"], repeat))
    return row


def measure_zoo(name: str, batches: tuple[int, ...], image: int | None, repeat: int, device="cpu",
                compiled_at: tuple[int, ...] = (), inductor_dir: str | None = None) -> list[dict]:
    """The zoo rows of one model (planned afresh at each batch: the first is the first plan of this process), with
    torch.compile beside them at the batches in `compiled_at`, its C++ kernels in `inductor_dir`."""
    if inductor_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    return [measure(name, b, image, repeat, device, b in compiled_at) for b in batches]


REAL_TARGETS = {"latency": 1.00, "latency_geo": 0.95, "total/eager": 1.00, "arena/bound": 1.02}
MODEL_RANGE = (1.00, 1.05)      # memory_model's planned bytes / the allocator's: never below, at most 5% above
_HELD = {MemoryKind.PARAMETERS.value, MemoryKind.INPUTS.value}


def _model_ok(ratio: float) -> bool:
    return MODEL_RANGE[0] <= ratio <= MODEL_RANGE[1]


def measure_real(name: str, batches: tuple[int, ...], quick: bool, repeat: int, compiled: bool = True,
                 inductor_dir: str | None = None) -> list[dict]:
    """Rows of one `transformers` architecture: one capture (at the first batch, the first plan of this process,
    timed as `plan_s`), every batch planned from it; with `compiled`, torch.compile's peak and latency beside it
    (quick: at the largest batch only), its C++ kernels in `inductor_dir` (its compile times: `compile_times`)."""
    from memfit.testing.zoo import build_real
    if inductor_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    model, make_input = build_real(name, quick)
    t0 = time.perf_counter()
    pm = plan(model, (make_input(batches[0]),))
    plan_s = time.perf_counter() - t0
    mm = memory_model(model, make_input(2))           # what a user asks for the bytes of this planned call
    rows = []
    for b in batches:
        x = make_input(b)
        row = planned_row(name, model, pm, x, repeat, plan_s if b == batches[0] else 0.0)
        # the memory model's bytes beyond parameters and inputs (arena + unplanned + its stated margin: 16 B on the
        # CPU for a Python number an op wraps, as GPT-2's `mul` does, 12 B) against the planned call's by the
        # allocator (its arena + its peak beyond it)
        row["predicted"] = sum(v for k, v in mm.breakdown(b).items() if k not in _HELD)
        row["model/real"] = row["predicted"] / max(row["planned_total"], 1)
        if compiled and (not quick or b == batches[-1]):
            row.update(compiled_columns(model, x, row["planned_total"], repeat))
        row["PASS/MISS"] = " ".join(
            f"{key}:{'PASS' if row[col] <= REAL_TARGETS[key] else 'MISS'}"
            for key, col in (("latency", "latency_ratio"), ("total/eager", "total/eager"),
                             ("arena/bound", "arena/bound"))) + \
            f" model/real:{'PASS' if _model_ok(row['model/real']) else 'MISS'}"
        rows.append(row)
    return rows


def _with_compiler(measure_rows, build, batch: int | None, *args) -> list[dict]:
    """One model's rows, measured in a process of its own by `measure_rows(*args, inductor_dir)`; with `batch`
    (not None), torch.compile's compile times at that batch first, each in a fresh process (`compile_times`), all
    three sharing one inductor cache folder, empty at first (the first compile is fully cold)."""
    inductor_dir = tempfile.mkdtemp(prefix="memfit-inductor-")
    try:
        times = compile_times(build, batch, inductor_dir) if batch is not None else {}
        rows = in_own_process(measure_rows, *args, inductor_dir)
    finally:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    with_compile_times(rows, times)
    return rows


def verdicts_real(rows: list[dict]) -> list[str]:
    """The targets for real models, each with PASS or MISS and the rows that miss it."""
    geo = math.exp(sum(math.log(r["latency_ratio"]) for r in rows) / len(rows))
    out = [f"latency planned / eager, geometric mean {geo:.3f} (target <= {REAL_TARGETS['latency_geo']}): "
           f"{'PASS' if geo <= REAL_TARGETS['latency_geo'] else 'MISS'}"]
    for key, col in (("latency", "latency_ratio"), ("total/eager", "total/eager"), ("arena/bound", "arena/bound")):
        miss = [f"{r['model']}/{r['batch']} ({r[col]:.3f})" for r in rows if r[col] > REAL_TARGETS[key]]
        out.append(f"{col} <= {REAL_TARGETS[key]:.2f} for every model: "
                   f"{'PASS' if not miss else 'MISS ' + ', '.join(miss)}")
    off = [f"{r['model']}/{r['batch']} ({r['predicted'] - r['planned_total']:+d} B)" for r in rows
           if not _model_ok(r["model/real"])]
    ratios = [r["model/real"] for r in rows]
    out.append(f"memory_model / allocator, the planned call's arena + unplanned, in [{min(ratios):.4f}, "
               f"{max(ratios):.4f}] (target every row in [{MODEL_RANGE[0]:.2f}, {MODEL_RANGE[1]:.2f}]): "
               f"{'PASS' if not off else 'MISS ' + ', '.join(off)}")
    # the symbolic batch starts at 2 (export specialises sizes of 1), so batch 1 has a capture of its own
    batches = {}
    for r in rows:
        batches.setdefault(r["model"], set()).add(r["batch"])
    allowed = {m: 1 + (1 in bs and max(bs) > 1) for m, bs in batches.items()}
    one = sorted({r["model"] for r in rows if r["captures"] > allowed[r["model"]]})
    out.append(f"one capture per model for every batch size >= 2 (batch 1 has its own): "
               f"{'PASS' if not one else 'MISS ' + ', '.join(one)}")
    return out + compiled_verdicts(rows)


def verdicts(rows: list[dict]) -> list[str]:
    """The planner's targets, each with the measured value and PASS or MISS."""
    ratios = [r["arena/bound"] for r in rows]
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    worst = max(rows, key=lambda r: r["arena/bound"])
    worst_ok = worst["arena/bound"] <= TARGETS["worst_ratio"]
    out = [f"arena / lower bound, geometric mean {geo:.3f} (target <= {TARGETS['geo_ratio']}): "
           f"{'PASS' if geo <= TARGETS['geo_ratio'] else 'MISS'}",
           f"arena / lower bound, worst {worst['arena/bound']:.3f} ({worst['model']} batch {worst['batch']}; "
           f"target <= {TARGETS['worst_ratio']}): {'PASS' if worst_ok else 'MISS'}"]
    for r in rows:
        if r["model"] in ("resnet50", "mobilenet_v2") and r["batch"] == 1 and not r["naive"]:
            out.append(f"naive / arena, {r['model']} batch 1: n/a (no op writes into an arena: each runs where "
                       "eager puts its output, which the plan found cheaper; target >= "
                       f"{TARGETS['naive_over_planned']:g}x where one does)")
        elif r["model"] in ("resnet50", "mobilenet_v2") and r["batch"] == 1:
            ok = r["naive/arena"] >= TARGETS["naive_over_planned"]
            out.append(f"naive / arena, {r['model']} batch 1: {r['naive/arena']:.1f}x "
                       f"(target >= {TARGETS['naive_over_planned']:g}x): "
                       f"{'PASS' if ok else 'MISS'}")
    over = [f"{r['model']}/{r['batch']}" for r in rows if r["arena"] > r["eager_peak"]]
    out.append(f"arena <= eager peak for every model: {'PASS' if not over else 'MISS ' + ', '.join(over)}")
    over = [f"{r['model']}/{r['batch']} ({r['total/eager']:.2f}x)" for r in rows if r["total/eager"] > 1.0]
    out.append(f"arena + unplanned <= eager peak for every model: {'PASS' if not over else 'MISS ' + ', '.join(over)}")
    slow = [f"{r['model']}/{r['batch']} ({r['latency_ratio']:.2f}x)" for r in rows
            if r["latency_ratio"] > TARGETS["latency"]]
    out.append(f"planned latency <= {TARGETS['latency']:.2f}x eager for every model: "
               f"{'PASS' if not slow else 'MISS ' + ', '.join(slow)}")
    return out + compiled_verdicts(rows)


def run(models=tuple(MODELS), batches=(1, 32), image: int | None = None, repeat: int = 5,
        csv: str | None = None, as_json: bool = False, device="cpu", compiled: bool = True,
        quick: bool = False) -> list[dict]:
    """Measure every model at every batch size, each model in a process of its own; with `compiled`, torch.compile
    beside it (quick: at the largest batch only; its compile times at the largest batch); print the table and the
    target lines; return the rows."""
    if not as_json:
        print(machine_header(device))
    rows = []
    for name in models:
        at = () if not compiled else tuple(batches[-1:] if quick else batches)
        new = _with_compiler(measure_zoo, functools.partial(zoo_model, name, image, device),
                             batches[-1] if compiled else None, name, tuple(batches), image, repeat, device, at)
        rows += new
        if not as_json:
            for r in new:
                print(f"# {name} batch {r['batch']}: arena {format_bytes(r['arena'])}, eager peak "
                      f"{format_bytes(r['eager_peak'])}, {r['latency_ratio']:.2f}x eager latency{_vs(r, new)}",
                      flush=True)
    lines = verdicts(rows)
    warning = spread_warning()
    if warning:
        lines.append(warning)
    if as_json:
        print(json.dumps({"machine": machine_header(device), "rows": rows, "targets": lines}))
    else:
        cols = ["model", "batch", "naive", "eager_peak", "arena", "bound", "arena/bound", "naive/arena",
                "unplanned", "total/eager", "order", "graph_order_total", "reorder_saved", "eager_ms", "planned_ms",
                "latency_ratio"]
        print(table(rows, cols, bytes_columns={"naive", "eager_peak", "arena", "bound", "unplanned",
                                               "graph_order_total", "reorder_saved"}))
        vs = compiled_table(rows)
        if vs:
            print(vs)
        print("\n".join(lines))
    if csv:
        to_csv(rows, csv)
    return rows


def _vs(r: dict, rows: list[dict]) -> str:
    """The progress line's words on torch.compile for row r of one model's rows."""
    vs = f", planned / compiled peak {r['planned/compiled']:.2f}" if "planned/compiled" in r else \
        (f", compiled {r['compiled']}" if "compiled" in r else "")
    if "compile_cold_s" in r:
        vs += (f", compile {r['compile_cold_s']:.1f} s cold / {r['compile_warm_s']:.1f} s warm C++ cache, "
               f"plan {rows[0]['plan_s']:.1f} s = {r['plan/cold']:.2f}x the cold compile, {r['plan/warm']:.2f}x the "
               "warm-cache one")
    return vs


def run_real(models, batches=(1, 8), quick: bool = False, repeat: int = 5, csv: str | None = None,
             as_json: bool = False, compiled: bool = True) -> list[dict]:
    """Measure every real architecture at every batch size; print the table and the target lines."""
    if not as_json:
        print(machine_header("cpu"))
    from memfit.testing.zoo import build_real
    rows = []
    for name in models:
        try:
            new = _with_compiler(measure_real, functools.partial(build_real, name, quick),
                                 batches[-1] if compiled else None, name, tuple(batches), quick, repeat, compiled)
        except Exception as e:              # a model that fails is a row of the table, not the end of the run
            print(f"# {name}: FAILED {whole_words(first_line(e), 200)}", flush=True)
            continue
        rows += new
        if not as_json:
            for r in new:
                print(f"# {name} batch {r['batch']}: arena/bound {r['arena/bound']:.3f}, (arena + unplanned) / eager "
                      f"{r['total/eager']:.2f}, memory model / allocator {r['model/real']:.4f}, latency "
                      f"{r['latency_ratio']:.2f}x eager{_vs(r, new)}", flush=True)
    lines = verdicts_real(rows) if rows else ["no model ran"]
    warning = spread_warning()
    if warning:
        lines.append(warning)
    if as_json:
        print(json.dumps({"machine": machine_header("cpu"), "rows": rows, "targets": lines}))
    else:
        cols = ["model", "batch", "eager_peak", "arena", "bound", "arena/bound", "unplanned", "total/eager",
                "predicted", "model/real", "order", "graph_order_total", "reorder_saved", "eager_ms", "planned_ms",
                "latency_ratio", "PASS/MISS"]
        print("# predicted: memfit.memory_model(model, example) at this batch, its arena + unplanned bytes + its "
              "stated margin (16 B on the CPU); model/real: that / (arena + unplanned by the allocator)")
        print(table(rows, cols, bytes_columns={"eager_peak", "arena", "bound", "unplanned", "graph_order_total",
                                               "reorder_saved", "predicted"}))
        vs = compiled_table(rows)
        if vs:
            print(vs)
        print("\n".join(lines))
        print("unplanned ops (run by torch, outside the arena; reasons in pm.report.unplanned_reasons):")
        for r in rows[::len(batches)]:
            print(f"  {r['model']}: {r['unplanned_ops'] or '-'}")
    if csv:
        to_csv(rows, csv)
    return rows


def run_fuzz(examples: int, seed: int = 0) -> int:
    """Differential fuzzing: `examples` random models of up to 6 programs each, planned with every
    algorithm, compared with eager bit for bit. Prints progress; raises on the first difference."""
    from memfit.testing.fuzz import fuzz
    t0 = time.perf_counter()
    step = max(1, examples // 10)
    done = 0
    while done < examples:
        k = min(step, examples - done)
        fuzz(k, seed=seed + done)
        done += k
        print(f"# fuzz: {done}/{examples} models equal eager bit for bit ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    from memfit.cli.options import count_arg, counts_arg, device_arg, names_arg
    from memfit.testing.held_out import HELD_OUT
    from memfit.testing.zoo import REAL
    p = argparse.ArgumentParser(prog="memfit bench planner", description=__doc__.splitlines()[0],
                                epilog="example:\n  memfit bench planner --quick\n"
                                       "  memfit bench planner --real --quick\n"
                                       "  memfit bench planner --fuzz 500\n"
                                       "  memfit bench planner --held-out\n"
                                       "  memfit bench planner --models resnet50,mobilenet_v2 --batches 1 --json\n"
                                       "  memfit bench planner --quick --device cuda",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller inputs and configs, fewer repeats")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out torch.compile (a cold inductor compile takes tens of seconds a model)")
    p.add_argument("--real", action="store_true",
                   help=f"real architectures from transformers configs ({', '.join(REAL)}); needs transformers")
    p.add_argument("--held-out", action="store_true",
                   help=f"models the planner was not tuned to ({', '.join(HELD_OUT)}), batch 8, against torch.compile "
                        "(memfit.cli.bench.held_out); the transformers ones need transformers")
    p.add_argument("--fuzz", type=count_arg(1), default=None, metavar="N",
                   help="run N random-graph models against eager, bit for bit, instead of the table")
    p.add_argument("--models", default=None, type=names_arg((*MODELS, *REAL, *HELD_OUT), "model"),
                   help=f"comma-separated, from {', '.join(MODELS)} (with --real or --held-out, from their lists)")
    p.add_argument("--batches", default=None, type=counts_arg(1),
                   help="comma-separated batch sizes (default 1,32; quick 1,8; real 1,8; real quick 2,8)")
    p.add_argument("--image", type=count_arg(1), default=None, help="height and width of the image models' inputs")
    p.add_argument("--repeat", type=count_arg(1), default=None, help="timed repeats per measurement")
    p.add_argument("--seed", type=int, default=0, help="seed of the --fuzz run")
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="cpu, cuda, cuda:1 (default cpu: the published figures are the CPU's)")
    p.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    args = p.parse_args(argv)
    if args.fuzz is not None:
        run_fuzz(args.fuzz, args.seed)
        return 0
    if args.real and args.held_out:
        p.error("--real and --held-out are two tables: ask for one at a time")
    known, which = (REAL, "--real") if args.real else (HELD_OUT, "--held-out") if args.held_out else (MODELS, "the zoo")
    models = args.models or tuple(known)
    unknown = [m for m in models if m not in known]
    if unknown:
        p.error(f"--models: unknown model {', '.join(map(repr, unknown))} for {which}; expected comma-separated "
                f"names from {', '.join(known)}")
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 5)
    if args.held_out:
        from memfit.cli.bench.held_out import run_held_out
        batches = args.batches or (8,)
        if len(batches) != 1:
            p.error(f"--held-out measures one batch size; found --batches {','.join(map(str, batches))}")
        run_held_out(models, batches[0], repeat, args.csv, args.json, compiled=not args.no_compile)
        return 0
    if args.real:
        try:
            import transformers  # noqa: F401
        except ImportError:
            p.error("--real needs transformers (pip install transformers; an optional bench dependency)")
        run_real(models, args.batches or ((2, 8) if args.quick else (1, 8)), args.quick, repeat, args.csv, args.json,
                 compiled=not args.no_compile)
        return 0
    batches = args.batches or ((1, 8) if args.quick else (1, 32))
    image = args.image if args.image is not None else (64 if args.quick else None)
    run(models, batches, image, repeat, args.csv, args.json, args.device, compiled=not args.no_compile,
        quick=args.quick)
    return 0

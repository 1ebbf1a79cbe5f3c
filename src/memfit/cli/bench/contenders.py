"""What memfit is measured against, side by side in the benchmarks: `torch.compile` (inductor, CPU) beside the
planned forward (`bench planner --real`), PyTorch's `MemTracker` beside the training-step memory model
(`bench train`). Both measured as memfit is: bytes by the allocator (`memfit.device.measure.track_memory`).

A contender that cannot run here (no C compiler for inductor, a model `MemTracker` cannot run on fake tensors)
is a row saying why, not a failed benchmark.

Run:
    memfit bench planner --quick          # the compiled columns beside memfit's zoo, at the largest batch
    memfit bench planner --real --quick   # the same beside the `transformers` architectures
    memfit bench train --quick            # the MemTracker columns
"""

from __future__ import annotations

import math
import os
import shutil
import time

import torch

from memfit.batches import batch_tensors, forward
from memfit.cli.bench.common import in_own_process, paired_ratio, rounds_for, table
from memfit.device.measure import track_memory
from memfit.device.torch_private import FakeTensorMode, dynamo_reset, inductor_config, mem_tracker
from memfit.messages import first_line, whole_words

__all__ = ["CAPTURE_TARGET", "compile_seconds", "compile_times", "compiled_columns", "compiled_table",
           "compiled_verdicts", "memtracker_columns", "with_compile_times"]

CAPTURE_TARGET = 1 / 3          # the first plan (capture + placement) at most a third of a user's first compile


def _peak(fn, x) -> int:
    with torch.inference_mode(), track_memory(x.device) as mem:
        out = fn(x)
        del out
    return mem.peak


def _no_compiler(x: torch.Tensor) -> str:
    """Why inductor cannot build here ("" when it can)."""
    if x.device.type == "cpu" and shutil.which("cc") is None and shutil.which("gcc") is None:
        return "unavailable: inductor's CPU code needs a C compiler (cc or gcc) on the PATH"
    return ""


def compiled_columns(model, x: torch.Tensor, planned_total: int, repeat: int) -> dict:
    """`torch.compile(model)` (inductor, static shapes) on x: its peak by the allocator and its latency against
    eager (called in turn), with the planned forward's peak over it. Its compile time is not taken here (this
    process has planned and measured before: its imports and caches are warm): `compile_seconds` takes it, in a
    fresh process. `compiled` says "unavailable: why" where inductor cannot build."""
    why = _no_compiler(x)
    if why:
        return {"compiled": why}
    inductor = inductor_config()
    dynamo_reset()
    try:
        with inductor.patch(fx_graph_cache=False, autotune_local_cache=False):
            compiled = torch.compile(model, backend="inductor", dynamic=False)
            with torch.inference_mode():
                compiled(x)
    except Exception as e:              # a contender that cannot run here is a row that says why
        return {"compiled": f"unavailable: {whole_words(first_line(e), 120)}"}
    peak = _peak(compiled, x)
    with torch.inference_mode():
        reps = rounds_for(lambda: compiled(x), seconds=0.5, at_least=3 * repeat, at_most=1000, device=x.device)
        _, t_compiled, ratio = paired_ratio(lambda: model(x), lambda: compiled(x), repeat=reps, warmup=2,
                                            device=x.device, what="compiled / eager")
    return {"compiled": "inductor", "compiled_peak": peak, "planned/compiled": planned_total / max(peak, 1),
            "vs compiled": "PASS" if planned_total <= peak else "MISS", "compiled_ms": 1e3 * t_compiled,
            "compiled_latency": ratio}


# inductor's caches of whole compiled graphs, off: the time is that of compiling, not of loading a past result
_NO_GRAPH_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def compile_seconds(build, batch: int, cache_dir: str) -> dict:
    """Seconds of a user's first `torch.compile(model)(x)` (inductor, static shapes), to be called in a fresh
    process (`build()` -> (model, make_input)): torch's lazy imports and inductor's first-use set-up are in it,
    as they are in a first `plan`. inductor's C++ kernels are built into, or loaded from, `cache_dir`: an empty
    folder gives a fully cold compile (what a user's first run meets), one a compile has filled gives a compile
    with its C++ kernel cache warm. Its FX graph and AOT autograd caches are off either way. {"compile_s": s},
    or {"compiled": "unavailable: why"}."""
    os.environ.update({"TORCHINDUCTOR_CACHE_DIR": cache_dir, **_NO_GRAPH_CACHES})   # read when inductor first runs
    model, make_input = build()
    x = make_input(batch)
    why = _no_compiler(x)
    if why:
        return {"compiled": why}
    t0 = time.perf_counter()
    try:
        compiled = torch.compile(model, backend="inductor", dynamic=False)
        with torch.inference_mode():
            compiled(x)
    except Exception as e:              # a contender that cannot run here is a row that says why
        return {"compiled": f"unavailable: {whole_words(first_line(e), 120)}"}
    return {"compile_s": time.perf_counter() - t0}


def compile_times(build, batch: int, inductor_dir: str) -> dict:
    """torch.compile's first call at `batch`, each in a fresh process as a user's first run is (as a row's `plan_s`
    is the first plan of its process): fully cold (an empty inductor cache in `inductor_dir`, so its C++ kernels are
    built) and then again with those C++ kernels on disk (FX graph and AOT autograd caches off in both). `build`:
    a picklable `() -> (model, make_input)` (a `functools.partial` of a module-level builder)."""
    cold = in_own_process(compile_seconds, build, batch, inductor_dir)
    if "compile_s" not in cold:
        return cold
    warm = in_own_process(compile_seconds, build, batch, inductor_dir)
    return {"compile_cold_s": cold["compile_s"], "compile_warm_s": warm.get("compile_s", math.nan)}


def with_compile_times(rows: list[dict], times: dict) -> None:
    """Put `compile_times`' figures on the last of one model's rows (the batch they were taken at), with the first
    plan of its process (`plan_s` of its first row) over them."""
    if "compile_cold_s" in times:
        plan_s = rows[0]["plan_s"]
        rows[-1].update(times, first_plan_s=plan_s, **{"plan/cold": plan_s / times["compile_cold_s"],
                                                       "plan/warm": plan_s / times["compile_warm_s"]})
    elif times:
        rows[-1].update(times)


def compiled_verdicts(rows: list[dict]) -> list[str]:
    """The targets against torch.compile, each PASS or MISS with the rows that miss it: planned peak <= compiled
    peak (the rows it ran on), and the first plan <= `CAPTURE_TARGET` of a fully cold compile (the models timed).
    [] where torch.compile did not run."""
    out = []
    vs = [r for r in rows if "planned/compiled" in r]
    if vs:
        miss = [f"{r['model']}/{r['batch']} ({r['planned/compiled']:.3f})" for r in vs if r["planned/compiled"] > 1]
        out.append(f"planned peak <= torch.compile's for every model ({len(vs)} rows): "
                   f"{'PASS' if not miss else 'MISS ' + ', '.join(miss)}")
    timed = [r for r in rows if "plan/cold" in r]
    if timed:
        slow = [f"{r['model']} ({r['plan/cold']:.2f})" for r in timed if r["plan/cold"] > CAPTURE_TARGET]
        warm = f"{min(r['plan/warm'] for r in timed):.2f}-{max(r['plan/warm'] for r in timed):.2f}"
        out.append(f"first plan <= {CAPTURE_TARGET:.2f} of a fully cold compile (a user's first; {warm} of one with "
                   f"the C++ kernel cache warm) for every model: {'PASS' if not slow else 'MISS ' + ', '.join(slow)}")
    return out


def compiled_table(rows: list[dict]) -> str:
    """The rows torch.compile ran beside, its columns side by side with the planned ones ("" where none)."""
    vs = [r for r in rows if "compiled" in r]
    if not vs:
        return ""
    return ("# torch.compile (inductor, static shapes), peaks by the allocator; planned = arena + unplanned.\n"
            "# first_plan_s: the first plan (capture at the first batch + placement) in a fresh process;\n"
            "# compile: the first compiled call in a fresh process, FX graph and AOT autograd caches off;\n"
            "#   compile_cold_s: inductor's cache empty, its C++ kernels built (what a user's first run meets);\n"
            "#   compile_warm_s: the same with those C++ kernels on disk (a later run, FX graph cache off);\n"
            f"# target plan/cold <= {CAPTURE_TARGET:.2f}: judged on the cold compile, the one a user meets first\n"
            + table(vs, ["model", "batch", "planned_total", "compiled_peak", "planned/compiled", "vs compiled",
                         "compiled_ms", "compiled_latency", "first_plan_s", "compile_cold_s", "compile_warm_s",
                         "plan/cold", "plan/warm", "compiled"], bytes_columns={"planned_total", "compiled_peak"}))


def step(case, model, opt, x, y) -> None:
    """One training step as `bench train` measures it (gradients dropped first)."""
    opt.zero_grad(set_to_none=True)
    out = forward(model, x)
    loss = case.loss(out, y)
    loss.backward()
    opt.step()
    del out, loss


def memtracker_columns(case, n: int, optimizer_of, measured: int) -> dict:
    """PyTorch's `MemTracker` (torch.distributed._tools.mem_tracker) predicting the peak of the training
    step at batch n as it is meant to: the model, optimizer and batch made under `FakeTensorMode`, one step
    run untracked (it makes AdamW's state), the next tracked: its peak of every tensor it saw. One prediction
    per batch size (memfit's model answers every size from one call). `measured` is the real step's peak."""
    MemTracker = mem_tracker()
    t0 = time.perf_counter()
    try:
        with FakeTensorMode():
            model = case.make()
            opt = optimizer_of(model)
            x, y = case.batch(n)
            step(case, model, opt, x, y)          # untracked: AdamW's state exists, as at the real second step
            tracker = MemTracker()                # it tracks one iteration per instance
            tracker.track_external(model, opt, *batch_tensors(x), *batch_tensors(y))
            with tracker:
                step(case, model, opt, x, y)
            peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    except Exception as e:              # a contender that cannot run this model is a row that says why
        return {"MemTracker": f"unavailable: {whole_words(first_line(e), 100)}"}
    return {"MemTracker": "fake tensors", "MemTracker/meas": peak / measured, "MemTracker s": time.perf_counter() - t0}

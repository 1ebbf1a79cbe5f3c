"""Training benchmark: the training-step memory model against real steps, and exact accumulation.

Ten models: memfit's zoo (MLP, LeNet, ResNet-18, MobileNetV2, U-Net, a transformer block) and
`transformers` models built from configs with random weights (BERT, GPT-2, which torch.export cannot
capture, ViT, ConvNeXt; skipped when `transformers` is not installed), AdamW, two batch sizes each.

1. peak: `memfit.memory_model(train=True)` against the bytes the allocator serves to real training steps
   (`memfit.device.measure.track_memory`, on the CPU from its allocation events, inside kernels too:
   parameters, gradients, AdamW state, the batch, and the peak of zero_grad + forward + loss + backward +
   step, the larger of the first two steps). Target: predicted / measured in [1.00, 1.05] on every row
   (below 1 would be an out-of-memory error). Beside it, PyTorch's `MemTracker` on fake tensors (one run
   per batch size), its predicted / measured and its cost (`memfit.cli.bench.contenders`).
2. max batch: `memfit.max_batch_size(train=True)` for an emulated device of 1.5x the measured peak at
   the larger size, against the largest batch whose real step fits it (bisection on the measured
   figure). Target >= 0.9, and the predicted size really fits (0 out-of-memory errors).
3. cost: per small model, the first `memory_model` call for a fresh model (nothing cached) and its first answer
   at the larger size against one real step at the largest batch that really fits the emulated device
   (information: these steps take milliseconds, a fake run's Python per op does not). The cost table
   (`memfit.cli.bench.train_cost`) times a typical user's three-block CNN and BERT and GPT-2 768 wide (12 layers;
   2 with --quick): the memory model against one real step at the batch (target: at most 3 s on the CNN, at most
   one real step at width 768) and `max_batch_size(train=True)` against one real step at the size it answers.
4. accumulation: `memfit.accumulate` in micro-batches of about a third of the batch (an uneven last
   one) against one plain full-batch step: the largest gradient difference relative to each tensor's
   largest gradient, floored at 1e-3 of the model's largest (target <= 1e-4: float32 reassociation);
   and the step time of accumulate at the auto micro-batch under a budget the whole batch fits
   against the plain step: the two called in turn, the median over rounds of their ratio (target >= 0.9x).
   BatchNorm is put in eval mode for this row (accumulate refuses batch statistics), dropout is 0.

A broad sweep of the memory model alone, on `transformers` architectures of every common kind:
`--architectures` (`memfit.cli.bench.architectures`). memfit's per-step cost against a hand-written micro-batch
loop: `--overhead` (`memfit.cli.bench.step_overhead`).

Run:
    memfit bench train --architectures   # the memory model on 19 transformers architectures (about 30 s)
    memfit bench train --overhead        # accumulate and plan.step against a hand-written loop (minutes)
    memfit bench train --quick           # eight light models, small sizes (a few minutes on 2 busy cores)
    memfit bench train --cost --quick    # the cost table alone: memory model and max_batch_size / one real step
    memfit bench train     # batch 8 and 32
    memfit bench train --quick --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from memfit.accumulation.run import accumulate
from memfit.budget import format_bytes
from memfit.cli.bench.architectures import ARCHITECTURES
from memfit.cli.bench.architectures import run as run_architectures
from memfit.cli.bench.common import machine_header, median_time, paired_ratio, rounds_for, spread_warning, table
from memfit.cli.bench.contenders import memtracker_columns
from memfit.cli.bench.step_overhead import NAMES as OVERHEAD_NAMES
from memfit.cli.bench.step_overhead import run as run_overhead
from memfit.cli.bench.train_cases import Case, cost_cases, hf_cases, on_device, zoo_cases
from memfit.cli.bench.train_cost import HEADING, cost_row, cost_verdicts
from memfit.cli.bench.train_cost import run as run_cost
from memfit.cli.bench.train_steps import (
    accumulate_peak,
    adamw,
    bn_eval,
    grad_rel_error,
    largest_really_fitting,
    measured_peak,
    plain_step,
)
from memfit.cli.options import device_arg
from memfit.memory.micro_batch import training_peak

TARGETS = {"peak_low": 1.00, "peak_high": 1.05, "max_batch": 0.9, "grad_rel": 1e-4, "step_time": 0.9}


# ---- the memory model (memfit.memory_model(train=True)) ---------------------------------------------------
def memory_model_api() -> tuple[Callable | None, str]:
    """(memfit's training memory model, its name): `memfit.memory_model(train=True)`, else the fake-tensor
    step model it is built on (`memfit.memory.step_model.step_memory_model`), else (None, why)."""
    import inspect

    import memfit
    mm = getattr(memfit, "memory_model", None)
    if mm is not None and "train" in inspect.signature(mm).parameters:
        return mm, "memfit.memory_model(train=True)"
    try:
        from memfit.memory.step_model import step_memory_model
    except ImportError:
        return None, "this memfit has no training memory model"
    return step_memory_model, "memfit.memory.step_model.step_memory_model"


def predict(case: Case, sizes=()):
    """(the memory model of a training step of a fresh model, the seconds it took: the first prediction for
    this model, nothing cached, and its first answer at each of `sizes`: the kernels' workspaces are measured on
    the real kernels at each batch size asked about, the first time it is asked)."""
    mm_fn, _ = memory_model_api()
    model = case.make()
    x, y = case.batch(2)
    t0 = time.perf_counter()
    mm = mm_fn(model, x, train=True, optimizer=adamw(model), loss_fn=case.loss, target=y)
    for n in sizes:
        mm.total_bytes(n)
    return mm, time.perf_counter() - t0


def predicted_max_batch(case: Case, mm, budget: int) -> tuple[int, str]:
    """`memfit.max_batch_size(train=True)` when this memfit has it, else the same search on `mm`."""
    import inspect

    import memfit
    from memfit.budget import largest_fitting
    if "train" in inspect.signature(memfit.max_batch_size).parameters:
        model = case.make()
        x, y = case.batch(2)
        try:
            return memfit.max_batch_size(model, x, budget, train=True, optimizer=adamw(model), loss_fn=case.loss,
                                         target=y), "max_batch_size"
        except MemoryError:                      # BudgetExceeded: not one sample fits
            return 0, "max_batch_size"
    return largest_fitting(mm.total_bytes, budget, 2**20), "largest n with total_bytes(n) <= budget"


# ---- rows ---------------------------------------------------------------------------------------------------
def memory_rows(case: Case, sizes, room: float = 1.5, repeat: int = 3, contenders: bool = True) -> list[dict]:
    measured = [measured_peak(case, n) for n in sizes]
    mm, pred_s = predict(case, sizes[-1:])
    budget = int(room * measured[-1])
    mbs, _ = predicted_max_batch(case, mm, budget)
    best, fits = largest_really_fitting(case, budget, mbs)
    model = case.make()
    opt = adamw(model)
    x, y = case.batch(max(best, 1))
    step_s = median_time(lambda: plain_step(model, opt, x, y, case.loss), repeat=repeat,    # what a trial costs
                         device=next(model.parameters()).device)
    return [{"model": case.name, "batch": n, "measured": format_bytes(m), "predicted": format_bytes(mm.total_bytes(n)),
             "pred/meas": mm.total_bytes(n) / m, "peak in": mm.peak_phase(n) if hasattr(mm, "peak_phase") else "",
             "budget": format_bytes(budget), "max batch": mbs, "largest fits": best, "max/largest": mbs / max(best, 1),
             "OOM at max": 0 if fits else 1, "predict s": pred_s, "step s": step_s, "predict/step": pred_s / step_s,
             **(memtracker_columns(case, n, adamw, m) if contenders else {})}
            for n, m in zip(sizes, measured, strict=True)]


def accumulation_row(case: Case, n: int, repeat: int, auto: bool) -> dict:
    """Gradient of accumulate (micro-batches of about n/3) against one plain step, and the step times; with
    the memory model, `auto` under a budget just large enough for micro-batches of n/4 (measured, + 4 KiB): the
    size it picks and the real peak there."""
    ref = bn_eval(case.make())
    mod = bn_eval(case.make())
    mod.load_state_dict(ref.state_dict())
    x, y = case.batch(n)
    ref_opt, opt = adamw(ref), adamw(mod)
    plain_step(ref, ref_opt, x, y, case.loss)
    micro = max(1, math.ceil(n / 3))
    accumulate(mod, opt, (x, y), case.loss, micro_batch=micro)
    rel = grad_rel_error(ref, mod)
    budget = "1TiB"           # the whole batch fits: auto must choose it and cost nothing extra
    mode = "auto" if auto else n
    r = accumulate(mod, opt, (x, y), case.loss, budget=budget, micro_batch=mode)      # warm (and chooses)
    dev = next(ref.parameters()).device
    plain = lambda: plain_step(ref, ref_opt, x, y, case.loss)
    acc = lambda: accumulate(mod, opt, (x, y), case.loss, budget=budget, micro_batch=mode)
    rounds = rounds_for(plain, seconds=0.5, at_least=repeat, at_most=200, device=dev)
    t_acc, t_plain, ratio = paired_ratio(acc, plain, repeat=rounds, warmup=2, device=dev,
                                         what=f"{case.name} plain / accumulate")
    row = {"model": case.name, "batch": n, "micro": f"{micro} ({-(-n // micro)} parts)", "grad rel err": rel,
           "auto micro": r.micro_batch if auto else f"{n} (given: no memory model)", "plain s": t_plain,
           "accumulate s": t_acc, "plain/accumulate": ratio}
    if auto:
        # measured in a loop's steady state: the gradients of the step before held on entry (accumulate lets them
        # go as it begins, as zero_grad does, and counts none)
        quarter = max(1, math.ceil(n / 4))
        real, _ = accumulate_peak(mod, opt, x, y, case.loss, grads_held=True, micro_batch=quarter)
        budget = real + 4096    # room for accumulate's own scalars, which the prediction counts at their largest
        # what auto weighs the budget against there (the fake runs are made, and kept, by auto's choice anyway)
        predicted = training_peak(mod, opt, case.loss, x, y)[0](quarter)
        if dev.type == "cuda":  # predictions there add the allocator's stated margin: a measured budget is below
            budget = max(budget, predicted)
        row.update({"tight budget": format_bytes(budget), "micro fits": quarter,
                    "pred/real at micro fits": f"{predicted / real:.4f} ({predicted - real:+d} B)"})
        try:
            accumulate(mod, opt, (x, y), case.loss, budget=budget)       # chooses (the fake runs: not measured)
            peak, r = accumulate_peak(mod, opt, x, y, case.loss, grads_held=True, budget=budget)
        except MemoryError as e:                                  # refused: a row that says so, and a MISS
            row.update({"auto picks": f"refused ({type(e).__name__})", "real/budget": math.inf})
            return row
        row.update({"auto picks": r.micro_batch, "real/budget": peak / budget})
    return row


def run(sizes=(8, 32), quick: bool = False, repeat: int = 3, as_json: bool = False, models=None,
        device="cpu") -> dict:
    dev = torch.device(device)
    print(machine_header(dev))
    torch.manual_seed(0)
    cases = [on_device(c, dev) for c in zoo_cases() + hf_cases(seq=32 if quick else 64)]
    realistic = not models                # the predict-cost table runs unless a subset of models is asked for
    if quick and not models:          # the eight light ones: ResNet-18 and MobileNetV2 steps take seconds each
        models = [c.name.split(" ")[0] for c in cases if c.name not in ("resnet18", "mobilenet_v2")]
    if models:
        cases = [c for c in cases if c.name.split(" ")[0] in models]
    elif len(cases) < 10:
        print("# transformers is not installed: its four models are skipped (pip install 'memfit[dev]')")
    mm_fn, mm_name = memory_model_api()
    have_mm = mm_fn is not None
    mem_rows, acc_rows = [], []
    for case in cases:
        t0 = time.perf_counter()
        if have_mm:
            # a step of these models takes milliseconds: a median of 5 costs little and steadies predict/step
            mem_rows += memory_rows(case, sizes, room=1.2 if quick else 1.5, repeat=5)
        acc_rows.append(accumulation_row(case, sizes[-1], repeat, auto=have_mm))
        print(f"# {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    cost_rows = []
    if have_mm and realistic:
        for case, n, budget in cost_cases(quick):
            t0 = time.perf_counter()
            cost_rows.append(cost_row(on_device(case, dev), n, budget, repeat=2 if quick else 4,
                                       warmup=0 if quick else 1))
            print(f"# {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(f"# training-step memory, AdamW, batch sizes {list(sizes)}; emulated device = {1.2 if quick else 1.5}x the "
          f"measured peak at {sizes[-1]}")
    if have_mm:
        print(f"# predicted by {mm_name}; predict/step: one memory-model call against one real step at the "
              "largest batch that fits (what finding it by trial costs at the least)")
        print(table(mem_rows))
        if cost_rows:
            print(HEADING)
            print(table(cost_rows))
    else:
        print(f"not available: {mm_name}; the peak, max-batch and predict-cost targets are not measured")
    print(f"# accumulation at batch {sizes[-1]}: gradient vs one plain step; step time at the auto micro-batch "
          "(budget 1TiB: the whole batch fits) vs the plain step; tight budget: the measured peak of accumulate "
          "in micro-batches of a quarter (micro fits) + 4 KiB, the previous step's gradients held on entry (the "
          "steady state auto's choice counts), auto's prediction there over that peak, the size auto picks and "
          "its real peak")
    print(table(acc_rows))
    _verdicts(mem_rows, acc_rows, have_mm, cost_rows)
    warning = spread_warning()
    if warning:
        print(warning)
    out = {"memory": mem_rows, "accumulation": acc_rows, "predict_cost": cost_rows, "memory_model": have_mm}
    if as_json:
        print(json.dumps(out, default=str))
    return out


def _line(ok: bool, text: str) -> None:
    print(f"{'PASS' if ok else 'MISS'}  {text}")


def _verdicts(mem_rows, acc_rows, have_mm, cost_rows=()) -> None:
    t = TARGETS
    if have_mm:
        lo = min(r["pred/meas"] for r in [*mem_rows, *cost_rows])
        hi = max(r["pred/meas"] for r in [*mem_rows, *cost_rows])
        _line(lo >= t["peak_low"] and hi <= t["peak_high"],
              f"predicted / measured step peak in [{lo:.3f}, {hi:.3f}] (target within [1.00, 1.05])")
        worst = min(r["max/largest"] for r in mem_rows)
        _line(worst >= t["max_batch"], f"max_batch_size(train=True) / largest that fits: worst {worst:.2f} "
                                       "(target >= 0.9)")
        ooms = sum(r["OOM at max"] for r in mem_rows[::2])
        _line(ooms == 0, f"out-of-memory errors at the predicted size: {ooms} (target 0)")
        worst = max(mem_rows, key=lambda r: r["predict s"])
        print(f"INFO  the memory model of the small models above (once each, the first in the process included): "
              f"worst {worst['predict s']:.2f} s ({worst['model']}), {max(r['predict/step'] for r in mem_rows):.1f}x "
              "one real step at most (their steps take milliseconds; the targets are in the cost table's lines)")
        if cost_rows:
            cost_verdicts(cost_rows, _line)
        tracked = [r for r in mem_rows if "MemTracker/meas" in r]
        if tracked:                    # the contender, side by side: not a target, a comparison
            lo, hi = min(r["MemTracker/meas"] for r in tracked), max(r["MemTracker/meas"] for r in tracked)
            mine = [r["pred/meas"] for r in tracked]
            cost = sorted(r["MemTracker s"] / r["predict s"] for r in tracked)[len(tracked) // 2]
            print(f"INFO  PyTorch's MemTracker (fake tensors, one run per batch size): predicted / measured in "
                  f"[{lo:.3f}, {hi:.3f}] where memfit's is in [{min(mine):.3f}, {max(mine):.3f}] on the same rows; "
                  f"one MemTracker prediction / memfit's model (every size): median {cost:.2f}x; "
                  f"{sum('MemTracker/meas' not in r for r in mem_rows)} rows it could not run")
    else:
        for what in ("predicted / measured step peak", "max_batch_size(train=True) / largest that fits",
                     "out-of-memory errors at the predicted size", "predicting / one real step"):
            print(f"N/A   {what}: not available (no training memory model in this memfit)")
    rel = max(r["grad rel err"] for r in acc_rows)
    _line(rel <= t["grad_rel"], f"accumulated gradient vs full batch: max relative error {rel:.2e} (target <= 1e-4)")
    speed = min(r["plain/accumulate"] for r in acc_rows)
    _line(speed >= t["step_time"], f"step time, plain / accumulate at auto: worst {speed:.2f}x (target >= 0.9x)")
    tight = [r for r in acc_rows if "real/budget" in r]
    if tight:
        over = max(r["real/budget"] for r in tight)
        small = min(r["auto picks"] / r["micro fits"] if isinstance(r["auto picks"], int) else 0 for r in tight)
        _line(over <= 1.0, f"accumulate under a tight budget: real peak / budget at most {over:.4f} (target <= 1); "
                           f"auto's micro-batch / one that fits at least {small:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="memfit bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,32", help="two comma-separated batch sizes")
    p.add_argument("--quick", action="store_true",
                   help="eight light models (no ResNet-18, MobileNetV2), batch 4 and 8, shorter sequences, an "
                        "emulated device of 1.2x, fewer timing repeats")
    p.add_argument("--models", default=None, help="comma-separated subset, e.g. mlp,gpt2 (default: all ten)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    p.add_argument("--architectures", nargs="?", const="all", default=None, metavar="NAMES",
                   help=f"instead: the memory model against real steps on {len(ARCHITECTURES)} transformers "
                        "architectures (causal LMs, seq2seq, speech, text, audio and image classifiers), or the "
                        "comma-separated ones named; on the CPU, no other option but --json")
    p.add_argument("--overhead", nargs="?", const="all", default=None, metavar="NAMES",
                   help="instead: memfit's per-step cost (accumulate, plan.step) against a hand-written micro-batch "
                        f"loop on {', '.join(OVERHEAD_NAMES)} (or the comma-separated ones named); --quick, --json")
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="cpu (default; peaks from memfit.device.measure's live bytes), cuda, cuda:1 (the caching "
                        "allocator's peak; predictions add its rounding and margin)")
    p.add_argument("--cost", action="store_true",
                   help="instead: the cost table alone (the memory model and max_batch_size against one real step on "
                        "a small CNN, BERT and GPT-2 768 wide); --quick (2 layers), --device, --json")
    a = p.parse_args(argv)
    if a.cost:
        if a.architectures is not None or a.overhead is not None or a.models or a.sizes != "8,32":
            p.error("--cost runs its own models and sizes; drop --architectures, --overhead, --models and --sizes")
        run_cost(quick=a.quick, device=a.device, as_json=a.json)
        return 0
    if a.architectures is not None:
        given = [f"--{k}" for k, v in (("quick", a.quick), ("models", a.models), ("sizes", a.sizes != "8,32"),
                                         ("device", a.device != "cpu")) if v]
        if given:
            p.error(f"--architectures runs on the CPU at batch 3 and 6 and takes no {', '.join(given)}; drop "
                    f"{'it' if len(given) == 1 else 'them'}")
        try:                   # unknown names raise before anything runs
            run_architectures(None if a.architectures == "all" else a.architectures.split(","), as_json=a.json)
        except ValueError as e:
            p.error(f"--architectures: {e}")
        return 0
    if a.overhead is not None:
        chosen = None if a.overhead == "all" else a.overhead.split(",")
        if chosen and set(chosen) - set(OVERHEAD_NAMES):
            p.error(f"--overhead: unknown {sorted(set(chosen) - set(OVERHEAD_NAMES))}; expected some of "
                    f"{OVERHEAD_NAMES}")
        run_overhead(chosen, quick=a.quick, as_json=a.json)
        return 0
    names = ["mlp", "lenet", "resnet18", "mobilenet_v2", "unet", "transformer", "bert", "gpt2", "vit", "convnext"]
    models = None if a.models is None else a.models.split(",")
    if models and set(models) - set(names):
        p.error(f"--models: unknown {sorted(set(models) - set(names))}; expected some of {names}")
    sizes = (4, 8) if a.quick else tuple(int(s) for s in a.sizes.split(","))
    if len(sizes) != 2 or min(sizes) < 1:
        p.error(f"--sizes: expected two batch sizes >= 1, e.g. 8,32; found {a.sizes!r}")
    run(sizes, quick=a.quick, repeat=3 if a.quick else 5, as_json=a.json, models=models, device=a.device)
    return 0


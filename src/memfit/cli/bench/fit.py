"""`memfit bench fit`: `memfit.fit` against a measured grid, on seven models at three budgets each.

Models (tiny, random weights, CPU): a CNN of conv blocks without and with BatchNorm (memfit's own), and from
`transformers` configs BERT (encoder), GPT-2 and Llama (causal LMs, `use_cache=False`), ViT and ConvNeXt; AdamW.
For each,
every point of the grid (micro-batch 1, 2, 4, ..., N x checkpointing 0, 1/4, 1/2, 3/4, all of the candidate
blocks; the whole batch only with BatchNorm) is run for real on a fresh copy of the model: its peak
(`memfit.device.measure`'s live bytes, the emulated device) and its step time relative to the plain step, every
point timed in turn in each round (ABBA order), each round's times over that round's plain step, the median over
rounds. Those relative times against the time model's predictions (`explain()`'s "time" column) over the whole
grid: the error distribution per model. Three budgets per model, from the predicted grid: one where the plain
step fits, one where micro-batching alone fits (not with BatchNorm), one where only checkpointing does (below
every micro-batch without checkpointing, where checkpointing lowers the least peak by at least 1%). Per row:
- the plan's real peak <= the budget (target: every row, 0 out-of-memory errors) in two training loops, one
  calling `optimizer.zero_grad()` before each `plan.step` and one not ("real", "real zg": the larger is the real
  peak), and predicted / real peak (target [1.00, 1.05]);
- the plan's setting against the fastest grid point whose real peak fits the budget (target >= 0.95x): the
  grid's relative times only shortlist the points within 30% of the fastest that fits; each of those is then
  timed against the plan's own setting, both run as the grid runs them (accumulate on a fresh copy), in ABBA pairs
  of rounds (`paired_ratios`: the median over pairs of that point's step time / the setting's; "fastest/own"; more
  rounds, up to `MAX_ROUNDS`, while the median's 95% interval holds the 0.95 target: `paired_ratios_until`);
  that setting is timed against `plan.step` too ("own/step": what plan.step's own checks per step cost), and
  "fastest/step" (the fastest grid point over plan.step, the same target) is printed beside it;
- `accumulate(micro_batch="auto")` alone at the budget, its step time over the plan's (the speed-up, paired);
- the plan's gradient against one full-batch step (max relative error, target <= 1e-4);
- the same choice in repeated fits (`--repeat`, 5; 2 with `--quick`) in a process of their own, each on a fresh
  model with what fit keeps across models dropped (kernel timings, the host's chain), at the default thread
  count ("same": how many chose what most did); fit's own cost: the first of those fits' seconds (nothing kept
  from any fit before), over one real plain step (target: "fit s" under 10 s; the 3x target is `--wide`'s).

Times are the calling thread's CPU time with one intra-op thread (`memfit.fitting.timing.clock`: everything of a
CPU step runs on the calling thread, and other processes' turns on the core are left out: on a VM at load 10 a
step's wall time was 2.4x its CPU time, which held within a few percent), else the wall clock.

Run:
    memfit bench fit --quick        # batch 8, eight timing rounds (a few minutes on 2 busy cores)
    memfit bench fit                # batch 16, twelve rounds
    memfit bench fit --models cnn,gpt2
    memfit bench fit --quick --bf16 # also the bf16 lever's alternatives and plans (`fit_bf16`)
    memfit bench fit --wide         # fit's cost at training widths over one real step (`fit_wide`)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import warnings

import torch

import memfit
from memfit.batches import forward
from memfit.cli.bench.common import (
    in_own_process,
    in_turn,
    machine_header,
    median,
    paired_ratios,
    paired_ratios_until,
    spread,
    spread_warning,
    table,
)
from memfit.cli.bench.train_cases import Case, fit_cases
from memfit.cli.bench.train_steps import grad_rel_error, held_bytes
from memfit.device.measure import track_memory
from memfit.fitting.checkpointing import checkpointed
from memfit.fitting.timing import clock

TARGETS = {"peak_low": 1.00, "peak_high": 1.05, "time": 0.95, "grad_rel": 1e-4}
SHORTLIST = 1.30      # grid points within this factor of the fastest fitting grid median are timed against the plan
GRID_SECONDS = 8.0    # CPU seconds of grid rounds per model (within 4 to 12 rounds)
PAIR_SECONDS = 3.0    # CPU seconds of ABBA rounds per comparison against the plan (within `repeat` to 48 rounds):
#                       pairs of steps on a busy 2-core VM spread 10-25%, so the median needs a few dozen
MAX_ROUNDS = 96       # rounds a comparison judged against the time target may take while its median's interval
#                       holds the target (a slow row's 14 rounds, 7 pairs: 0.936x and 1.090x in two runs)
NAMES = ["cnn", "cnn_bn", "bert", "gpt2", "llama", "vit", "convnext"]
CHECKPOINT_GAIN = 0.01  # the "only checkpointing" budget needs the least unchecked peak 1% above the least
#                         checkpointed one (the other models: 2.4% to 89%); BERT at batch 8: 32 B apart, both peaks
#                         the optimizer step's (micro-batch 1's float64 loss buffer of 8 against micro-batch 2's of 4):
#                         a budget between the two tested the memory model's bounds (16 B on the CPU; transformers'
#                         attention mask, counted where a batch without padding drops it), not checkpointing
QUICK_NAMES = ["cnn", "bert", "llama"]      # --quick: a CNN and two transformers, batch 8


# ---- real steps ------------------------------------------------------------------------------------------
def _fresh(case: Case):
    model = case.make()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, batch, loss, m: int, ckpt) -> None:
    with checkpointed(model, ckpt):
        memfit.accumulate(model, opt, batch, loss, micro_batch=m)


def real_peak(model, opt, batch, run, zero_grad: bool = False) -> int:
    """Live bytes at the peak of a training loop's steady state, held bytes included: after a warm-up step (AdamW's
    state exists), two steps of `run()` from no gradients, the second entered with the first's gradients held
    (a loop without zero_grad) or, with `zero_grad`, after `opt.zero_grad()`. Tracked from before the first of
    the two, so that the allocator's frees of every gradient are seen (the CPU tracker misses frees of blocks made
    before it)."""
    run()
    opt.zero_grad(set_to_none=True)
    held = held_bytes(model, opt, *batch)
    with track_memory("cpu") as mem:
        for _ in range(2):
            if zero_grad:
                opt.zero_grad(set_to_none=True)
            run()
    return held + mem.peak


def _clock():
    return clock(torch.device("cpu"))


def grid(case: Case, plan_all, batch, rounds: int) -> dict:
    """(micro-batch, checkpoint set) -> (real peak, step time relative to the plain step) for every alternative of
    the exhaustive plan, each on a fresh copy: all points timed in turn in each round (ABBA order; at least
    `rounds`, more up to 12 where a round is short), each round's times over that round's plain step, the median
    over rounds."""
    runs, peaks, once = {}, {}, 0.0
    for a in plan_all.alternatives:
        if a.setting.autocast is not None:
            continue
        model, opt = _fresh(case)
        k = (a.micro_batch, a.setting.checkpoint)
        runs[k] = lambda model=model, opt=opt, k=k: _step(model, opt, batch, case.loss, *k)
        peaks[k] = real_peak(model, opt, batch, runs[k])
        once += _once(runs[k], _clock())
    rounds = max(rounds, min(12, int(GRID_SECONDS / once)))
    times = in_turn(runs, rounds, 1, None, _clock())
    plain = times[(plan_all.n, ())]
    return {k: (peaks[k], median([t / p for t, p in zip(ts, plain, strict=True)], f"{case.name} grid"))
            for k, ts in times.items()}


def model_errors(case: Case, plan_all, measured: dict) -> dict:
    """The time model against the grid: predicted / measured relative step time - 1 at every point."""
    predicted = {(a.micro_batch, a.setting.checkpoint): a.time for a in plan_all.alternatives
                 if a.setting.autocast is None}
    errors = {k: predicted[k] / measured[k][1] - 1 for k in measured if k != (plan_all.n, ())}
    worst = max(errors, key=lambda k: abs(errors[k]))
    return {"model": case.name, "points": len(errors),
            "median |err|": statistics.median(abs(e) for e in errors.values()),
            "worst |err|": abs(errors[worst]), "worst at": _label(worst),
            "its pred": predicted[worst], "its meas": measured[worst][1],
            "mean err": statistics.mean(errors.values()), "errors": list(errors.values())}


def step_grad_error(case: Case, batch, plan_step) -> float:
    """`grad_rel_error` of the model after `plan_step(model, opt)` against one full-batch step's gradient."""
    ref, ropt = _fresh(case)
    ropt.zero_grad(set_to_none=True)
    case.loss(forward(ref, batch[0]), batch[1]).backward()
    model, opt = _fresh(case)
    plan_step(model, opt)
    return grad_rel_error(ref, model)


def budgets(plan_all, n: int) -> dict[str, int | str]:
    """Three budgets from the predicted grid: the plain step fits; micro-batching alone fits (the whole batch
    does not); only checkpointing fits (every micro-batch without checkpointing needs more, by at least
    `CHECKPOINT_GAIN`). Where there is no such budget, why not (a str)."""
    b = {(a.micro_batch, len(a.setting.checkpoint)): a.bytes for a in plan_all.alternatives
         if a.setting.autocast is None}
    plain = b[(n, 0)]
    least = min(v for (m, k), v in b.items() if k == 0)
    ckpt = min(v for (m, k), v in b.items() if k > 0) if any(k for _, k in b) else None
    micro = [v for (m, k), v in b.items() if k == 0 and m < n and v < plain]
    if ckpt is None:
        only = "no block to checkpoint (no checkpointed alternative)"
    elif ckpt >= least:
        only = "micro-batch 1 alone needs less than any checkpointed alternative"
    elif least < ckpt * (1 + CHECKPOINT_GAIN):
        only = (f"checkpointing lowers the least predicted peak by {least - ckpt} B only (under "
                f"{CHECKPOINT_GAIN:.0%}: within what the memory model counts above a real step)")
    else:
        only = (ckpt + least) // 2
    return {"plain fits": plain,
            "micro-batching fits": max(micro) if micro else
            "batch statistics (BatchNorm): no micro-batches" if all(m == n for m, _ in b) else
            "no micro-batch without checkpointing needs less than the plain step",
            "only checkpointing": only}


def _cold_fits(name: str, n: int, budget: int, fits: int) -> list[tuple]:
    """[(micro-batch, checkpointed modules, seconds, CPU seconds of the process)] of `fits` calls of `memfit.fit`
    on fresh models of case `name`, in a process that has fitted nothing before the first (`in_own_process`); before
    each later one, what fit keeps across models (kernel timings, the host's chain) is dropped (memory models and
    the step's costs are kept per model, and each model is fresh), so every call times its kernels and micro-steps
    anew."""
    from memfit.fitting import host, timing
    warnings.simplefilter("ignore")
    case = next(c for c in fit_cases() if c.name == name)
    batch = case.batch(n)
    out = []
    for _ in range(fits):
        for kept in (timing._SECONDS, timing._SPREAD, timing._RATES, host._MACHINES):
            kept.clear()
        model, opt = _fresh(case)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = memfit.fit(model, opt, batch, case.loss, budget)
        out.append((plan.micro_batch, plan.checkpoint, time.perf_counter() - t0, time.process_time() - c0))
    return out


def rows_for(case: Case, n: int, repeat: int, fits: int = 5) -> tuple[list[dict], dict]:
    batch = case.batch(n)
    model, opt = _fresh(case)
    plan_all = memfit.fit(model, opt, batch, case.loss, "1TiB", exhaustive=True)
    measured = grid(case, plan_all, batch, max(4, repeat // 2))
    errors = model_errors(case, plan_all, measured)
    plain_model, plain_opt = _fresh(case)
    plain_run = lambda: _step(plain_model, plain_opt, batch, case.loss, n, ())
    plain_run()
    now = _clock()
    plain_s = statistics.median(_once(plain_run, now) for _ in range(3))       # one real plain step, for fit's cost
    rows = []
    for what, budget in budgets(plan_all, n).items():
        if isinstance(budget, str):
            rows.append({"model": case.name, "budget": what, "plan": f"n/a: {budget}"})
            continue
        model, opt = _fresh(case)
        plan = memfit.fit(model, opt, batch, case.loss, budget)
        run = lambda plan=plan: plan.step(batch)
        loops = {zero: real_peak(model, opt, batch, run, zero_grad=zero) for zero in (False, True)}
        peak = max(loops.values())
        # the same call again, each in a process of its own: the choices, and fit's cost from nothing kept
        cold = in_own_process(_cold_fits, case.name, n, budget, fits)
        choices = collections.Counter((m, ckpt) for m, ckpt, *_ in cold)
        fit_s, fit_cpu = cold[0][2:]          # the first, in a process that had fitted nothing
        fitting = sorted((t, k) for k, (p, t) in measured.items() if p <= budget)
        mine = (plan.micro_batch, plan.checkpoint)
        # the grid shortlists; each point on the list is timed against the plan's own setting, both run as the
        # grid runs them (accumulate on a fresh copy), in ABBA pairs; that setting is timed against plan.step too
        shortlist = [k for t, k in fitting if t <= SHORTLIST * fitting[0][0] and k != mine][:3] if fitting else []
        run()
        pairs = max(repeat, min(48, int(PAIR_SECONDS / (2 * _once(run, now)))))
        own = _step_of(case, batch, mine)
        own_r, own_spread, own_rounds = _paired(run, own, pairs, f"{case.name} {what} own setting")
        ratios = {k: _paired(own, _step_of(case, batch, k), pairs, f"{case.name} {what} {_label(k)}")
                  for k in shortlist}
        best_k, (best_r, best_spread, _) = min(ratios.items(), key=lambda kv: kv[1][0],
                                               default=(mine, (1.0, 0.0, 0)))
        rounds = max([own_rounds, *(r for _, _, r in ratios.values())])
        auto = _auto(case, batch, budget)
        auto_r = _paired(run, auto, pairs, f"{case.name} {what} auto", judged=False)[0] if auto is not None else None
        predicted = {(a.micro_batch, a.setting.checkpoint): a.time for a in plan_all.alternatives}
        # the plan's choice on a fresh copy (plan.step is bound to the model it was made for, stepped above)
        rel = step_grad_error(case, batch, lambda m, o, p=plan: _step(m, o, batch, case.loss, p.micro_batch,
                                                                     p.checkpoint))
        fastest = min(1.0, best_r)              # the fastest grid point that fits / the plan's setting
        rows.append({"model": case.name, "budget": what, "bytes": budget,
                     "plan": f"m={plan.micro_batch} ckpt {len(plan.checkpoint)}/{len(plan.candidates)}",
                     "rounds": rounds,
                     "predicted": plan.peak_bytes, "real": loops[False], "real zg": loops[True],
                     "pred/real": plan.peak_bytes / peak,
                     "OOM": int(peak > budget), "fastest": _label(best_k) if best_r < 1 else "plan",
                     "fastest/own": fastest, "spread": max(best_spread, own_spread),
                     "own/step": own_r, "fastest/step": fastest * min(1.0, own_r) if fastest < 1 else min(1.0, own_r),
                     "its pred": predicted[best_k] / predicted[mine] if best_k in predicted else float("nan"),
                     "auto/step": auto_r if auto_r is not None else "refused", "grad rel": f"{rel:.1e}",
                     "same": f"{choices.most_common(1)[0][1]}/{fits}",
                     "choices": "; ".join(f"{_label(k)} x{c}" for k, c in choices.most_common()),
                     # by the clock the step was timed by: CPU time at one thread, else the wall clock
                     "fit/step": (fit_cpu if now is time.thread_time else fit_s) / plain_s, "fit s": fit_s,
                     "fit cpu s": fit_cpu})
    return rows, errors


def _once(fn, now) -> float:
    t0 = now()
    fn()
    return now() - t0


def _label(k) -> str:
    return f"m={k[0]} ckpt {len(k[1])}"


def _step_of(case: Case, batch, k):
    """A step of grid point k = (micro-batch, checkpoint set) on a fresh copy of the model, run once (warm)."""
    model, opt = _fresh(case)
    run = lambda: _step(model, opt, batch, case.loss, *k)
    run()
    return run


def _paired(plan_run, other, repeat: int, what: str, judged: bool = True) -> tuple[float, float, int]:
    """(median over ABBA rounds of other's step time / the plan's, the relative spread of those ratios, the rounds
    run). A ratio judged against the time target gets more rounds, up to `MAX_ROUNDS`, while its median's
    confidence interval still holds the target (`paired_ratios_until`)."""
    if judged:
        ratios = paired_ratios_until(plan_run, other, TARGETS["time"], repeat=repeat, at_most=MAX_ROUNDS,
                                     what=what, clock=_clock())
    else:
        ratios = paired_ratios(plan_run, other, repeat=repeat, warmup=1, what=what, clock=_clock())
    return statistics.median(ratios), spread(ratios), 2 * len(ratios)


def _auto(case: Case, batch, budget: int):
    """A step of accumulate(micro_batch='auto') alone at the budget on a fresh copy; None when it refuses."""
    model, opt = _fresh(case)
    run = lambda: memfit.accumulate(model, opt, batch, case.loss, budget=budget)
    try:
        run()
    except (MemoryError, ValueError):        # BudgetExceeded; BatchDependentError (BatchNorm)
        return None
    return run


def _line(ok: bool, text: str) -> None:
    print(f"{'PASS' if ok else 'MISS'}  {text}")


def run(names, n: int, repeat: int, as_json: bool, bf16: bool = False, fits: int = 5) -> list[dict]:
    print(machine_header("cpu"))
    what_clock = "the thread's CPU time" if _clock() is time.thread_time else "wall time"
    print(f"# memfit bench fit: batch {n}, AdamW; times by {what_clock}; the grid in {max(4, repeat // 2)} to 12 "
          f"rounds (every point in turn, over the plain step; about {GRID_SECONDS:.0f} s a model), then "
          f"{repeat + repeat % 2} to 48 rounds (ABBA pairs, about {PAIR_SECONDS:.0f} s each), more up to {MAX_ROUNDS} "
          "while a median's 95% interval holds the time target (column 'rounds': the most a row took), against "
          f"the plan; peaks from memfit.device.measure (live tensor bytes: the emulated device); {fits} fits of each "
          "row in a process of its own ('same'; 'fit s' the first, from nothing kept)")
    rows, errors = [], []
    for case in fit_cases():
        if case.name not in names:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # accumulate's notes on labels; said once in the table instead
            t0 = time.perf_counter()
            got, err = rows_for(case, n, repeat, fits)
            rows += got
            errors.append(err)
            print(f"# {case.name}: {len(got)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    print(table(rows, ["model", "budget", "bytes", "plan", "rounds", "predicted", "real", "real zg", "pred/real",
                       "OOM", "fastest", "fastest/own", "spread", "its pred", "own/step", "fastest/step", "auto/step",
                       "grad rel", "same", "fit s", "fit cpu s", "fit/step"],
                bytes_columns=("bytes", "predicted", "real", "real zg")))
    unsure = [r for r in rows if "same" in r and not r["same"].startswith(f"{fits}/")]
    for r in unsure:
        print(f"INFO  {r['model']} {r['budget']}: the fits chose {r['choices']}")
    done = [r for r in rows if "real" in r]
    t = TARGETS
    _line(all(r["OOM"] == 0 for r in done), f"real peak <= budget on every row, in loops with and without zero_grad: "
                                            f"{sum(r['OOM'] for r in done)} out-of-memory errors (target 0)")
    lo, hi = min(r["pred/real"] for r in done), max(r["pred/real"] for r in done)
    _line(t["peak_low"] <= lo and hi <= t["peak_high"], f"predicted / real peak in [{lo:.3f}, {hi:.3f}] "
                                                        "(target within [1.00, 1.05])")
    worst = min(done, key=lambda r: r["fastest/own"])
    _line(worst["fastest/own"] >= t["time"],
          f"the plan's setting vs the fastest grid point that fits, both run as the grid runs them (accumulate on a "
          f"fresh copy), ABBA pairs: worst {worst['fastest/own']:.3f}x ({worst['model']} {worst['budget']}, "
          f"{worst['fastest']}, predicted {worst['its pred']:.3f}x the plan's time; target >= {t['time']}x)")
    step = min(done, key=lambda r: r["fastest/step"])
    _line(step["fastest/step"] >= t["time"],
          f"plan.step vs the fastest grid point that fits: worst {step['fastest/step']:.3f}x ({step['model']} "
          f"{step['budget']}; target >= {t['time']}x); plan.step's own work per step (its checks of the batch, "
          f"model and optimizer) beside the same setting run by accumulate: own/step "
          f"{min(r['own/step'] for r in done):.3f}x to {max(r['own/step'] for r in done):.3f}x")
    print(f"INFO  ABBA pairs' spread (interquartile range / median of the pairs' ratios) up to "
          f"{max(r['spread'] for r in done):.0%}")
    _errors(errors)
    rel = max(float(r["grad rel"]) for r in done)
    _line(rel <= t["grad_rel"], f"gradient vs one full-batch step: max relative error {rel:.2e} (target <= 1e-4)")
    sped = [r["auto/step"] for r in done if isinstance(r["auto/step"], float)]
    if sped:
        print(f"INFO  accumulate(micro_batch='auto') alone / plan.step time: {min(sped):.2f}x to {max(sped):.2f}x "
              f"({sum(r['auto/step'] == 'refused' for r in done)} rows where accumulate alone refuses)")
    _line(not unsure, f"the same choice in {fits} fits, nothing kept between them: {len(done) - len(unsure)} of "
                      f"{len(done)} rows (target all)")
    slow = max(done, key=lambda r: r["fit cpu s"])
    _line(slow["fit cpu s"] < 10, f"fit's CPU seconds (a row's first fit, from nothing kept): at most "
                                  f"{slow['fit cpu s']:.1f} s ({slow['model']} {slow['budget']}; target under 10 s; "
                                  f"wall {slow['fit s']:.1f} s on this machine, load average {os.getloadavg()[0]:.1f})")
    print(f"INFO  fit's cost / one real plain step: {min(r['fit/step'] for r in done):.1f}x to "
          f"{max(r['fit/step'] for r in done):.1f}x (these models' steps take milliseconds; the 3x target is for "
          "training widths: `memfit bench fit --wide`)")
    if bf16:
        rows += _bf16(names, n)
    warn = spread_warning()
    if warn:
        print(warn)
    if as_json:
        print(json.dumps(rows + [{k: v for k, v in e.items() if k != "errors"} for e in errors]))
    return rows


def _errors(errors: list[dict]) -> None:
    """The time model's predicted / measured relative step time over every grid point: per model and overall."""
    every = [e for m in errors for e in m["errors"]]
    if not every:
        return
    total = {"model": "all", "points": len(every), "median |err|": statistics.median(map(abs, every)),
             "worst |err|": max(map(abs, every)), "mean err": statistics.mean(every)}
    print("time model: predicted / measured step time relative to the plain step, every grid point but the plain "
          "step (|err| = |predicted / measured - 1|)")
    print(table([*errors, total], ["model", "points", "median |err|", "worst |err|", "worst at", "its pred",
                                   "its meas", "mean err"]))


def _bf16(names, n: int) -> list[dict]:
    from memfit.cli.bench.fit_bf16 import bf16_section
    return bf16_section([c for c in fit_cases() if c.name in names], n, _fresh, real_peak, TARGETS, _line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="memfit bench fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"batch 8, eight timing rounds, two fits a row, the models "
                                                        f"{','.join(QUICK_NAMES)}")
    p.add_argument("--repeat", type=int, default=None, metavar="K",
                   help="fits of each row, nothing kept between them (default 5; 2 with --quick)")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--bf16", action="store_true", help="also the bf16 lever: its alternatives' predicted and real "
                                                       "peaks, and the plan where only bf16 fits")
    p.add_argument("--wide", action="store_true", help="instead: fit's cost at training widths (768 wide, 12 layers; "
                                                       "256 wide with --quick) over one real step (`fit_wide`)")
    a = p.parse_args(argv)
    if a.wide:
        from memfit.cli.bench.fit_wide import wide_rows
        print(machine_header("cpu"))
        wide_rows(a.quick, _line)
        return 0
    names = (QUICK_NAMES if a.quick else NAMES) if a.models is None else a.models.split(",")
    if set(names) - set(NAMES):
        p.error(f"--models: unknown {sorted(set(names) - set(NAMES))}; expected some of {NAMES}")
    fits = a.repeat if a.repeat is not None else 2 if a.quick else 5
    if fits < 1:
        p.error(f"--repeat: expected at least 1 fit a row; found {fits}")
    run(names, 8 if a.quick else 16, 8 if a.quick else 12, a.json, a.bf16, fits)
    return 0

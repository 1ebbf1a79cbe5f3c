"""`memfit bench fit`: `memfit.fit` against a measured grid, on six models at three budgets each.

Models (tiny, random weights, CPU): a CNN of conv blocks without and with BatchNorm (memfit's own), and from
`transformers` configs BERT (encoder), GPT-2 (causal LM, `use_cache=False`), ViT and ConvNeXt; AdamW. For each,
every point of the grid (micro-batch 1, 2, 4, ..., N x checkpointing 0, 1/4, 1/2, 3/4, all of the candidate
blocks; the whole batch only with BatchNorm) is run for real: its peak (`memfit.memory.measure`'s live bytes,
the emulated device) and its step time (median). Three budgets per model, from the predicted grid: one where
the plain step fits, one where micro-batching alone fits (not with BatchNorm), one where only checkpointing
does (below every micro-batch without checkpointing). Per row:
- the plan's real peak <= the budget (target: every row, 0 out-of-memory errors) and predicted / real peak
  (target [1.00, 1.05]);
- the plan's step time against the fastest grid point whose real peak fits the budget (target >= 0.95x): the
  grid's medians (each point timed on its own) only shortlist the points within 30% of the fastest that fits;
  each of those is then timed against the plan in ABBA rounds (`paired_ratio`: the median over rounds of
  that point's step time / the plan's, taken back to back, so a busy stretch of the machine cancels), and so
  is the plan's own setting on a fresh copy of the model ("self/plan": what two identical steps measure apart,
  the noise floor). A row below 0.95x is the time model's choice only where the winner's ratio is below
  self/plan by more than the rounds' spread;
- `accumulate(micro_batch="auto")` alone at the budget, its step time over the plan's (the speed-up, paired);
- the plan's gradient against one full-batch step (max relative error, target <= 1e-4);
- fit's own cost (seconds of `memfit.fit`, first call at that budget) over one real plain step.

Run:
    memfit bench fit --quick        # batch 8, eight timing rounds (a few minutes on 2 busy cores)
    memfit bench fit                # batch 16, twelve rounds
    memfit bench fit --models cnn,gpt2
    memfit bench fit --quick --bf16 # also the bf16 lever's alternatives and plans (`fit_bf16`)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.batches import batch_tensors, forward
from memfit.cli.bench.common import machine_header, median_time, paired_ratios, spread, spread_warning, table
from memfit.cli.bench.train_cases import Case, hf_cases
from memfit.fitting.checkpointing import checkpointed
from memfit.memory.measure import optimizer_state, track_memory, unique_bytes

TARGETS = {"peak_low": 1.00, "peak_high": 1.05, "time": 0.95, "grad_rel": 1e-4}
SHORTLIST = 1.30      # grid points within this factor of the fastest fitting grid median are timed against the plan
NAMES = ["cnn", "cnn_bn", "bert", "gpt2", "vit", "convnext"]


def _cnn(bn: bool):
    def block(cin, cout):
        norm = (lambda c: [nn.BatchNorm2d(c)]) if bn else (lambda c: [])
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), *norm(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, padding=1), *norm(cout), nn.ReLU())

    def make():
        torch.manual_seed(0)
        return nn.Sequential(block(3, 16), block(16, 16), block(16, 16), block(16, 16), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, 10)).train()
    return make


def cases() -> list[Case]:
    g = lambda n, k=0: torch.Generator().manual_seed(n * 31 + k)
    images = lambda n: (torch.randn(n, 3, 24, 24, generator=g(n)), torch.randint(0, 10, (n,), generator=g(n, 1)))
    out = [Case("cnn", _cnn(False), images, F.cross_entropy), Case("cnn_bn", _cnn(True), images, F.cross_entropy)]
    for c in hf_cases(seq=32):
        name = c.name.split()[0]
        if name == "gpt2":           # a key/value cache would be appended to again by a checkpointed block's rerun
            c = Case(name, (lambda make: lambda: _no_cache(make()))(c.make), c.batch, c.loss)
        out.append(Case(name, c.make, c.batch, c.loss))
    return out


def _no_cache(model):
    model.config.use_cache = False
    return model


# ---- real steps ------------------------------------------------------------------------------------------
def _fresh(case: Case):
    model = case.make()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model, opt, batch, loss, m: int, ckpt) -> None:
    with checkpointed(model, ckpt):
        memfit.accumulate(model, opt, batch, loss, micro_batch=m)


def real_peak(model, opt, batch, run) -> int:
    """Live bytes at the peak of `run()` (a step after a warm-up step: AdamW's state exists), held bytes included."""
    run()
    opt.zero_grad(set_to_none=True)
    held = unique_bytes([*model.parameters(), *model.buffers(), *optimizer_state(opt), *batch_tensors(batch[0]),
                         *batch_tensors(batch[1])])
    with track_memory("cpu") as mem:
        run()
    return held + mem.peak


def grid(case: Case, plan_all, batch, repeat: int) -> dict:
    """(micro-batch, checkpoint set) -> (real peak, median seconds) for every alternative of the exhaustive plan."""
    out = {}
    for a in plan_all.alternatives:
        if a.setting.autocast is not None:
            continue
        model, opt = _fresh(case)
        run = lambda model=model, opt=opt, a=a: _step(model, opt, batch, case.loss, a.micro_batch,
                                                      a.setting.checkpoint)
        peak = real_peak(model, opt, batch, run)
        out[(a.micro_batch, a.setting.checkpoint)] = (peak, median_time(run, repeat=repeat, warmup=0,
                                                                        what=f"{case.name} grid"))
    return out


def grad_rel_error(case: Case, batch, plan_step) -> float:
    """max over tensors of |g - g_ref| / max |g_ref| (floored at 1e-3 of the largest), g_ref one full-batch step."""
    ref, ropt = _fresh(case)
    ropt.zero_grad(set_to_none=True)
    case.loss(forward(ref, batch[0]), batch[1]).backward()
    model, opt = _fresh(case)
    plan_step(model, opt)
    top = max(float(p.grad.abs().max()) for p in ref.parameters() if p.grad is not None)
    return max(float((p.grad - q.grad).abs().max()) / max(float(q.grad.abs().max()), 1e-3 * top)
               for p, q in zip(model.parameters(), ref.parameters(), strict=True) if q.grad is not None)


def budgets(plan_all, n: int) -> dict[str, int | None]:
    """Three budgets from the predicted grid: the plain step fits; micro-batching alone fits (the whole batch
    does not); only checkpointing fits (every micro-batch without checkpointing needs more)."""
    b = {(a.micro_batch, len(a.setting.checkpoint)): a.bytes for a in plan_all.alternatives
         if a.setting.autocast is None}
    plain = b[(n, 0)]
    none = sorted(v for (m, k), v in b.items() if k == 0)
    ckpt = min(v for (m, k), v in b.items() if k > 0) if any(k for _, k in b) else None
    micro = [v for (m, k), v in b.items() if k == 0 and m < n and v < plain]
    only = (ckpt + none[0]) // 2 if ckpt is not None and ckpt < none[0] else None
    return {"plain fits": plain, "micro-batching fits": max(micro) if micro else None, "only checkpointing": only}


def rows_for(case: Case, n: int, repeat: int) -> list[dict]:
    batch = case.batch(n)
    model, opt = _fresh(case)
    plan_all = memfit.fit(model, opt, batch, case.loss, "1TiB", exhaustive=True)
    measured = grid(case, plan_all, batch, max(3, repeat // 2))      # it only shortlists: fewer repeats do
    plain_s = measured[(n, ())][1]          # one real plain step, for fit's cost
    rows = []
    for what, budget in budgets(plan_all, n).items():
        if budget is None:
            rows.append({"model": case.name, "budget": what, "plan": "n/a: " + (
                "batch statistics (BatchNorm): no micro-batches" if "micro" in what else
                "micro-batch 1 alone needs less than any checkpointed alternative")})
            continue
        model, opt = _fresh(case)
        t0 = time.perf_counter()
        plan = memfit.fit(model, opt, batch, case.loss, budget)
        fit_s = time.perf_counter() - t0
        run = lambda plan=plan: plan.step(batch)
        peak = real_peak(model, opt, batch, run)
        fitting = sorted((t, k) for k, (p, t) in measured.items() if p <= budget)
        mine = (plan.micro_batch, plan.checkpoint)
        # the grid's medians shortlist; each point on the list and the plan's own setting on a fresh copy (the
        # noise floor) are timed against the plan in ABBA rounds, ratios taken back to back
        shortlist = [k for t, k in fitting if t <= SHORTLIST * fitting[0][0] and k != mine][:3] if fitting else []
        run()
        ratios = {k: _paired(run, _step_of(case, batch, k), repeat, f"{case.name} {what} {_label(k)}")
                  for k in [mine, *shortlist]}
        self_ratio, self_spread = ratios.pop(mine)
        best_k, (best_r, best_spread) = min(ratios.items(), key=lambda kv: kv[1][0], default=(mine, (1.0, 0.0)))
        auto = _auto(case, batch, budget)
        auto_r = _paired(run, auto, repeat, f"{case.name} {what} auto")[0] if auto is not None else None
        predicted = {(a.micro_batch, a.setting.checkpoint): a.time for a in plan_all.alternatives}
        # the plan's choice on a fresh copy (plan.step is bound to the model it was made for, stepped above)
        rel = grad_rel_error(case, batch, lambda m, o, p=plan: _step(m, o, batch, case.loss, p.micro_batch,
                                                                     p.checkpoint))
        rows.append({"model": case.name, "budget": what, "bytes": budget,
                     "plan": f"m={plan.micro_batch} ckpt {len(plan.checkpoint)}/{len(plan.candidates)}",
                     "predicted": plan.peak_bytes, "real": peak, "pred/real": plan.peak_bytes / peak,
                     "OOM": int(peak > budget), "fastest": _label(best_k) if best_r < 1 else "plan",
                     "fastest/plan": min(1.0, best_r), "spread": max(best_spread, self_spread),
                     "self/plan": self_ratio,
                     "its pred": predicted[best_k] / predicted[mine] if best_k in predicted else float("nan"),
                     "auto/plan": auto_r if auto_r is not None else "refused", "grad rel": f"{rel:.1e}",
                     "fit/step": fit_s / plain_s, "fit s": fit_s})
    return rows


def shortfall_is_the_models(row: dict) -> bool:
    """A row's plan slower than another grid point beyond the noise: that point's paired ratio below the ratio
    of the plan's own setting on a fresh copy (two identical steps) by more than the rounds' spread."""
    return row["fastest/plan"] < row["self/plan"] * (1 - row["spread"])


def _label(k) -> str:
    return f"m={k[0]} ckpt {len(k[1])}"


def _step_of(case: Case, batch, k):
    """A step of grid point k = (micro-batch, checkpoint set) on a fresh copy of the model, run once (warm)."""
    model, opt = _fresh(case)
    run = lambda: _step(model, opt, batch, case.loss, *k)
    run()
    return run


def _paired(plan_run, other, repeat: int, what: str) -> tuple[float, float]:
    """(median over ABBA rounds of other's step time / the plan's, the relative spread of those ratios)."""
    ratios = paired_ratios(plan_run, other, repeat=repeat, warmup=1, what=what)
    return statistics.median(ratios), spread(ratios)


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


def run(names, n: int, repeat: int, as_json: bool, bf16: bool = False) -> list[dict]:
    print(machine_header("cpu"))
    print(f"# memfit bench fit: batch {n}, AdamW; grid medians of {max(3, repeat // 2)} runs shortlist, then "
          f"{repeat + repeat % 2} rounds (ABBA pairs) against the plan; peaks from memfit.memory.measure (live tensor "
          "bytes: the emulated device)")
    rows = []
    for case in cases():
        if case.name not in names:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # accumulate's notes on labels; said once in the table instead
            rows += rows_for(case, n, repeat)
    print(table(rows, ["model", "budget", "bytes", "plan", "predicted", "real", "pred/real", "OOM", "fastest",
                       "fastest/plan", "spread", "self/plan", "its pred", "auto/plan", "grad rel", "fit s",
                       "fit/step"],
                bytes_columns=("bytes", "predicted", "real")))
    done = [r for r in rows if "real" in r]
    t = TARGETS
    _line(all(r["OOM"] == 0 for r in done), f"real peak <= budget on every row: {sum(r['OOM'] for r in done)} "
                                            "out-of-memory errors (target 0)")
    lo, hi = min(r["pred/real"] for r in done), max(r["pred/real"] for r in done)
    _line(t["peak_low"] <= lo and hi <= t["peak_high"], f"predicted / real peak in [{lo:.3f}, {hi:.3f}] "
                                                        "(target within [1.00, 1.05])")
    worst = min(r["fastest/plan"] for r in done)
    _line(worst >= t["time"], f"plan's step time vs the fastest grid point that fits: worst {worst:.2f}x "
                              "(target >= 0.95x; paired ABBA ratios)")
    below = [r for r in done if r["fastest/plan"] < t["time"]]
    if below:
        model_s = [r for r in below if shortfall_is_the_models(r)]
        names = ", ".join(f"{r['model']} {r['budget']}" for r in model_s) or "none"
        print(f"INFO  {len(below)} rows below {t['time']}x: {len(model_s)} the time model's choice (the faster "
              f"point's ratio below self/plan by more than the rounds' spread: {names}), the rest within the noise")
    selfs = [r["self/plan"] for r in done]
    print(f"INFO  noise floor: the plan's own setting on a fresh copy / the plan, {min(selfs):.2f}x to "
          f"{max(selfs):.2f}x; rounds' spread up to {max(r['spread'] for r in done):.0%}")
    rel = max(float(r["grad rel"]) for r in done)
    _line(rel <= t["grad_rel"], f"gradient vs one full-batch step: max relative error {rel:.2e} (target <= 1e-4)")
    sped = [r["auto/plan"] for r in done if isinstance(r["auto/plan"], float)]
    if sped:
        print(f"INFO  accumulate(micro_batch='auto') alone / plan step time: {min(sped):.2f}x to {max(sped):.2f}x "
              f"({sum(r['auto/plan'] == 'refused' for r in done)} rows where accumulate alone refuses)")
    print(f"INFO  fit's cost / one real plain step: {min(r['fit/step'] for r in done):.1f}x to "
          f"{max(r['fit/step'] for r in done):.1f}x")
    if bf16:
        rows += _bf16(names, n)
    warn = spread_warning()
    if warn:
        print(warn)
    if as_json:
        print(json.dumps(rows))
    return rows


def _bf16(names, n: int) -> list[dict]:
    from memfit.cli.bench.fit_bf16 import bf16_rows
    rows = []
    for case in cases():
        if case.name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rows += bf16_rows(case, n, _fresh, real_peak)
    print(table(rows, ["model", "what", "bytes", "predicted", "real", "pred/real", "OOM"],
                bytes_columns=("bytes", "predicted", "real")))
    done = [r for r in rows if "real" in r]
    lo, hi = min(r["pred/real"] for r in done), max(r["pred/real"] for r in done)
    _line(TARGETS["peak_low"] <= lo and hi <= TARGETS["peak_high"],
          f"bf16: predicted / real peak in [{lo:.3f}, {hi:.3f}] over {len(done)} rows (target within [1.00, 1.05])")
    _line(all(r.get("OOM", 0) == 0 for r in done), "bf16: real peak <= budget where only bf16 fits: "
                                                   f"{sum(r.get('OOM', 0) for r in done)} out-of-memory errors")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="memfit bench fit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="batch 8, eight timing rounds")
    p.add_argument("--models", default=None, help=f"comma-separated subset of {','.join(NAMES)}")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--bf16", action="store_true", help="also the bf16 lever: its alternatives' predicted and real "
                                                       "peaks, and the plan where only bf16 fits")
    a = p.parse_args(argv)
    names = NAMES if a.models is None else a.models.split(",")
    if set(names) - set(NAMES):
        p.error(f"--models: unknown {sorted(set(names) - set(NAMES))}; expected some of {NAMES}")
    run(names, 8 if a.quick else 16, 8 if a.quick else 12, a.json, a.bf16)
    return 0

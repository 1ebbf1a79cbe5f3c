"""`memfit bench fit --bf16`: the bf16 lever's bytes against the allocator, on the models of `memfit bench fit`.

Per model, from `memfit.fit(..., levers=("bf16",), exhaustive=True)`: every bf16 alternative (micro-batch m of the
whole batch, forward and loss under bf16 autocast, as `FitPlan.step` runs it) is run for real and its peak
(`memfit.device.measure`'s live bytes, the larger of a loop with and one without `zero_grad`) set against the
predicted bytes (target: predicted / real in [1.00, 1.05]); and where one exists, the budget where only bf16 fits
(halfway between the least bf16 alternative and the least float32 one) gets the plan `fit` chooses, run through
`plan.step` (target: real peak <= budget).

Run:
    memfit bench fit --quick --bf16 --models cnn,bert
"""

from __future__ import annotations

import warnings

import torch

import memfit
from memfit.cli.bench.common import table
from memfit.cli.bench.train_cases import Case
from memfit.fitting.fitter import _cast_loss


def _bf16_step(case: Case, model, opt, batch, m: int) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):          # as FitPlan.step runs a bf16 plan
        memfit.accumulate(model, opt, batch, _cast_loss(case.loss), micro_batch=m)


def bf16_rows(case: Case, n: int, fresh, real_peak) -> list[dict]:
    """Rows of predicted and real peaks of the bf16 alternatives, and of the plan at the budget where only bf16
    fits (`fresh(case)` -> (model, AdamW); `real_peak(model, opt, batch, run, zero_grad)` -> bytes)."""
    def loops(model, opt, run) -> int:
        return max(real_peak(model, opt, batch, run, zero_grad=zero) for zero in (False, True))
    batch = case.batch(n)
    model, opt = fresh(case)
    plan_all = memfit.fit(model, opt, batch, case.loss, "1TiB", exhaustive=True, levers=("bf16",))
    rows = []
    for a in sorted((a for a in plan_all.alternatives if a.setting.autocast), key=lambda a: -a.micro_batch):
        model, opt = fresh(case)
        peak = loops(model, opt, lambda model=model, opt=opt, a=a: _bf16_step(case, model, opt, batch, a.micro_batch))
        rows.append({"model": case.name, "what": f"bf16 alternative m={a.micro_batch}", "predicted": a.bytes,
                     "real": peak, "pred/real": a.bytes / peak})
    least32 = min(a.bytes for a in plan_all.alternatives if a.setting.autocast is None)
    least16 = min(a.bytes for a in plan_all.alternatives if a.setting.autocast)
    if least16 >= least32:
        rows.append({"model": case.name, "what": "only bf16 fits: n/a (bf16 needs more than the least float32 "
                                                 "alternative)"})
        return rows
    budget = (least16 + least32) // 2
    model, opt = fresh(case)
    plan = memfit.fit(model, opt, batch, case.loss, budget, levers=("bf16",))
    peak = loops(model, opt, lambda: plan.step(batch))
    rows.append({"model": case.name, "what": f"only bf16 fits: plan m={plan.micro_batch} "
                                             f"{str(plan.autocast).removeprefix('torch.')}",
                 "bytes": budget, "predicted": plan.peak_bytes, "real": peak, "pred/real": plan.peak_bytes / peak,
                 "OOM": int(peak > budget)})
    return rows


def bf16_section(cases: list[Case], n: int, fresh, real_peak, targets: dict, line) -> list[dict]:
    """`bf16_rows` of every case, their table and PASS/MISS lines (`line(ok, text)`) against `targets`."""
    rows = []
    for case in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows += bf16_rows(case, n, fresh, real_peak)
    print(table(rows, ["model", "what", "bytes", "predicted", "real", "pred/real", "OOM"],
                bytes_columns=("bytes", "predicted", "real")))
    done = [r for r in rows if "real" in r]
    lo, hi = min(r["pred/real"] for r in done), max(r["pred/real"] for r in done)
    line(targets["peak_low"] <= lo and hi <= targets["peak_high"],
         f"bf16: predicted / real peak in [{lo:.3f}, {hi:.3f}] over {len(done)} rows (target within [1.00, 1.05])")
    line(all(r.get("OOM", 0) == 0 for r in done), "bf16: real peak <= budget where only bf16 fits: "
                                                  f"{sum(r.get('OOM', 0) for r in done)} out-of-memory errors")
    return rows

"""What the training memory model costs against one real step: `memfit bench train`'s cost table.

Per model (`train_cases.cost_cases`: a typical user's three-block CNN, BERT and GPT-2 768 wide), side by side in
one process:
- memory model: the first `memfit.memory_model(train=True)` of the model with its first answer at the batch (the
  kernels' workspaces are measured at each batch asked about), against one real training step at that batch;
- max_batch_size: `memfit.max_batch_size(train=True)` under a budget, against one real step at the size it
  answers (what finding that size by trial costs at the least).

Each prediction starts with nothing kept: the model's predictions and every kernel's measured bytes are forgotten
(`memfit.memory.cache.forget`, `memfit.memory.kernel_scratch.forget_measured`); what the process pays once (imports,
a kernel's first call) is paid before. Prediction and step run in turn, ABBA, and the ratio is the median over
pairs of rounds (`common.paired_ratio`): a busy stretch of a shared machine hits both alike.

Targets (issue 35, "fast enough to use"): the memory model of the small CNN in at most 3 s; at width 768, at most
one real step. max_batch_size's ratio is printed beside it, with no target: it runs the measured kernels at the
size it answers (and at the sizes its search asks about near it), about one real step of theirs each.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from memfit.budget import format_bytes, parse_bytes
from memfit.cli.bench.common import machine_header, paired_ratio, spread_warning, table
from memfit.cli.bench.train_cases import Case, cost_cases, on_device
from memfit.cli.bench.train_steps import adamw, measured_peak, plain_step

__all__ = ["HEADING", "TARGETS", "cost_row", "cost_verdicts", "run"]

TARGETS = {"cnn_seconds": 3.0, "wide_steps": 1.0, "wide": 768}
HEADING = ("# cost: the first memory_model(train=True) of a model (nothing kept) and its answer at the batch, and "
           "max_batch_size(train=True) in the budget, each against one real step (at the batch; at the size it "
           "answers), run in turn: medians of seconds and of paired ratios")


def _predict(case: Case, model, opt, x, y, n: int):
    """The memory model of a step as a first prediction (nothing kept), and its answer at n."""
    import memfit
    from memfit.memory.cache import forget
    from memfit.memory.kernel_scratch import forget_measured
    forget(model)
    forget_measured()
    mm = memfit.memory_model(model, x, train=True, optimizer=opt, loss_fn=case.loss, target=y)
    mm.total_bytes(n)
    return mm


def _largest(case: Case, model, opt, x, y, budget: int) -> int:
    """`memfit.max_batch_size(train=True)` as a first prediction (nothing kept)."""
    import memfit
    from memfit.memory.cache import forget
    from memfit.memory.kernel_scratch import forget_measured
    forget(model)
    forget_measured()
    return memfit.max_batch_size(model, x, budget, train=True, optimizer=opt, loss_fn=case.loss, target=y)


def cost_row(case: Case, n: int, budget: str | None, repeat: int, warmup: int = 1) -> dict:
    """The memory model's and max_batch_size's seconds against one real step (paired, `repeat` rounds after `warmup`),
    and the memory model's predicted / measured peak at n."""
    model = case.make()
    dev = next(model.parameters()).device
    opt = adamw(model)
    x2, y2 = case.batch(2)
    x, y = case.batch(n)
    measured = measured_peak(case, n)
    mm = _predict(case, model, opt, x2, y2, n)           # the process's first calls of these kernels: not timed
    step_s, model_s, model_ratio = paired_ratio(lambda: plain_step(model, opt, x, y, case.loss),
                                                lambda: _predict(case, model, opt, x2, y2, n), repeat=repeat,
                                                warmup=warmup, device=dev, what=f"{case.name} memory model / step")
    limit = parse_bytes(budget) if budget else int(1.5 * mm.total_bytes(n))
    largest = _largest(case, model, opt, x2, y2, limit)
    xb, yb = case.batch(largest)
    plain_step(model, opt, xb, yb, case.loss)             # a new size's first step (oneDNN's primitives): not timed
    big_s, search_s, search_ratio = paired_ratio(lambda: plain_step(model, opt, xb, yb, case.loss),
                                                 lambda: _largest(case, model, opt, x2, y2, limit), repeat=repeat,
                                                 warmup=warmup, device=dev, what=f"{case.name} max_batch_size / step")
    return {"model": case.name, "batch": n, "measured": format_bytes(measured),
            "predicted": format_bytes(mm.total_bytes(n)), "pred/meas": mm.total_bytes(n) / measured,
            "model s": model_s, "step s": step_s, "model/step": model_ratio,
            "budget": format_bytes(limit), "max batch": largest, "max_batch_size s": search_s,
            "step at max s": big_s, "max_batch_size/step": search_ratio}


def cost_verdicts(rows: list[dict], line) -> None:
    """PASS/MISS lines of the cost targets (`line(ok, text)` prints one)."""
    t = TARGETS
    for r in rows:
        if r["model"].startswith("cnn"):
            line(r["model s"] <= t["cnn_seconds"],
                 f"memory model of the small CNN ({r['model']}, batch {r['batch']}): {r['model s']:.2f} s, "
                 f"{r['model/step']:.2f}x one real step (target <= {t['cnn_seconds']:.0f} s)")
    wide = [r for r in rows if f"{t['wide']}x" in r["model"]]
    if wide:
        worst = max(wide, key=lambda r: r["model/step"])
        line(worst["model/step"] <= t["wide_steps"],
             f"memory model / one real step at width {t['wide']}: worst {worst['model/step']:.2f}x ({worst['model']}) "
             f"(target <= {t['wide_steps']:.0f}x)")
    searches = ", ".join(f"{r['model'].split(' ')[0]} {r['max_batch_size/step']:.2f}x (batch {r['max batch']})"
                         for r in rows)
    print(f"INFO  max_batch_size(train=True) / one real step at the size it answers: {searches} (no target)")


def run(quick: bool = False, device="cpu", as_json: bool = False) -> list[dict]:
    """The cost table alone (`memfit bench train --cost`), its verdicts and the machine it ran on."""
    dev = torch.device(device)
    print(machine_header(dev))
    rows = []
    for case, n, budget in cost_cases(quick):
        t0 = time.perf_counter()
        rows.append(cost_row(on_device(case, dev), n, budget, repeat=2 if quick else 4, warmup=0 if quick else 1))
        print(f"# {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    print(HEADING)
    print(table(rows))
    cost_verdicts(rows, lambda ok, text: print(f"{'PASS' if ok else 'MISS'}  {text}"))
    warning = spread_warning()
    if warning:
        print(warning)
    if as_json:
        print(json.dumps(rows, default=str))
    return rows

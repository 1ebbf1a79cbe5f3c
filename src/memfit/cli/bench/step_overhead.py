"""`memfit bench train --overhead`: what memfit adds to a training step against the loop a user would write.

The reference is a hand-written micro-batch loop doing the same arithmetic: `zero_grad`, then per micro-batch
forward, the loss scaled by the micro-batch's share of the batch, backward, then `optimizer.step()`. Against it,
at the same micro-batch size and on copies of the same model (AdamW, BatchNorm in eval mode, no dropout):
- `accumulate(..., micro_batch=m)`;
- `plan.step(batch)`, the plan `memfit.fit` makes (no checkpointing candidates) under a budget of the step's
  predicted bytes at m (it may take a larger micro-batch that fits the same bytes: the loop then runs at that);
- `accumulate(..., budget=...)`, auto under the same budget plus the gradients it holds on entry (it counts the
  gradients of the previous step, held until its step ends: `plan.step` does not).
Each is timed against the loop in ABBA pairs of rounds, in process CPU time (on a shared VM wall time counts other
processes' slices); the speed ratio loop / memfit is the median over pairs (target >= 0.95x on every model but the
MLP, whose 10 ms step shows fixed costs), and memfit's host time per step is that ratio's excess times the loop's
median. The loop against itself on a fresh copy of the model ("loop/loop") is the noise floor. Also counted,
exactly: memfit's reads of the device per step beyond the loop's (each a sync on a GPU, `memfit.testing.reads`).

Run:
    OMP_NUM_THREADS=1 memfit bench train --overhead          # six models, batch 32 in micro-batches of 8 (25 min)
    memfit bench train --overhead --quick                     # batch 16 in micro-batches of 4, no ResNet-18
"""

from __future__ import annotations

import math
import time
import warnings

import torch

import memfit
from memfit.batches import batch_len, batch_slice, forward
from memfit.cli.bench.common import machine_header, paired_ratio, spread_warning, table
from memfit.cli.bench.train_cases import Case, hf_cases, zoo_cases
from memfit.device.torch_private import BatchNormBase
from memfit.memory.micro_batch import training_peak
from memfit.testing.reads import counted_reads
from memfit.testing.zoo import build

TARGET = 0.95
TINY = ("mlp",)                 # steps of milliseconds: the fixed costs show, printed but not judged
NAMES = ["mlp", "transformer", "resnet18", "bert", "gpt2", "vit"]


def hand_loop(model, opt, batch, loss_fn, m: int) -> None:
    """The reference: what a user writes for micro-batches of m."""
    x, y = batch
    n = batch_len(y)
    opt.zero_grad(set_to_none=True)
    for s in range(0, n, m):
        e = min(n, s + m)
        (loss_fn(forward(model, batch_slice(x, s, e)), batch_slice(y, s, e)) * ((e - s) / n)).backward()
    opt.step()


def cases(quick: bool) -> list[Case]:
    found = {c.name.split()[0]: c for c in zoo_cases() + hf_cases(seq=32)}
    shape = build("resnet18", image=32)[1]        # 32 pixels: a quarter of the training bench's step
    found["resnet18"] = Case("resnet18", lambda: build("resnet18", image=32)[0],
                             lambda n: (torch.randn(n, *shape, generator=torch.Generator().manual_seed(n)),
                                        torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))),
                             found["resnet18"].loss)
    return [found[k] for k in NAMES if k in found and not (quick and k == "resnet18")]


def _fresh(case: Case):
    torch.manual_seed(0)
    model = case.make()
    for mod in model.modules():              # accumulate refuses batch statistics: as `bench train` does
        if isinstance(mod, BatchNormBase):
            mod.eval()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _reads(run) -> int:
    with counted_reads() as reads:
        run()
    return len(reads)


def rows_for(case: Case, n: int, m: int, seconds: float) -> dict:
    batch = case.batch(n)
    model, opt = _fresh(case)
    peak, _ = training_peak(model, opt, case.loss, *batch)
    budget = int(peak(m))
    auto_budget = budget        # auto counts no gradients held on entry (accumulate lets them go as it begins)
    plan = memfit.fit(model, opt, batch, case.loss, budget, candidates=())
    auto_model, auto_opt = _fresh(case)
    auto = memfit.accumulate(auto_model, auto_opt, batch, case.loss, budget=auto_budget)     # chooses
    micro_model, micro_opt = _fresh(case)
    contenders = {
        "accumulate": (m, lambda: memfit.accumulate(micro_model, micro_opt, batch, case.loss, micro_batch=m)),
        "plan.step": (plan.micro_batch, lambda: plan.step(batch)),
        "auto": (auto.micro_batch, lambda: memfit.accumulate(auto_model, auto_opt, batch, case.loss,
                                                             budget=auto_budget)),
    }
    row = {"model": case.name.split()[0], "batch": n}
    floor_model, floor_opt = _fresh(case)              # the noise floor: the loop against itself, on another copy
    contenders = {"loop": (m, lambda: hand_loop(floor_model, floor_opt, batch, case.loss, m)), **contenders}
    for what, (size, run) in contenders.items():
        ref_model, ref_opt = _fresh(case)
        hand = lambda ref_model=ref_model, ref_opt=ref_opt, size=size: hand_loop(ref_model, ref_opt, batch,
                                                                                case.loss, size)
        hand(), run()                                            # lazy state (AdamW's) made before timing
        once = min(_cpu_seconds(hand), _cpu_seconds(hand))
        rounds = max(6, min(60, 2 * round(seconds / once / 4)))   # ABBA pairs of about `seconds` in all
        # loop / memfit over ABBA pairs of rounds, by process CPU time: on a shared VM wall time counts other
        # processes' slices, CPU time only this one's work (all its threads); the spread is noted for the warning
        _, hand_s, ratio = paired_ratio(run, hand, repeat=rounds, warmup=0, what=f"{case.name} loop/{what}",
                                        clock=time.process_time)
        if what == "loop":
            row.update({"loop s": hand_s, "loop/loop": ratio})
            continue
        row.update({f"{what} m": size, f"loop/{what}": ratio, f"{what} ms/step": 1e3 * hand_s * (1 / ratio - 1),
                    f"{what} reads": _reads(run) - _reads(hand)})
    return row


def _cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def run(names=None, quick: bool = False, as_json: bool = False) -> list[dict]:
    n, m, seconds = (16, 4, 2.0) if quick else (32, 8, 10.0)
    print(machine_header("cpu"))
    print(f"# memfit's per-step cost against a hand-written micro-batch loop: batch {n}, micro-batches of {m} "
          f"({math.ceil(n / m)}), AdamW; loop/x = the loop's step time / memfit's (process CPU time), the median over "
          f"ABBA pairs of rounds (6 to 60 rounds, about {seconds:.0f} s of steps); ms/step = memfit's CPU time beyond "
          "the loop's (from that ratio); reads = memfit's reads of the device per step beyond the loop's (each a "
          "sync on a GPU; AdamW's own reads of its CPU step counters are the loop's too)")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases(quick):
            if names and case.name.split()[0] not in names:
                continue
            rows.append(rows_for(case, n, m, seconds))
    what = ("accumulate", "plan.step", "auto")
    print(table(rows, ["model", "batch", "loop s", "loop/loop",
                       *[c for w in what for c in (f"{w} m", f"loop/{w}", f"{w} ms/step", f"{w} reads")]]))
    judged = [r for r in rows if r["model"] not in TINY]
    for w in what:
        if judged:
            worst = min(judged, key=lambda r: r[f"loop/{w}"])
            ok = worst[f"loop/{w}"] >= TARGET
            print(f"{'PASS' if ok else 'MISS'}  {w}: step time vs the hand-written loop at its micro-batch, worst "
                  f"{worst[f'loop/{w}']:.3f}x ({worst['model']}; target >= {TARGET}x on every model but "
                  f"{', '.join(TINY)}); memfit's host time {min(r[f'{w} ms/step'] for r in rows):.2f} to "
                  f"{max(r[f'{w} ms/step'] for r in rows):.2f} ms a step")
    floor = [r["loop/loop"] for r in rows]
    print(f"INFO  noise floor: the loop against itself on another copy of the model {min(floor):.3f}x to "
          f"{max(floor):.3f}x (a ratio within that of 1 is no measured difference)")
    reads = sorted({r[f"{w} reads"] for r in rows for w in what})
    print(f"INFO  memfit's reads of the device per step beyond the loop's: {reads} (the labels once, the loss sum "
          "once)")
    warning = spread_warning()
    if warning:
        print(warning)
    if as_json:
        import json
        print(json.dumps(rows, default=str))
    return rows

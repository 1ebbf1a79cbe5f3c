"""Chunked-evaluation benchmark: is the auto chunk size as large as what really fits, and is it fast?

A CPU has no memory limit small enough to hit, so the benchmark emulates a device of each `--budget`
size: a chunk "really fits" when the parameters, the decoded input chunk and the live bytes
measured while the model runs it (`memfit.device.measure.track_memory`, the runner evaluate really uses:
the planned module with its arena, or eager) add up to at most the budget. The compact dataset
stays on the host here (as with a dataset larger than the device); its gathered rows are freed
once decoded, before the model runs.

1. auto / largest: `evaluate(chunk_size="auto")` chooses from its estimate; the largest chunk that
   really fits is found by bisection on the measured figure. Target >= 0.9x.
2. out-of-memory errors: the same evaluation through a wrapper that raises `torch.OutOfMemoryError`
   whenever a chunk goes over the emulated device. Target 0 with the planner-based estimate.
3. throughput: with a budget that holds everything, `evaluate` against one eager `model(x)` on the
   whole float32 set computing the same accuracy. Target >= 0.95x.

Run:
    memfit bench evaluate
    memfit bench evaluate --budget 8MiB,32MiB --device cuda
    memfit bench evaluate --quick
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from memfit import evaluate
from memfit.budget import format_bytes, model_device, parse_bytes
from memfit.cli.bench.common import alternating_medians, machine_header, paired_ratio, rounds_for, spread_warning, table
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device
from memfit.device.measure import held_bytes, track_memory


def cnn(classes: int = 10) -> torch.nn.Module:
    """A small MNIST CNN (about 0.1 M parameters) whose activations dominate its memory."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),     # (N, 32, 14, 14)
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),    # (N, 64, 7, 7)
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, classes))


def data(n: int, seed: int = 0) -> CompactDataset:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    return CompactDataset.from_arrays(x, y, normalize="dataset", device="cpu")


def runner_for(model, ds: CompactDataset, n: int, kind: str):
    """The callable evaluate runs for a chunk of n: the planned module (arena made for n) or eager."""
    if kind != "planned":
        return model, 0
    from memfit import plan
    pm = plan(model, (torch.empty((n, *ds.sample_shape), device=model_device(model)),))
    return pm, pm.report.arena_bytes


def measured(model, ds: CompactDataset, n: int, kind: str) -> int:
    """Bytes a chunk of n really holds on the emulated device."""
    runner, arena = runner_for(model, ds, n, kind)
    dev = model_device(model)
    x, _ = ds.batch(torch.arange(n))
    x = x.to(dev)
    with torch.inference_mode():
        runner(x)                                  # warm: any lazy set-up happens outside the measure
        with track_memory(dev) as mem:
            runner(x)
    return held_bytes(model) + x.nbytes + arena + mem.peak


def largest_really_fitting(model, ds, budget: int, kind: str) -> int:
    lo, hi = 0, len(ds)
    while lo < hi:                                  # measured(n) grows with n
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if measured(model, ds, mid, kind) <= budget else (lo, mid - 1)
    return lo


class EmulatedDevice(torch.nn.Module):
    """Raises torch.OutOfMemoryError for a chunk whose measured bytes exceed the budget."""

    def __init__(self, model, ds, budget: int, kind: str):
        super().__init__()
        self.model, self.ds, self.budget, self.kind, self.ooms = model, ds, budget, kind, 0
        self.fits: dict[int, bool] = {}

    def forward(self, x):
        n = x.shape[0]
        if n not in self.fits:
            self.fits[n] = measured(self.model, self.ds, n, self.kind) <= self.budget
        if not self.fits[n]:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"emulated device: a chunk of {n} needs more than "
                                         f"{format_bytes(self.budget)}")
        return self.model(x)


class TokenClassifier(torch.nn.Module):
    """A small transformer text classifier on token ids (embedding, 2 encoder layers, mean pool, linear)."""

    def __init__(self, vocab: int = 1000, d: int = 64, classes: int = 10):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, classes)

    def forward(self, ids):                       # (N, L) int64 -> (N, classes)
        return self.head(self.enc(self.emb(ids)).mean(1))


def plain_loop(model, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """The loop a user writes over tensors already in memory: accuracy over batches."""
    correct = 0
    with torch.inference_mode():
        for s in range(0, len(y), batch):
            correct += int((model(x[s:s + batch]).argmax(1) == y[s:s + batch]).sum())
    return correct / len(y)


def size_sweep(dev: torch.device, sizes, repeat: int) -> list[dict]:
    """evaluate(model, compact set) vs the plain loop over the decoded float32/int64 tensors, at each set size,
    for the CNN (MNIST-shaped uint8 images) and a transformer (token ids). The first call of each model
    includes what evaluate does once per model (capture for the planner when it is used)."""
    rows = []
    rng = np.random.default_rng(1)
    n = max(sizes)
    sets = {"cnn": (cnn(), rng.integers(0, 256, (n, 1, 28, 28), dtype=np.uint8), {"normalize": "dataset"}),
            "transformer": (TokenClassifier(), rng.integers(0, 1000, (min(n, 4096), 32)), {})}
    for name, (model, x, kw) in sets.items():
        model = model.eval().to(dev)
        y = rng.integers(0, 10, len(x))
        for m in sorted({min(k, len(x)) for k in sizes}):
            ds = CompactDataset.from_arrays(x[:m], y[:m], device="cpu", **kw)
            xt, yt = (t.to(dev) for t in ds.batch(torch.arange(m)))
            go = lambda ds=ds, model=model: evaluate(model, ds, metrics=("accuracy",), device=dev, progress=False)
            t0 = time.perf_counter()
            r = go()
            first = time.perf_counter() - t0
            loop = lambda xt=xt, yt=yt, model=model: plain_loop(model, xt, yt)
            # about 1 s of each (timed warm: a first call may carry a one-time cost), at least 7 rounds
            rounds = rounds_for(loop, seconds=1.0, at_least=max(repeat, 7), at_most=200, device=dev)
            t_plain, t_mem, ratio = paired_ratio(loop, go, repeat=rounds, device=dev,
                                                 what=f"{name} {m} evaluate / plain loop")
            assert r.metrics["accuracy"] == plain_loop(model, xt, yt), "evaluate and the plain loop disagree"
            rows.append({"model": name, "samples": m, "runner": r.runner, "chunk": r.chunk_size,
                         "first call s": first, "evaluate s": t_mem, "plain loop s": t_plain,
                         "evaluate / plain": ratio})
    return rows


def run(n: int = 10_000, budgets=("8MiB", "16MiB", "32MiB"), repeat: int = 3, as_json: bool = False,
        device="cpu") -> list[dict]:
    dev = resolve_device(device)
    print(machine_header(dev))
    torch.manual_seed(0)
    model = cnn().eval().to(dev)
    ds = data(n)
    rows = []
    for b in budgets:
        budget = parse_bytes(b)
        r = evaluate(model, ds, chunk_size="auto", budget=budget, device=dev, progress=False)
        kind = "planned" if r.runner == "planned" else "eager"
        best = largest_really_fitting(model, ds, budget, kind)
        emu = EmulatedDevice(model, ds, budget, kind)
        r2 = evaluate(emu, ds, chunk_size=r.chunk_size, budget=budget, device=dev, progress=False, planned=False)
        rows.append({"budget": format_bytes(budget), "runner": kind, "auto chunk": r.chunk_size,
                     "largest that fits": best, "auto / largest": r.chunk_size / max(best, 1),
                     "estimated peak": format_bytes(r.peak_bytes),
                     "measured at auto": format_bytes(measured(model, ds, r.chunk_size, kind)),
                     "OOMs": r2.retries, "accuracy equal": r2.metrics["accuracy"] == r.metrics["accuracy"]})
    print(f"# {n} MNIST-shaped samples (uint8), the CNN above, emulated device of each budget")
    print(table(rows))

    # throughput when everything fits: memfit (auto, compact data decoded per chunk) vs eager whole set
    x_all, y_all = (t.to(dev) for t in ds.batch(torch.arange(n)))

    def eager():
        with torch.inference_mode():
            return (model(x_all).argmax(1) == y_all).sum().item() / n

    def chunked():
        return evaluate(model, ds, metrics=("accuracy",), budget="8GiB", device=dev, progress=False)

    res = chunked()
    times = alternating_medians({"eager whole set": eager, "evaluate auto": chunked}, repeat=repeat, device=dev)
    t_eager, t_mem = times["eager whole set"], times["evaluate auto"]
    speed = {"unchunked eager s": t_eager, "memfit auto s": t_mem, "auto chunk": res.chunk_size,
             "runner": res.runner.split(" ")[0], "throughput ratio": t_eager / t_mem}
    print("# everything fits (budget 8GiB): evaluate(auto) vs one eager model(x) over the float32 set")
    print(table([speed]))
    sizes = [32, 256, 1024, n] if n > 1024 else [32, 256, n]
    sweep = size_sweep(dev, sizes, repeat)
    print("# set-size sweep, default budget: evaluate vs a plain PyTorch loop (batches of 512, float32 tensors)")
    print(table(sweep))
    worst = min(r["auto / largest"] for r in rows)
    ooms = sum(r["OOMs"] for r in rows)
    print(f"{'PASS' if worst >= 0.9 else 'MISS'}  auto chunk / largest that fits: worst {worst:.2f} (target >= 0.9)")
    print(f"{'PASS' if ooms == 0 else 'MISS'}  out-of-memory errors at the auto size: {ooms} (target 0)")
    ratio = speed["throughput ratio"]
    print(f"{'PASS' if ratio >= 0.95 else 'MISS'}  throughput at auto vs unchunked: {ratio:.2f}x (target >= 0.95x)")
    slow = max(r["evaluate / plain"] for r in sweep)
    print(f"{'PASS' if slow <= 1.1 else 'MISS'}  evaluate / plain loop, every set size and model: worst {slow:.2f}x "
          "(target <= 1.1x)")
    warning = spread_warning()
    if warning:
        print(warning)
    if as_json:
        print(json.dumps({"rows": rows, "throughput": speed}))
    return rows


def main(argv=None) -> int:
    from memfit.cli.options import budgets_arg, count_arg, device_arg
    p = argparse.ArgumentParser(prog="memfit bench evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=count_arg(1), default=10_000, help="samples in the synthetic test set (default 10,000)")
    p.add_argument("--budget", dest="budgets", type=budgets_arg, default=None, metavar="SIZES",
                   help="emulated device sizes, comma-separated (default 8MiB,16MiB,32MiB; quick 4MiB)")
    p.add_argument("--budgets", dest="budgets", type=budgets_arg, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)                                     # its former name
    p.add_argument("--device", default="cpu", type=device_arg,
                   help="where the model runs: cpu, cuda, cuda:1 (default cpu; the device size is emulated)")
    p.add_argument("--repeat", type=count_arg(1), default=None, help="timed repeats of the throughput (default 3)")
    p.add_argument("--quick", action="store_true", help="2,000 samples and one budget (for tests)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    a = p.parse_args(argv)
    budgets = a.budgets or (("4MiB",) if a.quick else ("8MiB", "16MiB", "32MiB"))
    repeat = a.repeat or (1 if a.quick else 3)
    run(n=2_000 if a.quick else a.n, budgets=budgets, repeat=repeat, as_json=a.json, device=a.device)
    return 0

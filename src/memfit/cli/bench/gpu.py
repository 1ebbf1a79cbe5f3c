"""`memfit bench gpu` (`make gpu-check`): memfit's CUDA predictions against a GPU, in one command; exit status 1 on
a MISS.

On a CUDA device, for each model (`gpu_cases.cases`: an MLP, ResNet-18 and a UNet (conv nets), a transformer
encoder block, a causal transformer under bf16 autocast (flash attention), GPT-2 from a transformers config
(float32, and under bf16 autocast) and BERT; AdamW; random weights, nothing downloaded):
1. predicted vs real peaks of a training loop (`STEPS` steps from a fresh allocator): reserved
   (`torch.cuda.max_memory_reserved`; target: predicted / real in [1.00, 1.05]) with allocated
   (`max_memory_allocated`) beside it; the same target for the reserved bytes predicted by a process that sees no
   GPU (`CUDA_VISIBLE_DEVICES` empty; for this device's compute capability): the answer a user gets from a machine
   without the GPU;
2. the out-of-memory boundary under `torch.cuda.set_per_process_memory_fraction(f)`, f chosen so that the
   predicted boundary is about 4x the larger batch: the largest batch the replayed allocator serves against the
   largest the device runs (searched outward from the predicted one, then bisected); target: within 2%;
3. `memfit.fit`'s plans (ResNet-18 and GPT-2; else the first model chosen) at three budgets (the least any of its
   alternatives needs, plus 1.0, 0.5 and 0.2 of the way to the fastest plan's peak): the plan's real peak (reserved,
   plus what lies outside the allocator) against its budget; target: none over;
4. the loaders (`memfit bench loaders`' GPU rows): stream uint8 vs stream float32 samples/s (target >= 3x) and
   the share of the copy prefetch hides (target >= 80%);
with the CUDA context measured beside its stated default. A run on the CPU (`--dry-run`; on a GPU with `--parts
here`) also prints the CUDA predictions made there beside the CPU's for the same models, with the attention kernel
each is routed to and what it saves over the math kernel (the model predicted again under
`torch.nn.attention.sdpa_kernel(SDPBackend.MATH)`): flash attention for the causal transformer under bf16.

`--dry-run` runs the same code on the CPU with the CPU's figures (predictions for the CPU, its live bytes as both
peaks, out of memory emulated at a fraction of a notional 64 GiB), so every part but the CUDA calls
(`gpu_cases.CudaSide`) runs without a GPU.

Run:
    make gpu-check                      # memfit bench gpu: under 8 minutes on one GPU
    memfit bench gpu --quick --models mlp,gpt2-bf16
    memfit bench gpu --dry-run --quick  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

import memfit
from memfit.budget import BudgetExceeded, format_bytes
from memfit.cli.bench.common import machine_header, table
from memfit.cli.bench.gpu_cases import Case, CpuSide, CudaSide, cases, loop
from memfit.device.cuda_costs import CONTEXT_LAZY

__all__ = ["boundary", "main", "verdict"]

RESERVED = (1.00, 1.05)           # predicted / real reserved
BOUNDARY = 0.02                   # |predicted - real| / real of the out-of-memory boundary
FIT_CASES = ("resnet18", "gpt2")
FIT_SHARES = (1.0, 0.5, 0.2)     # of the way from the least any plan needs to the fastest plan's peak, in bytes
PARTS = ("here", "peaks", "oom", "fit", "loaders")
BLIND_TIMEOUT = 300               # seconds the predictions without the GPU may take (all models)


def verdict(ok: bool | None) -> str:
    """PASS, MISS, or n/a (None: nothing to compare)."""
    return "n/a" if ok is None else "PASS" if ok else "MISS"


def boundary(fits, start: int, upper: int) -> int:
    """The largest n in [1, upper] with fits(n) (fits monotone), 0 if none: from `start` outward by doubling
    steps, then bisection; each n asked once (a real run each on the device).

    Example:
        >>> fits = lambda n: n <= 37
        >>> boundary(fits, 30, 1000), boundary(fits, 60, 1000), boundary(fits, 60, 20), boundary(lambda n: False, 5, 9)
        (37, 37, 20, 0)
    """
    seen: dict[int, bool] = {}
    f = lambda n: seen[n] if n in seen else seen.setdefault(n, bool(fits(n)))   # noqa: E731
    start = min(max(start, 1), upper)
    if f(start):
        lo, step = start, 1
        while True:
            if lo >= upper:
                return upper
            hi = min(lo + step, upper)
            if not f(hi):
                break
            lo, step = hi, 2 * step
    else:
        hi, step = start, 1
        while True:
            lo = hi - step
            if lo < 1:
                lo = 0
                break
            if f(lo):
                break
            hi, step = lo, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid)
    return lo


def _predict(case: Case, device, gpu=None, **options):
    """(memory model of the case's training step for `device`, the model it is kept for)."""
    model = case.build()
    x, y = case.sample(2)
    mm = memfit.memory_model(model, x, train=True, optimizer=case.optimizer(model.parameters()), loss_fn=case.loss_fn,
                             target=y, autocast=case.autocast, device=device, gpu=gpu, **options)
    return mm, model


def _predicted(mm, n: int) -> tuple[int, int]:
    """(allocated, reserved) at batch n: the replay's on CUDA; the CPU's live bytes for both."""
    if mm.device.type == "cuda":
        p = mm.cuda(n)
        return p.allocated, p.reserved
    return mm.total_bytes(n), mm.total_bytes(n)


def peaks(models: dict, side, blind: dict | None = None) -> list[dict]:
    """Part 1: predicted vs real peaks of the loop at each case's batch sizes; `blind`: the reserved bytes predicted
    where the device could not be seen ({(model, batch): reserved}, `blind_predictions`), held to the same target."""
    rows = []
    for case, mm in models.values():
        for n in case.batches:
            pa, pr = _predicted(mm, n)
            real = side.run(loop(case, n))
            ra, rr = real if real is not None else (0, 0)
            ok = real is not None and RESERVED[0] <= pr / rr <= RESERVED[1]
            row = {"model": case.name, "batch": n, "pred reserved": pr, "real reserved": rr,
                   "pred/real": pr / rr if rr else float("nan"), "pred allocated": pa, "real allocated": ra,
                   "alloc pred/real": pa / ra if ra else float("nan")}
            if blind is not None:
                b = blind.get(f"{case.name}/{n}")
                row["no-GPU pred/real"] = b / rr if b is not None and rr else float("nan")
                ok = ok and b is not None and RESERVED[0] <= b / rr <= RESERVED[1]
            rows.append({**row, "verdict": verdict(ok) if real is not None else "MISS (out of memory)"})
    return rows


def blind_predictions(names: list[str], quick: bool, device: torch.device) -> dict:
    """{"model/batch": reserved} predicted by a process that sees no GPU (CUDA_VISIBLE_DEVICES empty) for a GPU of
    this device's compute capability: the answer a user gets from a machine without it (`memfit.memory_model(...,
    device="cuda", gpu=capability)`), made here so the peaks part can hold it against the real bytes. On the CPU
    (`--dry-run`) the same process predicts for the CPU."""
    target = ".".join(map(str, torch.cuda.get_device_capability(device))) if device.type == "cuda" else "cpu"
    argv = [sys.executable, "-m", "memfit", "bench", "gpu", "--blind", target, "--models", ",".join(names)]
    # the same memfit as this process's (a checkout's src on the path, as under pytest), no GPU visible
    src = os.path.dirname(os.path.dirname(memfit.__file__))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        done = subprocess.run(argv + (["--quick"] if quick else []), env=env, capture_output=True, text=True,
                              timeout=BLIND_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"exit status {done.returncode}: {done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, RuntimeError, ValueError, IndexError) as e:
        # the other parts still run and print: every row's no-GPU column is then a MISS, and this says why
        print(f"MISS  the predictions without the GPU failed ({' '.join(argv)}): {e}", flush=True)
        return {}


def _blind(chosen: list[Case], target: str) -> dict:
    """`--blind`: each case's reserved bytes predicted for `target` ("8.0": CUDA of that compute capability, from
    this process, which sees no GPU; "cpu": the CPU's)."""
    cuda = target != "cpu"
    gpu = tuple(int(v) for v in target.split(".")) if cuda else None
    out = {}
    for case in chosen:
        mm, _ = _predict(case, "cuda" if cuda else "cpu", gpu)
        out.update({f"{case.name}/{n}": _predicted(mm, n)[1] for n in case.batches})
    return out


def oom_boundaries(models: dict, side) -> list[dict]:
    """Part 2: the largest batch under a memory fraction, predicted against real."""
    from memfit.accumulation.checks import batch_dependent_modules
    rows = []
    for case, mm in models.values():
        # a model with batch statistics (BatchNorm) cannot train on one sample: batch 1 is no boundary there
        least = 2 if batch_dependent_modules(case.build()) else 1
        target = 4 * max(case.batches)
        capacity = _predicted(mm, target)[1]
        fraction = capacity / side.total
        if mm.device.type == "cuda":
            serves = lambda n, mm=mm, f=fraction: mm.serves(n, None, memory_fraction=f, device_total=side.total)
        else:
            serves = lambda n, mm=mm, c=capacity: mm.total_bytes(n) <= c
        predicted = boundary(lambda n, s=serves, least=least: n >= least and s(n), target, 4 * target)
        t0 = time.perf_counter()
        real = boundary(lambda n, case=case, f=fraction, least=least:
                        n >= least and side.run(loop(case, n), fraction=f) is not None, predicted, 4 * target)
        err = abs(predicted - real) / real if real else float("inf")
        rows.append({"model": case.name, "fraction": f"{fraction:.4g}", "allowed": int(fraction * side.total),
                     "pred largest": predicted, "real largest": real, "error": err,
                     "search s": time.perf_counter() - t0, "verdict": verdict(err <= BOUNDARY)})
    return rows


def plans(models: dict, side) -> list[dict]:
    """Part 3: fit's plans at three budgets, between the least any alternative needs and the fastest plan's peak, and
    their real peaks against the budgets (one model and optimizer on the device per case, as a user keeps them)."""
    rows = []
    names = [k for k in FIT_CASES if k in models] or \
        [k for k, (c, _) in models.items() if c.sample(1)[1] is not None][:1]
    for name in names:
        case, mm = models[name]
        n = max(case.batches)
        model = case.build().to(side.device)
        opt = case.optimizer(model.parameters())
        x, y = (t.to(side.device) for t in case.sample(n))
        high = memfit.fit(model, opt, (x, y), case.loss_fn, 10 * mm.total_bytes(n)).peak_bytes   # the fastest
        try:
            low = memfit.fit(model, opt, (x, y), case.loss_fn, 1).peak_bytes
        except BudgetExceeded as e:
            low = e.needed                                             # the least any alternative needs
        for share in FIT_SHARES:
            budget = int(low + share * (high - low))
            row = {"model": name, "batch": n, "budget": budget}
            try:
                plan = memfit.fit(model, opt, (x, y), case.loss_fn, budget)
            except BudgetExceeded:
                rows.append({**row, "plan": "nothing fits", "verdict": verdict(None)})
                continue
            if isinstance(side, CudaSide):
                side.clean()
            real = side.plan_peak(plan, (x, y), model, opt)
            rows.append({**row, "plan": f"micro {plan.micro_batch}, {len(plan.checkpoint)} checkpointed",
                         "predicted": plan.peak_bytes, "real": real, "real/budget": real / budget,
                         "verdict": verdict(real <= budget)})
        del model, opt, x, y
        if isinstance(side, CudaSide):
            side.clean()
    return rows


def loader_lines(device: torch.device, quick: bool) -> list[str]:
    """Part 4: the loaders benchmark's GPU lines (stream uint8 vs float32, prefetch), its table printed above."""
    from memfit.cli.bench import loaders
    rows = loaders.run(n=60_000 if device.type == "cuda" and not quick else 8192 if device.type == "cuda" else 2048,
                       micro_sizes=(512,),
                       macro_sizes=(4096,), repeat=2 if quick else 3, device=device, host_memory_mb=0)
    return [line for line in loaders.targets(rows, device).splitlines() if "stream uint8" in line or "prefetch" in line]


def from_here(chosen: list[Case], gpu: str) -> list[dict]:
    """The CUDA predictions made on this machine beside the CPU's, with flash attention's saving over math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for case in chosen:
        n = 4 * max(case.batches)
        cpu, _ = _predict(case, "cpu")
        cuda, keep = _predict(case, "cuda", gpu)
        row = {"model": case.name, "batch": n, "CPU": cpu.total_bytes(n), "CUDA reserved": cuda.cuda(n).reserved,
               "CUDA total": cuda.total_bytes(n), "CUDA/CPU": cuda.total_bytes(n) / cpu.total_bytes(n),
               "attention": "", "saved vs math": "", "reserved vs math": ""}
        if case.attention:
            with sdpa_kernel([SDPBackend.MATH]):
                math, _ = _predict(case, "cuda", gpu)
            routed = re.search(r"attention routed as the GPU runs it: ([a-z, ]+)", cuda.method)
            row["attention"] = routed.group(1) if routed else "(torch's choice)"
            # allocated: at small sizes whole 2 MiB segments hide the saving in reserved
            row["saved vs math"] = math.cuda(n).allocated - cuda.cuda(n).allocated
            row["reserved vs math"] = math.cuda(n).reserved - cuda.cuda(n).reserved
        rows.append(row)
        del keep
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="memfit bench gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help=f"comma-separated, among {', '.join(cases())} (default: all)")
    p.add_argument("--quick", action="store_true", help="smaller models and batches")
    p.add_argument("--dry-run", action="store_true", help="the same code on the CPU with the CPU's figures")
    p.add_argument("--gpu", default="H100", help="the GPU the predictions made here are for (default H100)")
    p.add_argument("--parts", default=None, help=f"comma-separated, among {', '.join(PARTS)} (default: all; on a "
                   "GPU all but 'here', the predictions made here for another GPU)")
    p.add_argument("--blind", default=None, help=argparse.SUPPRESS)    # blind_predictions' own process
    a = p.parse_args(argv)
    chosen_parts = set(a.parts.split(",")) if a.parts else set(PARTS) - (set() if a.dry_run else {"here"})
    if not chosen_parts <= set(PARTS):
        p.error(f"unknown parts {sorted(chosen_parts - set(PARTS))}; expected among {', '.join(PARTS)}")
    every = cases(a.quick)
    names = a.models.split(",") if a.models else list(every)
    unknown = sorted(set(names) - set(every))
    if unknown:
        p.error(f"unknown models {unknown}; expected among {', '.join(every)}")
    chosen = [every[k] for k in names]
    if a.blind is not None:
        print(json.dumps(_blind(chosen, a.blind)))
        return 0
    if not a.dry_run and not torch.cuda.is_available():
        print(f"memfit bench gpu: torch {torch.__version__} sees no CUDA device; run it on a GPU (make gpu-check), or "
              "--dry-run for the same code with the CPU's figures")
        return 2
    side = CpuSide(64 << 30) if a.dry_run else CudaSide(torch.device("cuda", torch.cuda.current_device()))
    print(machine_header(side.device))
    t0 = time.perf_counter()
    if "here" in chosen_parts:
        print(f"\n# CUDA predictions made here ({a.gpu}'s stated defaults where no GPU is here) beside the CPU's")
        print(table(from_here(chosen, a.gpu), bytes_columns=("CPU", "CUDA reserved", "CUDA total", "saved vs math",
                                                                  "reserved vs math")))
    models = {c.name: (c, _predict(c, side.device)) for c in chosen}
    models = {k: (c, mm) for k, (c, (mm, _)) in models.items()}
    misses = 0
    blind = blind_predictions(names, a.quick, side.device) if "peaks" in chosen_parts else None
    parts = [("peaks", "1. predicted vs real peaks of a training loop (target reserved pred/real in [1.00, 1.05]; "
              "'no-GPU': predicted by a process that sees no GPU, for this one's compute capability)",
              lambda models, side: peaks(models, side, blind),
              ("pred reserved", "real reserved", "pred allocated", "real allocated")),
             ("oom", "2. out-of-memory boundary under a memory fraction (target within 2%)", oom_boundaries,
              ("allowed",)),
             ("fit", "3. memfit.fit's plans: real peak vs budget (target: none over)", plans,
              ("budget", "predicted", "real"))]
    for name, title, part, byte_columns in parts:
        if name not in chosen_parts:
            continue
        rows = part(models, side)
        print(f"\n# {title}")
        print(table(rows, bytes_columns=byte_columns))
        misses += sum(str(r["verdict"]).startswith("MISS") for r in rows)
    if "loaders" in chosen_parts:
        print("\n# 4. loaders on the device (memfit bench loaders' GPU rows, below its own table and targets: only "
              "these two count here)")
        lines = loader_lines(side.device, a.quick)
        print("\n".join(lines))
        misses += sum(line.startswith("MISS") for line in lines)
    print(f"\nCUDA context: {format_bytes(side.context())} measured outside the caching allocator "
          f"(stated default {format_bytes(CONTEXT_LAZY)}){' (dry run: none on the CPU)' if a.dry_run else ''}")
    print(f"{misses} MISS in {time.perf_counter() - t0:.0f} s" + (" (dry run: the CPU's figures)" if a.dry_run else ""))
    return 1 if misses else 0

"""Distributed benchmark: resident-loader throughput and evaluation time with 1 and 2 processes.

Each rank holds only its shard of the compact dataset (`loader(..., distributed=True)` and
`evaluate(..., distributed=True)` shard it), so the bytes per rank fall as 1/world. On a CPU the
processes share the cores: a run with `world` processes gives each `cores // world` torch threads,
so that every configuration uses the same cores. On CUDA each rank takes its own GPU (nccl).

Run:
    memfit bench distributed
    memfit bench distributed --memory --quick     (per-rank memory of DDP and FSDP2: memfit.cli.bench.rank_memory)
    memfit bench distributed --worlds 1,2 --n 60000
"""

from __future__ import annotations

import argparse
import json
import os
import time

from memfit.cli.bench.common import machine_header, table
from memfit.testing.ranks import spawn


def _rank(rank: int, world: int, n: int, batch: int, epochs: int, device: str = "cpu") -> dict:
    """One rank's loader and evaluation figures (run by `memfit.testing.ranks.spawn` in a process group)."""
    import torch
    import torch.distributed as dist
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    from memfit import evaluate, loader
    from memfit.cli.bench.evaluate import cnn
    from memfit.compact import CompactDataset
    from memfit.readers import synthetic
    x, y = synthetic(n, seed=0)
    ds = CompactDataset.from_arrays(x, y, normalize="dataset", device="cpu").shard()   # this rank's part only
    del x, y
    ld = loader(ds, batch, strategy="resident", device=dev, seed=0, distributed=True, budget="4GiB")
    for _batch in ld:                                  # warm-up epoch: allocations, first touches
        pass
    dist.barrier()
    t0 = time.perf_counter()
    seen = 0
    for _ in range(epochs):
        for xb, _ in ld:
            seen += xb.shape[0]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t_load = time.perf_counter() - t0
    torch.manual_seed(0)                               # the same weights in every process and world size
    model = cnn().to(dev)
    dist.barrier()
    t0 = time.perf_counter()
    res = evaluate(model, ds, metrics=("accuracy",), chunk_size=1024, device=dev, progress=False,
                   distributed=True, planned=False)
    t_eval = time.perf_counter() - t0
    return {"seen": seen, "load_s": t_load, "eval_s": t_eval, "held": ds.nbytes,
            "accuracy": res.metrics["accuracy"], "n": res.n}


def measure(world: int, n: int, batch: int, epochs: int, timeout: float = 600, device: str = "cpu") -> dict:
    """Start `world` processes (on `device`: 'cpu' with gloo, 'cuda' with nccl, one GPU per rank) and
    return the slowest rank's times and the per-rank figures."""
    threads = max(1, (os.cpu_count() or 1) // world)
    out = spawn(_rank, world, n, batch, epochs, device, timeout=timeout, threads=threads,
                backend="nccl" if device == "cuda" else "gloo")
    load_s = max(v["load_s"] for v in out.values())
    return {"processes": world, "threads each": threads,
            "loader samples/s": sum(v["seen"] for v in out.values()) / load_s,
            "eval s": max(v["eval_s"] for v in out.values()),
            "bytes per rank": max(v["held"] for v in out.values()),
            "accuracy": out[0]["accuracy"], "evaluated": out[0]["n"]}


def run(worlds=(1, 2), n: int = 60_000, batch: int = 512, epochs: int = 3, as_json: bool = False,
        device: str | None = None) -> list[dict]:
    import torch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = device or ("cuda" if gpus >= max(worlds) else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda' (each rank takes its own GPU); found {device!r}")
    if device == "cuda" and gpus < max(worlds):
        raise ValueError(f"--device cuda gives each process its own GPU: {max(worlds)} processes need "
                         f"{max(worlds)} GPUs, this machine has {gpus}; pass --worlds 1 or --device cpu")
    print(machine_header(device))
    rows = [measure(w, n, batch, epochs, device=device) for w in worlds]
    base = rows[0]
    for r in rows:
        r["loader speed-up"] = r["loader samples/s"] / base["loader samples/s"]
        r["eval speed-up"] = base["eval s"] / r["eval s"]
        r["bytes vs 1 process"] = r["bytes per rank"] / base["bytes per rank"]
    print(f"# {n} MNIST-shaped uint8 samples, resident loader batch {batch} over {epochs} epochs, "
          "exact distributed evaluation of a small CNN (chunks of 1024)")
    print(table(rows, bytes_columns={"bytes per rank"}))
    same = len({r["accuracy"] for r in rows}) == 1 and all(r["evaluated"] == n for r in rows)
    print(f"{'PASS' if same else 'MISS'}  every world size evaluates all {n} samples once, same accuracy")
    if as_json:
        print(json.dumps(rows))
    return rows


def main(argv=None) -> int:
    from memfit.cli.options import count_arg, counts_arg
    p = argparse.ArgumentParser(prog="memfit bench distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2", type=counts_arg(1), help="comma-separated process counts (default 1,2)")
    p.add_argument("--n", type=count_arg(1), default=60_000, help="samples (default 60,000, MNIST's size)")
    p.add_argument("--batch", type=count_arg(1), default=512, help="samples per batch (default 512)")
    p.add_argument("--epochs", type=count_arg(1), default=3, help="timed epochs (default 3)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="cpu (gloo) or cuda (nccl, one GPU per process); default: cuda when every process gets "
                        "a GPU, else cpu")
    p.add_argument("--quick", action="store_true", help="6,000 samples, one epoch (with --memory: batches 4 and 16)")
    p.add_argument("--memory", action="store_true",
                   help="instead: per-rank memory of DDP and FSDP2 training steps, predicted in one process against "
                        "2 and 4 gloo ranks (memfit.cli.bench.rank_memory)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    a = p.parse_args(argv)
    if a.memory:
        from memfit.cli.bench.rank_memory import run as run_memory
        rows = run_memory(quick=a.quick)
        if a.json:
            print(json.dumps(rows))
        return 0
    run(a.worlds, n=6_000 if a.quick else a.n, batch=a.batch, epochs=1 if a.quick else a.epochs, as_json=a.json,
        device=a.device)
    return 0

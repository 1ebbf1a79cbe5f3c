"""Codec benchmark: bytes held and `ds.batch` throughput of every codec against a float32 gather.

The baseline is what airbench does: the whole set normalised once into a float32 tensor on the
device, each batch one `index_select`. memfit holds the compact rows instead and decodes per batch.
Both run side by side in one process on the same random indices.

Run:
    memfit bench codecs                 # MNIST- and CIFAR-shaped sets, batch 512, on the default device
    memfit bench codecs --quick --device cpu
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from memfit.cli.bench.common import machine_header, median, spread_warning, sync, table, to_csv
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device

SHAPES = {"mnist": (60_000, (1, 28, 28)), "cifar": (50_000, (3, 32, 32))}
CODECS = ("uint8", "int8", "q8", "q4", "bits1", "fp16", "bf16", "float32")
TARGET_BYTES = {"uint8": 0.25, "int8": 0.25, "q8": 0.25, "q4": 0.125, "bits1": 1 / 32}


def images(n: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """uint8 images with some spatial structure (smooth gradients plus noise), generated fast."""
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 200, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    out = np.empty((n, *shape), np.uint8)
    for s in range(0, n, 10_000):
        k = min(10_000, n - s)
        noise = rng.integers(0, 56, (k, *shape), dtype=np.uint8)
        out[s:s + k] = base.astype(np.uint8) + noise
    return out


def _time_batches(fn, batches, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for idx in batches:
        fn(idx)
    sync(device)
    return (time.perf_counter() - t0) / len(batches)


def run(sets=("mnist", "cifar"), codecs=CODECS, batch: int = 512, device=None, repeat: int = 15,
        n_batches: int = 40, scale: float = 1.0, csv: str | None = None, as_json: bool = False) -> list[dict]:
    """Measure every codec on every set; print the table and the target lines; return the rows."""
    dev = resolve_device(device)
    print(machine_header(dev))
    rows = []
    for name in sets:
        n, shape = SHAPES[name]
        n = max(batch, int(n * scale))
        raw = images(n, shape)
        labels = np.arange(n) % 10
        g = torch.Generator().manual_seed(0)
        batches = [torch.randint(0, n, (batch,), generator=g).to(dev) for _ in range(n_batches)]
        ref = CompactDataset.from_arrays(raw, labels, codec="float32", normalize="dataset", device="cpu")
        dense_x = ref.batch(slice(None))[0].to(dev)              # (N, *shape) normalised float32
        dense_y = torch.from_numpy(labels).to(dev)
        baseline = lambda idx, dx=dense_x, dy=dense_y: (dx.index_select(0, idx), dy.index_select(0, idx))
        contenders = {"float32 gather": baseline}
        held = {"float32 gather": dense_x.nbytes + dense_y.nbytes}
        rows.append({"set": name, "codec": "float32 gather", "bytes held": held["float32 gather"],
                     "x bytes / float32": 1.0, "max abs error": 0.0})
        datasets = {}
        for codec in codecs:
            data = (raw > 127) if codec == "bits1" else raw
            ds = CompactDataset.from_arrays(data, labels, codec=codec, normalize="dataset", device=dev)
            datasets[codec] = ds
            contenders[codec] = ds.gather
            held[codec] = ds.nbytes
        # Each codec is timed in alternation with its own baseline run (A/B), so both see the same
        # allocator state and machine noise; interleaving all codecs at once churns malloc's
        # thresholds (large frees move glibc's mmap threshold) and distorts every figure.
        for k, fn in contenders.items():
            if k == "float32 gather":
                continue
            ts, bs = [], []
            for f in (baseline, fn):                              # warm-up
                _time_batches(f, batches[:5], dev)
            for _ in range(repeat):
                bs.append(_time_batches(baseline, batches, dev))
                ts.append(_time_batches(fn, batches, dev))
            t, base_t = median(ts, f"{name} {k}"), median(bs, f"{name} float32 gather beside {k}")
            ds = datasets[k]
            x_ratio = (ds.nbytes - ds.y.nbytes) / (4 * n * int(np.prod(shape)))   # rows + decode parameters
            rows.append({"set": name, "codec": k, "bytes held": held[k], "x bytes / float32": round(x_ratio, 5),
                         "max abs error": ds.codec.max_abs_error, "us/batch": t * 1e6,
                         "float32 us/batch": base_t * 1e6, "samples/s": batch / t,
                         "vs float32 gather": base_t / t})
        del dense_x, datasets, contenders, baseline
    cols = ["set", "codec", "bytes held", "x bytes / float32", "max abs error", "us/batch", "float32 us/batch",
            "samples/s", "vs float32 gather"]
    print(f"# batch {batch}, random indices, normalize='dataset'; median of {repeat} runs of {n_batches} batches, "
          "each codec alternating with its own float32-gather run")
    print(table(rows, cols, bytes_columns={"bytes held"}))
    print(summary(rows))
    warning = spread_warning()
    if warning:
        print(warning)
    if csv:
        to_csv(rows, csv)
    if as_json:
        print(json.dumps(rows))
    return rows


def summary(rows: list[dict]) -> str:
    """PASS/MISS lines for the targets: compact bytes and uint8 decode throughput."""
    lines = []
    for r in rows:
        want = TARGET_BYTES.get(r["codec"])
        if want is not None:
            ok = abs(r["x bytes / float32"] - want) < 1e-3
            lines.append(f"{'PASS' if ok else 'MISS'}  {r['set']:<5} {r['codec']:<6} bytes ratio "
                         f"{r['x bytes / float32']:.5f} (target {want:g} + per-channel parameters)")
        if r["codec"] == "uint8":
            ok = r["vs float32 gather"] >= 1.0
            lines.append(f"{'PASS' if ok else 'MISS'}  {r['set']:<5} uint8 decode throughput "
                         f"{r['vs float32 gather']:.2f}x the float32 gather (target >= 1.0x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    from memfit.cli.options import count_arg, device_arg, names_arg
    p = argparse.ArgumentParser(prog="memfit bench codecs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default="mnist,cifar", type=names_arg(tuple(SHAPES), "set"),
                   help=f"comma-separated, from {', '.join(SHAPES)} (default both)")
    p.add_argument("--codecs", default=",".join(CODECS), type=names_arg(CODECS, "codec"),
                   help=f"comma-separated, from {', '.join(CODECS)} (default all)")
    p.add_argument("--batch", type=count_arg(1), default=512, help="samples per batch (default 512)")
    p.add_argument("--device", default=None, type=device_arg,
                   help="cpu, cuda, cuda:1 (default: first CUDA device, else cpu)")
    p.add_argument("--repeat", type=count_arg(1), default=15, help="timed rounds per codec (default 15)")
    p.add_argument("--quick", action="store_true", help="a tenth of the data and fewer repeats (for tests)")
    p.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    a = p.parse_args(argv)
    run(sets=a.sets, codecs=a.codecs, batch=a.batch, device=a.device,
        repeat=3 if a.quick else a.repeat, n_batches=10 if a.quick else 40, scale=0.1 if a.quick else 1.0,
        csv=a.csv, as_json=a.json)
    return 0

"""Loader benchmark: memfit's strategies (resident / stream / macro) against what users write today.

Baselines, measured side by side in one process (every contender runs once per round, rounds
repeated, medians reported):
- `torch.utils.data.DataLoader(TensorDataset(float32 x, y), batch_size, shuffle=True)`, num_workers=0;
- a float32 tensor gathered with a random permutation (airbench), holding 4x the bytes of uint8.
memfit's strategies run on the compact uint8 dataset over a grid of macro and micro batch sizes.
Then (not with --quick) host memory over 5 epochs of a 502 MB memory-mapped file at a 64 MiB budget
(`host_memory`): growth must stop after the first epoch and stay within the budget. Last, the resident loader
against a hand-written gather + decode (`against_loop`), paired round by round, on MNIST- and CIFAR-shaped
data at batches 256 and 512: the target, >= 0.95x its images/s on every row.

Run:
    memfit bench loaders --quick
    memfit bench loaders --plot loaders.png --data my_images.npy
    memfit bench loaders --paired-only --paired 30 --clock cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from memfit import loader
from memfit.budget import format_bytes
from memfit.cli.bench import augmentation, host_memory
from memfit.cli.bench.augmentation import reused_loop
from memfit.cli.bench.codecs import images
from memfit.cli.bench.common import in_turn, machine_header, median, spread_warning, sync, table
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device


def _epoch_time(make_iter, device, clock=time.perf_counter) -> float:
    sync(device)
    t0 = clock()
    for _ in make_iter():
        pass
    sync(device)
    return clock() - t0


def _contenders(raw, labels, micro_sizes, macro_sizes, device, seed=0):
    """{name: (row fields, make_iter)} for every configuration of the grid."""
    ds = CompactDataset.from_arrays(raw, labels, normalize="dataset", device="cpu")
    dense = ds.batch(slice(None))[0].to(device)                   # (N, C, H, W) normalised float32
    dense_y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device)
    dense_bytes = dense.nbytes + dense_y.nbytes
    g = torch.Generator().manual_seed(seed)
    tds = torch.utils.data.TensorDataset(dense.cpu(), dense_y.cpu())
    # the same normalised values stored as float32 (4x the bytes of uint8): what a stream of float32 copies
    wide = CompactDataset.from_arrays(dense.cpu().numpy(), labels, codec="float32", device="cpu") \
        if device.type == "cuda" else None
    out = {}
    for b in micro_sizes:
        dl = torch.utils.data.DataLoader(tds, batch_size=b, shuffle=True, num_workers=0, generator=g)
        if device.type == "cuda":
            make = lambda dl=dl: ((x.to(device, non_blocking=True), y.to(device)) for x, y in dl)
        else:
            make = lambda dl=dl: iter(dl)
        out[f"DataLoader float32 b{b}"] = ({"strategy": "DataLoader", "data": "float32", "macro": "",
                                            "micro": b, "bytes held": dense_bytes}, make)

        def gather(b=b):
            perm = torch.randperm(len(dense), device=device)
            for idx in perm.split(b):
                yield dense.index_select(0, idx), dense_y.index_select(0, idx)
        out[f"float32 gather b{b}"] = ({"strategy": "gather", "data": "float32", "macro": "", "micro": b,
                                        "bytes held": dense_bytes}, gather)
        out[f"uint8 reused loop b{b}"] = ({"strategy": "reused loop", "data": "uint8", "macro": "", "micro": b,
                                           "bytes held": ds.to(device).nbytes}, reused_loop(ds, b, device))
        for strategy in ("resident", "stream"):
            ld = loader(ds, b, strategy=strategy, device=device, seed=seed, budget="64GiB")
            out[f"{strategy} b{b}"] = ({"strategy": strategy, "data": "uint8", "macro": "", "micro": b,
                                        "bytes held": ld.nbytes}, lambda ld=ld: iter(ld))
        if device.type == "cuda":     # the GPU targets: 4x fewer bytes over the bus, and the copy hidden
            ld = loader(wide, b, strategy="stream", device=device, seed=seed, budget="64GiB")
            out[f"stream float32 b{b}"] = ({"strategy": "stream float32", "data": "float32", "macro": "", "micro": b,
                                            "bytes held": ld.nbytes}, lambda ld=ld: iter(ld))
            ld = loader(ds, b, strategy="stream", device=device, seed=seed, budget="64GiB", prefetch=False)
            out[f"stream no prefetch b{b}"] = ({"strategy": "stream, no prefetch", "data": "uint8", "macro": "",
                                                "micro": b, "bytes held": ld.nbytes}, lambda ld=ld: iter(ld))
        for m in macro_sizes:
            if m < 2 * b or m % b or m >= len(ds):
                continue
            ld = loader(ds, b, strategy="macro", macro_batch=m, device=device, seed=seed, budget="64GiB")
            out[f"macro {m} b{b}"] = ({"strategy": "macro", "data": "uint8", "macro": m, "micro": b,
                                       "bytes held": ld.nbytes}, lambda ld=ld: iter(ld))
    return out


def run(n: int = 60_000, micro_sizes=(128, 512, 2048), macro_sizes=(2048, 8192, 32768), repeat: int = 5,
        device=None, data: str | None = None, plot: str | None = None, as_json: bool = False,
        host_memory_mb: int = 502, clock: str = "wall", paired: int = 20, paired_n: int | None = None) -> list[dict]:
    """Measure the grid; print the table, the targets and the recommendation, then (`paired` rounds, 0: none)
    `run_paired`; return the grid's rows. `clock` 'cpu': the CPU seconds of this process at one torch thread (the
    contenders all run in it), instead of wall seconds."""
    dev = resolve_device(device)
    now = _clock(clock)
    print(machine_header(dev))
    if data:
        from memfit.readers import load_array
        raw = load_array(data)
        if isinstance(raw, dict):
            raise ValueError(f"--data expects a .npy file of images (N, C, H, W); found an archive: {data}; "
                             "save one of its arrays with np.save and pass that file")
        raw = np.asarray(raw[:n]) if n else np.asarray(raw)
        name = data
    else:
        raw, name = images(n, (1, 28, 28)), f"synthetic MNIST-shaped uint8 (n={n})"
    labels = np.arange(len(raw)) % 10
    cont = _contenders(raw, labels, micro_sizes, macro_sizes, dev)
    for _, make in cont.values():                                 # warm-up: allocations, first touches
        _epoch_time(make, dev)
    times: dict[str, list[float]] = {k: [] for k in cont}
    for r in range(repeat):                        # rounds: every contender once each, in turn (ABBA)
        for k, (_, make) in (list(cont.items()) if r % 2 == 0 else list(cont.items())[::-1]):
            times[k].append(_epoch_time(make, dev, now))
    rows = []
    for k, (fields, _) in cont.items():
        t = median(times[k], k)
        rows.append({**fields, "s/epoch": t, "samples/s": len(raw) / t})
    by = {(r["strategy"], r["macro"], r["micro"]): r for r in rows}
    dense_bytes = next(r["bytes held"] for r in rows if r["data"] == "float32")   # the same data as float32
    for r in rows:
        b = r["micro"]
        r["vs DataLoader"] = r["samples/s"] / by[("DataLoader", "", b)]["samples/s"]
        r["vs float32 gather"] = r["samples/s"] / by[("gather", "", b)]["samples/s"]
        r["vs resident"] = r["samples/s"] / by[("resident", "", b)]["samples/s"]
        r["vs reused loop"] = r["samples/s"] / by[("reused loop", "", b)]["samples/s"]
        r["bytes vs float32"] = r["bytes held"] / dense_bytes
        r["bytes held"] = format_bytes(r["bytes held"])
    what = "CPU seconds at one torch thread" if clock == "cpu" else "wall seconds"
    print(f"# {name}, {len(raw)} samples, device {dev}; median of {repeat} rounds of one epoch each, all "
          f"contenders alternating in every round (ABBA); {what}")
    print(table(rows))
    print(targets(rows, dev))
    warning = spread_warning()
    if warning:
        print(warning)
    best = max((r for r in rows if r["data"] == "uint8"), key=lambda r: r["samples/s"])
    auto = loader(CompactDataset.from_arrays(raw[:1], labels[:1], device="cpu"), 1, device=dev)
    print(f"recommended here: '{best['strategy']}'" + (f" macro {best['macro']}" if best["macro"] else "")
          + f" at batch {best['micro']} ({best['samples/s']:,.0f} samples/s); memfit.loader(strategy='auto') picks "
          f"'resident' whenever the compact data fits the budget (here: {auto.strategy} for a small set)")
    if host_memory_mb:
        print(host_memory_line(host_memory_mb))
    if plot:
        _plot(rows, plot)
    if as_json:
        print(json.dumps(rows))
    if paired:
        run_paired(paired, dev, clock, paired_n)
    return rows


def _clock(clock: str):
    """What an epoch is timed with: wall seconds, or ('cpu') this process's CPU seconds at one torch thread."""
    if clock == "cpu":
        torch.set_num_threads(1)
        return time.process_time
    return time.perf_counter


def run_paired(rounds: int = 20, device=None, clock: str = "wall", n: int | None = None) -> list[dict]:
    """Print `against_loop`'s table and verdict; return its rows."""
    dev = resolve_device(device)
    now = _clock(clock)
    what = "CPU seconds at one torch thread" if clock == "cpu" else "wall seconds"
    print(f"# the resident loader against a hand-written gather + decode, device {dev}: {rounds} rounds of one epoch "
          f"each after one of warm-up, the three alternating in every round (ABBA); ratios of images/s per round "
          f"(median, quartiles); {what}")
    rows = against_loop(rounds=rounds, device=dev, clock=now, n=n)
    print(table(rows))
    print(loop_verdict(rows))
    warning = spread_warning()
    if warning:
        print(warning)
    return rows


def targets(rows: list[dict], dev: torch.device) -> str:
    """PASS/MISS lines for the loader targets (batch 512)."""
    by = {(r["strategy"], r["macro"], r["micro"]): r for r in rows}
    lines = []
    res = by.get(("resident", "", 512))
    if res is None:
        return "(targets are stated at batch 512, which this run did not measure)"
    ok = res["vs DataLoader"] >= 15
    lines.append(f"{'PASS' if ok else 'MISS'}  resident uint8 {res['vs DataLoader']:.1f}x the DataLoader samples/s "
                 "(target >= 15x)")
    ok = res["vs float32 gather"] >= 1.0
    lines.append(f"{'PASS' if ok else 'MISS'}  resident uint8 {res['vs float32 gather']:.2f}x the float32 gather "
                 f"holding {res['bytes held']} vs {by[('gather', '', 512)]['bytes held']} (target >= 1.0x)")
    loop = by[("reused loop", "", 512)]
    lines.append(f"info  resident uint8 {res['vs reused loop']:.2f}x a hand-written gather + decode into reused "
                 f"buffers ({res['samples/s']:,.0f} vs {loop['samples/s']:,.0f} samples/s; the target, >= 0.95x, is "
                 "judged on paired rounds: `against_loop`)")
    for r in rows:
        if r["strategy"] == "macro" and r["micro"] == 512:
            ok = r["vs resident"] >= 0.8
            lines.append(f"{'PASS' if ok else 'MISS'}  macro {r['macro']} {r['vs resident']:.2f}x resident "
                         "(target >= 0.8x)")
    if dev.type != "cuda":
        lines.append("n/a   GPU targets (stream uint8 >= 3x stream float32; prefetch hides >= 80% of the copy): "
                     "no CUDA device here")
        return "\n".join(lines)
    stream, wide = by.get(("stream", "", 512)), by.get(("stream float32", "", 512))
    inline = by.get(("stream, no prefetch", "", 512))
    if stream is None or wide is None or inline is None:
        lines.append("MISS  GPU targets: the stream rows at batch 512 were not measured")
        return "\n".join(lines)
    ratio = stream["samples/s"] / wide["samples/s"]
    lines.append(f"{'PASS' if ratio >= 3 else 'MISS'}  stream uint8 {ratio:.2f}x stream float32 samples/s "
                 "(4x fewer bytes copied to the device; target >= 3x)")
    t_res, t_stream, t_inline = res["s/epoch"], stream["s/epoch"], inline["s/epoch"]
    copy = t_inline - t_res                         # what copying costs an epoch when nothing overlaps it
    hidden = (t_inline - t_stream) / copy if copy > 0 else 1.0
    lines.append(f"{'PASS' if hidden >= 0.8 else 'MISS'}  prefetch hides {hidden:.0%} of the copy (an epoch: "
                 f"{t_inline:.3f} s without prefetch, {t_stream:.3f} s with, {t_res:.3f} s resident, nothing to "
                 "copy; target >= 80%)")
    return "\n".join(lines)


SHAPES = (("MNIST-shaped", (1, 28, 28), 60_000), ("CIFAR-shaped", (3, 32, 32), 50_000))


def against_loop(batches=(256, 512), rounds: int = 20, device=None, clock=time.perf_counter,
                 n: int | None = None) -> list[dict]:
    """memfit's resident loader against the hand-written gather + decode (`augmentation.reused_loop`: the same
    kernels into buffers allocated once, writing over the batch it handed out last; and the same with two output
    buffers in turn, as memfit keeps the batch you hold) on MNIST- and CIFAR-shaped uint8 data (`n` samples, at
    most each set's size): one epoch of each per round, in turn (ABBA), after a round of warm-up. The ratios are
    paired, per round (a busy machine slows the three alike): images/s of memfit over the loop's, their median and
    quartiles."""
    dev = resolve_device(device)
    rows = []
    for name, shape, size in SHAPES:
        size = size if n is None else min(n, size)
        ds = CompactDataset.from_arrays(images(size, shape), np.arange(size) % 10, normalize="dataset",
                                        device="cpu").to(dev)
        for b in batches:
            ld = loader(ds, b, strategy="resident", device=dev, seed=0, budget="64GiB")
            fns = {"memfit": lambda ld=ld: _drain(iter(ld)), "loop": _drained(reused_loop(ds, b, dev)),
                   "loop2": _drained(reused_loop(ds, b, dev, outputs=2))}
            t = in_turn(fns, rounds, 1, dev, clock)
            what = f"{name} b{b}"
            row = {"data": f"{name} {size:,}x{'x'.join(map(str, shape))}", "batch": b,
                   "memfit images/s": size / median(t["memfit"], f"memfit {what}"),
                   "loop images/s": size / median(t["loop"], f"loop {what}")}
            median(t["loop2"], f"loop2 {what}")
            for k, col in (("loop", "vs loop"), ("loop2", "vs loop, 2 buffers")):
                r = [a / m for a, m in zip(t[k], t["memfit"], strict=True)]
                q1, _, q3 = statistics.quantiles(r, n=4) if len(r) > 1 else r * 3
                row[col], row[f"{col}, quartiles"] = statistics.median(r), f"{q1:.2f}-{q3:.2f}"
            rows.append(row)
    return rows


def _drain(it) -> None:
    for _ in it:                    # holds each batch while the next is made, as a training loop does
        pass


def _drained(epoch):
    return lambda: _drain(epoch())


def loop_verdict(rows: list[dict]) -> str:
    """PASS/MISS: memfit's resident loader >= 0.95x the hand-written gather + decode on every row of
    `against_loop` (median of the paired ratios); the two-buffer figures beside it."""
    worst = min(rows, key=lambda r: r["vs loop"])
    ok = worst["vs loop"] >= 0.95
    lo2, hi2 = (f(r["vs loop, 2 buffers"] for r in rows) for f in (min, max))
    return (f"{'PASS' if ok else 'MISS'}  resident uint8 {min(r['vs loop'] for r in rows):.2f}-"
            f"{max(r['vs loop'] for r in rows):.2f}x a hand-written gather + decode into one reused output buffer "
            f"(worst: {worst['data'].split()[0]} batch {worst['batch']}, quartiles {worst['vs loop, quartiles']}; "
            f"target >= 0.95x on every row); {lo2:.2f}-{hi2:.2f}x the same loop with two output buffers in turn, "
            "as memfit keeps the batch you hold while it makes the next")


def host_memory_line(mb: int, budget: str = "64MiB", epochs: int = 5) -> str:
    """The PASS/MISS line of `host_memory` for a CIFAR-shaped file of `mb` MB (written to a temporary folder)."""
    with tempfile.TemporaryDirectory() as d:
        path = host_memory.write_images(Path(d) / "images.npy", mb * 10**6 // 3072)
        r = host_memory.run_child(str(path), budget, epochs)
    return host_memory.verdict(r)[2] + f" [{mb} MB memory-mapped .npy, labels and outputs kept]"


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['strategy']}{' ' + str(r['macro']) if r['macro'] else ''} b{r['micro']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
    colors = {"DataLoader": "tab:gray", "gather": "tab:orange", "reused loop": "tab:olive",
              "resident": "tab:blue", "stream": "tab:green", "stream float32": "tab:red",
              "stream, no prefetch": "tab:cyan", "macro": "tab:purple"}
    ax.barh(labels, [r["samples/s"] for r in rows], color=[colors[r["strategy"]] for r in rows])
    ax.set_xscale("log")
    ax.set_xlabel("samples/s (log)")
    ax.invert_yaxis()
    ax.set_title("memfit loaders vs DataLoader and a float32 gather")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def main(argv=None) -> int:
    from memfit.cli.options import count_arg, counts_arg, device_arg
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--augment" in argv:                    # augmented CIFAR-shaped batches: a benchmark of its own
        return augmentation.main(argv)
    p = argparse.ArgumentParser(prog="memfit bench loaders", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--augment", action="store_true", help="crop + flip + cutout on CIFAR-shaped data against "
                   "DataLoader, a hand-written batch-wide reference and airbench (see memfit bench loaders "
                   "--augment --help)")
    p.add_argument("--n", type=count_arg(1), default=60_000, help="samples (default 60,000, MNIST's size)")
    p.add_argument("--micro", default="128,512,2048", type=counts_arg(1), help="comma-separated batch sizes")
    p.add_argument("--macro", default="2048,8192,32768", type=counts_arg(1), help="comma-separated macro-batch sizes")
    p.add_argument("--repeat", type=count_arg(1), default=5, help="rounds of one epoch each (default 5)")
    p.add_argument("--device", default=None, type=device_arg,
                   help="cpu, cuda, cuda:1 (default: first CUDA device, else cpu)")
    p.add_argument("--data", default=None, help="a .npy file of images (N, C, H, W) instead of synthetic data")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart of samples/s")
    p.add_argument("--quick", action="store_true", help="batch 512 only, 2 macro sizes, 3 rounds, no host-memory "
                   "check (< 60 s)")
    p.add_argument("--host-memory", type=count_arg(0), default=502, metavar="MB",
                   help="size of the file streamed for the host-memory check (default 502, as in issue 26; 0 skips)")
    p.add_argument("--json", action="store_true", help="also print the rows as JSON")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: seconds an epoch takes; cpu: CPU seconds it uses at one torch thread (steadier on a "
                        "busy machine)")
    p.add_argument("--paired", type=count_arg(0), default=20, metavar="ROUNDS",
                   help="rounds of the paired comparison of the resident loader with a hand-written gather + decode "
                        "on MNIST- and CIFAR-shaped data, batches 256 and 512 (default 20; 0 skips it)")
    p.add_argument("--paired-only", action="store_true", help="only that comparison (no grid, no host-memory check)")
    a = p.parse_args(argv)
    micro, macro, repeat, host, paired, paired_n = a.micro, a.macro, a.repeat, a.host_memory, a.paired, None
    if a.quick:
        micro, macro, repeat, host, paired, paired_n = (512,), (4096, 16384), 3, 0, min(paired, 4), 10_000
    if a.paired_only:
        _clock(a.clock)                             # one torch thread before the header says how many
        print(machine_header(resolve_device(a.device)))
        run_paired(paired, a.device, a.clock, paired_n)
        return 0
    run(n=a.n, micro_sizes=micro, macro_sizes=macro, repeat=repeat, device=a.device, data=a.data, plot=a.plot,
        as_json=a.json, host_memory_mb=host, clock=a.clock, paired=paired, paired_n=paired_n)
    return 0

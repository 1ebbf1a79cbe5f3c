"""`memfit demo`: the whole job on real data in under a minute: store, train, plan, evaluate.

On scikit-learn's bundled digits (or `--data` of your own) with a memory budget (default 64MiB):
1. stores the images compactly (uint8) and prints float32 bytes against compact bytes;
2. trains a small CNN through `memfit.loader` (strategy chosen by the budget, with its reason); then
   takes steps on batches of 4x the batch size under an emulated device too small for them, with
   `memfit.accumulate` (micro-batches from the training memory model), beside plain steps on the same
   batches: both loss curves and their largest difference are printed;
3. plans the model's activation memory (the planned forward's peak against eager's, by the allocator; the
   arena, naive and lower bound) and finds the largest evaluation batch that fits the budget;
4. evaluates on the held-out split with `memfit.evaluate` (auto chunk size) for the exact accuracy;
5. writes arena.png and loss.png into the `--plot` folder (default memfit-demo/).

With `--augment`, the training batches are augmented on the device from the stored uint8 bytes
(`memfit.augment`: a random crop with reflect padding and a flip for colour images, a random shift for
digits), and the evaluation stays unaugmented.

Run:
    memfit demo
    memfit demo --augment --data cifar10:~/data/cifar-10-python.tar.gz
    memfit demo --epochs 3 --budget 16MiB --plot demo-pictures --json
    torchrun --standalone --nproc-per-node=2 -m memfit demo --distributed
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from memfit.budget import check_count, format_bytes, parse_bytes
from memfit.cli.data import SPECS, open_data
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device
from memfit.messages import plural
from memfit.progress import progress_bar


def _activation_peaks(model: torch.nn.Module, planned, x: torch.Tensor) -> tuple[int, int]:
    """The most bytes the allocator held during one eager forward and one planned forward on `x` (the planned
    arena included, allocated once before the call: counted as held), after a warm-up call of each."""
    from memfit.device.measure import track_memory
    x = torch.zeros_like(x)
    peaks = []
    with torch.inference_mode():
        for fn, held in ((model, 0), (planned, planned.report.arena_bytes)):
            fn(x)
            with track_memory(x.device) as mem:
                out = fn(x)
                del out
            peaks.append(mem.peak + held)
    return peaks[0], peaks[1]


def small_cnn(in_channels: int, classes: int, side: int) -> torch.nn.Module:
    """Three 3x3 convolutions and a linear head; pools only when the image is large enough."""
    pool = [torch.nn.MaxPool2d(2)] if side >= 16 else []
    return torch.nn.Sequential(
        torch.nn.Conv2d(in_channels, 32, 3, padding=1), torch.nn.ReLU(), *pool,      # (N, 32, H', W')
        torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), *pool,
        torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU(),
        # a 4x4 grid keeps where the strokes are (a global average loses it and learns slowly)
        torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(),                            # (N, 64 * 16)
        torch.nn.Linear(64 * 16, classes))


def augment_ops(sample_shape: tuple[int, ...]) -> list:
    """The demo's augmentation for images of `sample_shape` (C, H, W): colour images a random crop of their size
    with reflect padding of an eighth of the side and a left-right flip (the CIFAR recipe); others (digits,
    which a flip would change into other symbols) a random shift by an eighth of the side, zero-padded.

    Example:
        >>> augment_ops((3, 32, 32))
        [Crop(size=32, padding=4, mode='reflect', fill=0, layout='CHW'), Flip(p=0.5, layout='CHW')]
        >>> augment_ops((1, 8, 8))
        [Translate(shift=1, mode='zero', fill=0, layout='CHW')]
    """
    from memfit import augment
    side = min(sample_shape[-2:])
    pad = max(1, side // 8)
    if sample_shape[0] == 3:
        return [augment.Crop(sample_shape[-1], padding=pad, mode="reflect"), augment.Flip()]
    return [augment.Translate(pad)]


def _say(quiet: bool, *args) -> None:
    if not quiet:
        print(*args, flush=True)


def run(data: str = "digits", *, budget="64MiB", device=None, epochs: int = 8, batch_size: int = 64,
        lr: float = 3e-3, seed: int = 0, out: str | os.PathLike = "memfit-demo", as_json: bool = False,
        distributed: bool = False, plots: bool = True, augment: bool = False) -> dict:
    """Run the demo and return its figures (what `--json` prints; on a rank other than 0 of a distributed run,
    which prints nothing, without the plan's figures: "plan" and "max_eval_batch" None)."""
    from memfit import evaluate, loader, max_batch_size, plan

    t0 = time.perf_counter()
    epochs, batch_size = check_count("epochs", epochs, 1), check_count("batch_size", batch_size, 1)
    seed = check_count("seed", seed, 0)
    if plots:
        check_folder(out)                       # before the work, not after a minute of training
    rank, world = _init_distributed(device) if distributed else (0, 1)
    quiet = as_json or rank != 0
    dev = resolve_device(device if device is not None else (_local_cuda() if distributed else None))
    limit = parse_bytes(budget)
    torch.manual_seed(seed)

    d = open_data(data, seed=seed, test_fraction=0.2)     # demo trains: an .npz of x, y only is split
    train = CompactDataset.from_arrays(d.x_train, d.y_train, normalize="dataset", device="cpu")
    test = CompactDataset.from_arrays(d.x_test, d.y_test, normalize=(train.mean, train.std), device="cpu")
    dense = train.dense_nbytes + test.dense_nbytes
    compact = train.nbytes + test.nbytes
    _say(quiet, f"data     {d.name}: {len(train)} train + {len(test)} test images of shape "
                f"{tuple(train.sample_shape)}, {d.num_classes} classes")
    _say(quiet, f"storage  float32 {format_bytes(dense)} -> {train.codec.name} {format_bytes(compact)} "
                f"({dense / compact:.1f}x smaller)")

    # 2. train through the loader: the budget picks the strategy
    sample_shape = tuple(train.sample_shape)
    model = small_cnn(sample_shape[0], d.num_classes, sample_shape[-1]).to(dev)
    net = _ddp(model, dev) if distributed else model
    ops = augment_ops(sample_shape) if augment else []
    ld = loader(train, batch_size, budget=limit, device=dev, seed=seed, distributed=distributed, augment=ops)
    _say(quiet, f"loader   {ld.strategy}: {ld.explain()}")
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        bar = progress_bar(len(ld), f"epoch {epoch + 1}/{epochs}", unit="batch", enabled=not quiet)
        total, n, t_epoch = torch.zeros((), device=dev), 0, time.perf_counter()
        for i, (x, y) in enumerate(ld):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.detach() * len(y)          # summed on the device: no sync per batch
            n += len(y)
            bar.update(1)
            if not quiet and i % 10 == 9:           # .item() waits for the device: only now and then
                bar.set_postfix_str(f"loss {total.item() / n:.4f}", refresh=False)
        bar.close()
        losses.append(total.item() / max(n, 1))
        _say(quiet, f"epoch {epoch + 1:>2}/{epochs}  loss {losses[-1]:.4f}  ({time.perf_counter() - t_epoch:.1f} s)")

    accumulated = None if distributed else train_under_budget(train, d.num_classes, dev, seed, 4 * batch_size, lr,
                                                              quiet)

    # 3. plan the activation memory of inference and the largest evaluation batch in the budget: rank 0 reports
    # them (every rank's would be the same figures, shown nowhere)
    model.eval()
    rep = largest = figures = None
    if rank == 0:
        example = torch.empty((batch_size, *sample_shape), device=dev)
        pm = plan(model, (example,))
        rep = pm.report
        eager_peak, planned_peak = _activation_peaks(model, pm, example)
        largest = max_batch_size(model, sample_shape, limit, extra_bytes_per_sample=train.row_nbytes)
        _say(quiet, f"plan     batch {batch_size}: the planned forward holds {format_bytes(planned_peak)} of "
                    f"activations at its peak, eager PyTorch {format_bytes(eager_peak)} "
                    f"({eager_peak / max(planned_peak, 1):.1f}x less; by the allocator): arena "
                    f"{format_bytes(rep.arena_bytes)} (naive {format_bytes(rep.naive_bytes)}, lower bound "
                    f"{format_bytes(rep.lower_bound)}) + {format_bytes(rep.unplanned_bytes)} allocated by torch, "
                    f"parameters {format_bytes(rep.param_bytes)}")
        _say(quiet, f"         largest evaluation batch within {format_bytes(limit)}: {largest}")
        figures = {"batch": batch_size, "naive": rep.naive_bytes, "planned": rep.arena_bytes,
                   "eager_peak": eager_peak, "planned_peak": planned_peak, "lower_bound": rep.lower_bound,
                   "unplanned": rep.unplanned_bytes, "parameters": rep.param_bytes}

    # 4. exact evaluation in chunks sized to the budget
    res = evaluate(model, test, metrics=("accuracy", "loss"), budget=limit, device=dev, progress=not quiet,
                   distributed=distributed)
    _say(quiet, f"evaluate chunk size {res.chunk_size} ({res.reason}); {plural(res.chunks, 'chunk')}, "
                f"{plural(res.n, 'sample')}")
    _say(quiet, f"accuracy {res.metrics['accuracy']:.4f}  loss {res.metrics['loss']:.4f}  (exact, whole test set)")

    # 5. pictures
    files = []
    if plots and rank == 0:
        files = _plots(Path(out), rep, losses, quiet)
    result = {
        "data": d.name, "train": len(train), "test": len(test), "sample_shape": list(sample_shape),
        "device": str(dev), "budget": limit, "world_size": world,
        "bytes": {"float32": dense, "compact": compact, "ratio": dense / compact, "codec": train.codec.name},
        "loader": {"strategy": ld.strategy, "reason": ld.explain(), "batches_per_epoch": len(ld),
                   "augment": [repr(op) for op in ops]},
        "losses": losses,
        "accumulate": accumulated,
        "plan": figures,                                    # None on a rank other than 0 (it reports nothing)
        "max_eval_batch": largest,
        "evaluate": {"chunk_size": res.chunk_size, "chunks": res.chunks, "n": res.n, "runner": res.runner,
                     "accuracy": res.metrics["accuracy"], "loss": res.metrics["loss"], "reason": res.reason},
        "files": [str(f) for f in files],
        "seconds": time.perf_counter() - t0,
    }
    _say(quiet, f"done in {result['seconds']:.1f} s")
    if as_json and rank == 0:
        print(json.dumps(result))
    if distributed:
        torch.distributed.destroy_process_group()
    return result


def train_under_budget(train: CompactDataset, classes: int, dev: torch.device, seed: int, batch: int, lr: float,
                       quiet: bool, steps: int = 5) -> dict:
    """Steps on a batch too large for an emulated device, with `memfit.accumulate`, beside plain steps.

    Two copies of the model start from the same weights. One takes plain steps on batches of `batch`; the
    other `accumulate`s the same batches in micro-batches chosen by the training memory model under a
    budget halfway between one sample's step and the whole batch's. Their loss curves are printed side by
    side: the same curve, up to float reassociation.
    """
    import copy

    from memfit.accumulation.run import accumulate
    from memfit.memory.micro_batch import training_peak
    torch.manual_seed(seed)
    sample_shape = tuple(train.sample_shape)
    plain = small_cnn(sample_shape[0], classes, sample_shape[-1]).to(dev)
    accumulated = copy.deepcopy(plain)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=lr)
    opt_acc = torch.optim.Adam(accumulated.parameters(), lr=lr)
    loss_fn = torch.nn.functional.cross_entropy
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    batches = [train.batch(order[torch.arange(i * batch, (i + 1) * batch) % len(train)]) for i in range(steps)]
    batches = [(x.to(dev), y.to(dev)) for x, y in batches]
    peak, how = training_peak(accumulated, opt_acc, loss_fn, *batches[0])
    budget = (peak(batch) + peak(1)) // 2                  # an emulated device too small for the plain batch
    _say(quiet, f"budget   a training step on {batch} samples needs {format_bytes(peak(batch))}; on an emulated "
                f"device of {format_bytes(budget)} it runs as micro-batches with memfit.accumulate")
    curve_plain, curve_acc, r = [], [], None
    for x, y in batches:
        opt_plain.zero_grad(set_to_none=True)
        loss = loss_fn(plain(x), y)
        loss.backward()
        opt_plain.step()
        curve_plain.append(loss.item())
        r = accumulate(accumulated, opt_acc, (x, y), loss_fn, budget=budget)
        curve_acc.append(r.loss)
    diff = max(abs(a - b) for a, b in zip(curve_plain, curve_acc, strict=True))
    _say(quiet, f"         micro-batch {r.micro_batch} ({r.micro_batches} per step, {r.retries} out-of-memory "
                f"retries): {r.reason.split(' (')[0]}")
    _say(quiet, "         step  plain batch loss  accumulated loss")
    for i, (a, b) in enumerate(zip(curve_plain, curve_acc, strict=True)):
        _say(quiet, f"         {i + 1:>4}  {a:>16.6f}  {b:>16.6f}")
    _say(quiet, f"         max |difference| {diff:.2e} over {steps} steps: the same loss curve")
    return {"batch": batch, "needs": peak(batch), "budget": budget, "micro_batch": r.micro_batch,
            "micro_batches": r.micro_batches, "reason": r.reason, "plain": curve_plain, "accumulated": curve_acc,
            "max_difference": diff}


def _plots(out: Path, report, losses: list[float], quiet: bool) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        _say(quiet, "plots    skipped: matplotlib is not installed (pip install 'memfit[demo]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    arena = report.plot(out / "arena.png")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(1, len(losses) + 1), losses, marker="o")
    ax.set(xlabel="epoch", ylabel="mean training loss", title="memfit demo: training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=120)
    plt.close(fig)
    files = [Path(arena or out / "arena.png"), out / "loss.png"]
    _say(quiet, f"plots    {files[0]} (arena plan), {files[1]} (loss curve)")
    return files


def _local_cuda():
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def _init_distributed(device) -> tuple[int, int]:
    import torch.distributed as dist
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError("--distributed needs the process group variables torchrun sets; start with "
                             "torchrun --standalone --nproc-per-node=2 -m memfit demo --distributed")
        dev = resolve_device(device if device is not None else _local_cuda())
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _ddp(model, dev):
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev] if dev.type == "cuda" else None)


def check_folder(out: str | os.PathLike) -> Path:
    """Create `out` (with its parents) and check that a file can be written there.

    Raises:
        UsageError: `out` cannot be created or written (the command line exits 2 before any work).
    """
    from memfit.cli.options import UsageError
    path = Path(out).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise UsageError(f"--plot: cannot write the pictures into {str(path)!r} ({e.strerror or e}); "
                         "give a writable folder, or --no-plot") from None
    return path


def add_arguments(p: argparse.ArgumentParser) -> None:
    from memfit.cli.options import budget_arg, count_arg, data_arg, device_arg
    p.add_argument("--data", default="digits", type=data_arg, help=f"{SPECS} (default: digits)")
    p.add_argument("--budget", default="64MiB", type=budget_arg,
                   help="memory budget for the loader, plan and evaluation (default 64MiB)")
    p.add_argument("--device", default=None, type=device_arg,
                   help="cpu, cuda, cuda:1 (default: first CUDA device, else cpu)")
    p.add_argument("--epochs", type=count_arg(1), default=8, help="training epochs (default 8)")
    p.add_argument("--batch-size", type=count_arg(1), default=64, help="training batch size (default 64)")
    p.add_argument("--seed", type=count_arg(0), default=0, help="the same seed gives the same run (default 0)")
    p.add_argument("--plot", default="memfit-demo", metavar="FOLDER", dest="out",
                   help="folder for arena.png and loss.png (default memfit-demo/)")
    p.add_argument("--no-plot", action="store_true", help="do not write PNGs")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--distributed", action="store_true", help="one process per rank, started by torchrun")
    p.add_argument("--augment", action="store_true", help="augment the training batches on the device (a crop and "
                   "a flip for colour images, a shift for digits); evaluation stays unaugmented")


def main(args) -> int:
    run(args.data, budget=args.budget, device=args.device, epochs=args.epochs, batch_size=args.batch_size,
        seed=args.seed, out=args.out, as_json=args.json, distributed=args.distributed, plots=not args.no_plot,
        augment=args.augment)
    return 0


if __name__ == "__main__":  # pragma: no cover
    p = argparse.ArgumentParser(prog="memfit demo")
    add_arguments(p)
    sys.exit(main(p.parse_args()))

"""`memfit bench loaders --augment`: augmented CIFAR-shaped batches, memfit's resident loader against what people
write for it, images/s and the device bytes each holds for the data.

The augmentation: `Crop(32, padding=4, mode="reflect")`, `Flip()`, `Cutout(8)` (the standard CIFAR recipe with
cutout). Contenders, each run once per round, the rounds in alternating order (ABBA), medians reported:
- memfit: `memfit.loader(ds, 512, strategy="resident", augment=[...])` on the uint8 set on the device;
- (a) `torch.utils.data.DataLoader` over the normalised float32 set, the same ops per sample (torch's pad, slices,
  flip, a slice set to zero), 2 workers (persistent), `shuffle=True`;
- (b) the same ops written by hand, batch-wide, on the uint8 set on the device, into buffers allocated once,
  parameters drawn per batch on the device (no tables, no checks): the limit memfit is held to;
- (c) airbench's recipe (Jordan, 2024): the set normalised, flipped and reflect-padded once as fp16 copies kept on
  the device, cropped as a whole every epoch (its `batch_crop`), flipped as a whole every other epoch, cutout
  per batch by a mask (its `batch_cutout`);
- and, unaugmented, memfit's resident loader against a hand-written gather + decode into reused buffers.
Bytes: what each holds for the data between batches (the set and its copies, the epoch order, memfit's
parameter tables; the DataLoader's set is in host memory); batch buffers are not counted.

Run:
    memfit bench loaders --augment            # 50,000 samples, 5 rounds
    memfit bench loaders --augment --quick    # 10,000 samples, 3 rounds, < 1 min
    memfit bench loaders --augment --clock cpu --device cuda
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from memfit import augment, loader
from memfit.cli.bench.codecs import images
from memfit.cli.bench.common import in_turn, machine_header, median, spread_warning, table
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device

OPS = (augment.Crop(32, padding=4, mode="reflect"), augment.Flip(), augment.Cutout(8))
PAD, CUT = 4, 8


class _PerSample(torch.utils.data.Dataset):
    """(a): the ops on one float32 sample at a time, as a torchvision-style pipeline does in each worker."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        s = F.pad(self.x[i][None], (PAD,) * 4, mode="reflect")[0]         # (3, 40, 40)
        top, left = torch.randint(0, 2 * PAD + 1, (2,)).tolist()
        s = s[:, top:top + 32, left:left + 32]
        if torch.rand(()) < 0.5:
            s = s.flip(2)
        s = s.clone()
        cy, cx = torch.randint(0, 32, (2,)).tolist()
        s[:, max(cy - CUT // 2, 0):cy - CUT // 2 + CUT, max(cx - CUT // 2, 0):cx - CUT // 2 + CUT] = 0
        return s, self.y[i]


def _decode_ops(ds: CompactDataset) -> list[tuple[int, float, float]]:
    """(channel, scale, shift) of the dataset's decode: value = code * scale + shift, normalised."""
    a, b = ds.codec.affine()
    a, b = a / ds.std, (b - ds.mean) / ds.std
    return [(c, float(a[c]), float(b[c])) for c in range(len(a))]


def reused_loop(ds: CompactDataset, b: int, device: torch.device, outputs: int = 1):
    """The resident loader's work written by hand in plain torch, into buffers allocated once: gather the
    uint8 rows (as 8-byte words), convert into a float32 buffer, one multiply-add per channel (memfit's
    fastest form; two broadcast passes for many channels). `outputs` output buffers in turn: 1 overwrites the
    batch the consumer was given, 2 keep it while the next is made (as memfit does)."""
    x = ds.x.to(device)
    n, row = x.shape[0], x[:1].nbytes
    words = x.view(n, -1).view(torch.int64) if row % 8 == 0 else x.view(n, -1)      # (N, row / 8)
    labels = ds.y.to(device)
    shape = (1, -1) + (1,) * (len(ds.sample_shape) - 1)
    a, c = ds.codec.affine()                         # value = code * a + c, then (value - mean) / std
    if ds.mean is not None:
        a, c = a / ds.std, (c - ds.mean) / ds.std
    scale, shift = (t.float().view(shape).to(device) for t in (a, c))
    per_channel = [(k, float(a[k]), float(c[k])) for k in range(len(a))] if len(a) <= 16 else None
    rows = torch.empty((b, words.shape[1]), dtype=words.dtype, device=device)
    outs = [torch.empty((b, *ds.sample_shape), dtype=torch.float32, device=device) for _ in range(outputs)]

    def epoch():
        for k, idx in enumerate(torch.randperm(n, device=device).split(b)):
            m = len(idx)
            torch.index_select(words, 0, idx, out=rows[:m])
            xb = outs[k % outputs][:m]
            xb.copy_(rows[:m].view(x.dtype).view(m, *x.shape[1:]))
            if per_channel is None:
                xb.mul_(scale).add_(shift)
            else:
                for ch, s, t in per_channel:
                    torch.add(t, xb[:, ch], alpha=s, out=xb[:, ch])
            yield xb, labels.index_select(0, idx).long()
    return epoch


def batched_reference(ds: CompactDataset, b: int, device: torch.device, outputs: int = 1):
    """(b): crop (reflect) + flip + cutout by hand, batch-wide, from the uint8 set: pad the columns, mirror the
    padded batch, cut each output row as one window of a padded row (`unfold` + `index_select`), from the mirror
    where the sample is flipped; fill the cutout squares' positions; decode. Buffers allocated once (`outputs`
    output buffers in turn, as `reused_loop`)."""
    x = ds.x.to(device)
    n, (c, h, w) = x.shape[0], ds.sample_shape
    words, y = x.view(n, -1).view(torch.int64), ds.y.to(device)
    wp, per = w + 2 * PAD, c * h * w
    rows = torch.empty((b, per // 8), dtype=torch.int64, device=device)
    padded = torch.empty((2, b, c, h, wp), dtype=torch.uint8, device=device)      # the batch and its mirror
    codes = torch.empty(b * per, dtype=torch.uint8, device=device)
    outs = [torch.empty((b, c, h, w), device=device) for _ in range(outputs)]
    ar, ops = torch.arange(h, device=device), _decode_ops(ds)
    square = torch.arange(CUT, device=device)

    def epoch():
        for k, idx in enumerate(torch.randperm(n, device=device).split(b)):
            m = len(idx)
            torch.index_select(words, 0, idx, out=rows[:m])
            xb, pd = rows[:m].view(torch.uint8).view(m, c, h, w), padded[:, :m]
            pd[0, ..., PAD:PAD + w].copy_(xb)
            pd[0, ..., :PAD].copy_(xb[..., 1:PAD + 1].flip(3))
            pd[0, ..., PAD + w:].copy_(xb[..., w - 1 - PAD:w - 1].flip(3))
            pd[1].copy_(pd[0].flip(3))
            top, left = torch.randint(0, 2 * PAD + 1, (2, m), device=device)
            flip = torch.rand(m, device=device) < 0.5
            left = torch.where(flip, b * c * h * wp + wp - w - left, left)       # the mirror's window
            r = (top[:, None] + ar - PAD).abs()
            r = torch.where(r >= h, 2 * (h - 1) - r, r)                           # reflected rows
            start = (torch.arange(m * c, device=device).view(m, c, 1) * h + r[:, None]) * wp + left.view(m, 1, 1)
            torch.index_select(padded.view(-1).unfold(0, w, 1), 0, start.view(-1), out=codes[:m * per].view(-1, w))
            cy, cx = torch.randint(0, h, (2, m), device=device) - CUT // 2     # cutout: centre anywhere, clipped
            t0, l0 = cy.clamp(min=0), cx.clamp(min=0)
            hh, ww = (cy + CUT).clamp(max=h) - t0, (cx + CUT).clamp(max=w) - l0
            rr = t0[:, None] + torch.minimum(square, hh[:, None] - 1)
            cc = l0[:, None] + torch.minimum(square, ww[:, None] - 1)
            pos = (torch.arange(m * c, device=device).view(m, c, 1, 1) * h + rr.view(m, 1, -1, 1)) * w
            codes.index_fill_(0, (pos + cc.view(m, 1, 1, -1)).view(-1), 0)
            xo = outs[k % outputs][:m]
            xo.copy_(codes[:m * per].view(m, c, h, w))
            for ch, s, t in ops:
                torch.add(t, xo[:, ch], alpha=s, out=xo[:, ch])
            yield xo, y.index_select(0, idx).long()
    return epoch


class Airbench:
    """(c): airbench's CifarLoader with its cached fp16 copies (airbench94.py), plus airbench96's batch_cutout."""

    def __init__(self, ds: CompactDataset, b: int, device: torch.device):
        self.images = ds.x.to(device).half() / 255                   # airbench: uint8 loaded, then fp16 / 255
        mean, std = (torch.as_tensor(t, dtype=torch.float64) / 255 for t in (ds.mean, ds.std))
        self.mean, self.std = (t.half().view(1, -1, 1, 1).to(device) for t in (mean, std))
        self.labels, self.b, self.epoch, self.proc = ds.y.to(device).long(), b, 0, {}
        self.peak_nbytes = 0

    def __call__(self):
        if self.epoch == 0:                                     # the first epoch makes the copies, kept after
            norm = self.proc["norm"] = (self.images - self.mean) / self.std
            self.proc["flip"] = norm.flip(-1)
            self.proc["pad"] = F.pad(norm, (PAD,) * 4, mode="reflect")
        images = _batch_crop(self.proc["pad"], self.images.shape[-1])
        if self.epoch % 2 == 1:                                 # every other epoch, the whole set flipped
            images = images.flip(-1)
        held = sum(t.nbytes for t in self.proc.values()) + self.images.nbytes + self.labels.nbytes
        self.peak_nbytes = max(self.peak_nbytes, held + 2 * images.nbytes)      # the crop and its flip
        self.epoch += 1
        idx = torch.randperm(len(images), device=images.device)
        for i in range(0, len(images), self.b):
            j = idx[i:i + self.b]
            yield _batch_cutout(images[j], CUT), self.labels[j]


def _batch_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """airbench94's batch_crop for r > 2: rows by each shift's mask, then columns."""
    r = (images.size(-1) - size) // 2
    shifts = torch.randint(-r, r + 1, size=(len(images), 2), device=images.device)
    out = torch.empty((len(images), 3, size, size), device=images.device, dtype=images.dtype)
    tmp = torch.empty((len(images), 3, size, size + 2 * r), device=images.device, dtype=images.dtype)
    for s in range(-r, r + 1):
        mask = shifts[:, 0] == s
        tmp[mask] = images[mask, :, r + s:r + s + size, :]
    for s in range(-r, r + 1):
        mask = shifts[:, 1] == s
        out[mask] = tmp[mask, :, :, r + s:r + s + size]
    return out


def _batch_cutout(inputs: torch.Tensor, size: int) -> torch.Tensor:
    """airbench96's batch_cutout: a size x size square inside the image, by a mask."""
    n, _, h, w = inputs.shape
    cy = torch.randint(0, h - size + 1, (n,), device=inputs.device)
    cx = torch.randint(0, w - size + 1, (n,), device=inputs.device)
    ar = torch.arange(h, device=inputs.device)
    my = (ar >= cy[:, None]) & (ar < cy[:, None] + size)
    mx = (ar[:w] >= cx[:, None]) & (ar[:w] < cx[:, None] + size)
    return inputs.masked_fill(my[:, None, :, None] & mx[:, None, None, :], 0)


def _cpu_seconds(pids: list[int]) -> float:
    """This process's CPU seconds (all its threads) plus those of `pids` (worker processes), from /proc."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick          # utime, stime
        except OSError:
            pass
    return total


def contenders(raw: np.ndarray, labels: np.ndarray, b: int, device: torch.device, workers: int = 2):
    """{name: (row fields, one epoch as a callable)}, and the DataLoader (its workers' pids are read once started)."""
    ds = CompactDataset.from_arrays(raw, labels, normalize="dataset", device="cpu")
    on_dev = ds.to(device)
    uint8_bytes = ds.x.nbytes
    dense = ds.batch(slice(None))[0]                                        # (N, 3, 32, 32) normalised float32
    g = torch.Generator().manual_seed(0)
    dl = torch.utils.data.DataLoader(_PerSample(dense, ds.y.long()), batch_size=b, shuffle=True, generator=g,
                                     num_workers=workers, persistent_workers=workers > 0)
    mf = loader(on_dev, b, strategy="resident", device=device, seed=0, augment=OPS, budget="64GiB")
    plain = loader(on_dev, b, strategy="resident", device=device, seed=0, budget="64GiB")
    held = lambda ld: sum(n for name, n in ld.choice.items if name.startswith(("compact", "epoch order",
                                                                               "augmentation parameters")))
    air = Airbench(ds, b, device)
    drain = lambda it: (lambda: [None for _ in it()])
    out = {
        "memfit": ({"contender": "memfit resident, crop + flip + cutout", "bytes": held(mf)},
                   drain(lambda: iter(mf))),
        "reference": ({"contender": "(b) by hand, batch-wide (the limit)", "bytes": uint8_bytes + ds.y.nbytes},
                      drain(batched_reference(ds, b, device))),
        "DataLoader": ({"contender": f"(a) DataLoader, per sample, float32, {workers} workers",
                        "bytes": dense.nbytes + ds.y.nbytes * 8},
                       drain(lambda: ((xb.to(device), yb.to(device)) for xb, yb in dl))),
        "airbench": ({"contender": "(c) airbench, cached fp16 copies", "bytes": 0}, drain(air)),
        "plain": ({"contender": "memfit resident, no augmentation", "bytes": held(plain)},
                  drain(lambda: iter(plain))),
        "loop": ({"contender": "by hand: gather + decode, no augmentation", "bytes": uint8_bytes + ds.y.nbytes},
                 drain(reused_loop(ds, b, device))),
        "loop2": ({"contender": "by hand: gather + decode, 2 output buffers in turn",
                   "bytes": uint8_bytes + ds.y.nbytes}, drain(reused_loop(ds, b, device, outputs=2))),
    }
    return out, dl, air, uint8_bytes


def run(n: int = 50_000, b: int = 512, repeat: int = 5, device=None, clock: str = "wall", workers: int = 2) -> list:
    """Measure; print the table and the PASS/MISS lines; return the rows."""
    dev = resolve_device(device)
    if clock == "cpu":
        torch.set_num_threads(1)               # the CPU time of one thread's work, whatever else runs
    print(machine_header(dev))
    raw, labels = images(n, (3, 32, 32)), np.arange(n) % 10
    cont, dl, air, uint8_bytes = contenders(raw, labels, b, dev, workers)
    pids: list[int] = []
    if clock == "cpu":
        iter(dl)                               # starts the persistent workers: this process's children
        pids = [p.pid for p in multiprocessing.active_children()]
    now = (lambda: _cpu_seconds(pids)) if clock == "cpu" else time.perf_counter
    times = in_turn({k: f for k, (_, f) in cont.items()}, repeat, 1, dev, clock=now)
    cont["airbench"][0]["bytes"] = air.peak_nbytes
    rows = []
    for k, (fields, _) in cont.items():
        t = median(times[k], k)
        rows.append({**fields, "s/epoch": t, "images/s": n / t, "bytes vs uint8 set": fields["bytes"] / uint8_bytes})
    mf, ref = rows[0], rows[1]
    for r in rows:
        r["vs memfit"] = r["images/s"] / mf["images/s"]
    what = "CPU seconds (this process and the DataLoader's workers)" if clock == "cpu" else "wall seconds"
    print(f"# CIFAR-shaped uint8 {n:,}x3x32x32, batch {b}, device {dev}: Crop(32, padding=4, reflect) + Flip + "
          f"Cutout(8); median of {repeat} rounds of one epoch each, contenders alternating (ABBA); {what}")
    print(table(rows, ["contender", "bytes", "bytes vs uint8 set", "s/epoch", "images/s", "vs memfit"],
                bytes_columns=("bytes",)))
    ratios = {k: [a / m for a, m in zip(times[k], times[base], strict=True)]
              for k, base in (("reference", "memfit"), ("loop", "plain"), ("loop2", "plain"))}
    print(verdicts(mf, ref, rows, ratios, uint8_bytes))
    warning = spread_warning()
    if warning:
        print(warning)
    return rows


def verdicts(mf: dict, ref: dict, rows: list[dict], ratios: dict[str, list[float]], uint8_bytes: int) -> str:
    """PASS/MISS lines: memfit augmented >= 0.9x the batch-wide reference, its data <= 1.05x the uint8 set, the
    unaugmented resident loader >= 0.95x the hand-written gather + decode (medians of per-round ratios)."""
    find = lambda word: next(r for r in rows if word in r["contender"])
    plain, hand, dl, air = find("no augmentation"), find("gather + decode, no"), find("DataLoader"), find("airbench")
    pair, loop, loop2 = ratios["reference"], ratios["loop"], ratios["loop2"]
    r_aug, r_plain, r_two = (statistics.median(r) for r in (pair, loop, loop2))
    span = lambda r: f"{min(r):.2f}-{max(r):.2f}"
    return "\n".join([
        f"{'PASS' if r_aug >= 0.9 else 'MISS'}  augmented: memfit {r_aug:.2f}x the batch-wide reference's images/s "
        f"(median of per-round ratios, {span(pair)}; target >= 0.9x)",
        f"{'PASS' if mf['bytes'] <= 1.05 * uint8_bytes else 'MISS'}  memfit holds {mf['bytes vs uint8 set']:.3f}x the "
        f"uint8 set for the data (target <= 1.05x); airbench {air['bytes vs uint8 set']:.1f}x, DataLoader "
        f"{dl['bytes vs uint8 set']:.1f}x (host)",
        f"{'PASS' if r_plain >= 0.95 else 'MISS'}  unaugmented: memfit resident {r_plain:.2f}x a hand-written gather "
        f"+ decode into reused buffers ({span(loop)}; target >= 0.95x); {r_two:.2f}x ({span(loop2)}) the same loop "
        "with two output buffers in turn, as memfit keeps the batch you hold while it makes the next",
        f"info  memfit augmented {dl['vs memfit'] ** -1:.1f}x the DataLoader's images/s, {air['vs memfit'] ** -1:.2f}x "
        f"airbench's; augmentation costs {plain['images/s'] / mf['images/s']:.2f}x the unaugmented epoch "
        f"(by hand: {hand['images/s'] / ref['images/s']:.2f}x)",
    ])


def main(argv=None) -> int:
    import argparse

    from memfit.cli.options import count_arg, device_arg
    p = argparse.ArgumentParser(prog="memfit bench loaders --augment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--augment", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--n", type=count_arg(1), default=50_000, help="samples (default 50,000, CIFAR-10's)")
    p.add_argument("--batch-size", type=count_arg(1), default=512, help="batch size (default 512)")
    p.add_argument("--repeat", type=count_arg(1), default=5, help="rounds of one epoch each (default 5)")
    p.add_argument("--workers", type=count_arg(0), default=2, help="the DataLoader's workers (default 2)")
    p.add_argument("--device", default=None, type=device_arg, help="cpu, cuda, cuda:1 (default: first CUDA device, "
                   "else cpu)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: seconds an epoch takes; cpu: CPU seconds it uses, at one torch thread (this process "
                        "and the DataLoader's workers): steadier on a busy machine")
    p.add_argument("--quick", action="store_true", help="10,000 samples, 3 rounds")
    a = p.parse_args(argv)
    n, repeat = (min(a.n, 10_000), 3) if a.quick else (a.n, a.repeat)
    run(n=n, b=a.batch_size, repeat=repeat, device=a.device, clock=a.clock, workers=a.workers)
    return 0

"""A loader's augmentation: batches bit-identical to a per-sample reference (the ops done with numpy on the data
itself, one sample at a time, then decoded) for every strategy, codec and layout; the same augmented samples for
every strategy, batch size and rank layout; per (seed, epoch) draws; soft targets; evaluation unaugmented; the
bytes in the ledger; the errors.

Run: `python -m pytest -q tests/loading/test_augmenter.py`.
"""
import numpy as np
import pytest
import torch

import memfit
from memfit import loader
from memfit.augment import Crop, CutMix, Cutout, Flip, MixUp, Translate
from memfit.budget import format_bytes
from memfit.compact import CompactDataset
from memfit.testing.ranks import run_ranks

N = 203                                    # an uneven last batch for every batch size used here
STRATEGIES = [("resident", {}), ("stream", {}), ("macro", {"macro_batch": 128}), ("stream", {"prefetch": False})]


def images(shape=(3, 7, 9), n=N, dtype=np.uint8, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.floating):
        return (rng.integers(0, 64, (n, *shape)) / 4).astype(dtype)     # exact in fp16 and bf16
    lo = -50 if np.issubdtype(dtype, np.signedinteger) else 0
    return rng.integers(lo, 200, (n, *shape)).astype(dtype)


def sample_reference(raw, op, p, layout, prev=None):
    """One op on one raw sample (numpy, spatial axes first), from that sample's parameters."""
    s = raw if raw.ndim == 3 and layout == "HWC" else raw[:, :, None] if raw.ndim == 2 else raw.transpose(1, 2, 0)
    if isinstance(op, Crop):
        h, w = op.out_size(s.shape[:2])
        pad = ((op.padding,) * 2, (op.padding,) * 2, (0, 0))
        s = np.pad(s, pad, mode="reflect") if op.mode == "reflect" else np.pad(s, pad, constant_values=op.fill)
        s = s[p["top"]:p["top"] + h, p["left"]:p["left"] + w]
    elif isinstance(op, Flip):
        s = s[:, ::-1] if p["flip"] else s
    elif isinstance(op, Cutout):
        s = s.copy()
        if p.get("on", True):
            s[p["top"]:p["top"] + p["height"], p["left"]:p["left"] + p["width"]] = op.fill
    if raw.ndim == 2:
        return s[:, :, 0]
    return np.ascontiguousarray(s if layout == "HWC" else s.transpose(2, 0, 1))


def reference_batch(ds, raw, ids, ops, params, layout="CHW"):
    """The loader's batch for samples `ids`, one sample at a time: the ops on the raw data, then the dataset's
    encode and decode of that sample alone."""
    out = []
    for i in ids.tolist():
        s = raw[i]
        for op, p in zip(ops, params, strict=True):
            s = sample_reference(s, op, {k: v[i].item() for k, v in p.items()}, layout)
        sample = torch.from_numpy(np.ascontiguousarray(s))[None]
        codes = ds.codec.unpack(ds.codec.encode(sample), tuple(sample.shape[1:]))    # bits1: packed, unpacked
        out.append(ds.decode_codes(codes)[0])
    return torch.stack(out)


def run_epoch(ld):
    xs, ys = zip(*ld, strict=True)
    return torch.cat(xs), torch.cat(ys)


OPS = [Crop(5, padding=3, fill=11), Flip(), Cutout(3, fill=2)]


@pytest.mark.parametrize("strategy, kw", STRATEGIES)
@pytest.mark.parametrize("ops", [OPS, [Translate(2, mode="reflect"), Flip(p=0.7), Cutout((2, 3), p=0.5, inside=True)],
                                 [Cutout(4), Crop((6, 8), padding=1, mode="reflect")], [Crop((5, 6)), Flip()]])
def test_batches_are_the_per_sample_reference_bit_for_bit(strategy, kw, ops):
    raw = images()
    ds = CompactDataset.from_arrays(raw, np.arange(N), normalize="dataset", device="cpu")
    ld = loader(ds, 64, strategy=strategy, seed=4, device="cpu", augment=ops, **kw)
    for epoch in range(2):
        x, ids = run_epoch(ld)
        params = ld.augment_parameters(epoch)
        assert torch.equal(x, reference_batch(ds, raw, ids, ops, params)), (strategy, epoch)


@pytest.mark.parametrize("dtype, codec", [(np.uint8, "uint8"), (np.uint8, "int8"), (np.int16, "auto"),
                                          (np.int32, "int32"), (np.int64, "int64"), (np.float32, "fp16"),
                                          (np.float32, "bf16"), (np.float32, "float32"), (np.float64, "float64"),
                                          (np.bool_, "bits1")])
@pytest.mark.parametrize("layout, shape", [("CHW", (2, 9, 7)), ("HWC", (9, 7, 2)), ("CHW", (7, 5))])
def test_every_lossless_codec_and_layout(dtype, codec, layout, shape):
    raw = images(shape, dtype=np.uint8 if dtype == np.bool_ else dtype)
    raw = (raw % 2).astype(bool) if dtype == np.bool_ else raw
    fill = 1 if dtype == np.bool_ else 3
    ops = [Crop((6, 5), padding=2, mode="zero", fill=fill, layout=layout), Flip(layout=layout),
           Cutout(3, fill=fill, p=0.8, layout=layout)]
    norm = "dataset" if layout == "CHW" and len(shape) == 3 else None
    out = torch.float32                      # int16 data: decoded to its integers (int64), unnormalised
    if dtype == np.int16:
        norm, out = None, None
    ds = CompactDataset.from_arrays(raw, np.arange(N), codec=codec, normalize=norm, device="cpu", dtype=out)
    assert ds.codec.max_abs_error == 0                       # every value stored exactly
    for strategy, kw in STRATEGIES[:2]:
        ld = loader(ds, 50, strategy=strategy, seed=1, device="cpu", augment=ops, **kw)
        x, ids = run_epoch(ld)
        assert x.shape[1:] == ld._augmenter.sample_shape
        assert torch.equal(x, reference_batch(ds, raw, ids, ops, ld.augment_parameters(0), layout))


def test_the_same_samples_under_every_strategy_and_batch_size_reshuffled_each_epoch():
    raw = images()
    ds = CompactDataset.from_arrays(raw, np.arange(N), device="cpu")
    seen = {}
    for strategy, kw in STRATEGIES + [("macro", {"macro_batch": 96, "order": "blocks"})]:
        for b in (32, 48):
            ld = loader(ds, b, strategy=strategy, seed=9, device="cpu", augment=OPS, drop_last=False,
                        **{k: (v if k != "macro_batch" else v // 32 * b) for k, v in kw.items()})
            for epoch in range(2):
                x, ids = run_epoch(ld)
                seen[strategy, str(kw), b, epoch] = x[ids.argsort()]
    firsts = [v for k, v in seen.items() if k[3] == 0]
    seconds = [v for k, v in seen.items() if k[3] == 1]
    assert all(torch.equal(v, firsts[0]) for v in firsts) and all(torch.equal(v, seconds[0]) for v in seconds)
    assert not torch.equal(firsts[0], seconds[0])
    again = loader(ds, 32, seed=9, device="cpu", augment=OPS)
    again.set_epoch(1)                                           # an epoch's draws are a function of (seed, epoch)
    x, ids = run_epoch(again)
    assert torch.equal(x[ids.argsort()], seconds[0])
    other = loader(ds, 32, seed=10, device="cpu", augment=OPS)
    x, ids = run_epoch(other)
    assert not torch.equal(x[ids.argsort()], firsts[0])


def test_mixing_makes_soft_targets_and_says_so():
    raw = images((3, 8, 8))
    y = np.arange(N) % 5
    ds = CompactDataset.from_arrays(raw, y, normalize="dataset", device="cpu")
    ld = loader(ds, 40, seed=0, device="cpu", augment=[CutMix(), MixUp(alpha=0.5)])
    assert ld.targets.kind == "soft" and ld.targets.num_classes == 5
    assert "soft targets" in ld.explain()
    for x, t in ld:
        assert x.dtype == torch.float32 and t.shape == (len(x), 5) and t.dtype == torch.float32
        assert torch.allclose(t.sum(1), torch.ones(len(x)))
    # the plain decode of the same samples mixed in the test: CutMix on the codes, then MixUp on the values
    plain = loader(ds, 40, seed=0, device="cpu", shuffle=False)
    mixed = loader(ds, 40, seed=0, device="cpu", shuffle=False, augment=[CutMix(), MixUp(alpha=0.5)])
    cut, mix = mixed.augment_parameters(0)
    (xa, ya), (_, yp) = next(iter(mixed)), next(iter(plain))
    codes = ds.rows(torch.arange(40))
    codes, soft = CutMix(num_classes=5).apply(codes, yp, {k: v[:40] for k, v in cut.items()})
    x, soft = MixUp(num_classes=5).apply(ds.decode_codes(codes), soft, {"lam": mix["lam"][:40]})
    assert torch.equal(xa, x) and torch.equal(ya, soft)


def test_evaluate_reads_the_loader_unaugmented():
    x, y = memfit.readers.synthetic(300, seed=0)
    ds = CompactDataset.from_arrays(x, y, normalize="dataset", device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    ld = loader(ds, 64, seed=0, device="cpu", augment=[Crop(28, padding=4), Flip(), Cutout(8)])
    want = memfit.evaluate(model, ds, progress=False)
    got = memfit.evaluate(model, ld, progress=False)
    assert got.metrics == want.metrics and got.n == want.n == 300
    assert ld._epoch == 0                                   # reading it unaugmented is not an epoch
    asked = memfit.evaluate(model, iter(ld), progress=False)     # augmented batches, asked for
    assert asked.metrics["loss"] != want.metrics["loss"]
    assert ld._epoch == 1                                   # that was an epoch
    xs, _ = run_epoch(ld.unaugmented())                     # the next epoch's order, decoded only
    assert torch.equal(xs, ds.batch(ld.epoch_order(1))[0]) and ld._epoch == 1


def test_the_ledger_holds_the_augmentation_bytes():
    raw = images((3, 32, 32), n=600)
    ds = CompactDataset.from_arrays(raw, np.arange(600) % 10, device="cpu")
    plain = loader(ds, 128, seed=0, device="cpu", strategy="resident")
    ld = loader(ds, 128, seed=0, device="cpu", strategy="resident",
                augment=[Crop(32, padding=4, mode="reflect"), Flip(), Cutout(8, p=0.5)])
    items = dict(ld.choice.items)
    run_epoch(ld)
    used = ld._augmenter.workspace.nbytes                   # what the ops' reused buffers hold, measured
    name = next(k for k in items if k.startswith("augmentation buffers"))
    assert used <= items[name] <= 1.5 * used + 2 * 128 * 3072   # (the rest: the flip's copy, made per batch)
    table = items[next(k for k in items if k.startswith("augmentation parameters"))]
    assert table == 600 * 4 * 8                    # top, left; flip; top, left, height, width, on: int32 each
    assert ld.nbytes - plain.nbytes == items[name] + table
    assert format_bytes(table) in ld.explain() and "Crop(size=32, padding=4, mode='reflect'" in ld.explain()
    with pytest.raises(memfit.BudgetExceeded, match="augmentation buffers"):
        loader(ds, 128, strategy="resident", device="cpu", budget=plain.nbytes + table, augment=ld.augment)


def test_bad_augmentation_says_what_to_do():
    raw = images((3, 8, 8))
    ds = CompactDataset.from_arrays(raw, np.arange(N) % 3, device="cpu")
    with pytest.raises(TypeError, match="list of memfit.augment ops"):
        loader(ds, 8, device="cpu", augment=["crop"])
    with pytest.raises(ValueError, match="put MixUp last"):
        loader(ds, 8, device="cpu", augment=[MixUp(), Flip()])
    with pytest.raises(ValueError, match="does not fit in a 8x8 sample"):
        loader(ds, 8, device="cpu", augment=[Crop(12, padding=1)])
    q8 = CompactDataset.from_arrays(raw.astype(np.float32) / 7 + 0.3, np.arange(N) % 3, codec="q8", device="cpu")
    with pytest.raises(ValueError, match="fill=0 is not a value the codec q8"):
        loader(q8, 8, device="cpu", augment=[Cutout(2)])
    loader(q8, 8, device="cpu", augment=[Flip(), Crop(8, padding=2, mode="reflect")])   # moves only: fine
    with pytest.raises(ValueError, match="fill=300 is not a value the codec uint8"):
        loader(ds, 8, device="cpu", augment=[Cutout(2, fill=300)])
    masks = CompactDataset.from_arrays(raw, raw[:, 0] % 3, device="cpu")
    with pytest.raises(ValueError, match="per-position labels"):
        loader(masks, 8, device="cpu", augment=[Flip()])
    loader(masks, 8, device="cpu", augment=[Cutout(2)])                          # writes only: the masks stay right
    floats = CompactDataset.from_arrays(raw, np.arange(N, dtype=np.float32), device="cpu")
    with pytest.raises(ValueError, match="needs one class id per sample"):
        loader(floats, 8, device="cpu", augment=[MixUp()])
    hwc = CompactDataset.from_arrays(raw.transpose(0, 2, 3, 1), np.arange(N) % 3, normalize="dataset", device="cpu")
    with pytest.raises(ValueError, match="channels-last data"):
        loader(hwc, 8, device="cpu", augment=[Crop(8, padding=1, layout="HWC")])
    with pytest.raises(ValueError, match="different layouts"):
        loader(ds, 8, device="cpu", augment=[Flip(layout="HWC"), Cutout(2)])
    fields = ({"a": raw, "b": raw[:, 0]}, np.arange(N) % 3)
    with pytest.raises(ValueError, match="several inputs per sample"):
        loader(fields, 8, device="cpu", augment=[Flip()])


def _rank_epoch(rank, world):
    """This rank's augmented samples of epoch 0, {id: x}, for a whole set given to every rank and for parts."""
    raw = images()
    out = {}
    for name, data, kw in [("whole resident", (raw, np.arange(N)), {"strategy": "resident"}),
                           ("whole stream", (raw, np.arange(N)), {"strategy": "stream"}),
                           ("parts", (raw[rank::world], np.arange(N)[rank::world]), {"sharded": True})]:
        ld = loader(data, 16, seed=3, device="cpu", distributed=True, augment=OPS, normalize=(100.0, 50.0), **kw)
        x, ids = run_epoch(ld)
        out[name] = (ids.tolist(), x.numpy())
    return out


def test_the_same_samples_on_every_rank_layout():
    raw = images()
    whole = loader((raw, np.arange(N)), 16, seed=3, device="cpu", augment=OPS, normalize=(100.0, 50.0))
    x, ids = run_epoch(whole)
    want = dict(zip(ids.tolist(), x, strict=True))
    out = run_ranks(_rank_epoch, 2)
    assert all(s == "ok" for s, _ in out.values()), out
    for name in ("whole resident", "whole stream"):
        got = {i: torch.from_numpy(v) for r in range(2) for i, v in zip(*out[r][1][name], strict=True)}
        assert sorted(got) == list(range(N)) and all(torch.equal(got[i], want[i]) for i in got), name
    # parts split beforehand (strided here): their union in rank order is the whole the parameters are drawn for
    got = {i: torch.from_numpy(v) for r in range(2) for i, v in zip(*out[r][1]["parts"], strict=True)}
    ids_whole = np.concatenate([np.arange(N)[0::2], np.arange(N)[1::2]])
    union = loader((np.concatenate([raw[0::2], raw[1::2]]), ids_whole), 16, seed=3, device="cpu", augment=OPS,
                   normalize=(100.0, 50.0))
    x, ids = run_epoch(union)
    want = dict(zip(ids.tolist(), x, strict=True))
    assert sorted(got) == list(range(N)) and all(torch.equal(got[i], want[i]) for i in got)


# ---- CUDA ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("strategy, kw", STRATEGIES)
def test_cuda_augments_as_the_cpu_does(strategy, kw):
    """The same samples augmented on the GPU: the codes moved bit for bit, the decode within float rounding (the GPU's
    multiply-add may fuse); soft targets from CutMix the same."""
    raw = images((3, 16, 16))
    ds = CompactDataset.from_arrays(raw, np.arange(N) % 7, normalize="dataset", device="cpu")
    ops = [Crop(16, padding=2, mode="reflect"), Flip(), Cutout(4, p=0.5), CutMix()]
    cpu = list(loader(ds, 32, strategy="resident", seed=2, device="cpu", augment=ops))
    for data in (ds, ds.to("cuda")):
        got = list(loader(data, 32, strategy=strategy, seed=2, device="cuda", augment=ops, **kw))
        assert len(got) == len(cpu)
        for (xg, yg), (xc, yc) in zip(got, cpu, strict=True):
            assert xg.device.type == "cuda"
            torch.testing.assert_close(xg.cpu(), xc, rtol=0, atol=1e-6)
            torch.testing.assert_close(yg.cpu(), yc, rtol=0, atol=1e-7)
    alone = Crop(16, padding=2, mode="reflect")(ds.x[:8].cuda(), torch.Generator().manual_seed(0))
    assert alone.device.type == "cuda" and torch.equal(alone.cpu(), Crop(16, padding=2, mode="reflect")(
        ds.x[:8], torch.Generator().manual_seed(0)))

"""`memfit bench loaders --augment`: its hand-written contenders make the batches they claim (checked sample by
sample against numpy), airbench's copies are counted, and the verdicts' arithmetic (rows and ratios given)."""
import numpy as np
import pytest
import torch

from memfit.cli.bench import augmentation as A
from memfit.cli.bench.codecs import images
from memfit.compact import CompactDataset

N = 70


@pytest.fixture(scope="module")
def ds():
    return CompactDataset.from_arrays(images(N, (3, 32, 32)), np.arange(N), normalize="dataset", device="cpu")


def _codes(ds, xb):
    """Decoded batch -> the uint8 codes it decodes from (the decode is a per-channel affine, exact on 0..255)."""
    a, b = ds.codec.affine()
    a, b = a / ds.std, (b - ds.mean) / ds.std
    return ((xb.double() - b.view(1, -1, 1, 1)) / a.view(1, -1, 1, 1)).round().to(torch.uint8)


@pytest.mark.parametrize("outputs", [1, 2])
def test_the_hand_written_loops_make_the_batches_they_claim(ds, outputs):
    raw = ds.x.numpy()
    seen = []
    for xb, yb in A.reused_loop(ds, 16, torch.device("cpu"), outputs)():
        assert torch.equal(xb, ds.batch(yb)[0])                      # gather + decode, exactly
        seen += yb.tolist()
    assert sorted(seen) == list(range(N))
    for xb, yb in A.batched_reference(ds, 16, torch.device("cpu"), outputs)():
        codes = _codes(ds, xb).numpy()
        for i, j in enumerate(yb.tolist()):                       # a crop of the reflect-padded sample, maybe flipped,
            padded = np.pad(raw[j], ((0, 0), (4, 4), (4, 4)), mode="reflect")   # all but the cutout's pixels
            crops = [padded[:, t:t + 32, s:s + 32] for t in range(9) for s in range(9)]
            best = max((codes[i] == c[:, :, ::-1] if f else codes[i] == c).mean() for c in crops for f in (0, 1))
            cut = (codes[i] == 0).all(0).sum() / 1024
            assert best >= 1 - cut and cut <= 64 / 1024


def test_airbench_holds_its_copies_and_yields_the_whole_set(ds):
    air = A.Airbench(ds, 16, torch.device("cpu"))
    ys = [yb for _ in range(2) for xb, yb in air()]
    assert sorted(torch.cat(ys[:len(ys) // 2]).tolist()) == list(range(N))
    # fp16 copies: the set, normalised, flipped (2 B a value each), padded to 40x40, the epoch's crop and its flip
    assert air.peak_nbytes == N * 3 * (3 * 2 * 1024 + 2 * 1600 + 2 * 2 * 1024) + N * 8
    x, y = A._PerSample(ds.batch(slice(None))[0], ds.y.long())[3]
    assert x.shape == (3, 32, 32) and int(y) == 3


def test_the_verdicts():
    rows = [{"contender": c, "bytes": nb, "bytes vs uint8 set": nb / 100, "images/s": s, "vs memfit": s / 50}
            for c, nb, s in [("memfit resident, crop + flip + cutout", 101, 50), ("(b) by hand", 100, 52),
                             ("(a) DataLoader, per sample", 400, 5), ("(c) airbench", 1300, 10),
                             ("memfit resident, no augmentation", 101, 150),
                             ("by hand: gather + decode, no aug", 100, 160),
                             ("by hand: gather + decode, 2 output buffers", 100, 150)]]
    ratios = {"reference": [0.95, 0.97, 0.99], "loop": [0.9, 0.93, 0.96], "loop2": [1.0, 1.0, 1.0]}
    lines = A.verdicts(rows[0], rows[1], rows, ratios, 100).splitlines()
    assert lines[0].startswith("PASS  augmented: memfit 0.97x") and "0.95-0.99" in lines[0]
    assert lines[1].startswith("PASS  memfit holds 1.010x") and "airbench 13.0x, DataLoader 4.0x" in lines[1]
    assert lines[2].startswith("MISS  unaugmented: memfit resident 0.93x") and "1.00x (1.00-1.00)" in lines[2]
    assert "10.0x the DataLoader" in lines[3] and "5.00x airbench" in lines[3]
    ratios["reference"] = [0.8, 0.85, 0.89]
    rows[0]["bytes"] = 106
    lines = A.verdicts(rows[0], rows[1], rows, ratios, 100).splitlines()
    assert lines[0].startswith("MISS  augmented") and lines[1].startswith("MISS  memfit holds")

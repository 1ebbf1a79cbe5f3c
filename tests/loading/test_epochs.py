"""One epoch of a loader: the resident strategy's targets decoded once per epoch, in its order, where each sample
has one value (class ids, a float), their bytes in the ledger; per batch otherwise.

Run: `python -m pytest -q tests/loading/test_epochs.py`.
"""
import numpy as np
import pytest
import torch

import memfit
from memfit.loading.epochs import targets_per_epoch

N = 203
ITEM = "targets of the epoch (decoded once, in its order)"


def _x(n=N):
    return np.random.default_rng(0).integers(0, 256, (n, 1, 4, 4), dtype=np.uint8)


@pytest.mark.parametrize("y, dtype", [(np.arange(N) % 7, torch.int64), (np.arange(N) / 8, torch.float32)])
def test_one_value_per_sample_is_decoded_once_per_epoch(y, dtype):
    ds = memfit.CompactDataset.from_arrays(_x(), y, device="cpu")
    ld = memfit.loader(ds, 64, seed=3, device="cpu", strategy="resident")
    assert targets_per_epoch(ds.targets) and dict(ld.choice.items)[ITEM] == N * dtype.itemsize
    for epoch in range(2):
        order = ld.epoch_order(epoch)
        got = list(ld)
        assert torch.equal(torch.cat([yb for _, yb in got]), ds.batch(order)[1])
        assert all(yb.dtype == dtype and yb._base is got[0][1]._base for _, yb in got)     # views of one epoch


def test_targets_of_several_values_are_decoded_per_batch():
    y = np.random.default_rng(1).integers(0, 5, (N, 4, 4))                 # a label per position
    ds = memfit.CompactDataset.from_arrays(_x(), y, device="cpu")
    ld = memfit.loader(ds, 64, seed=3, device="cpu", strategy="resident")
    assert not targets_per_epoch(ds.targets) and ITEM not in dict(ld.choice.items)
    got = list(ld)
    assert torch.equal(torch.cat([yb for _, yb in got]), ds.batch(ld.epoch_order(0))[1])
    assert all(yb._base is None for _, yb in got)
    stream = memfit.loader(memfit.CompactDataset.from_arrays(_x(), np.arange(N), device="cpu"), 64, device="cpu",
                           strategy="stream")
    assert ITEM not in dict(stream.choice.items)                            # stream and macro: per batch


def test_an_epoch_begun_under_inference_mode_trains_after_it():
    ds = memfit.CompactDataset.from_arrays(_x(), np.arange(N) % 10, normalize="dataset", device="cpu")
    ld = memfit.loader(ds, 64, seed=0, device="cpu", strategy="resident")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 10))
    it = iter(ld)
    with torch.inference_mode():
        next(it)                                                             # the epoch's targets decoded here
    for xb, yb in it:                                                        # cross_entropy saves the target
        torch.nn.functional.cross_entropy(model(xb), yb).backward()

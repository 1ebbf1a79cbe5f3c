"""Reused decode buffers: a buffer the consumer still holds is never written; buffers first made under
torch.inference_mode (a loader read by memfit.evaluate) stay writable by the training epochs after it; full
resident batches decoded in pieces through views made once per buffer decode as the dataset does.

Run: `python -m pytest -q tests/loading/test_pool.py`.
"""
import math

import numpy as np
import pytest
import torch

import memfit
import memfit.loading.pool as pool_mod
from memfit.loading.pool import BatchPool


def test_a_held_buffer_is_never_handed_out_again():
    pool = BatchPool((3,), torch.float32, torch.device("cpu"), rows=4)
    a = pool.take(4)
    b = pool.take(4)
    assert a.data_ptr() != b.data_ptr()
    ptr = a.data_ptr()
    del a
    assert pool.take(2).data_ptr() == ptr


def test_buffers_made_under_inference_mode_are_written_again_outside_it():
    with torch.inference_mode():
        pool = BatchPool((3,), torch.float32, torch.device("cpu"), rows=4, count=1)
        pool.take(4).fill_(1)
    pool.take(4).fill_(2)                       # raised "Inplace update to inference tensor outside InferenceMode"
    x, y = memfit.readers.synthetic(200, seed=0)
    ds = memfit.CompactDataset.from_arrays(x, y, normalize="dataset", device="cpu")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    ld = memfit.loader(ds, 64, seed=0, device="cpu")
    memfit.evaluate(model, ld, progress=False)  # the loader's first batches: under inference mode
    for xb, yb in ld:                           # then training epochs reuse the same buffers
        torch.nn.functional.cross_entropy(model(xb), yb).backward()


def _images(shape, n=300, seed=0):
    x = np.random.default_rng(seed).integers(0, 256, (n, *shape), dtype=np.uint8)
    return memfit.CompactDataset.from_arrays(x, np.arange(n), normalize="dataset", device="cpu")


@pytest.mark.parametrize("shape, dtype, strategy", [((3, 8, 8), torch.float32, "resident"),
                                                    ((1, 6, 6), torch.float32, "resident"),
                                                    ((3, 8, 8), torch.float64, "resident"),
                                                    ((5, 1, 7), torch.float32, "resident"),
                                                    ((3, 8, 8), torch.float32, "stream"),
                                                    ((3, 8, 8), torch.float32, "macro")])
def test_full_batches_decode_in_pieces_as_the_dataset_does(monkeypatch, shape, dtype, strategy):
    ds = _images(shape)
    if dtype != torch.float32:
        ds = memfit.CompactDataset.from_arrays(ds.x.numpy(), ds.y.numpy(), normalize="dataset", dtype=dtype,
                                               device="cpu")
    sample = math.prod(shape) * dtype.itemsize
    monkeypatch.setattr(pool_mod, "PIECE_BYTES", 20 * sample)          # 64 samples: 3 pieces of 22, 22, 20
    ld = memfit.loader(ds, 64, seed=1, device="cpu", strategy=strategy, **({"macro_batch": 128} if strategy == "macro"
                                                                           else {}))
    batches = list(ld)                                                 # all held: every one in its own buffer
    assert [len(y) for _, y in batches] == [64] * 4 + [300 - 256]
    for x, y in batches:
        assert x.dtype == dtype and torch.equal(x, ds.batch(y)[0])
    assert [len(out) for _, out, _ in ld._decode._full.take_prepared(64)[1]] == [22, 22, 20]
    before = None
    for x, _ in ld:                                                    # the batch held across next() is unchanged
        assert before is None or torch.equal(*before)
        before = (x, x.clone())


def test_only_a_plain_convert_and_multiply_add_takes_the_full_batch_path():
    ds = _images((3, 8, 8))
    assert memfit.loader(ds, 64, device="cpu", strategy="resident")._decode._full is not None
    half = memfit.CompactDataset.from_arrays(ds.x.numpy(), ds.y.numpy(), dtype=torch.float16, device="cpu")
    assert memfit.loader(half, 64, device="cpu", strategy="resident")._decode._full is None    # via float32
    q4 = memfit.CompactDataset.from_arrays(ds.x.numpy().astype(np.float32), ds.y.numpy(), codec="q4", device="cpu")
    assert memfit.loader(q4, 64, device="cpu", strategy="stream")._decode._full is None        # codes unpacked


def test_loops_that_fetch_ahead_get_every_batch_unchanged():
    # accelerate's DataLoaderShard takes the next batch before it yields the current one; transformers' Trainer
    # gathers the batches of an accumulation step first: a loader that wrote over the batch it handed out last
    # would change theirs silently (why memfit decodes into one of two buffers, more while more are held)
    ds = _images((3, 8, 8))
    ld = memfit.loader(ds, 64, seed=2, device="cpu", strategy="resident")

    def one_ahead(it):
        it = iter(it)
        current = next(it)
        for following in it:
            yield current
            current = following
        yield current

    want = [(x.clone(), y.clone()) for x, y in ld]
    ld.set_epoch(0)
    for k, (x, y) in enumerate(one_ahead(ld)):             # each compared when it arrives, then dropped
        assert torch.equal(x, want[k][0]) and torch.equal(y, want[k][1])
    ld.set_epoch(0)
    it = iter(ld)
    for s in range(len(ld) // 3):
        step = [next(it) for _ in range(3)]
        assert all(torch.equal(x, want[3 * s + j][0]) for j, (x, _) in enumerate(step))

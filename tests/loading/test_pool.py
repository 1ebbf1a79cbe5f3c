"""Reused decode buffers: a buffer the consumer still holds is never written; buffers first made under
torch.inference_mode (a loader read by memfit.evaluate) stay writable by the training epochs after it.

Run: `python -m pytest -q tests/loading/test_pool.py`.
"""
import torch

import memfit
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

"""A dataset as chunks for evaluation: [s, e) decoded on the device, the compact rows crossing the bus."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from memfit.batches import batch_to, plain_batch
from memfit.compact import CompactDataset
from memfit.targets import IGNORE_INDEX, check_count

__all__ = ["Chunks", "as_chunks"]


class Chunks:
    """Decoded chunks [s, e) of a CompactDataset, copied compact to `device` and decoded there."""

    def __init__(self, ds: CompactDataset, device: torch.device):
        self.ds, self.device, self.n = ds, device, len(ds)
        self.sample_shape, self.dtype = ds.sample_shape, ds.dtype
        self.fields = ds.fields is not None      # a dict of inputs: model(**x), not planned
        self.compact_per_sample = ds.row_nbytes if ds.device != device else 0
        self.decoded_per_sample = ds.batch_nbytes(1)

    def get(self, s: int, e: int):
        idx = torch.arange(s, e, device=self.ds.device)
        rows = self.ds.rows(idx)
        y = None if self.ds.y is None else self.ds.y[s:e]
        if self.ds.device != self.device:          # compact bytes cross the bus, not float32
            rows, y = batch_to((rows, y), self.device)     # blocking to the CPU: decoded at once there
        return self.ds.decode(rows), (None if y is None else self.ds.targets.decode(y))


def as_chunks(data, device: torch.device, asked: tuple[int, str] | None = None):
    """A CompactDataset, a memfit Loader (any iterable of (x, y) batches) or (x, y) arrays (stored with the ignore
    index asked for, `asked[0]`, else -100)."""
    ignore = IGNORE_INDEX if asked is None else asked[0]
    if isinstance(data, CompactDataset):
        if len(data) == 0:
            raise ValueError("the data is empty: nothing to evaluate")
        return Chunks(data, device)
    if isinstance(data, tuple) and len(data) == 2:
        x, y = plain_batch(data)
        if isinstance(x, dict):     # several inputs per sample; from_arrays checks every count
            return Chunks(CompactDataset.from_arrays(x, y, device="cpu", ignore_index=ignore), device)
        if y is not None:
            check_count(y, len(x))
        if len(x) == 0:
            raise ValueError("the data is empty: nothing to evaluate")
        # stored compactly on the host; each chunk crosses to the device compact and is decoded there
        return Chunks(CompactDataset.from_arrays(x, y, device="cpu", ignore_index=ignore), device)
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, dict)):
        # a memfit Loader that augments is read unaugmented: evaluation never augments unless asked (pass the
        # batches themselves, e.g. iter(loader))
        return data.unaugmented() if getattr(data, "augment", ()) and hasattr(data, "unaugmented") else data
    raise TypeError(f"data must be a CompactDataset, a memfit Loader (or iterable of (x, y) batches) or an "
                    f"(x, y) tuple of arrays; found {type(data).__name__}")

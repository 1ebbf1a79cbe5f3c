"""A decoded batch seen as samples: what torch's DataLoader takes from `CompactDataset.__getitems__`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["SampleList", "Samples"]


class Samples(Sequence):
    """A decoded batch seen as a sequence of samples: `[i]` is `(x[i], y[i])` (views; x alone without
    targets, a dict of views for a dataset of fields or a dict of targets). `x`, `y` hold the whole batch."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        first = next(iter(self.x.values())) if isinstance(self.x, dict) else self.x
        return first.shape[0]

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"samples are indexed by an int; found {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a batch of {len(self)}")
        x = {k: v[i] for k, v in self.x.items()} if isinstance(self.x, dict) else self.x[i]
        if self.y is None:
            return x
        return x, ({k: v[i] for k, v in self.y.items()} if isinstance(self.y, dict) else self.y[i])


class SampleList(list):
    """An unlabelled batch as a list of per-sample views (what torch.stack takes); `x` is the batch."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x.unbind(0))
        self.x = x

"""Data augmentation on whole batches, for `memfit.loader(..., augment=[...])` or on a batch alone.

Each op draws per-sample parameters and applies them to the whole batch with tensor ops (row windows,
gathers of whole samples, fills at computed positions), never a Python loop over samples:

| op | what it does to each sample | where a loader runs it |
|---|---|---|
| `Crop(size, padding, mode)` | pads ('zero' or 'reflect'), cuts a random window | on the stored codes |
| `Translate(shift, mode)` | shifts by up to `shift` pixels, size kept (`Crop(None, shift)`) | on the stored codes |
| `Flip(p)` | mirrors left-right with probability p | on the stored codes |
| `Cutout(size, fill, p)` | sets a square (centre anywhere, clipped) to `fill` | on the stored codes |
| `CutMix(alpha)` | pastes a rectangle of the previous sample; class ids -> soft targets | on the stored codes |
| `MixUp(alpha)` | mixes with the previous sample; class ids -> soft targets | on the decoded values |

A loader draws every sample's parameters of an epoch from a generator seeded by (seed, epoch) and looks
them up by sample, so an augmented sample is the same under every strategy, batch size and rank layout
(MixUp and CutMix pair each sample with the one before it in its batch: the pairs follow the batches).
Ops that move or write values run on the compact codes before the decode, exactly as on the data itself
(`fill` is in the data's units), so no float copy of the dataset is made. `memfit.evaluate` reads a
loader's batches unaugmented.

Example:
    >>> import torch, memfit
    >>> x = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    >>> g = torch.Generator().manual_seed(0)
    >>> for op in [memfit.augment.Crop(32, padding=4, mode="reflect"), memfit.augment.Flip()]:
    ...     x = op(x, g)
    >>> x.shape, x.dtype
    (torch.Size([8, 3, 32, 32]), torch.uint8)
"""

from memfit.augment.mixing import CutMix, MixUp
from memfit.augment.ops import Crop, Cutout, Flip, Op, Translate

__all__ = ["Crop", "CutMix", "Cutout", "Flip", "MixUp", "Op", "Translate"]

"""Minibatch loading, the code behind `memfit.loader(...)` and `memfit.loading.Loader`.

Modules: `order` (epoch permutations, sharded by rank), `strategy` (resident, stream or macro, chosen
from the bytes each needs and the budget), `sources` (where rows come from: a `CompactDataset` or a
memory-mapped file), `pool` (reused decode buffers), `augmenter` (`memfit.augment` ops run on the stored
codes inside the decode, parameters per (seed, epoch) by sample), `prefetch` (background copies, double
buffering), `epochs` (one epoch's batches, resident or from copied blocks), `minibatches` (`Loader`,
`loader()`). The entry point is `memfit.loader`; this package exports `Loader` and `LoaderConfig`.
"""

from memfit.loading.minibatches import Loader, LoaderConfig

__all__ = ["Loader", "LoaderConfig"]

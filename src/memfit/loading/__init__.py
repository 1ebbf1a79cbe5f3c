"""Minibatch loading, the code behind `memfit.loader(...)` and `memfit.Loader`.

Modules: `order` (epoch permutations, sharded by rank), `strategy` (resident, stream or macro, chosen
from the bytes each needs and the budget), `sources` (where rows come from: a `CompactDataset` or a
memory-mapped file), `pool` (reused decode buffers), `prefetch` (background copies, double
buffering), `minibatches` (`Loader`, `loader()`). The public names live on `memfit` only.
"""

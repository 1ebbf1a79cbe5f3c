"""Minibatch loaders: `order` (epoch permutations), `plan` (strategy by budget), `source` (host data),
`prefetch` (background copies, double buffering), `core` (`Loader`, `loader()`).

The public entry point is `memfit.loader(...)`; see `memfit.loaders.core`.
"""

from memfit.loaders.core import Loader, loader

__all__ = ["Loader", "loader"]

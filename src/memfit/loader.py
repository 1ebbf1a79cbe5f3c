"""`memfit.loader`: minibatch loaders chosen by memory budget (the code lives in `memfit.loaders`).

Example:
    >>> from memfit.loader import Loader, loader
    >>> callable(loader) and Loader.__name__
    'Loader'
"""

from memfit.loaders.core import Loader, loader
from memfit.loaders.plan import Plan

__all__ = ["Loader", "Plan", "loader"]

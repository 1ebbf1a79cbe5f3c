"""Function caches (`functools.lru_cache`) a model's code fills, which a fake run must leave without fake tensors.

A forward run on fake tensors (memfit's memory model, torch.export's capture) that fills such a cache, as
transformers' BEiT does with its relative position index, would hand a fake tensor to every real forward
after it. `function_caches_kept_real(model)` around the run clears the caches that missed during it.
"""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager

import torch

__all__ = ["cache_misses", "clear_filled", "function_caches", "function_caches_kept_real"]


def function_caches(model: torch.nn.Module) -> list:
    """The `functools.lru_cache`s the model's code may fill: those in the modules its classes are defined in,
    on those classes or on its modules, or one or two wrappers deep (a decorator's closure, as transformers'
    method cache)."""
    found: dict[int, object] = {}

    def look(v, depth: int) -> None:
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        if isinstance(v, functools._lru_cache_wrapper):
            found[id(v)] = v
        if depth < 2 and callable(v):
            for c in getattr(v, "__closure__", None) or ():
                try:
                    look(c.cell_contents, depth + 1)
                except ValueError:                    # an empty cell
                    pass
            if hasattr(v, "__wrapped__"):
                look(v.__wrapped__, depth + 1)
    classes = {c for m in model.modules() for c in type(m).__mro__          # torch's own modules cache no tensors
               if c.__module__ != "builtins" and not c.__module__.startswith("torch.")}
    for mod in {sys.modules.get(c.__module__) for c in classes} - {None}:
        for v in list(vars(mod).values()):
            look(v, 0)
    for c in classes:
        for v in list(vars(c).values()):
            look(v, 0)
    for m in model.modules():                              # a cache made per instance in __init__
        for v in list(vars(m).values()):
            look(v, 0)
    return list(found.values())


def cache_misses(model: torch.nn.Module) -> list:
    """[(cache, misses so far)] for `function_caches(model)`: taken before a fake run, for `clear_filled`."""
    return [(c, c.cache_info().misses) for c in function_caches(model)]


def clear_filled(caches: list) -> None:
    """Clear the caches of `cache_misses` that missed since: a fake run (a memory model, torch.export) that
    fills one would hand fake tensors to the real runs after it (transformers' BEiT caches its relative
    position index so). Their earlier entries are computed again when next asked for."""
    for c, misses in caches:
        if c.cache_info().misses != misses:
            c.cache_clear()


@contextmanager
def function_caches_kept_real(model: torch.nn.Module):
    """Around a fake run of `model`: no function cache it fills keeps a fake tensor after it."""
    caches = cache_misses(model)
    try:
        yield
    finally:
        clear_filled(caches)

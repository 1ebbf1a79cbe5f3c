"""What a kept plan or memory model of a model depends on, as one comparable value (`model_state`), and the
function caches its code fills (`function_caches`), which a fake run must leave without fake tensors.

A captured plan bakes in what the forward read besides its inputs: a float attribute (`self.scale`), a
flag (`gradient_checkpointing`, a dropout's `p`), a replaced `forward` or a hook, a config object's
fields. Plans and memory models are kept per model (capturing takes seconds) and must be dropped when any
of that changes, or a later call returns the old model's numbers. `model_state` lists, for every module,
its parameters and buffers (identity, storage, shape, dtype, requires_grad: a plan reads their values by
reference, so a training step's in-place updates keep it), its training flag and every
other attribute: plain values (numbers, strings, small containers of them) by value, tensors by identity
and version (an in-place write bumps it), callables and other objects by identity, and the plain fields of
objects such as a `transformers` config. What it cannot see (a global the forward reads, an object's
attribute two levels down) is the caller's to signal by building a new model or a new plan.

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    >>> before = model_state(m)
    >>> m[1].p = 0.5
    >>> model_state(m) == before
    False
"""

from __future__ import annotations

import enum
import functools
import sys
from contextlib import contextmanager

import torch

__all__ = ["cache_misses", "clear_filled", "function_caches", "function_caches_kept_real", "model_state"]

_OWN = frozenset({"_parameters", "_buffers", "_modules", "training"})   # listed on their own
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)
_LONG = 64          # longer containers are compared by identity and length only


def model_state(model: torch.nn.Module) -> tuple:
    """A value that changes when anything a forward of `model` could depend on changes (see the module doc)."""
    seen: dict[int, object] = {}
    tensors = tuple((id(t), t.data_ptr(), tuple(t.shape), t.dtype, t.requires_grad)    # values are read by
                    for t in [*model.parameters(), *model.buffers()])                    # reference: no version
    modules = tuple((id(m), m.training, tuple((k, _value(v, 0, seen)) for k, v in vars(m).items() if k not in _OWN))
                    for m in model.modules())
    return tensors, modules


def _value(v, depth: int, seen: dict):
    if v is None or isinstance(v, _PLAIN):
        return v
    if isinstance(v, torch.Tensor):      # an inference tensor has no version: it cannot be written in place
        return "tensor", id(v), v.data_ptr(), tuple(v.shape), v.dtype, None if v.is_inference() else v._version
    if isinstance(v, (tuple, list, dict, set, frozenset)):
        if depth > 2 or len(v) > _LONG:
            return type(v).__name__, id(v), len(v)
        items = v.items() if isinstance(v, dict) else enumerate(sorted(v, key=repr) if isinstance(v, (set, frozenset))
                                                                else v)
        return type(v).__name__, tuple((k, _value(x, depth + 1, seen)) for k, x in items)
    if callable(v) or isinstance(v, torch.nn.Module):      # functions, hooks, a replaced forward, other modules
        return "object", id(v)
    fields = getattr(v, "__dict__", None)
    if depth > 0 or not isinstance(fields, dict):
        return type(v).__name__, id(v)
    if id(v) not in seen:              # a config object shared by many modules: its plain fields, once
        seen[id(v)] = (type(v).__name__, id(v), tuple((k, _value(x, 1, seen)) for k, x in fields.items()))
    return seen[id(v)]


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

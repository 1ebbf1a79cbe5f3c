"""What a prediction leaves alone: the user's module (as every other thread sees it) and every random generator.

A memory model runs the user's code on fake tensors (`memfit.memory.fake_run`) or traces it with
`torch.export` (the planner's capture). Both swap the module's parameters for fake ones, which, done on the
user's module, every thread would see for the length of the run: a plain forward in another thread failed
(5,117 of 8,779 times during `max_batch_size(train=True)`). So the runs here work on a `structural_copy` (the
module tree copied shallowly, every tensor shared, nothing copied in memory) and never touch the user's module.
`predicting()` is around every prediction, plan and capture: it keeps torch's CPU RNG and every initialised
CUDA device's RNG as found (a dropout in a fake or diagnosing run would otherwise draw from them), and it
runs one prediction at a time in the process (torch's tracing machinery keeps global state).
`tracer_patches_this_thread_only()` is around `torch.export`: its fx tracer replaces `torch.nn.Module.__call__`
and `__getattr__` for the whole process while it traces, which would route another thread's plain forward of
any model into the trace.

Known limitations: a module reached only through a plain attribute (not a submodule, not in a dict or list
attribute) is shared with the user's, not copied; `evaluate` still puts the user's model in eval mode for its
loop (it runs the model itself).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> c = structural_copy(model)
    >>> c[0] is model[0], c[0].weight is model[0].weight
    (False, True)
    >>> s = torch.get_rng_state()
    >>> with predicting():
    ...     _ = torch.rand(3)
    >>> torch.equal(s, torch.get_rng_state())
    True
"""

from __future__ import annotations

import copy
import functools
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["kept_rng", "predicting", "structural_copy", "tracer_patches_this_thread_only"]

# One prediction at a time in the process: torch.export's tracer and the fake-tensor runs keep global state
# (patched Module methods, gc switched off). Re-entrant: a prediction may capture, a capture may diagnose.
_ONE_AT_A_TIME = threading.RLock()


@contextmanager
def kept_rng() -> Iterator[None]:
    """Torch's CPU RNG and the RNG of every CUDA device are as found afterwards (CUDA's only when CUDA is
    initialised: reading them would initialise it)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextmanager
def predicting() -> Iterator[None]:
    """Around a prediction, plan or capture: one at a time in the process, every RNG kept as found."""
    with _ONE_AT_A_TIME, kept_rng():
        yield


def structural_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The module tree of `model` copied shallowly: a new object per module (a module registered twice stays
    one), with its own attribute dict, its own `_parameters`, `_buffers` and `_modules` dicts and its own copy of
    every dict or list attribute (a memo a forward fills, an LSTM's `_flat_weights`), all holding the same
    tensors. A method of a module of the tree kept in an attribute or a dict (a hook registered as
    `self._hook`) is bound to that module's copy. Swapping a parameter, setting `training` or an attribute on
    the copy changes nothing of `model`."""
    copies: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        c = object.__new__(type(m))         # no __init__, no __setstate__: the attributes as they are
        c.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, list)) else v for k, v in vars(m).items()})
        copies[id(m)] = c
    def rebound(v):          # a method of a module of the tree (a hook a module registered): the copy's
        own = copies.get(id(v.__self__)) if isinstance(v, types.MethodType) else None
        return types.MethodType(v.__func__, own) if own is not None else v

    for c in copies.values():
        for name, sub in c._modules.items():
            if sub is not None:
                c._modules[name] = copies[id(sub)]
        for k, v in vars(c).items():
            if isinstance(v, dict) and k not in ("_parameters", "_buffers", "_modules"):
                v.update({key: rebound(f) for key, f in v.items() if isinstance(f, types.MethodType)})
            elif isinstance(v, types.MethodType):
                c.__dict__[k] = rebound(v)
    return copies[id(model)]


@contextmanager
def tracer_patches_this_thread_only() -> Iterator[None]:
    """Around `torch.export` (and any fx trace) in this thread: a method torch's fx tracer patches on a class
    (`torch.nn.Module.__call__`, `__getattr__`) keeps its original behaviour in every other thread, whose
    plain forwards then neither go into the trace nor break it."""
    from torch.fx import _symbolic_trace as st
    owner = threading.get_ident()
    original = st._Patcher.patch_method

    def patch_method(self, cls, name, new_fn, deduplicate: bool = True):
        if threading.get_ident() != owner:              # another thread's own trace: as torch does it
            return original(self, cls, name, new_fn, deduplicate)
        before = getattr(cls, name)

        @functools.wraps(new_fn)
        def this_thread_only(*args, **kwargs):
            return (new_fn if threading.get_ident() == owner else before)(*args, **kwargs)
        return original(self, cls, name, this_thread_only, deduplicate)

    st._Patcher.patch_method = patch_method
    try:
        yield
    finally:
        st._Patcher.patch_method = original

"""The plans and planned memory models kept per model (`memfit.memory.cache.ModelCache`): evaluating every epoch
captures the model once. A borrowed plan holds its arena only until it is given back.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    >>> pm = borrow_plan(model, torch.empty(16, 8))
    >>> pm(torch.ones(16, 8)).shape, give_back(pm), pm.arena_bytes
    (torch.Size([16, 4]), None, 0)
    >>> borrow_plan(model, torch.empty(16, 8)) is pm          # the same plan, nothing re-captured
    True
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable

import torch

from memfit.memory.cache import ModelCache
from memfit.memory.isolation import predicting
from memfit.memory.step import forward_state
from memfit.planner.arena_model import PlannedMemoryModel, planned_memory_model
from memfit.planner.capture import CaptureError
from memfit.planner.planned import PlannedModule, plan, plan_captured

__all__ = ["borrow_plan", "give_back", "known_planned_model", "planned_model_of"]


_PLANS = ModelCache()     # plans and inference memory models (or the CaptureError that made one impossible)
_LENT: weakref.WeakSet = weakref.WeakSet()          # the cached plans borrowed now (each by one caller)
_LENDING = threading.Lock()


def _context() -> tuple:
    """What every kept plan or memory model also depends on: the surrounding autocast (a capture or estimate
    under autocast holds only under it) and the intra-op thread count (the kernels' workspaces the placements
    and memory models count, oneDNN's scratch, are measured per thread count: `fake_kernels.WORKSPACE`)."""
    return forward_state(), torch.get_num_threads()


def _cached(model: torch.nn.Module, key: tuple, make: Callable):
    key = (*key, *_context())
    with predicting():                      # a second thread finds the first one's entry, not a second capture
        return _cached_locked(model, key, make)


def _cached_locked(model: torch.nn.Module, key: tuple, make: Callable):
    values = _PLANS.values(model)          # one fingerprint per call (1-2 ms on a large model)
    if key not in values:
        try:
            values[key] = make()
        except CaptureError as e:   # a model that cannot be captured fails fast next time (capture takes seconds);
            values[key] = _bare(e)      # other errors (a transient OutOfMemoryError) are not kept
            raise                       # with its traceback the first time
        return values[key]
    value = values[key]
    if isinstance(value, CaptureError):
        raise _bare(value)          # a fresh copy: the kept one never holds a traceback (nor the model via its frames)
    return value


def _bare(e: CaptureError) -> CaptureError:
    """A copy of `e` without traceback, cause or context."""
    try:
        c = copy.copy(e)
    except Exception:               # an exception type whose copy fails: a plain one with the same message
        c = CaptureError(str(e), getattr(e, "kind", "export"))
    c.__traceback__ = c.__cause__ = c.__context__ = None
    return c


def planned_model_of(model: torch.nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype,
                     algorithm: str = "greedy_by_size") -> PlannedMemoryModel:
    """`planned_memory_model(model, sample_shape, dtype)`, made once per model (raises CaptureError likewise, at
    once the next time: a capture takes seconds)."""
    return _cached(model, ("memory", tuple(sample_shape), dtype, algorithm),
                   lambda: planned_memory_model(model, tuple(sample_shape), dtype, algorithm))


def known_planned_model(model: torch.nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype,
                        algorithm: str = "greedy_by_size"):
    """The planned memory model `planned_model_of` already made for these inputs, or the CaptureError that made it
    impossible, else None: nothing is captured here."""
    return _PLANS.peek(model, ("memory", tuple(sample_shape), dtype, algorithm, *_context()))


def borrow_plan(model: torch.nn.Module, example: torch.Tensor) -> PlannedModule:
    """The model's cached plan for inputs like `example` (made on first use), for this caller alone until
    `give_back`: while another thread has it, a plan of its own from the same capture (no export; its own
    arena, which is freed when given back)."""
    pm = _cached(model, ("plan", tuple(example.shape[1:]), example.dtype, example.device),
                 lambda: plan(model, (example,)))
    with _LENDING:
        lent = pm in _LENT
        if not lent:
            _LENT.add(pm)
            pm.model = model         # held only while borrowed: new shapes may need a new capture
    if lent:                         # in use by another thread, whose give_back would free its arena mid-call
        pm = plan_captured(next((c for c in pm.captures if c.accepts((example,))), pm.captures[0]), (example,),
                           model=model, algorithm=pm.algorithm, inplace=pm.inplace,
                           eager_where_cheaper=pm.eager_where_cheaper, reorder=pm.reorder)
    return pm


def give_back(pm: PlannedModule) -> None:
    """Free the plan's arena and let go of its model (the placements stay for the next borrow)."""
    pm.release()
    with _LENDING:
        pm.model = None
        _LENT.discard(pm)

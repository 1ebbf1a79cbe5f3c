"""What is kept per model across calls, in one mechanism (`ModelCache`): plans (evaluating every epoch
captures the model once), memory models, and accumulate's chosen micro-batch sizes. The cache never keeps
the model (or an arena) alive between calls.

An entry lives as long as its model (a weak key) and is dropped when anything a forward could depend on
changes (`model_state`: a parameter, buffer or submodule replaced, a training flag, an attribute such as a
dropout's `p` or a float the forward multiplies by); in-place weight updates are seen, since a plan reads
the parameters by reference. A borrowed plan holds its arena only until it is given back.

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

from memfit.memory.fingerprint import model_state
from memfit.memory.isolation import predicting
from memfit.memory.step import autocast_state
from memfit.planner.capture import CaptureError
from memfit.planner.planned import PlannedModule, plan, plan_captured

__all__ = ["ModelCache", "borrow_plan", "forget", "forward_memory_of", "give_back", "known_memory_model",
           "memory_model_of"]


_ALL: weakref.WeakSet = weakref.WeakSet()      # every ModelCache, for `forget`


class ModelCache:
    """Values kept per model under a key: a weak key (an entry lives as long as its model), and, when
    `fingerprinted`, dropped as soon as `model_state(model)` changes.

    Example:
        >>> cache = ModelCache()
        >>> model = torch.nn.Linear(2, 2)
        >>> cache.get(model, "k", lambda: 1), cache.get(model, "k", lambda: 2)
        (1, 1)
        >>> model.training = False                       # a flag a forward may read: the entry is dropped
        >>> cache.peek(model, "k"), cache.get(model, "k", lambda: 2)
        (None, 2)
    """

    def __init__(self, fingerprinted: bool = True):
        _ALL.add(self)
        self.fingerprinted = fingerprinted   # False where walking every module per call costs too much
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (fingerprint, {key: v})
        self._lock = threading.Lock()        # the dicts only: `make` runs outside it

    def values(self, model: torch.nn.Module) -> dict:
        """The dict of values kept for `model` (a new empty one if none, or if its fingerprint changed)."""
        return self._values(model, create=True)

    def _values(self, model: torch.nn.Module, create: bool) -> dict | None:
        if self.fingerprinted:
            with self._lock:
                entry = self._entries.get(model)
            if entry is not None and entry[0].holds(model):       # unchanged: no new value built
                return entry[1]
        fp = model_state(model) if self.fingerprinted else None
        with self._lock:
            entry = self._entries.get(model)
            if entry is None or entry[0] != fp:
                if not create:
                    return None
                entry = self._entries[model] = (fp, {})
            elif fp is not None:            # equal, by other objects of the same value: quick from now on
                self._entries[model] = (fp, entry[1])
            return entry[1]

    def peek(self, model: torch.nn.Module, key, default=None):
        """The value kept under `key`, else `default`: nothing is made."""
        values = self._values(model, create=False)
        return default if values is None else values.get(key, default)

    def get(self, model: torch.nn.Module, key, make: Callable):
        """The value kept under `key`, made by `make()` (and kept) the first time."""
        values = self._values(model, create=True)
        if key not in values:
            values[key] = make()
        return values[key]

    def put(self, model: torch.nn.Module, key, value) -> None:
        self._values(model, create=True)[key] = value

    def forget(self, model: torch.nn.Module) -> None:
        """Drop everything kept for `model` (to time a prediction rather than a cache hit)."""
        with self._lock:
            self._entries.pop(model, None)


def forget(model: torch.nn.Module) -> None:
    """Drop everything any cache keeps for `model`: the next call predicts (or captures) again."""
    for c in list(_ALL):
        c.forget(model)


_PLANS = ModelCache()     # plans and inference memory models (or the CaptureError that made one impossible)
_LENT: weakref.WeakSet = weakref.WeakSet()          # the cached plans borrowed now (each by one caller)
_LENDING = threading.Lock()


def _context() -> tuple:
    """What every kept plan or memory model also depends on: the surrounding autocast (a capture or estimate
    under autocast holds only under it) and the intra-op thread count (the kernels' workspaces the placements
    and memory models count, oneDNN's scratch, are measured per thread count: `fake_kernels.WORKSPACE`)."""
    return autocast_state(), torch.get_num_threads()


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


def memory_model_of(model: torch.nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype):
    """`memory_model(model, sample_shape, dtype)`, made once per model (raises CaptureError likewise)."""
    from memfit.memory.sizing import memory_model
    return _cached(model, ("memory", tuple(sample_shape), dtype),
                   lambda: memory_model(model, sample_shape, dtype=dtype))


def known_memory_model(model: torch.nn.Module, sample_shape: tuple[int, ...], dtype: torch.dtype):
    """The memory model `memory_model_of` already made for these inputs (or its error), else None: nothing
    is captured here."""
    return _PLANS.peek(model, ("memory", tuple(sample_shape), dtype, *_context()))


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


def forward_memory_of(model: torch.nn.Module, example) -> object:
    """`memfit.memory.step_model.step_memory_model(model, example, train=False)` (fake-tensor runs of an eager
    forward, for models the planner cannot capture), made once per model and input signature."""
    from memfit.memory.step_model import step_memory_model
    leaves = example.items() if isinstance(example, dict) else [("", example)]
    key = ("forward",) + tuple((k, tuple(v.shape[1:]), v.dtype, v.device) for k, v in leaves)
    return _cached(model, key, lambda: step_memory_model(model, example, train=False))

"""What is kept per model across calls, in one mechanism (`ModelCache`): memory models, plans (evaluating every
epoch captures the model once: `memfit.planner.kept`), accumulate's chosen micro-batch sizes, fit's plans. The cache
never keeps the model alive between calls.

An entry lives as long as its model (a weak key) and is dropped when anything a forward could depend on
changes (`model_state`: a parameter, buffer or submodule replaced, a training flag, an attribute such as a
dropout's `p` or a float the forward multiplies by); in-place weight updates are seen, since a plan reads
the parameters by reference.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from memfit.memory.fingerprint import model_state

__all__ = ["ModelCache", "Same", "forget"]


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


class Same:
    """An object by identity in a cache key (a loss_fn, what a closure holds): equal to another `Same` only while
    both name one object still alive. A bare `id()` is reused once its object is collected: a loss made per call,
    another class's at the old one's address, got the old one's kept prediction. An object that takes no weak
    reference (a list, an int) is by its id alone.

    Example:
        >>> class Loss: pass
        >>> a = Loss(); key = Same(a); key == Same(a)
        True
        >>> del a; key == Same(Loss())                     # a new object, whatever its address
        False
    """

    __slots__ = ("id", "ref")

    def __init__(self, obj):
        self.id = id(obj)
        try:
            self.ref = weakref.ref(obj)
        except TypeError:
            self.ref = None

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other) -> bool:
        if not isinstance(other, Same) or other.id != self.id or (self.ref is None) != (other.ref is None):
            return False
        return self.ref is None or (self.ref() is not None and self.ref() is other.ref())


def forget(model: torch.nn.Module) -> None:
    """Drop everything any cache keeps for `model`: the next call predicts (or captures) again."""
    for c in list(_ALL):
        c.forget(model)

"""A model's state as one comparable value, and the pieces it is made of: `State` (what `model_state` returns) and
`_value` (an attribute's value: plain values by value, tensors by identity and version, other objects by identity).
`memfit.memory.fingerprint` builds it for a model (`model_state`); `memfit.memory.fingerprint_check` checks a kept
one quickly. See `memfit.memory.fingerprint` for what the value covers and what it cannot see.
"""

from __future__ import annotations

import collections
import enum
import itertools
import operator
import weakref

import torch

from memfit.device.torch_private import MODULE_DICTS, version_counter

__all__ = ["State"]

_DEREF = weakref.ref.__call__                # a weak reference's object (None once collected)
_OWN = frozenset({*MODULE_DICTS, "training"})   # listed on their own
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)
_LONG = 64          # longer containers are compared by identity and length only


class State:
    """`model_state`'s value: per module (id, training flag, its tensors, its other attributes), ids standing
    for objects; `weak` and `strong` hold those objects. Equal to another only when the entries are equal and
    every object either names is still alive (then an equal id is the same object)."""
    __slots__ = ("entries", "quick", "strong", "weak")

    def __init__(self, entries: tuple, weak: list, strong: list):
        self.entries, self.weak, self.strong = entries, weak, strong
        self.quick = None             # a `fingerprint_check.Quick`, set by `model_state`

    def alive(self) -> bool:
        return not any(map(operator.is_, map(_DEREF, self.weak), itertools.repeat(None)))   # a C loop

    def holds(self, model: torch.nn.Module) -> bool:
        """True only when `model_state(model) == self`, checked without building that value (a tenth of its cost or
        less: see `memfit.memory.fingerprint_check`); False when it may differ (then compare `model_state(model)`)."""
        return self.quick is not None and self.quick.same(model)     # it checks what it compares is alive

    def __eq__(self, other) -> bool:
        if not isinstance(other, State):
            return NotImplemented
        return self.entries == other.entries and self.alive() and other.alive()

    __hash__ = None


def _held(obj, held: State) -> int:
    """obj's id, the object held beside it (weakly where it can be)."""
    try:
        held.weak.append(weakref.ref(obj))
    except TypeError:
        if not isinstance(obj, _CONTAINERS):
            held.strong.append(obj)
    return id(obj)


_EXACT = frozenset({bool, int, float, str, torch.dtype, torch.device})     # the common cases, by a set lookup
_CONTAINERS = (tuple, list, dict, set, frozenset)
_EMPTY = {t: (t.__name__, ()) for t in (*_CONTAINERS, collections.OrderedDict)}   # an empty one, as `_value` says


def _tensor(t: torch.Tensor, held: State) -> tuple:
    """A parameter or buffer: a plan reads its values by reference, so no version (training updates it)."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):      # a lazy module's, before its first forward
        return _held(t, held), "uninitialized"
    return _held(t, held), _address(t), t.shape, t.dtype, t.requires_grad, _strides(t)


def _strides(t: torch.Tensor):
    """The tensor's strides (a transposed square weight set through `.data` keeps storage and shape); None for a
    tensor without strides (sparse)."""
    try:
        return t.stride()
    except (RuntimeError, ValueError):
        return None


def _address(t: torch.Tensor):
    """Where the tensor's data is; None for a tensor subclass without storage."""
    try:
        return t.data_ptr()
    except (RuntimeError, ValueError):
        return None


def _value(v, depth: int, seen: dict, held: State):
    t = type(v)         # classes checked on the type: `isinstance` reads a config's `__class__` through its own
    if v is None or t in _EXACT:                    # Python `__getattribute__`, about 1 us a call
        return v
    if depth == 0 and id(v) in seen:    # a config object shared by many modules, met before in this walk
        return seen[id(v)]
    if issubclass(t, _CONTAINERS) and not v:        # most of a module's attributes: its empty hook dicts
        return t.__name__, ()
    if issubclass(t, _PLAIN):
        return v
    if issubclass(t, torch.Tensor):      # an inference tensor has no version: it cannot be written in place
        return ("tensor", _held(v, held), _address(v), tuple(v.shape), v.dtype,
                None if v.is_inference() else version_counter(v))
    if issubclass(t, _CONTAINERS):
        if depth > 2 or len(v) > _LONG:
            return t.__name__, _held(v, held), len(v)
        items = v.items() if issubclass(t, dict) else enumerate(sorted(v, key=repr) if issubclass(t, (set, frozenset))
                                                                else v)
        return t.__name__, tuple((k, _value(x, depth + 1, seen, held)) for k, x in items)
    if callable(v) or issubclass(t, torch.nn.Module):      # functions, hooks, a replaced forward, other modules
        return "object", _held(v, held)
    fields = getattr(v, "__dict__", None)
    if depth > 0 or not isinstance(fields, dict):
        return t.__name__, _held(v, held)
    # a config object: its plain fields, once per walk (`seen`: while the walk runs, an id is this object's)
    seen[id(v)] = (t.__name__, _held(v, held), tuple((k, _value(x, 1, seen, held)) for k, x in fields.items()))
    return seen[id(v)]

"""What a kept plan or memory model of a model depends on, as one comparable value (`model_state`).

A captured plan bakes in what the forward read besides its inputs: a float attribute (`self.scale`), a flag
(`gradient_checkpointing`, a dropout's `p`), a replaced `forward` or a hook, a config object's fields. Plans and
memory models are kept per model (capturing takes seconds) and must be dropped when any of that changes, or a later
call returns the old model's numbers. `model_state` lists, for every module, its parameters and buffers (identity,
storage, shape, dtype, requires_grad: a plan reads their values by reference, so a training step's in-place updates
keep it), its training flag and every other attribute: plain values (numbers, strings, small containers of them) by
value, tensors by identity and version (an in-place write bumps it), callables and other objects by identity, and
the plain fields of objects such as a `transformers` config. What it cannot see (a global the forward reads, torch's
global module hooks from `register_module_forward_hook`, an object's attribute two levels down) is the caller's to
signal by building a new model or a new plan.

An object named by identity is named by its `id()` and held by a weak reference beside (a strong one where it
takes none; a long container by id and length only, as it may hold the model): an id is reused once its object
is collected, so a forward installed after the first one was deleted could carry the very id a kept value
names; a value whose objects are not all alive any more equals no other. `describe_change` says in words what
differs between a kept value and the model now.

Example:
    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))
    >>> before = model_state(m)
    >>> m[1].p = 0.5
    >>> model_state(m) == before
    False
"""

from __future__ import annotations

import collections
import enum
import itertools
import operator
import weakref

import torch

import memfit.memory.fingerprint_check as check  # its `Quick` reads this module's `_value`, `State`

__all__ = ["describe_change", "model_state"]

_DEREF = weakref.ref.__call__                # a weak reference's object (None once collected)
_OWN = frozenset({"_parameters", "_buffers", "_modules", "training"})   # listed on their own
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)
_LONG = 64          # longer containers are compared by identity and length only


def model_state(model: torch.nn.Module) -> State:
    """A value that changes when anything a forward of `model` could depend on changes (see the module doc)."""
    seen: dict[int, object] = {}
    held = State((), [], [])
    modules = list(model.modules())
    quick = check.Quick(modules)
    held.entries = tuple((_held(m, held), m.training,
                          tuple(_tensor(t, held) for t in (*m._parameters.values(), *m._buffers.values())
                                if t is not None),
                          _attributes(vars(m), seen, held, quick, i), _held(type(m), held),
                          (tuple(m._modules), tuple(m._parameters), tuple(m._buffers)))   # names: `self.a` reads one
                         for i, m in enumerate(modules))
    held.quick = quick.done(model, modules)
    return held


def _attributes(fields: dict, seen: dict, held: State, quick: check.Quick, i: int) -> tuple:
    """A module's attributes but its own (`_OWN`), as `_value` gives them; the common ones (None, plain values,
    the empty hook dicts: most of a module's) without a call, since `plan.step` may walk every module each step.
    `quick` notes how `State.holds` checks each (module `i`'s): plain values and empty containers are held and
    compared by identity (the containers watched for growth), the rest by id and as `_value` gives them."""
    out = []
    for k, v in fields.items():
        t = type(v)
        if v is None or t in _EXACT:
            out.append((k, v))
            quick.hold(v)
        elif t is tuple and all(x is None or type(x) in _EXACT for x in v):     # a convolution's kernel_size
            out.append((k, _value(v, 0, seen, held)))
            quick.hold(v)                            # immutable: the same tuple has the same value
        elif t in _EMPTY and not v:
            out.append((k, _EMPTY[t]))
            quick.hold(v)
            quick.empty.append(v)
        else:
            quick.mask.append(False)
            if k not in _OWN:
                before = len(held.weak)
                value = _value(v, 0, seen, held)
                out.append((k, value))
                quick.deep.append((i, k, value))
                quick.deep_refs += held.weak[before:]
    return tuple(out)


class State:
    """`model_state`'s value: per module (id, training flag, its tensors, its other attributes), ids standing
    for objects; `weak` and `strong` hold those objects. Equal to another only when the entries are equal and
    every object either names is still alive (then an equal id is the same object)."""
    __slots__ = ("entries", "quick", "strong", "weak")

    def __init__(self, entries: tuple, weak: list, strong: list):
        self.entries, self.weak, self.strong = entries, weak, strong
        self.quick: check.Quick | None = None

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
        return "tensor", _held(v, held), _address(v), tuple(v.shape), v.dtype, None if v.is_inference() else v._version
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


def describe_change(before: State, model: torch.nn.Module) -> str | None:
    """What differs between `before` (an earlier `model_state(model)`) and the model now, in words naming the
    module, parameter or attribute ("parameter '0.weight' now requires grad"); None when nothing does."""
    now = model_state(model)
    if now == before:
        return None
    if len(now.entries) != len(before.entries):
        return f"modules were added or removed ({len(before.entries)} modules then, {len(now.entries)} now)"
    for (name, m), old, new in zip(model.named_modules(), before.entries, now.entries, strict=True):
        where = f"module '{name}'" if name else "the model"
        if old == new:
            continue
        if old[0] != new[0]:
            return f"{where} was replaced by another module"
        if old[1] != new[1]:
            return f"{where} was switched to {'training' if new[1] else 'eval'} mode"
        if old[2] != new[2]:
            return _tensor_change(name, m, old[2], new[2])
        if old[4] != new[4]:                      # `m.__class__ = Other`: the same object with another forward
            return f"the class of {where} changed (now {type(m).__name__})"
        if old[5] != new[5]:                      # the same objects in the same order under other names
            return f"the names of {where}'s submodules, parameters or buffers changed"
        was, now_ = dict(old[3]), dict(new[3])
        changed = [k for k in {**was, **now_} if was.get(k, _MISSING) != now_.get(k, _MISSING)]
        return f"attribute {', '.join(repr(k) for k in changed[:3])} of {where} changed"
    return "an object the model held when the value was taken (a forward, a tensor, a module) was deleted"


_MISSING = object()


def _tensor_change(name: str, m: torch.nn.Module, old: tuple, new: tuple) -> str:
    prefix = f"{name}." if name else ""
    kinds = [(k, "parameter") for k, t in m._parameters.items() if t is not None] + \
        [(k, "buffer") for k, t in m._buffers.items() if t is not None]
    if len(old) != len(new):
        return f"parameters or buffers of {name or 'the model'} were added or removed ({len(old)} then, {len(new)} now)"
    for (k, kind), a, b in zip(kinds, old, new, strict=True):
        if a == b:
            continue
        if a[0] != b[0]:
            return f"{kind} '{prefix}{k}' was replaced"
        if len(a) == len(b) == 6 and a[4] != b[4]:
            return f"{kind} '{prefix}{k}' {'now requires grad' if b[4] else 'no longer requires grad'}"
        return f"{kind} '{prefix}{k}' changed storage, shape, dtype or strides"
    return f"the parameters or buffers of {name or 'the model'} changed"

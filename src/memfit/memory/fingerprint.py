"""What a kept plan or memory model of a model depends on, as one comparable value (`model_state`).

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

import torch

__all__ = ["model_state"]

_OWN = frozenset({"_parameters", "_buffers", "_modules", "training"})   # listed on their own
_PLAIN = (bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)
_LONG = 64          # longer containers are compared by identity and length only


def model_state(model: torch.nn.Module) -> tuple:
    """A value that changes when anything a forward of `model` could depend on changes (see the module doc)."""
    seen: dict[int, object] = {}
    return tuple((id(m), m.training,
                  tuple(_tensor(t) for t in (*m._parameters.values(), *m._buffers.values()) if t is not None),
                  tuple((k, _value(v, 0, seen)) for k, v in vars(m).items() if k not in _OWN))
                 for m in model.modules())


_EXACT = frozenset({bool, int, float, str, torch.dtype, torch.device})     # the common cases, by a set lookup
_CONTAINERS = (tuple, list, dict, set, frozenset)


def _tensor(t: torch.Tensor) -> tuple:
    """A parameter or buffer: a plan reads its values by reference, so no version (training updates it)."""
    if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):      # a lazy module's, before its first forward
        return id(t), "uninitialized"
    return id(t), _address(t), t.shape, t.dtype, t.requires_grad


def _address(t: torch.Tensor):
    """Where the tensor's data is; None for a tensor subclass without storage."""
    try:
        return t.data_ptr()
    except (RuntimeError, ValueError):
        return None


def _value(v, depth: int, seen: dict):
    t = type(v)
    if v is None or t in _EXACT:
        return v
    if isinstance(v, _CONTAINERS) and not v:      # most of a module's attributes: its empty hook dicts
        return t.__name__, ()
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, torch.Tensor):      # an inference tensor has no version: it cannot be written in place
        return "tensor", id(v), _address(v), tuple(v.shape), v.dtype, None if v.is_inference() else v._version
    if isinstance(v, _CONTAINERS):
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

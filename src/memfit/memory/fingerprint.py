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

import torch

import memfit.memory.fingerprint_check as check  # `Quick`: the quick check built beside the value
from memfit.device.torch_private import own_buffers, own_children, own_parameters
from memfit.memory.model_value import _EMPTY, _EXACT, _OWN, State, _held, _tensor, _value

__all__ = ["State", "describe_change", "model_state"]


def model_state(model: torch.nn.Module) -> State:
    """A value that changes when anything a forward of `model` could depend on changes (see the module doc)."""
    seen: dict[int, object] = {}
    held = State((), [], [])
    modules = list(model.modules())
    quick = check.Quick(modules)
    held.entries = tuple((_held(m, held), m.training,
                          tuple(_tensor(t, held) for t in (*own_parameters(m).values(), *own_buffers(m).values())
                                if t is not None),
                          _attributes(vars(m), seen, held, quick, i), _held(type(m), held),
                          # names: `self.a` reads one
                          (tuple(own_children(m)), tuple(own_parameters(m)), tuple(own_buffers(m))))
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
    kinds = [(k, "parameter") for k, t in own_parameters(m).items() if t is not None] + \
        [(k, "buffer") for k, t in own_buffers(m).items() if t is not None]
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

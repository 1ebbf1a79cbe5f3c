"""What a `FitPlan` holds for, checked by `plan.step` before it runs one: the layout of the batch `memfit.fit`
planned (each tensor's shape past the samples, its dtype, where it sits in a dict or tuple), the model as it was
(`memfit.memory.fingerprint`) and the optimizer's parameter groups.

A plan's bytes are those of its batch. A batch with longer sequences or larger images needs more at the same
micro-batch (3 features per sample where the plan had 1: 2.25x the budget on an MLP, silently, before this
check), so `plan.step` refuses a batch larger than the plan's in any dimension, or of other dtypes or
structure. Smaller ones (a shorter last batch, a shorter padded sequence) pass: their step needs no more. More
samples pass only when the batch is held off the model's device (accumulate copies it a micro-batch at a time).

A model changed after `fit` (a parameter unfrozen: its gradient and optimizer state were not counted; a module
replaced; another forward) or an optimizer given other parameters or options that decide its state (momentum
switched on, amsgrad) is refused too (`held_error`): the plan's bytes are the old model's. A learning-rate
schedule (`lr` from 0 in a warm-up, `betas`; `momentum` between non-zero values) changes no byte and passes.
Each step is checked against the model as the previous step left it (as `fit` left it, for the first): what a
model's own forward sets (Swin's `shift_size`, a lazy module's weights) is not a change by the caller, unless it
changes what the bytes depend on (a parameter unfrozen, added or replaced: progressive unfreezing inside a
forward), which the next step refuses. A step on a
batch of the shapes (and dtypes, devices) of one that left the model as it found it is not checked after it runs
(`FitPlan.step`: one check a step, not two); a forward that changes its model only on some steps of one batch shape
is then refused as a change by the caller, and the error says so.

Example:
    >>> import torch
    >>> planned = layout((torch.zeros(8, 32, dtype=torch.long), torch.zeros(8, 32, dtype=torch.long)))
    >>> layout_error(planned, 8, (torch.zeros(8, 16, dtype=torch.long), torch.zeros(8, 16, dtype=torch.long)),
    ...              torch.device("cpu")) is None
    True
    >>> print(layout_error(planned, 8, (torch.zeros(8, 64, dtype=torch.long), torch.zeros(8, 64, dtype=torch.long)),
    ...                    torch.device("cpu")))       # doctest: +ELLIPSIS
    plan.step: x is (64,) per sample (torch.int64); the plan was made for (32,) per sample (torch.int64): ...
"""

from __future__ import annotations

import itertools
import operator
import weakref

import torch

from memfit.budget import model_device
from memfit.device.torch_private import keystr, tree_flatten, tree_flatten_with_path, tree_map
from memfit.memory.fingerprint import describe_change, model_state
from memfit.memory.micro_batch import shared_tensors

__all__ = ["ModelChanged", "apart", "batch_shapes", "first_sample", "grown", "held", "held_error", "layout",
           "layout_error", "optimizer_options", "targets_at"]

_MISSING = object()
_DEREF = weakref.ref.__call__                # a weak reference's object (None once collected), by a C loop in `map`


class ModelChanged(ValueError):
    """plan.step: the model changed since the plan was made (what its bytes depend on)."""


_AGAIN = "call memfit.fit again with the model and optimizer as they are now (it plans for them)"


def held(module: torch.nn.Module, optimizer, planned: tuple | None = None) -> tuple:
    """What of the model and optimizer a plan's bytes depend on, for `held_error`. After a step (`planned`: what the
    step was checked against), the model as the step left it: `planned`'s state again where the model still holds it
    (`State.holds`: a fraction of a new `model_state`, which walks every attribute of every module), and the
    parameter groups as planned (a step changes none; a schedule's numbers are not compared). A change the step's
    forward made to what the bytes depend on (`_tensors`: a parameter unfrozen, added or replaced) is not taken: the
    next step is checked against the model before it, and refused."""
    if planned is None:
        return model_state(module), _groups(optimizer), _tensors(module)
    if planned[0].holds(module):
        return planned
    tensors = _tensors(module)
    if planned[2] is not None and tensors != planned[2]:
        # what the plan's bytes depend on (a parameter unfrozen, added or replaced, a buffer resized) changed in the
        # step, by the model's own forward: not taken as planned, so the next step refuses it (a new tuple of the same
        # values: `planned` itself is returned only where the model holds it, which the caller tells by identity)
        return (planned[0], planned[1], planned[2])
    return model_state(module), planned[1], tensors


def _tensors(module: torch.nn.Module) -> tuple | None:
    """The parameters and buffers as far as a step's bytes go: each parameter's identity, shape, dtype and
    requires_grad, each buffer's shape and dtype (a buffer replaced by one alike, as a cache refilled, is no change).
    None for a model with a lazy (uninitialized) parameter: its first forward makes them, as planned."""
    params = list(module.parameters())
    if any(isinstance(p, torch.nn.parameter.UninitializedTensorMixin) for p in params):
        return None
    return (tuple((id(p), tuple(p.shape), p.dtype, p.requires_grad) for p in params),
            tuple((tuple(b.shape), b.dtype) for b in module.buffers()))


def held_error(planned: tuple, module: torch.nn.Module, optimizer, holds: bool | None = None) -> ValueError | None:
    """Why the model or optimizer may now need more than the plan made when they were `planned` (`held`), or None.
    `holds`: `planned[0].holds(module)`, already asked."""
    state, groups = planned[:2]
    if not (state.holds(module) if holds is None else holds) and model_state(module) != state:
        return ModelChanged(f"plan.step: the model changed since memfit.fit made this plan "
                          f"({describe_change(state, module)}): its bytes are the model's as it was (a parameter "
                          f"unfrozen adds its gradient and optimizer state; a module replaced, its own); {_AGAIN}")
    if _groups_hold(optimizer, groups):
        return None
    now = _groups(optimizer)            # built only to say what changed
    if not _same_groups(now, groups):
        changed = sorted({k for g, w in zip(now, groups, strict=False) for k, v in w[1].items()
                          if g[1].get(k, _MISSING) != v})
        what = (f"option {', '.join(changed)} changed" if changed else
                f"{len(groups)} group(s) of {[len(g[0]) for g in groups]} parameters then, {len(now)} of "
                f"{[len(g[0]) for g in now]} now, or other parameters")
        return ValueError(f"plan.step: the optimizer's parameter groups changed since memfit.fit made this plan "
                          f"({what}): the gradients and state it keeps were not counted; {_AGAIN}")
    return None


# numbers whose being 0 decides what an optimizer keeps or makes: SGD keeps a momentum buffer only for momentum != 0,
# and adds the weight decay into a new gradient only for weight_decay != 0; any other number (lr, betas, eps: what a
# schedule moves, from 0 too in a warm-up) changes no byte
_ZERO_DECIDES = frozenset({"momentum", "weight_decay"})


def optimizer_options(optimizer) -> tuple:
    """Per param group, its options as far as they decide the optimizer's bytes (see `_groups`), hashable: what a
    kept plan depends on (a schedule moving lr keeps it)."""
    return tuple(tuple(sorted(options.items())) for _, options in _groups(optimizer))


def _groups(optimizer) -> tuple:
    """Per param group (weak references to its parameters, its options reduced to what decides the optimizer's state
    and temporaries: None, flags and strings as they are; momentum and weight_decay by whether they are 0, other
    numbers not at all; a tensor by shape and dtype)."""
    return tuple((tuple(weakref.ref(p) for p in g["params"]),
                  {k: _option(v, k in _ZERO_DECIDES) for k, v in g.items() if k != "params"})
                 for g in optimizer.param_groups)


def _groups_hold(optimizer, planned: tuple) -> bool:
    """`_same_groups(_groups(optimizer), planned)` without building the weak references of every parameter (once a
    step in `plan.step`: 79 us a step on ResNet-50's 161 parameters, 15 us this way)."""
    now = optimizer.param_groups
    if len(now) != len(planned):
        return False
    for g, (params_then, options_then) in zip(now, planned, strict=True):
        params = g["params"]
        if len(params) != len(params_then) or not all(map(operator.is_, params, map(_DEREF, params_then))):
            return False
        if not all(k in g and _option(g[k], k in _ZERO_DECIDES) == v for k, v in options_then.items()):
            return False
    return True


def _option(v, zero_decides: bool):
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, (int, float)):
        return v != 0 if zero_decides else "number"
    if isinstance(v, torch.Tensor):
        return "tensor", tuple(v.shape), v.dtype, v.device
    if isinstance(v, (tuple, list)):
        return tuple(_option(x, zero_decides) for x in v)
    return type(v).__name__


def _same_groups(now: tuple, planned: tuple) -> bool:
    """The planned options unchanged (keys added since are a scheduler's own, `initial_lr`) and the very same
    parameters (alive: a weak reference to a collected one matches nothing)."""
    def same(group, was) -> bool:
        (params, options), (params_then, options_then) = group, was
        return (all(k in options and options[k] == v for k, v in options_then.items())
                and len(params) == len(params_then)
                and all(p() is not None and p() is q() for p, q in zip(params, params_then, strict=True)))
    return len(now) == len(planned) and all(same(g, w) for g, w in zip(now, planned, strict=True))


def batch_shapes(batch, leaves: list | None = None) -> tuple:
    """Every tensor's (shape, dtype, device) in the batch, flattened: what a forward's own changes to its model may
    depend on besides the values (Swin's window sizes on the image's, a cache on the sequence length). `leaves`: the
    batch's, flattened already."""
    leaves = tree_flatten(batch)[0] if leaves is None else leaves
    return tuple((t.shape, t.dtype, t.device) for t in leaves if isinstance(t, torch.Tensor))


def layout(batch) -> tuple:
    """(tree structure, [(where, shape past the samples, dtype), ...]) of a batch (x, y) or of the inputs x."""
    leaves, spec = tree_flatten_with_path(batch)
    return spec, [(_where(path), tuple(t.shape[1:]), t.dtype) for path, t in leaves if isinstance(t, torch.Tensor)]


def apart(x, y) -> tuple:
    """(x, y) with each tensor given twice (`(ids, ids)`, `labels=ids`) after its first a copy: a plan is for the
    batches a loop steps on later, where they are often two (a collator's `labels = input_ids.clone()`), and a plan
    that counted one tensor's bytes once would not hold there (nor refuse them: `layout` leaves sharing out). The
    copy is real and lives while `fit` runs (on the batch's device: an autoencoder's `(x, x)` holds its batch twice
    then), dropped when fit returns: the plan keeps the layout, not the tensors."""
    repeats = {i for i, _ in shared_tensors(x, y)}
    if not repeats:
        return x, y
    count = itertools.count()                # each tensor's index, in batch_tensors' order

    def copied(v):
        if isinstance(v, torch.Tensor):
            return v.clone() if next(count) in repeats else v
        if isinstance(v, dict):
            return {k: copied(u) for k, u in v.items()}
        if not isinstance(v, (tuple, list)):
            return v
        items = [copied(u) for u in v]
        return v._make(items) if hasattr(v, "_make") else type(v)(items)        # a namedtuple: its fields
    return copied(x), copied(y)


def _where(path) -> str:
    """'x', 'y', "x['input_ids']": the tensor's place in (x, y)."""
    text = keystr(path)
    return {"[0]": "x", "[1]": "y"}.get(text[:3], "the batch") + text[3:] if text else "x"


def _what(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of {tuple(v.shape[1:])} per sample ({v.dtype})" if v.dim() else f"a 0-d tensor ({v.dtype})"
    return f"a {type(v).__name__}"


def _kind(spec) -> str:
    """A batch's structure in words: 'a tuple of 2 (a tensor, a dict of input_ids, labels)'."""
    if spec.is_leaf():
        return "a tensor"
    if spec.type is type(None):
        return "None"
    if spec.type is dict:
        return f"a dict of {', '.join(map(str, spec.context))}"
    kids = ", ".join(_kind(c) for c in spec.children())
    return f"a {spec.type.__name__} of {spec.num_children} ({kids})"


def layout_error(planned: tuple, n: int, batch, device: torch.device, flat: tuple | None = None) -> Exception | None:
    """Why `batch` may need more than the plan made for `planned` (a `layout`) at n samples, or None. (Checked every
    `plan.step`: the batch is flattened without the names of its places, which only an error message needs; `flat`:
    `tree_flatten(batch)`, done already.)"""
    leaves, spec = tree_flatten(batch) if flat is None else flat
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    # the planned sample shape itself (most steps) by one comparison, a smaller one dimension by dimension
    fits = lambda t, was, dtype, shape: (t.dtype == dtype and (shape == was or len(shape) == len(was) and all(
        a <= b for a, b in zip(shape, was, strict=True))))
    if spec == planned[0] and len(tensors) == len(planned[1]) and all(
            fits(t, was, dtype, t.shape[1:]) for t, (_, was, dtype) in zip(tensors, planned[1], strict=True)):
        m = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
        if not (m > n and any(t.device == device for t in tensors)):
            return None
    return _said(planned, n, batch, device)


def _said(planned: tuple, n: int, batch, device: torch.device) -> Exception | None:
    """`layout_error`, with the places named."""
    spec, tensors = layout(batch)
    fix = ("fit the plan on the largest batch you will step on (pad shorter ones up to it: smaller batches and "
           "shorter samples pass), or call memfit.fit with this batch (plans are kept per layout)")
    if spec != planned[0] or len(tensors) != len(planned[1]):
        was = "; ".join(f"{where} a tensor of {shape} per sample ({dtype})" for where, shape, dtype in planned[1])
        leaves = tree_flatten_with_path(batch)[0]
        arrays = [_where(path) for path, v in leaves if type(v).__module__ == "numpy"]
        if arrays:
            return TypeError(f"plan.step takes torch tensors, as the plan was made for ({was}); found numpy arrays at "
                             f"{', '.join(arrays)}. Fix: torch.from_numpy(a) (.float() where the plan has float32 "
                             "and the array is float64), or step on a memfit loader's batches")
        found = "; ".join(f"{_where(path)} {_what(v)}" for path, v in leaves if v is not None) or "nothing"
        # the places the plan has and the batch lacks, and the other way round: what a user looks for first
        places = {_where(path) for path, v in leaves if isinstance(v, torch.Tensor)}
        lacks = [where for where, _, _ in planned[1] if where not in places]
        adds = sorted(places - {where for where, _, _ in planned[1]})
        head = "; ".join(part for part in (f"lacks {', '.join(lacks)}" if lacks else "",
                                           f"has {', '.join(adds)} beside what the plan was made for" if adds else "")
                         if part)
        if head:                   # another set of inputs: no padding makes it the plan's
            fix = ("step on batches holding what the plan was made for, or call memfit.fit with this batch (plans are "
                   "kept per layout)")
        return ValueError(f"plan.step: the batch {head + ': it ' if head else ''}holds {found}; the plan was made for "
                          f"{was} (in that structure: {_kind(planned[0])}, found {_kind(spec)}): {fix}")
    for (where, shape, dtype), (_, was, was_dtype) in zip(tensors, planned[1], strict=True):
        if dtype != was_dtype or len(shape) != len(was) or any(a > b for a, b in zip(shape, was, strict=True)):
            return ValueError(f"plan.step: {where} is {shape} per sample ({dtype}); the plan was made for {was} per "
                              f"sample ({was_dtype}): its step could need more than the plan's "
                              f"{'budget' if dtype == was_dtype else 'bytes'}; {fix}")
    leaves = [t for t in tree_flatten_with_path(batch)[0] if isinstance(t[1], torch.Tensor)]
    m = leaves[0][1].shape[0] if leaves and leaves[0][1].dim() else 0
    if m > n and any(t.device == device for _, t in leaves):
        return ValueError(f"plan.step: the batch holds {m} samples on the model's device; the plan was made for {n} "
                          f"(their bytes count in its peak): {fix}")
    return None


def targets_at(module, x, n: int, loss_fn, target) -> tuple[object, str]:
    """(y at the batch's size n, a note): `target` rebuilt at n (an example target batch, or one target's sample
    shape for float targets), or for a common loss built from the model's output as `memory_model` does. Only
    its shape and dtype matter to the search."""
    from memfit.memory.example_target import example_target
    from memfit.memory.step import ExampleBatch, is_shape
    device = model_device(module)
    if target is None:
        tgt, note = example_target(module, ExampleBatch(x), loss_fn, device)
    else:
        tgt, note = ExampleBatch(target), "target= given: its layout at the batch's size"
        if is_shape(target):
            note = "target= given as one target's sample shape (float32)"
    # zeros of one target broadcast to n (no bytes allocated; counted as n targets): the search reads shapes only
    grow = lambda t: torch.zeros((1, *t.shape[1:]), dtype=t.dtype, device=device).expand(n, *t.shape[1:]) \
        if isinstance(t, torch.Tensor) else t
    return tree_map(grow, tgt.template), note


def grown(batch, n: int):
    """The batch's first sample broadcast to n samples (no bytes allocated; counted as n: the search reads shapes)."""
    return tree_map(lambda t: t[:1].expand(n, *t.shape[1:]) if isinstance(t, torch.Tensor) and t.dim() else t, batch)


def first_sample(x):
    """x's first sample, copied (the batch is not kept): what the Trainer hand-off tries the model's own loss on."""
    from memfit.batches import batch_slice
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, batch_slice(x, 0, 1))

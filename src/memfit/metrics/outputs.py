"""What a metric reads from a model's output: the logits (`logits_of`), or with a dict of targets the output of
a target's name (`output_for`).

Example:
    >>> import torch
    >>> logits_of({"logits": torch.zeros(2, 3), "hidden": torch.zeros(2, 8)}).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

import torch

from memfit.losses import unit_dim

__all__ = ["logits_of", "order_error", "output_for"]


def logits_of(out, output_fn: Callable | None = None) -> torch.Tensor:
    """The logits in a model's output, by one documented rule.

    `output_fn(out)` when given; else a tensor as it is; an object with a tensor `.logits`
    (a transformers `ModelOutput`) its `.logits`; a dict its `"logits"` entry; a tuple or list its
    first element (the convention of `return_dict=False` models: logits first). Anything else raises,
    naming what was found.
    """
    if output_fn is not None:
        out = output_fn(out)
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        raise ValueError(f"the model returned a dict without a 'logits' tensor (keys {list(out)}); pass "
                         "output_fn=lambda out: out['KEY'] to say where the logits are")
    if isinstance(out, (tuple, list)) and out:
        return logits_of(out[0])
    raise TypeError(f"the model returned {type(out).__name__}; expected logits as a tensor, a tuple/list (logits "
                    "first), a dict or ModelOutput with 'logits', or pass output_fn= to pick them")


def output_for(out, name: str, names: list[str], output_fn: Callable | None = None) -> torch.Tensor:
    """The output compared with target `name` of a dict of targets `names`: the model's (or `output_fn`'s)
    dict entry of that name, or the tuple/list element at the target's position."""
    if output_fn is not None:
        out = output_fn(out)
    if isinstance(out, Mapping) and isinstance(out.get(name), torch.Tensor):
        return out[name]
    if isinstance(out, (tuple, list)) and len(out) == len(names):
        return out[names.index(name)]
    found = f"a dict with keys {list(out)}" if isinstance(out, Mapping) else (
        f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__)
    raise ValueError(f"target {name!r}: expected the model to return a dict with a tensor {name!r} (or a tuple of "
                     f"{len(names)} outputs in the targets' order {names}); found {found}; pass output_fn= to "
                     "make one")



def order_error(out, y: dict, ignored: dict, output_fn: Callable | None = None) -> ValueError | None:
    """With a tuple of outputs matched to a dict of targets by position (`output_for`): the error to raise when
    another order of the targets fits the outputs as well (a 2-class head and a 2-value box: swapped, each metric
    would be computed on the other's output, silently); None when only the targets' own order fits, or the
    outputs are a dict. `ignored`: each target's ignore index. Read once, on the first chunk."""
    if output_fn is not None:
        out = output_fn(out)
    names = list(y)
    if not isinstance(out, (tuple, list)) or len(out) != len(names) or not 1 < len(names) <= 6:
        return None
    fits = [[_fits(o, y[k], ignored.get(k, -100)) for k in names] for o in out]     # fits[output][target]
    orders = [p for p in itertools.permutations(range(len(names))) if all(fits[i][t] for i, t in enumerate(p))]
    if tuple(range(len(names))) not in orders or len(orders) == 1:
        return None
    other = next(p for p in orders if p != tuple(range(len(names))))
    return ValueError(f"the model returns a {type(out).__name__} of {len(out)} outputs, matched to the targets by "
                      f"their order {names}; the order {[names[t] for t in other]} fits the outputs' shapes as well, "
                      "so a swapped order would compute every metric on another target's output, silently. Say "
                      "which is which: output_fn=lambda out: {" + ", ".join(f"{k!r}: out[{i}]" for i, k in
                                                                         enumerate(names)) + "}")


def _fits(o, t, ignore: int) -> bool:
    """Could output o be scored against target t: values of one shape (one more dimension of 1 either way), or class
    scores on dimension 1 or the last one with more classes than the largest label."""
    if not isinstance(o, torch.Tensor) or not isinstance(t, torch.Tensor) or o.dim() == 0 or t.dim() == 0 \
            or o.shape[0] != t.shape[0]:
        return False
    if t.is_floating_point() or t.dtype == torch.bool:
        return o.shape == t.shape or unit_dim(tuple(o.shape), tuple(t.shape)) is not None \
            or unit_dim(tuple(t.shape), tuple(o.shape)) is not None
    if o.dim() != t.dim() + 1:
        return False
    counted = t[t != ignore]
    top = int(counted.max()) if counted.numel() else -1
    return any(shape == tuple(t.shape[1:]) and classes > top
               for classes, shape in ((o.shape[1], tuple(o.shape[2:])), (o.shape[-1], tuple(o.shape[1:-1]))))

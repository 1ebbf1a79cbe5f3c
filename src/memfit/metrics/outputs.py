"""What a metric reads from a model's output: the logits (`logits_of`), or with a dict of targets the output of
a target's name (`output_for`).

Example:
    >>> import torch
    >>> logits_of({"logits": torch.zeros(2, 3), "hidden": torch.zeros(2, 8)}).shape
    torch.Size([2, 3])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

__all__ = ["logits_of", "output_for"]


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


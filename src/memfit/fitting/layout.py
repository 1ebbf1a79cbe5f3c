"""The batches a `FitPlan` holds for: the layout of the batch `memfit.fit` planned (each tensor's shape past the
samples, its dtype, where it sits in a dict or tuple), and the check `plan.step` makes before it runs one.

A plan's bytes are those of its batch. A batch with longer sequences or larger images needs more at the same
micro-batch (3 features per sample where the plan had 1: 2.25x the budget on an MLP, silently, before this
check), so `plan.step` refuses a batch larger than the plan's in any dimension, or of other dtypes or
structure. Smaller ones (a shorter last batch, a shorter padded sequence) pass: their step needs no more. More
samples pass only when the batch is held off the model's device (accumulate copies it a micro-batch at a time).

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

import torch
from torch.utils._pytree import keystr, tree_flatten_with_path

__all__ = ["layout", "layout_error"]


def layout(batch) -> tuple:
    """(tree structure, [(where, shape past the samples, dtype), ...]) of a batch (x, y) or of the inputs x."""
    leaves, spec = tree_flatten_with_path(batch)
    return spec, [(_where(path), tuple(t.shape[1:]), t.dtype) for path, t in leaves if isinstance(t, torch.Tensor)]


def _where(path) -> str:
    """'x', 'y', "x['input_ids']": the tensor's place in (x, y)."""
    text = keystr(path)
    return {"[0]": "x", "[1]": "y"}.get(text[:3], "the batch") + text[3:] if text else "x"


def layout_error(planned: tuple, n: int, batch, device: torch.device) -> ValueError | None:
    """Why `batch` may need more than the plan made for `planned` (a `layout`) at n samples, or None."""
    spec, tensors = layout(batch)
    fix = ("fit the plan on the largest batch you will step on (pad shorter ones up to it: smaller batches and "
           "shorter samples pass), or call memfit.fit with this batch (plans are kept per layout)")
    if spec != planned[0] or len(tensors) != len(planned[1]):
        return ValueError(f"plan.step: the batch is laid out as {spec}; the plan was made for {planned[0]}: {fix}")
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

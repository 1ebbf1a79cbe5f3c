"""A batch as a model takes it: one tensor, a tuple or list of tensors, or a dict of tensors.

One rule wherever memfit runs a model on a batch (evaluate, its chunk sizing, accumulate): a tensor is one input,
`model(x)`; a tuple or list is positional inputs, `model(*x)`; a dict is keyword inputs, `model(**x)`
(a `transformers` model's `input_ids` + `attention_mask`). Dimension 0 of every tensor is the sample.
Values that are not tensors (a flag in a dict, None) pass through slicing and moves unchanged.

Example:
    >>> import torch
    >>> x = {"a": torch.zeros(4, 3), "b": (torch.ones(4), None)}
    >>> batch_len(x), batch_nbytes(x), batch_slice(x, 1, 3)["b"][0].shape
    (4, 64, torch.Size([2]))
    >>> forward(lambda a, b: a + b, (torch.ones(2), torch.ones(2))).tolist()
    [2.0, 2.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["async_copy_to", "batch_len", "batch_nbytes", "batch_slice", "batch_tensors", "batch_to", "forward",
           "plain_batch"]


def plain_batch(batch):
    """`batch` with a mapping that is not a dict made a dict, at the top and in an (x, y) tuple or list: a
    tokenizer's or data collator's `transformers.BatchEncoding` (a `UserDict`) is the keyword inputs it holds, as a
    dict is. Anything else is returned as it is.

    Example:
        >>> import collections, torch
        >>> x = collections.UserDict(input_ids=torch.zeros(2, 3))
        >>> type(plain_batch(x)).__name__, type(plain_batch((x, None))[0]).__name__
        ('dict', 'dict')
    """
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch)
    if type(batch) in (tuple, list) and any(isinstance(v, Mapping) and not isinstance(v, dict) for v in batch):
        return type(batch)(dict(v) if isinstance(v, Mapping) and not isinstance(v, dict) else v for v in batch)
    return batch


def forward(model, x):
    """`model(**x)` for a dict, `model(*x)` for a tuple or list, else `model(x)`."""
    if isinstance(x, dict):
        return model(**x)
    if isinstance(x, (tuple, list)):
        return model(*x)
    return model(x)


def batch_tensors(x) -> list[torch.Tensor]:
    """Every tensor in x (a tensor, or nested in dicts, tuples and lists), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return [t for v in items for t in batch_tensors(v)]


def batch_len(x) -> int:
    """Samples in x: dimension 0 of its first tensor."""
    ts = batch_tensors(x)
    if not ts or ts[0].dim() == 0:
        raise TypeError(f"expected a batch (a tensor, or a tuple, list or dict of tensors with a batch dimension); "
                        f"found {type(x).__name__}{' of no tensors' if not ts else ' holding a 0-d tensor'}")
    return ts[0].shape[0]


def batch_nbytes(x) -> int:
    """Bytes of every tensor in x (views counted at their own size)."""
    return sum(t.nbytes for t in batch_tensors(x))


def _map(x, fn):
    """x with fn applied to each tensor, the same structure (a tuple stays a tuple, a list a list)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: _map(v, fn) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        items = [_map(v, fn) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)     # a namedtuple takes fields
    return x


def batch_slice(x, start: int, stop: int):
    """Samples [start, stop) of x: views, no copy."""
    return _map(x, lambda t: t[start:stop])


def batch_to(x, device: torch.device):
    """x on `device` (the tensors already there are themselves, not copies: not asked of `to`, a dispatched call)."""
    non_blocking = async_copy_to(device)
    return _map(x, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking))


def async_copy_to(device) -> bool:
    """Whether a copy to `device` may be `non_blocking`: onto an accelerator only. A non-blocking copy from
    CUDA to the CPU returns before its bytes arrive (into pinned memory torch allocates), and the host would
    read them at once: stale values, silently. Copies to a device are ordered on its stream before any kernel
    that reads them."""
    return torch.device(device).type != "cpu"

"""Losses as memfit reproduces their whole-set mean from chunks: per-sample values and what torch divides by.

A loss is asked for per-sample (or per-element) values where it can say (`per_sample`); their float64
sum and the count torch's own mean divides by (`torch_denominator`: non-ignored targets, class weights,
'batchmean') add up over chunks and ranks to the loss of the whole set at once (`loss_sum`).

Example:
    >>> import torch
    >>> logits, y = torch.tensor([[2., 1.], [0., 3.]]), torch.tensor([0, -100])
    >>> fn, how = per_sample(torch.nn.CrossEntropyLoss(), None)
    >>> total, count = loss_sum(logits, y, fn, how, torch_denominator(torch.nn.CrossEntropyLoss()))
    >>> float(count), abs(float(total / count) - float(torch.nn.functional.cross_entropy(logits, y))) < 1e-7
    (1.0, True)
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["REDUCTIONS", "loss_sum", "per_sample", "torch_denominator"]

REDUCTIONS = ("mean", "sum")

# the torch functions whose mean is not sum / numel, recognised when given plainly or as a partial
_INDEX_LOSSES = (F.cross_entropy, F.nll_loss)


def _class_index_denominator(weight: torch.Tensor | None, ignore_index: int) -> Callable:
    """torch's mean for cross entropy / NLL with class-index targets: the number of targets that are
    not `ignore_index`, or with `weight` the sum of weight[y] over them. Probability targets
    (floating y, cross entropy only) are averaged over every element, as torch does."""
    def denominator(logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if y.is_floating_point():
            return torch.tensor(float(out.numel()), dtype=torch.float64, device=out.device)
        kept = y[y != ignore_index]
        if weight is None:
            return torch.tensor(float(kept.numel()), dtype=torch.float64, device=out.device)
        return weight.to(kept.device)[kept.long()].double().sum()     # uint8 ids would index as a mask
    return denominator


def _batch_denominator(logits: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """KL divergence with reduction='batchmean': the sum over the batch size, not over every element."""
    return torch.tensor(float(logits.shape[0] if logits.dim() else 1), dtype=torch.float64, device=out.device)


def _refuse(loss_fn, why: str) -> None:
    raise ValueError(f"loss_fn {loss_fn!r}: expected a loss whose mean memfit can reproduce from per-element "
                     f"values (the sum over the set divided by a count); found {why}. Fix: pass a plain function "
                     "returning per-sample losses (reduction='none'), or one returning the chunk's scalar with "
                     "loss_reduction='mean' or 'sum'")


def torch_denominator(loss_fn: Callable) -> Callable | None:
    """How torch's own mean divides the summed reduction='none' losses of `loss_fn`, as
    `(logits, y, per_element_losses) -> float64 tensor`; None where it is the number of elements.

    CrossEntropyLoss / NLLLoss (and F.cross_entropy / F.nll_loss, plainly or as a partial): targets
    equal to ignore_index give 0 and are not counted; with a class weight the count is sum(weight[y]).
    KLDivLoss(reduction='batchmean') (or F.kl_div with it): the batch size. CTCLoss (mean over target
    lengths) is refused.
    """
    if isinstance(loss_fn, torch.nn.Module):
        if isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
            return _class_index_denominator(loss_fn.weight, loss_fn.ignore_index)
        if isinstance(loss_fn, torch.nn.KLDivLoss):
            return _batch_denominator if loss_fn.reduction == "batchmean" else None
        if isinstance(loss_fn, torch.nn.CTCLoss):
            _refuse(loss_fn, "CTCLoss, whose mean divides each sample's loss by its target length")
        return None
    func, kw = loss_fn, {}
    if isinstance(loss_fn, functools.partial):
        func, kw = loss_fn.func, dict(loss_fn.keywords)
        if loss_fn.args and func in (*_INDEX_LOSSES, F.kl_div):
            _refuse(loss_fn, f"a partial with positional arguments {loss_fn.args!r}")
    if func in _INDEX_LOSSES:
        return _class_index_denominator(kw.get("weight"), kw.get("ignore_index", -100))
    if func is F.kl_div:
        return _batch_denominator if kw.get("reduction") == "batchmean" else None
    if func is F.ctc_loss:
        _refuse(loss_fn, "ctc_loss, whose mean divides each sample's loss by its target length")
    return None


def per_sample(loss_fn: Callable, reduction: str | None) -> tuple[Callable, str]:
    """(callable, how its result is summed): the loss asked for per-sample values where it can say.

    torch losses (a `reduction` attribute), `functools.partial(..., reduction=...)` and functions with a
    `reduction` parameter (F.cross_entropy) are called with reduction='none'; anything else is called
    as it is and its scalar is read as `reduction` ('mean' or 'sum' over the chunk), which the user
    must give: a guess would make a summing loss N times too large. How the per-element values are averaged
    is `torch_denominator`'s business.
    """
    if reduction is not None and reduction not in REDUCTIONS:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum' (what loss_fn does over a chunk); "
                         f"found {reduction!r}")
    if isinstance(getattr(loss_fn, "reduction", None), str) and isinstance(loss_fn, torch.nn.Module):
        clone = copy.copy(loss_fn)               # the user's module keeps its own reduction
        clone.reduction = "none"
        return clone, "none"
    if isinstance(loss_fn, functools.partial) and "reduction" in loss_fn.keywords:
        return functools.partial(loss_fn, reduction="none"), "none"
    try:
        takes = "reduction" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):             # builtins without a signature
        takes = False
    if takes and reduction is None:
        return functools.partial(loss_fn, reduction="none"), "none"
    return loss_fn, reduction or "unknown"


def loss_sum(logits: torch.Tensor, y, loss_fn: Callable, reduction: str = "none",
             denominator: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's losses in float64, what the whole-set mean divides by, float64).

    `loss_fn(outputs, y)` returns per-sample (or per-element) losses, or a scalar read as `reduction`.
    The divisor is the number of samples for a scalar, `denominator(logits, y, losses)` where torch's
    mean is not the plain one (ignored targets, class weights, 'batchmean'), else the number of values.
    """
    def count(k):
        return torch.tensor(float(k), dtype=torch.float64, device=logits.device)
    out = loss_fn(logits, y)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor; found {type(out).__name__}")
    if out.dim() == 0:
        if reduction == "sum":
            return out.double(), count(logits.shape[0])
        if reduction == "mean":
            return out.double() * logits.shape[0], count(logits.shape[0])
        raise ValueError("loss_fn returned a scalar, and memfit cannot tell whether it is the mean or the sum over "
                         "the chunk; return per-sample losses (reduction='none'), or pass loss_reduction='mean' "
                         "or 'sum' to evaluate")
    if out.shape[0] != logits.shape[0]:
        raise ValueError(f"loss_fn returned shape {tuple(out.shape)}; expected per-sample losses "
                         f"({logits.shape[0]},) or a scalar")
    return out.double().sum(), (count(out.numel()) if denominator is None else denominator(logits, y, out))

"""Losses as memfit reproduces their whole-set mean from chunks: per-sample values and what torch divides by.

A loss is asked for per-sample (or per-element) values where it can say (`per_sample`); their float64
sum and the count torch's own mean divides by (`torch_denominator`: non-ignored targets, class weights,
'batchmean') add up over chunks and ranks to the loss of the whole set at once (`loss_sum`). A loss that
returns the chunk's mean is weighted by the terms it averages over (`terms`, else by samples).

Outputs and targets that torch would broadcast into each other (a regression head's (N, 1) against targets
(N,): torch's mse_loss then averages all N * N pairs, and only warns) are refused (`call_loss`), and the label a
loss ignores is read from it where it says (`loss_ignore_index`).

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

__all__ = ["REDUCTIONS", "batch_terms", "call_loss", "count_terms", "loss_ignore_index", "loss_sum", "per_sample",
           "said_reduction", "torch_denominator", "unit_dim"]

REDUCTIONS = ("mean", "sum")

# the torch functions whose mean is not sum / numel, recognised when given plainly or as a partial
_INDEX_LOSSES = (F.cross_entropy, F.nll_loss)
# losses that compare outputs and targets value by value: the two must have one shape (torch broadcasts them)
_ELEMENTWISE_MODULES = (torch.nn.MSELoss, torch.nn.L1Loss, torch.nn.SmoothL1Loss, torch.nn.HuberLoss, torch.nn.BCELoss,
                        torch.nn.BCEWithLogitsLoss, torch.nn.SoftMarginLoss, torch.nn.PoissonNLLLoss,
                        torch.nn.KLDivLoss)
_ELEMENTWISE_FUNCTIONS = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy,
                          F.binary_cross_entropy_with_logits, F.soft_margin_loss, F.poisson_nll_loss, F.kl_div)
# the elementwise losses torch lets broadcast with only a warning ("Using a target size ... different to the input")
_WARNING_LOSSES = (F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss)


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


def _unwrapped(loss_fn: Callable) -> tuple[Callable, dict]:
    """(the function or module, its partial's keywords)."""
    if isinstance(loss_fn, functools.partial):
        return loss_fn.func, dict(loss_fn.keywords)
    return loss_fn, {}


def loss_ignore_index(loss_fn: Callable | None) -> int | None:
    """The target value `loss_fn` ignores, where it says: CrossEntropyLoss / NLLLoss (their `ignore_index`),
    F.cross_entropy / F.nll_loss plainly (-100) or as a partial; None for any other loss (or none).

    Example:
        >>> loss_ignore_index(torch.nn.CrossEntropyLoss(ignore_index=0)), loss_ignore_index(torch.nn.MSELoss())
        (0, None)
    """
    if isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
        return loss_fn.ignore_index
    func, kw = _unwrapped(loss_fn) if loss_fn is not None else (None, {})
    return kw.get("ignore_index", -100) if func in _INDEX_LOSSES else None


def _elementwise(loss_fn: Callable) -> bool:
    func, _ = _unwrapped(loss_fn)
    return isinstance(func, _ELEMENTWISE_MODULES) or func in _ELEMENTWISE_FUNCTIONS


def unit_dim(longer: tuple, shorter: tuple) -> int | None:
    """The dimension of size 1, never the batch's (0), whose removal turns shape `longer` into `shorter`; None if
    there is none. Example: unit_dim((8, 1, 4, 4), (8, 4, 4)) == 1."""
    if len(longer) != len(shorter) + 1 or len(longer) < 2:
        return None
    for d in range(1, len(longer)):
        if longer[d] == 1 and longer[:d] + longer[d + 1:] == shorter:
            return d
    return None


def _broadcast_error(out_shape, y_shape, where: str = "") -> ValueError:
    out_shape, y_shape = tuple(out_shape), tuple(y_shape)
    d_out, d_y = unit_dim(out_shape, y_shape), unit_dim(y_shape, out_shape)
    if d_out is not None:
        fix = (f"squeeze the output (out.squeeze({d_out}), e.g. lambda out, y: F.mse_loss(out.squeeze({d_out}), y)) "
               f"or give targets of the output's shape (y.unsqueeze({d_out}); for an array np.expand_dims(y, "
               f"{d_out}))")
    elif d_y is not None:
        fix = (f"squeeze the targets (y.squeeze({d_y}); for an array y.squeeze({d_y})) or give outputs of the "
               f"targets' shape (out.unsqueeze({d_y}))")
    else:
        fix = "reshape the output or the targets so that they match"
    try:
        both = (f"an elementwise loss broadcasts them to {tuple(torch.broadcast_shapes(out_shape, y_shape))} and "
                "averages over every pair, a wrong loss (torch's mse_loss and l1_loss only warn)")
    except (RuntimeError, TypeError):
        both = "they do not even broadcast"
    said = f" ({where})" if where else ""
    return ValueError(f"loss_fn compares outputs and targets value by value, so they need one shape; found outputs "
                      f"{out_shape} and targets {y_shape}: {both}{said}. Fix: {fix}")


class _RefuseBroadcast(torch.overrides.TorchFunctionMode):
    """Inside a user's loss callable: torch's elementwise losses that only warn when they broadcast (mse, l1,
    smooth_l1, huber) refuse outputs and targets of different shapes before they run. A torch function mode is
    this thread's alone: other threads' losses, and the process's warnings filters, are left as they are.
    With `weighted`, a list: the class weights of every cross entropy / NLL averaged inside are put there."""

    def __init__(self, weighted: list | None = None):
        super().__init__()
        self.weighted = weighted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.weighted is not None and func in _INDEX_LOSSES:
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            if weight is not None and kwargs.get("reduction", "mean") == "mean" and len(args) < 7:
                self.weighted.append(weight)
        if func in _WARNING_LOSSES:
            a = args[0] if args else kwargs.get("input")
            b = args[1] if len(args) > 1 else kwargs.get("target")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
                raise _broadcast_error(a.shape, b.shape, where=f"F.{func.__name__} inside loss_fn")
        return func(*args, **kwargs)


def call_loss(loss_fn: Callable, out, y, weighted: list | None = None):
    """loss_fn(out, y), refusing outputs and targets that an elementwise loss would broadcast into each other.

    A torch elementwise loss (MSELoss, L1Loss, SmoothL1Loss, HuberLoss, BCE, ..., or its F function) is checked
    before it runs: outputs and targets must have one shape. Any other callable runs with torch's losses that
    broadcast with only a warning (mse_loss, l1_loss, smooth_l1_loss, huber_loss) refusing shapes that differ, so a
    lambda around F.mse_loss is refused too (by a torch function mode of this thread: no warnings filter is
    changed). Raises ValueError saying the two shapes and the fix. With `weighted` (a list), the class weights of
    the cross entropies a callable averages inside are appended to it (`class_weighted_mean`).
    """
    tensors = isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor)
    if tensors and out.shape != y.shape and _elementwise(loss_fn):
        raise _broadcast_error(out.shape, y.shape)
    func, _ = _unwrapped(loss_fn)
    if type(func).__module__ == "torch.nn.modules.loss" or func in (*_ELEMENTWISE_FUNCTIONS, *_INDEX_LOSSES) or \
            (tensors and out.shape == y.shape and weighted is None):
        return loss_fn(out, y)          # nothing to broadcast, or a torch loss checked above
    with _RefuseBroadcast(weighted):
        return loss_fn(out, y)


def class_weighted_mean(weighted: list) -> str | None:
    """The warning to give when a loss callable averaged a class-weighted cross entropy inside (`call_loss`'s
    `weighted`): its mean divides by its batch's sum of target weights, which differs between micro-batches, so
    weighting them by samples is not the full-batch gradient; None when it did not."""
    if not weighted:
        return None
    return ("accumulate: loss_fn averages a cross entropy with class weights inside, whose mean divides by the sum "
            "of its targets' weights: micro-batches weighted by samples do not give the full-batch gradient. Pass "
            "terms=lambda x, y: w[y[y != -100]].sum() (w the weights, -100 the ignore index), or give the loss as "
            "torch.nn.CrossEntropyLoss(weight=w) or functools.partial(F.cross_entropy, weight=w), whose "
            "micro-batches memfit weighs itself")


def count_terms(terms: Callable, x, y) -> int | float:
    """terms(x, y): how many terms a loss's mean is over in a batch, as an int >= 0 (a float where the terms are
    weighted: a class-weighted loss's sum of weights, never rounded), or a clear error."""
    c = terms(x, y)
    try:
        f = float(c)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"terms(x, y) must return the number of terms loss_fn averages over (an int or a 0-d "
                        f"tensor), e.g. lambda x, y: (y != -100).sum(); found {type(c).__name__}") from None
    c = int(f) if f.is_integer() else f
    if not f >= 0 or f == float("inf"):
        raise ValueError(f"terms(x, y) must count terms (>= 0); found {c}")
    return c


def said_reduction(loss_fn: Callable) -> str | None:
    """The reduction over the batch a torch loss says it does: a loss module's `reduction`, a partial's
    `reduction=`, a torch loss function's default ('mean'); None where the loss does not say (a lambda)."""
    if isinstance(loss_fn, torch.nn.Module):
        r = getattr(loss_fn, "reduction", None)
        return r if isinstance(r, str) else None
    func, kw = _unwrapped(loss_fn)
    if "reduction" in kw:
        return kw["reduction"]
    if func in (*_INDEX_LOSSES, *_ELEMENTWISE_FUNCTIONS):
        return "mean"
    return None


def batch_terms(loss_fn: Callable, y) -> Callable | None:
    """terms(x, y) for a loss whose mean over a batch is not one term per sample, where the loss says so:
    CrossEntropyLoss / NLLLoss (or F.cross_entropy / F.nll_loss, plainly or as a partial) with reduction 'mean'
    on integer targets divide by the targets not ignored, each counted as its class weight. Weighting
    micro-batches by samples is then not the full-batch mean unless no target of `y` is ignored and the classes
    are unweighted (then None: samples are the terms). None for any other loss."""
    if said_reduction(loss_fn) != "mean" or not isinstance(y, torch.Tensor) or y.is_floating_point() \
            or y.dtype == torch.bool or not y.numel():
        return None
    if isinstance(loss_fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
        weight, ignore = loss_fn.weight, loss_fn.ignore_index
    else:
        func, kw = _unwrapped(loss_fn)
        if func not in _INDEX_LOSSES:
            return None
        weight, ignore = kw.get("weight"), kw.get("ignore_index", -100)
    if weight is None and not bool((y == ignore).any()):
        return None
    denominator = _class_index_denominator(weight, ignore)
    return lambda x, t: denominator(None, t, t)


def loss_sum(logits: torch.Tensor, y, loss_fn: Callable, reduction: str = "none",
             denominator: Callable | None = None, terms: int | None = None,
             ignore_index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's losses in float64, what the whole-set mean divides by, float64).

    `loss_fn(outputs, y)` returns per-sample (or per-element) losses, or a scalar read as `reduction`
    ('mean': times the terms it is over). The divisor is `terms` (the terms the loss averages over in this
    chunk) when given; else the number of samples for a scalar, `denominator(logits, y, losses)` where torch's
    mean is not the plain one (ignored targets, class weights, 'batchmean'), else the number of values, which
    is refused when those are per-position values of integer targets holding `ignore_index` (the mean would
    count the ignored positions: say `terms`).
    """
    def count(k):
        return torch.tensor(float(k), dtype=torch.float64, device=logits.device)
    # a chunk mean weighted by samples: a class-weighted cross entropy averaged inside loss_fn divides by its
    # chunk's sum of weights instead (evaluate cannot see that mean's terms: refused below)
    weighted = [] if reduction == "mean" and terms is None and denominator is None else None
    out = call_loss(loss_fn, logits, y, weighted)
    if weighted:
        raise ValueError("loss_fn averages a cross entropy with class weights inside (loss_reduction='mean'), whose "
                         "mean divides by the sum of its targets' weights: chunks weighted by samples would not give "
                         "the whole-set mean. Fix: pass terms=lambda x, y: w[y[y != -100]].sum() (w the weights), or "
                         "give the loss as torch.nn.CrossEntropyLoss(weight=w), whose mean memfit knows")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor; found {type(out).__name__}")
    if out.dim() == 0:
        k = logits.shape[0] if terms is None else terms
        if reduction == "sum":
            return out.double(), count(k)
        if reduction == "mean" or terms is not None:
            return out.double() * k, count(k)
        raise ValueError("loss_fn returned a scalar, and memfit cannot tell whether it is the mean or the sum over "
                         "the chunk; return per-sample losses (reduction='none'), or pass loss_reduction='mean' "
                         "or 'sum' to evaluate")
    if out.shape[0] != logits.shape[0]:
        raise ValueError(f"loss_fn returned shape {tuple(out.shape)}; expected per-sample losses "
                         f"({logits.shape[0]},) or a scalar")
    if terms is not None:
        return out.double().sum(), count(terms)
    if denominator is not None:
        return out.double().sum(), denominator(logits, y, out)
    if (ignore_index is not None and isinstance(y, torch.Tensor) and out.shape == y.shape
            and not y.is_floating_point() and y.dtype != torch.bool and bool((y == ignore_index).any())):
        raise ValueError(f"loss_fn returned one loss per target position, {tuple(out.shape)}, and some targets are "
                         f"ignore_index {ignore_index}: their mean over every position would count the ignored "
                         f"ones. Fix: pass terms=lambda x, y: (y != {ignore_index}).sum() to average over the "
                         "positions that count (terms=lambda x, y: y.numel() to count them all), or give "
                         "loss_fn as a torch loss (torch.nn.CrossEntropyLoss(), F.cross_entropy), whose mean "
                         "memfit knows")
    return out.double().sum(), count(out.numel())

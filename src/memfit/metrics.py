"""Metrics as sums and counts, so that any chunking gives exactly the whole-set value.

Averaging per-chunk accuracies is wrong when the last chunk is smaller: with
10,001 samples in chunks of 50 the last chunk of 1 sample weighs as much as a full one. Here each
chunk contributes sums (correct predictions, summed losses, confusion counts) and the sample
count; the value is computed once at the end. Contributions are computed first and committed
only after the whole chunk succeeded, so a chunk retried after an out-of-memory error is never
counted twice. States add up across processes too (`torch.distributed.all_reduce(SUM)`).

Example:
    >>> import torch
    >>> m = Accuracy()
    >>> m.commit(m.contribution(torch.tensor([[2., 1.], [0., 3.]]), torch.tensor([0, 0])))
    >>> m.commit(m.contribution(torch.tensor([[1., 0.]]), torch.tensor([0])))
    >>> m.compute()
    0.6666666666666666
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from memfit.messages import plural


def check_logits(logits: torch.Tensor, y: torch.Tensor, what: str) -> None:
    """Raise a clear ValueError unless logits are (N, classes) and y holds class ids that fit."""
    if logits.dim() != 2:
        raise ValueError(f"{what} needs model outputs of shape (N, classes); found shape {tuple(logits.shape)} "
                         "(flatten or pool the output, or pass a metric object that accepts this shape)")
    if y is None:
        raise ValueError(f"{what} needs labels; the data has none (give y, or use metrics that need no labels)")
    if y.shape[0] != logits.shape[0]:
        raise ValueError(f"{what}: {plural(logits.shape[0], 'output')} but {plural(y.shape[0], 'label')} in a chunk")
    if y.numel():
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= logits.shape[1]:
            bad = hi if hi >= logits.shape[1] else lo
            raise ValueError(f"label {bad} is out of range for a model with {plural(logits.shape[1], 'output')} "
                             f"(labels must be in 0..{logits.shape[1] - 1}); check the labels or the model's "
                             "output size")


# ---- pure functions: one chunk's sums -----------------------------------------------------------
def correct_topk(logits: torch.Tensor, y: torch.Tensor, k: int) -> torch.Tensor:
    """Number of samples whose label is among the k highest outputs (int64, 0-dim)."""
    k = min(k, logits.shape[1])
    top = logits.topk(k, dim=1).indices                  # (N, k)
    return (top == y[:, None]).any(1).sum()


def correct(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Number of samples whose argmax is the label (ties go to the first index, as torch.argmax)."""
    return (logits.argmax(1) == y).sum()


def confusion(logits: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    """(classes, classes) int64 counts: rows are true labels, columns predictions."""
    pred = logits.argmax(1)
    return torch.bincount(y * classes + pred, minlength=classes * classes).view(classes, classes)


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
        return weight.to(kept.device)[kept].double().sum()
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


def loss_sum(logits: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None, reduction: str = "none",
             denominator: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the chunk's losses in float64, what the whole-set mean divides by, float64); default
    cross entropy.

    `loss_fn(outputs, y)` returns per-sample (or per-element) losses, or a scalar read as `reduction`.
    The divisor is the number of samples for a scalar, `denominator(logits, y, losses)` where torch's
    mean is not the plain one (ignored targets, class weights, 'batchmean'), else the number of values.
    """
    def count(k):
        return torch.tensor(float(k), dtype=torch.float64, device=logits.device)
    if loss_fn is None:
        return F.cross_entropy(logits.float(), y, reduction="none").double().sum(), count(logits.shape[0])
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


# ---- thin stateful classes ----------------------------------------------------------------------
class Metric:
    """A metric kept as a dict of summed tensors plus a sample count."""
    name = "?"
    reduce = True          # states are sums: all-reduce them across processes (SUM)

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.n = 0

    def contribution(self, logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def commit(self, part: dict[str, torch.Tensor]) -> None:
        for k, v in part.items():
            self.state[k] = v.detach() if k not in self.state else self.state[k] + v.detach()
        self.n += int(part["n"])

    def compute(self):
        raise NotImplementedError


class Accuracy(Metric):
    name = "accuracy"

    def contribution(self, logits, y):
        check_logits(logits, y, "accuracy")
        return {"correct": correct(logits, y), "n": torch.tensor(y.shape[0], device=y.device)}

    def compute(self):
        return int(self.state["correct"]) / int(self.state["n"]) if self.n else float("nan")


class TopK(Accuracy):
    """Top-k accuracy: the share of samples whose label is among the k highest outputs."""

    def __init__(self, k: int) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"top-k needs k >= 1; found {k}")
        self.k, self.name = k, f"top{k}"

    def contribution(self, logits, y):
        check_logits(logits, y, f"topk:{self.k}")
        return {"correct": correct_topk(logits, y, self.k), "n": torch.tensor(y.shape[0], device=y.device)}


class Loss(Metric):
    """The mean loss over the whole set: a float64 sum of per-sample (or per-element) losses and
    the float64 count torch's own mean divides by (non-ignored targets, their class weights, the batch
    size for 'batchmean'; else the number of values), so any chunking gives the value of the loss
    applied to the whole set at once, to about 1e-15 relative. Both are state, summed across processes."""
    name = "loss"

    def __init__(self, loss_fn: Callable | None = None, reduction: str | None = None) -> None:
        super().__init__()
        self.denominator = None if loss_fn is None else torch_denominator(loss_fn)
        self.loss_fn, self.reduction = (None, "none") if loss_fn is None else per_sample(loss_fn, reduction)

    def contribution(self, logits, y):
        if self.loss_fn is None:
            check_logits(logits, y, "loss (cross entropy)")
        total, count = loss_sum(logits, y, self.loss_fn, self.reduction, self.denominator)
        return {"sum": total, "count": count, "n": torch.tensor(logits.shape[0], device=logits.device)}

    def compute(self):
        if not self.n or float(self.state["count"]) == 0:   # torch's mean of nothing (all ignored) is nan too
            return float("nan")
        return float(self.state["sum"]) / float(self.state["count"])


class Confusion(Metric):
    name = "confusion"

    def contribution(self, logits, y):
        check_logits(logits, y, "confusion")
        return {"matrix": confusion(logits, y, logits.shape[1]), "n": torch.tensor(y.shape[0], device=y.device)}

    def compute(self):
        return self.state["matrix"].cpu() if self.n else None


class External(Metric):
    """A torchmetrics-style object (`update(preds, target)`, `compute()`), updated per committed chunk.

    torchmetrics synchronises its own states across processes in `compute()`."""
    reduce = False

    def __init__(self, obj) -> None:
        super().__init__()
        self.obj = obj
        self.name = type(obj).__name__

    def contribution(self, logits, y):
        return {"pending": (logits, y), "n": torch.tensor(logits.shape[0])}

    def commit(self, part):
        logits, y = part["pending"]
        self.obj.update(logits, y)
        self.n += int(part["n"])

    def compute(self):
        value = self.obj.compute()
        return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def make_metric(spec, loss_fn: Callable | None = None, loss_reduction: str | None = None) -> Metric:
    """'accuracy', 'topk:5', 'loss', 'confusion', or an object with update() and compute()."""
    if isinstance(spec, str):
        if spec == "accuracy":
            return Accuracy()
        if spec == "loss":
            return Loss(loss_fn, loss_reduction)
        if spec == "confusion":
            return Confusion()
        if spec.startswith("topk:") and spec[5:].isdigit():
            return TopK(int(spec[5:]))
        raise ValueError(f"unknown metric {spec!r}; expected 'accuracy', 'topk:K' (e.g. 'topk:5'), 'loss', "
                         "'confusion', or an object with update(preds, target) and compute() (torchmetrics)")
    if callable(getattr(spec, "update", None)) and callable(getattr(spec, "compute", None)):
        return External(spec)
    raise TypeError(f"a metric must be a name or an object with update() and compute(); found {type(spec).__name__}")

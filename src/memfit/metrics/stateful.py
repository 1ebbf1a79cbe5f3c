"""Thin stateful classes: each metric keeps summed tensors and a sample count, adds a chunk's contribution only
when `commit` is called (after the whole chunk ran), and computes its value once at the end.

Example:
    >>> import torch
    >>> m = SquaredError()
    >>> m.commit(m.contribution(torch.tensor([1., 2.]), torch.tensor([1., 4.])))
    >>> m.compute()
    2.0
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from memfit.losses import loss_sum, per_sample, torch_denominator
from memfit.metrics.checks import class_targets, float_targets
from memfit.metrics.sums import confusion, correct, correct_topk, cross_entropy_sum, intersection_union
from memfit.targets import IGNORE_INDEX

__all__ = ["AbsoluteError", "Accuracy", "Confusion", "External", "IoU", "Loss", "Metric", "Perplexity",
           "SquaredError", "TopK"]


class Metric:
    """A metric kept as a dict of summed tensors plus a sample count.

    `target`: with a dict of targets, the one this metric reads (None: the only one). `ignore_index`: the
    label counted nowhere; None takes the data's (`bind`), else -100."""
    name = "?"
    reduce = True          # states are sums: all-reduce them across processes (SUM)

    def __init__(self, *, target: str | None = None, ignore_index: int | None = None) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.n = 0
        self.target, self.ignore_index = target, ignore_index

    def bind(self, ignore_index: int | None) -> None:
        """Take the data's ignore_index unless one was given."""
        if self.ignore_index is None:
            self.ignore_index = ignore_index

    @property
    def ignored(self) -> int:
        return IGNORE_INDEX if self.ignore_index is None else self.ignore_index

    def contribution(self, logits: torch.Tensor, y) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def commit(self, part: dict[str, torch.Tensor]) -> None:
        for k, v in part.items():
            self.state[k] = v.detach() if k not in self.state else self.state[k] + v.detach()
        self.n += int(part["n"])

    def compute(self):
        raise NotImplementedError

    @staticmethod
    def _n(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(t.shape[0], device=t.device)


class Accuracy(Metric):
    """The share of counted positions (samples, or pixels and tokens not ignored) whose argmax is the label."""
    name = "accuracy"

    def __init__(self, *, class_dim: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.class_dim = class_dim

    def contribution(self, logits, y):
        scores, y, keep = class_targets(logits, y, self.name, self.ignored, self.class_dim)
        return {"correct": correct(scores, y, keep), "count": keep.sum(), "n": self._n(y)}

    def compute(self):
        return int(self.state["correct"]) / int(self.state["count"]) if self.n and int(self.state["count"]) \
            else float("nan")


class TopK(Accuracy):
    """Top-k accuracy: the share of counted positions whose label is among the k highest outputs."""

    def __init__(self, k: int, **kw) -> None:
        super().__init__(**kw)
        if k < 1:
            raise ValueError(f"top-k needs k >= 1; found {k}")
        self.k, self.name = k, f"top{k}"

    def contribution(self, logits, y):
        scores, y, keep = class_targets(logits, y, self.name, self.ignored, self.class_dim)
        return {"correct": correct_topk(scores, y, keep, self.k), "count": keep.sum(), "n": self._n(y)}


class Loss(Metric):
    """The mean loss over the whole set: a float64 sum of per-sample (or per-element) losses and
    the float64 count torch's own mean divides by (non-ignored targets, their class weights, the batch
    size for 'batchmean'; else the number of values), so any chunking gives the value of the loss
    applied to the whole set at once, to about 1e-15 relative. Both are state, summed across processes.
    Default: cross entropy over the counted positions of class ids or labels (classes on dimension 1 or last)."""
    name = "loss"

    def __init__(self, loss_fn: Callable | None = None, reduction: str | None = None, *,
                 class_dim: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.class_dim = class_dim
        self.denominator = None if loss_fn is None else torch_denominator(loss_fn)
        self.loss_fn, self.reduction = (None, "none") if loss_fn is None else per_sample(loss_fn, reduction)

    def contribution(self, logits, y):
        if self.loss_fn is None:
            if isinstance(y, torch.Tensor) and y.is_floating_point():
                raise ValueError(f"{self.name} without loss_fn is cross entropy, which needs class ids; the targets "
                                 f"are float ({y.dtype}, shape {tuple(y.shape)}): pass loss_fn (e.g. "
                                 "torch.nn.MSELoss()) or use metrics 'mse' and 'mae'")
            scores, y, keep = class_targets(logits, y, f"{self.name} (cross entropy)", self.ignored, self.class_dim)
            total, count = cross_entropy_sum(scores, y, keep)
        else:
            total, count = loss_sum(logits, y, self.loss_fn, self.reduction, self.denominator)
        return {"sum": total, "count": count, "n": torch.tensor(logits.shape[0], device=logits.device)}

    def compute(self):
        if not self.n or float(self.state["count"]) == 0:   # torch's mean of nothing (all ignored) is nan too
            return float("nan")
        return float(self.state["sum"]) / float(self.state["count"])


class Perplexity(Loss):
    """exp of the mean cross entropy over every counted token (not over per-sequence perplexities)."""
    name = "perplexity"

    def __init__(self, **kw) -> None:
        super().__init__(None, **kw)

    def compute(self):
        return math.exp(super().compute())


class Confusion(Metric):
    name = "confusion"

    def __init__(self, *, class_dim: int | None = None, **kw) -> None:
        super().__init__(**kw)
        self.class_dim = class_dim

    def contribution(self, logits, y):
        scores, y, keep = class_targets(logits, y, self.name, self.ignored, self.class_dim)
        return {"matrix": confusion(scores, y, keep, scores.shape[1]), "n": self._n(y)}

    def compute(self):
        return self.state["matrix"].cpu() if self.n else None


class IoU(Confusion):
    """Mean intersection over union: per class, positions predicted and labelled c over those predicted or
    labelled c (counted over the whole set), averaged over the classes that occur; `per_class()` each one."""
    name = "iou"

    def contribution(self, logits, y):
        scores, y, keep = class_targets(logits, y, self.name, self.ignored, self.class_dim)
        inter, union = intersection_union(scores, y, keep, scores.shape[1])
        return {"intersection": inter, "union": union, "n": self._n(y)}

    def per_class(self) -> torch.Tensor:
        """(C,) float64 IoU of each class; nan where a class is neither predicted nor labelled."""
        inter, union = self.state["intersection"].double().cpu(), self.state["union"].double().cpu()
        return torch.where(union > 0, inter / union.clamp(min=1), torch.full_like(union, float("nan")))

    def compute(self):
        if not self.n:
            return float("nan")
        iou = self.per_class()
        present = ~torch.isnan(iou)
        return float(iou[present].mean()) if bool(present.any()) else float("nan")


class SquaredError(Metric):
    """Mean squared error over every value of float targets (float64 sums)."""
    name = "mse"

    def error(self, pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (pred.double() - y.double()).square()

    def contribution(self, pred, y):
        pred, y = float_targets(pred, y, self.name)
        return {"sum": self.error(pred, y).sum(), "count": torch.tensor(float(y.numel()), dtype=torch.float64,
                                                                         device=y.device), "n": self._n(y)}

    def compute(self):
        return float(self.state["sum"]) / float(self.state["count"]) if self.n and float(self.state["count"]) \
            else float("nan")


class AbsoluteError(SquaredError):
    """Mean absolute error over every value of float targets (float64 sums)."""
    name = "mae"

    def error(self, pred, y):
        return (pred.double() - y.double()).abs()


class External(Metric):
    """A torchmetrics-style object (`update(preds, target)`, `compute()`), updated per committed chunk.

    torchmetrics synchronises its own states across processes in `compute()`."""
    reduce = False

    def __init__(self, obj, target: str | None = None) -> None:
        super().__init__(target=target)
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

"""Metrics by name: the names `evaluate` takes ('accuracy', 'topk:5', 'loss', ... with '@TARGET'), and the
metrics each target kind gets by default.

Example:
    >>> make_metric("accuracy@label").target, default_metrics("float")
    ('label', ('mse', 'mae'))
"""

from __future__ import annotations

from collections.abc import Callable

from memfit.metrics.stateful import (
    AbsoluteError,
    Accuracy,
    Confusion,
    External,
    IoU,
    Loss,
    Metric,
    OwnLoss,
    Perplexity,
    SquaredError,
    TopK,
)
from memfit.own_loss import model_loss

__all__ = ["DEFAULTS", "NAMES", "default_metrics", "make_metric"]


NAMES = {"accuracy": Accuracy, "confusion": Confusion, "iou": IoU, "mse": SquaredError, "mae": AbsoluteError,
         "perplexity": Perplexity}
DEFAULTS = {"class": ("accuracy", "loss"), "labels": ("accuracy", "loss"), "float": ("mse", "mae")}


def make_metric(spec, loss_fn: Callable | None = None, loss_reduction: str | None = None,
                terms: Callable | None = None) -> Metric:
    """A name ('accuracy', 'topk:5', 'loss', 'confusion', 'iou', 'perplexity', 'mse', 'mae'; 'NAME@TARGET' for
    one target of a dict), a `Metric`, or an object with update() and compute() (torchmetrics). `loss_fn`,
    `loss_reduction` and `terms` make the 'loss' (`Loss`)."""
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, str):
        name, _, target = spec.partition("@")
        kw = {"target": target} if target else {}
        if name in NAMES:
            return NAMES[name](**kw)
        if name == "loss":
            if loss_fn is model_loss:               # the model's own, over the labels inside the inputs
                return OwnLoss(terms, **kw)
            return Loss(loss_fn, loss_reduction, terms=terms, **kw)
        if name.startswith("topk:") and name[5:].isdigit():
            return TopK(int(name[5:]), **kw)
        raise ValueError(f"unknown metric {spec!r}; expected 'accuracy', 'topk:K' (e.g. 'topk:5'), 'loss', "
                         "'confusion', 'iou', 'perplexity', 'mse', 'mae' (with '@TARGET' for one of a dict of "
                         "targets), a memfit.metrics.Metric, or an object with update(preds, target) and compute() "
                         "(torchmetrics)")
    if callable(getattr(spec, "update", None)) and callable(getattr(spec, "compute", None)):
        return External(spec)
    raise TypeError(f"a metric must be a name or an object with update() and compute(); found {type(spec).__name__}")


def default_metrics(kind) -> tuple[str, ...]:
    """The metrics a target kind gets by default: class ids and labels accuracy + loss, float targets mse + mae;
    a dict of targets ({name: kind}) each its own, as 'NAME@TARGET'; no targets (None): accuracy + loss, which
    then say that targets are needed."""
    if isinstance(kind, dict):
        return tuple(f"{m}@{name}" for name, k in kind.items() for m in DEFAULTS[k])
    return DEFAULTS.get(kind, DEFAULTS["class"])

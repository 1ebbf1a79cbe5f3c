"""Metrics as sums and counts, so that any chunking gives exactly the whole-set value.

Seed 004 averaged per-chunk accuracies, which is wrong when the last chunk is smaller: with
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

from collections.abc import Callable

import torch
import torch.nn.functional as F

from memfit.budget import plural


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


def loss_sum(logits: torch.Tensor, y: torch.Tensor, loss_fn: Callable | None) -> torch.Tensor:
    """Sum of per-sample losses over the chunk, float64.

    `loss_fn(outputs, y)` may return per-sample losses (N,), or a scalar: the mean over the chunk,
    unless the loss object says `reduction == 'sum'`.
    """
    if loss_fn is None:
        return F.cross_entropy(logits.float(), y, reduction="sum").double()
    out = loss_fn(logits, y)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"loss_fn must return a tensor; found {type(out).__name__}")
    if out.dim() == 0:
        return out.double() if getattr(loss_fn, "reduction", "mean") == "sum" else out.double() * logits.shape[0]
    if out.shape[0] != logits.shape[0]:
        raise ValueError(f"loss_fn returned shape {tuple(out.shape)}; expected per-sample losses "
                         f"({logits.shape[0]},) or a scalar")
    return out.double().sum()


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


class TopK(Metric):
    def __init__(self, k: int) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"top-k needs k >= 1; found {k}")
        self.k, self.name = k, f"top{k}"

    def contribution(self, logits, y):
        check_logits(logits, y, f"topk:{self.k}")
        return {"correct": correct_topk(logits, y, self.k), "n": torch.tensor(y.shape[0], device=y.device)}

    def compute(self):
        return int(self.state["correct"]) / int(self.state["n"]) if self.n else float("nan")


class Loss(Metric):
    name = "loss"

    def __init__(self, loss_fn: Callable | None = None) -> None:
        super().__init__()
        self.loss_fn = loss_fn

    def contribution(self, logits, y):
        if self.loss_fn is None:
            check_logits(logits, y, "loss (cross entropy)")
        return {"sum": loss_sum(logits, y, self.loss_fn), "n": torch.tensor(logits.shape[0], device=logits.device)}

    def compute(self):
        return float(self.state["sum"]) / int(self.state["n"]) if self.n else float("nan")


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


def make_metric(spec, loss_fn: Callable | None = None) -> Metric:
    """'accuracy', 'topk:5', 'loss', 'confusion', or an object with update() and compute()."""
    if isinstance(spec, str):
        if spec == "accuracy":
            return Accuracy()
        if spec == "loss":
            return Loss(loss_fn)
        if spec == "confusion":
            return Confusion()
        if spec.startswith("topk:") and spec[5:].isdigit():
            return TopK(int(spec[5:]))
        raise ValueError(f"unknown metric {spec!r}; expected 'accuracy', 'topk:K' (e.g. 'topk:5'), 'loss', "
                         "'confusion', or an object with update(preds, target) and compute() (torchmetrics)")
    if callable(getattr(spec, "update", None)) and callable(getattr(spec, "compute", None)):
        return External(spec)
    raise TypeError(f"a metric must be a name or an object with update() and compute(); found {type(spec).__name__}")

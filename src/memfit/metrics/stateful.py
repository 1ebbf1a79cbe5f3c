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

from memfit.batches import batch_len
from memfit.losses import count_terms, loss_sum, per_sample, torch_denominator
from memfit.metrics.checks import class_targets, float_targets
from memfit.metrics.sums import confusion, correct, correct_topk, cross_entropy_sum, intersection_union
from memfit.own_loss import model_loss
from memfit.targets import IGNORE_INDEX

__all__ = ["AbsoluteError", "Accuracy", "Confusion", "External", "IoU", "Loss", "Metric", "OwnLoss", "Perplexity",
           "SquaredError", "TopK"]


class Metric:
    """A metric kept as a dict of summed tensors plus a sample count.

    `target`: with a dict of targets, the one this metric reads (None: the only one). `ignore_index`: the
    label counted nowhere; None takes the data's (`bind`), else -100."""
    name = "?"
    reduce = True          # states are sums: all-reduce them across processes (SUM)
    reads_inputs = False   # True: `contribution(logits, y, x)` also takes the chunk's inputs

    def __init__(self, *, target: str | None = None, ignore_index: int | None = None) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.n = 0
        self.target, self.ignore_index = target, ignore_index

    def bind(self, ignore_index: int | None) -> None:
        """Take evaluate's ignore index (given to it, the loss's own, else the data's) unless one was given."""
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
    Default: cross entropy over the counted positions of class ids or labels (classes on dimension 1 or last).

    `terms(x, y)`: how many terms loss_fn's mean (or sum) is over in a chunk (`(y != -100).sum()` for a mean
    over the tokens that count); the count is then their total. Without it, a loss_fn that returns the chunk's
    mean is weighted by samples, which is the whole-set mean only when every sample has as many terms: on
    integer targets whose ignored positions (ignore_index) differ per sample that is refused, as is a mean over
    per-position values that counts ignored positions."""
    name = "loss"

    def __init__(self, loss_fn: Callable | None = None, reduction: str | None = None, *,
                 class_dim: int | None = None, terms: Callable | None = None, **kw) -> None:
        super().__init__(**kw)
        self.class_dim = class_dim
        if terms is not None and loss_fn is None:
            raise ValueError("terms= weights a loss_fn's mean by the terms it is over; found terms without "
                             "loss_fn (the default loss, cross entropy, counts the positions not ignored itself): "
                             "pass loss_fn too, or leave terms out")
        self.denominator = None if loss_fn is None else torch_denominator(loss_fn)
        self.loss_fn, self.reduction = (None, "none") if loss_fn is None else per_sample(loss_fn, reduction)
        self.terms, self.reads_inputs = terms, terms is not None
        self.per_sample_terms: int | None = None      # the counted positions per sample of the chunks so far

    def contribution(self, logits, y, x=None):
        spread: dict[str, torch.Tensor] = {}        # a chunk mean's counted positions per sample (_check_weighting)
        if self.loss_fn is None:
            if isinstance(y, torch.Tensor) and y.is_floating_point():
                raise ValueError(f"{self.name} without loss_fn is cross entropy, which needs class ids; the targets "
                                 f"are float ({y.dtype}, shape {tuple(y.shape)}): pass loss_fn, e.g. "
                                 "torch.nn.MSELoss() for values, torch.nn.CrossEntropyLoss() for class "
                                 "probabilities, or use metrics 'mse' and 'mae'")
            scores, y, keep = class_targets(logits, y, f"{self.name} (cross entropy)", self.ignored, self.class_dim)
            total, count = cross_entropy_sum(scores, y, keep)
        else:
            terms = None if self.terms is None else count_terms(self.terms, x, y)
            spread = self._check_weighting(y) if terms is None and self.denominator is None else {}
            try:
                total, count = loss_sum(logits, y, self.loss_fn, self.reduction, self.denominator, terms,
                                        None if terms is not None or self.denominator is not None else self.ignored)
            except AttributeError as e:       # out.logits / out.loss of a tensor: a loss_fn written for accumulate
                if getattr(e, "obj", None) is not logits:
                    raise
                raise TypeError(f"loss_fn reads .{e.name} of what it is given, but evaluate gives it the logits (a "
                                f"tensor of shape {tuple(logits.shape)}, taken from the model's output by "
                                "memfit.metrics.logits_of or output_fn), not the whole output as accumulate does; "
                                "write it for the logits, e.g. lambda logits, y: F.cross_entropy(logits.transpose(1, "
                                "2), y)") from None
            if terms is None and self.denominator is None and self.reduction != "sum":    # a mean over samples or
                self._refuse_unknown_index(y, logits)       # positions: the loss may ignore no label unknown here
        return {"sum": total, "count": count, "n": torch.tensor(logits.shape[0], device=logits.device), **spread}

    def _check_weighting(self, y) -> dict[str, torch.Tensor]:
        """A loss_fn returning the chunk's mean is weighted by samples: refuse integer targets whose counted
        positions (not ignore_index) differ per sample, in this chunk or from earlier ones; the sums of the counts
        and of their squares become state, so `compute` sees a difference between ranks too."""
        if self.reduction != "mean":
            return {}
        dev = y.device if isinstance(y, torch.Tensor) else None
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.dtype == torch.bool or y.dim() == 0 \
                or not y.numel():          # float or dict targets: every sample one term, as far as memfit can say
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            return {"terms": zero, "terms_sq": zero}
        counted = (y != self.ignored).reshape(y.shape[0], -1).sum(1)       # (n,) positions that count per sample
        lo, hi = int(counted.min()), int(counted.max())
        first = lo if self.per_sample_terms is None else self.per_sample_terms
        if lo != hi or lo != first:
            found = sorted({first, lo, hi})
            raise self._uneven(f"{found[0]} and {found[-1]}")
        self.per_sample_terms = first
        c = counted.double()
        return {"terms": c.sum(), "terms_sq": c.square().sum()}

    def _refuse_unknown_index(self, y, logits) -> None:
        """Class scores (N, C, *d) or (N, *d, C) for integer labels (N, *d) with a label outside 0..C-1 that is not
        ignore_index: loss_fn ran, so it ignores that label (lambda o, t: F.cross_entropy(o, t, ignore_index=255)),
        and a chunk mean weighted by samples, or a mean over every position, would count it, silently."""
        if not isinstance(y, torch.Tensor) or y.is_floating_point() or y.dtype == torch.bool or \
                not isinstance(logits, torch.Tensor) or logits.dim() != y.dim() + 1 or logits.shape[0] != y.shape[0]:
            return
        shape, ys = tuple(logits.shape), tuple(y.shape)
        sizes = [c for c, fits in ((shape[1], shape[2:] == ys[1:]), (shape[-1], shape[1:-1] == ys[1:])) if fits]
        if not sizes:
            return
        classes = max(sizes)
        lo, hi = torch.aminmax(y)                   # every label in range: no temporary the size of y
        if int(lo) >= 0 and int(hi) < classes:
            return
        bad = (y < 0) | (y >= classes)              # a bool per label (not a copy of the labels), on this chunk
        bad &= y != self.ignored
        if bool(bad.any()):
            v = int(y[bad].flatten()[0])
            raise ValueError(f"{self.name}: the targets hold label {v}, outside the {classes} classes of the "
                             f"output, and loss_fn ran on them, so it ignores them; memfit counts the positions not "
                             f"equal to ignore_index {self.ignored}, and would count those in the mean. Fix: "
                             f"pass ignore_index={v} (with terms=lambda x, y: (y != {v}).sum() if loss_fn averages "
                             "over the positions that count)")

    def _uneven(self, found: str) -> ValueError:
        return ValueError(
            f"{self.name}: loss_fn returns the mean over a chunk (loss_reduction='mean'), and the targets count a "
            f"different number of positions per sample (found {found} not equal to ignore_index {self.ignored}), so "
            "weighting chunks by samples would not give the whole-set mean. Fix: pass "
            f"terms=lambda x, y: (y != {self.ignored}).sum() if loss_fn averages over the positions that count "
            "(cross entropy does) or terms=lambda x, y: len(y) if it averages over samples; or leave loss_fn out "
            "(the default loss is cross entropy over the positions not ignored)")

    def compute(self):
        if not self.n or float(self.state["count"]) == 0:   # torch's mean of nothing (all ignored) is nan too
            return float("nan")
        if "terms_sq" in self.state:       # several ranks, each even on its own: n * sum(c^2) == sum(c)^2 iff all equal
            t, sq, n = float(self.state["terms"]), float(self.state["terms_sq"]), float(self.state["n"])
            if n * sq != t * t:
                raise self._uneven("counts that differ between ranks")
        return float(self.state["sum"]) / float(self.state["count"])


class OwnLoss(Metric):
    """The model's own loss (`out.loss`, labels inside the inputs: `memfit.own_loss`) over the whole set: each chunk's
    mean times the labels it is over (`terms`, `own_loss.LabelTerms`: not -100, a causal LM's from the second
    position on), summed in float64 and divided by their total, as one batch of the whole set would give it."""
    name = "loss"
    reads_inputs = True
    reads_output = True        # `contribution(output, y, x)`: the model's whole output, not the logits

    def __init__(self, terms: Callable, **kw) -> None:
        super().__init__(**kw)
        self.terms = terms

    def contribution(self, out, y, x=None):
        loss = model_loss(out).detach().double()
        count = self.terms(x).double()
        # a chunk whose every label is ignored has the mean 0 / 0 (nan) and adds nothing
        return {"sum": torch.where(count > 0, loss * count, torch.zeros_like(loss)), "count": count,
                "n": torch.tensor(batch_len(x), device=loss.device)}

    def compute(self):
        if not self.n or float(self.state["count"]) == 0:
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

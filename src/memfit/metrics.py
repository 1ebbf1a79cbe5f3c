"""Metrics as sums and counts, so that any chunking gives exactly the whole-set value.

Averaging per-chunk accuracies is wrong when the last chunk is smaller: with
10,001 samples in chunks of 50 the last chunk of 1 sample weighs as much as a full one. Here each
chunk contributes sums (correct predictions, summed losses, squared errors, confusion counts) and
counts; the value is computed once at the end. Contributions are computed first and committed
only after the whole chunk succeeded, so a chunk retried after an out-of-memory error is never
counted twice. States add up across processes too (`torch.distributed.all_reduce(SUM)`).

| metric        | targets                                   | value                                            |
|---------------|-------------------------------------------|--------------------------------------------------|
| `accuracy`, `topk:K` | class ids (N,) or labels (N, *d)   | share of positions (not ignore_index) predicted  |
| `loss`        | class ids / labels (default cross entropy), any with `loss_fn` | torch's mean over the whole set |
| `perplexity`  | token labels (N, T)                       | exp of the token-mean cross entropy (non-ignored)|
| `iou`         | labels (N, *d) (segmentation)             | mean over classes present of intersection / union |
| `confusion`   | class ids / labels                        | (C, C) counts, rows true, columns predicted      |
| `mse`, `mae`  | float targets of any shape                | mean squared / absolute error over every value   |

Class scores may lie on dimension 1 (`(N, C, *d)`, torch's convention) or last (`(N, *d, C)`, a language
model's logits); the shapes say which (`class_dim`). Labels equal to `ignore_index` (the data's, else -100)
count nowhere. With a dict of targets a metric names its target, `"accuracy@label"`, and reads the model's
output of that name (`output_for`).

Example:
    >>> import torch
    >>> m = Accuracy()
    >>> m.commit(m.contribution(torch.tensor([[2., 1.], [0., 3.]]), torch.tensor([0, 0])))
    >>> m.commit(m.contribution(torch.tensor([[1., 0.]]), torch.tensor([0])))
    >>> m.compute()
    0.6666666666666666
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from memfit.losses import loss_sum, per_sample, torch_denominator
from memfit.messages import plural
from memfit.targets import IGNORE_INDEX

__all__ = ["AbsoluteError", "Accuracy", "Confusion", "DEFAULTS", "External", "IoU", "Loss", "Metric", "NAMES",
           "Perplexity", "SquaredError", "TopK", "class_dim", "class_targets", "confusion", "correct",
           "correct_topk", "cross_entropy_sum", "default_metrics", "float_targets", "intersection_union",
           "logits_of", "make_metric", "output_for", "type_name"]


# ---- checks: what a metric compares ----------------------------------------------------------------
def class_dim(logits: torch.Tensor, y: torch.Tensor, what: str, given: int | None = None) -> int:
    """Where the class scores are: 1 for (N, C, *d) with labels (N, *d), -1 for (N, *d, C); raise otherwise."""
    shape, ys = tuple(logits.shape), tuple(y.shape)
    fix = ("the output must have one more dimension than the targets, the classes: (N, C, *d) or (N, *d, C) "
           "for targets (N, *d)")
    if logits.dim() != y.dim() + 1 or shape[0] != ys[0]:
        raise ValueError(f"{what}: found outputs of shape {shape} and targets of shape {ys}; {fix} (flatten or "
                         "pool the output, or check that the targets belong to this model)")
    first, last = shape[2:] == ys[1:], shape[1:-1] == ys[1:]
    if given is not None:
        if (given == 1 and not first) or (given == -1 and not last):
            raise ValueError(f"{what}: class_dim={given} needs outputs {'(N, C, *d)' if given == 1 else '(N, *d, C)'}"
                             f" for targets {ys}; found outputs {shape}")
        return given
    if logits.dim() == 2 or (first and not last):
        return 1
    if last and not first:
        return -1
    if first and last:
        raise ValueError(f"{what}: outputs {shape} with targets {ys} fit classes on dimension 1 and on the last "
                         f"one; say which: metrics=[memfit.metrics.{type_name(what)}(class_dim=1)] (or -1)")
    raise ValueError(f"{what}: found outputs of shape {shape} and targets of shape {ys}; {fix}: the shapes "
                     "other than the classes must match")


def type_name(what: str) -> str:
    return {"accuracy": "Accuracy", "loss (cross entropy)": "Loss", "perplexity": "Perplexity",
            "iou": "IoU", "confusion": "Confusion"}.get(what, "Accuracy")


def class_targets(logits: torch.Tensor, y, what: str, ignore_index: int, given: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores with classes on dimension 1 (N, C, *d): a view, targets (N, *d) as int64, mask of counted positions).

    Raises a ValueError saying what was expected and found: no targets, float targets, shapes that do not
    fit, a label outside 0..C-1 that is not ignore_index."""
    if y is None:
        raise ValueError(f"{what} needs targets; the data has none (give y, or use metrics that need none)")
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{what} compares with one target tensor; found {type(y).__name__} (a dict of targets: "
                         f"name the target, e.g. '{what.split()[0]}@NAME')")
    if y.is_floating_point():
        raise ValueError(f"{what} compares class ids, but the targets are float ({y.dtype}, shape "
                         f"{tuple(y.shape)}): use metrics 'mse' and 'mae' for float targets, or "
                         "y_dtype=torch.int64 when building the data if they are class ids")
    if y.shape[0] != logits.shape[0]:
        raise ValueError(f"{what}: {plural(logits.shape[0], 'output')} but {plural(y.shape[0], 'target')} in a "
                         "chunk")
    dim = class_dim(logits, y, what, given)
    scores = logits if dim == 1 else logits.movedim(-1, 1)
    y = y.long()        # uint8/int16/int32 labels (a loader's masks): y * classes and torch's losses need int64
    keep = y != ignore_index
    kept = y[keep]
    if kept.numel():
        lo, hi, c = int(kept.min()), int(kept.max()), scores.shape[1]
        if lo < 0 or hi >= c:
            bad = hi if hi >= c else lo
            raise ValueError(f"label {bad} is out of range for a model with {plural(c, 'output')} (labels must be "
                             f"in 0..{c - 1}, or ignore_index {ignore_index} where there is none); check the labels, "
                             "their ignore_index or the model's output size")
    return scores, y, keep


def float_targets(pred: torch.Tensor, y, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, targets) of one shape for an error metric; (N, 1) outputs meet (N,) targets."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{what} needs targets as one tensor; found {'none' if y is None else type(y).__name__} "
                         f"(a dict of targets: name one, e.g. '{what}@NAME')")
    if pred.shape != y.shape and pred.shape == (*y.shape, 1):
        pred = pred.squeeze(-1)                 # a regression head (N, 1) for targets (N,)
    if pred.shape != y.shape:
        raise ValueError(f"{what} compares outputs with targets of the same shape; found outputs {tuple(pred.shape)} "
                         f"and targets {tuple(y.shape)}; reshape the output (or the targets) to match")
    return pred, y


# ---- pure functions: one chunk's sums -----------------------------------------------------------
def correct_topk(scores: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, k: int) -> torch.Tensor:
    """Counted positions whose label is among the k highest scores (classes on dimension 1) (int64, 0-dim)."""
    top = scores.topk(min(k, scores.shape[1]), dim=1).indices       # (N, k, *d)
    return ((top == y.unsqueeze(1)).any(1) & keep).sum()


def correct(scores: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Counted positions whose argmax is the label (ties go to the first index, as torch.argmax)."""
    return ((scores.argmax(1) == y) & keep).sum()


def confusion(scores: torch.Tensor, y: torch.Tensor, keep: torch.Tensor, classes: int) -> torch.Tensor:
    """(classes, classes) int64 counts over counted positions: rows are true labels, columns predictions."""
    pred = scores.argmax(1)[keep]
    return torch.bincount(y[keep] * classes + pred, minlength=classes * classes).view(classes, classes)


def intersection_union(scores, y, keep, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class (classes,) int64: positions predicted and labelled c, and those predicted or labelled c."""
    pred, true = scores.argmax(1)[keep], y[keep]
    inter = torch.bincount(true[pred == true], minlength=classes)
    return inter, torch.bincount(pred, minlength=classes) + torch.bincount(true, minlength=classes) - inter


def cross_entropy_sum(scores, y, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 sum of cross entropy over counted positions, their count): torch's mean is sum / count."""
    ignored = torch.where(keep, y, torch.full_like(y, IGNORE_INDEX))   # one value torch skips (gives 0)
    wide = scores if scores.dtype == torch.float64 else scores.float()      # half types: in float32
    losses = F.cross_entropy(wide, ignored, ignore_index=IGNORE_INDEX, reduction="none")
    return losses.double().sum(), keep.sum().double()


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


# ---- thin stateful classes ----------------------------------------------------------------------
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


NAMES = {"accuracy": Accuracy, "confusion": Confusion, "iou": IoU, "mse": SquaredError, "mae": AbsoluteError,
         "perplexity": Perplexity}
DEFAULTS = {"class": ("accuracy", "loss"), "labels": ("accuracy", "loss"), "float": ("mse", "mae")}


def make_metric(spec, loss_fn: Callable | None = None, loss_reduction: str | None = None) -> Metric:
    """A name ('accuracy', 'topk:5', 'loss', 'confusion', 'iou', 'perplexity', 'mse', 'mae'; 'NAME@TARGET' for
    one target of a dict), a `Metric`, or an object with update() and compute() (torchmetrics)."""
    if isinstance(spec, Metric):
        return spec
    if isinstance(spec, str):
        name, _, target = spec.partition("@")
        kw = {"target": target} if target else {}
        if name in NAMES:
            return NAMES[name](**kw)
        if name == "loss":
            return Loss(loss_fn, loss_reduction, **kw)
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

"""What a metric compares, checked: where the class scores are, class-id targets and their ignored positions,
float targets of the outputs' shape. Each check raises a ValueError saying what was expected, what was found
and how to fix it.

Example:
    >>> import torch
    >>> class_dim(torch.zeros(2, 5, 3), torch.zeros(2, 5, dtype=torch.long), "accuracy")   # (N, T, C): last
    -1
"""

from __future__ import annotations

import torch

from memfit.losses import unit_dim
from memfit.messages import plural

__all__ = ["class_dim", "class_targets", "float_targets", "type_name"]


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
            void = f"; if {bad} marks positions without a label, pass ignore_index={bad}" if bad >= c > 1 else ""
            regress = (" (one output regresses a value: give integer targets to regress as floats, "
                       "y.astype(np.float32) or memfit.CompactDataset.from_arrays(..., y_dtype=torch.float32); "
                       "their metrics are 'mse' "
                       "and 'mae')") if c == 1 else ""
            raise ValueError(f"label {bad} is out of range for a model with {plural(c, 'output')} (labels must be "
                             f"in 0..{c - 1}, or ignore_index {ignore_index} where there is none); check the labels, "
                             f"their ignore_index or the model's output size{regress}{void}")
    return scores, y, keep


def float_targets(pred: torch.Tensor, y, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs, targets) of one shape for an error metric; outputs with one more dimension of size 1 than the
    targets ((N, 1) for (N,), (N, 1, H, W) for (N, H, W)), or the other way round, meet them value for value
    (never broadcast into (N, N))."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{what} needs targets as one tensor; found {'none' if y is None else type(y).__name__} "
                         f"(a dict of targets: name one, e.g. '{what}@NAME')")
    if pred.shape != y.shape:                   # (N, 1) heads for (N,) targets, (N, 1, H, W) for (N, H, W), or
        d = unit_dim(tuple(pred.shape), tuple(y.shape))              # the other way round: value for value
        pred = pred if d is None else pred.squeeze(d)
        d = unit_dim(tuple(y.shape), tuple(pred.shape))
        y = y if d is None else y.squeeze(d)
    if pred.shape != y.shape:
        ids = (" (if the targets are class ids stored as floats, give them as integers, y.astype(np.int64) or "
               "memfit.CompactDataset.from_arrays(..., y_dtype=torch.int64): class ids get 'accuracy' and 'loss')") \
            if pred.dim() == y.dim() + 1 and pred.shape[0] == y.shape[0] and pred.shape[1] > 1 else ""
        raise ValueError(f"{what} compares outputs with targets of the same shape; found outputs {tuple(pred.shape)} "
                         f"and targets {tuple(y.shape)}; reshape the output (or the targets) to match{ids}")
    return pred, y


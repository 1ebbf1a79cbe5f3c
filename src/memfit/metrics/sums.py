"""Pure functions: one chunk's sums and counts (classes on dimension 1, a mask of the positions that count).

Example:
    >>> import torch
    >>> scores, y = torch.tensor([[2., 1.], [0., 3.]]), torch.tensor([0, 0])
    >>> int(correct(scores, y, torch.ones(2, dtype=torch.bool)))
    1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.targets import IGNORE_INDEX

__all__ = ["confusion", "correct", "correct_topk", "cross_entropy_sum", "intersection_union"]


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


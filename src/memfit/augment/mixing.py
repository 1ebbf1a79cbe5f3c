"""The augmentation ops that mix samples (MixUp, CutMix): each sample with the one before it in its batch, the
class ids mixed into soft targets (float32 (B, classes), the target kind 'soft')."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from memfit.augment import kernels as K
from memfit.augment.kernels import LAYOUTS, canonical
from memfit.augment.ops import Op, _check

__all__ = ["CutMix", "MixUp", "soft_targets"]


def _beta(alpha: float, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """n draws of Beta(alpha, alpha), float32: numpy's, seeded from `generator` (torch has no seeded Beta)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return torch.from_numpy(np.random.default_rng(seed).beta(alpha, alpha, n).astype(np.float32))


def soft_targets(y: torch.Tensor, num_classes: int | None, op: Op) -> torch.Tensor:
    """Class ids (B,) as one-hot float32 (B, num_classes); soft targets (B, K) as they are."""
    if y is None:
        raise ValueError(f"{op!r} mixes samples and their class ids; give it an (x, y) batch with class ids")
    if y.is_floating_point() and y.dim() == 2:
        return y
    if y.dtype != torch.int64 or y.dim() != 1:
        raise ValueError(f"{op!r} needs class ids (int64 (B,)) or soft targets (float (B, classes)); found "
                         f"{y.dtype} {tuple(y.shape)}")
    if num_classes is None:
        raise ValueError(f"{op!r} needs num_classes to make soft targets from class ids in a batch alone "
                         f"(memfit.loader takes the dataset's); e.g. {type(op).__name__}(num_classes=10)")
    return torch.nn.functional.one_hot(y, num_classes).float()


@dataclass(frozen=True)
class MixUp(Op):
    """MixUp (Zhang et al., 2018): each sample mixed with the one before it in the batch (the first with the
    last), x * lam + x_before * (1 - lam), lam ~ Beta(alpha, alpha) per sample (timm's 'elem' mode), and the
    class ids the same way into soft targets (float32 (B, num_classes)). Runs on the decoded values.

    Example:
        >>> import torch
        >>> x, y = MixUp(num_classes=3)((torch.zeros(4, 2), torch.tensor([0, 1, 2, 0])))
        >>> y.shape, bool(torch.allclose(y.sum(1), torch.ones(4)))
        (torch.Size([4, 3]), True)
    """
    alpha: float = 1.0
    num_classes: int | None = None
    stage = "values"
    mixes = True

    def __post_init__(self):
        _check("alpha", self.alpha, isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
               and self.alpha > 0, "a number > 0")
        _check("num_classes", self.num_classes, self.num_classes is None or (isinstance(self.num_classes, int)
               and self.num_classes >= 1), "None or an int >= 1")

    def draw(self, n, size, generator):
        return {"lam": _beta(self.alpha, n, generator)}

    def apply(self, x, y, params, *, fill=None, num_classes=None, workspace=None, key=None, owned=False):
        if not x.is_floating_point():
            raise ValueError(f"{self!r} mixes values: it needs a float batch; found {x.dtype}")
        soft = soft_targets(y, self.num_classes or num_classes, self)
        lam = params["lam"]
        return K.mix(x, lam), K.mix(soft, lam)


@dataclass(frozen=True)
class CutMix(Op):
    """CutMix (Yun et al., 2019): a rectangle of each sample replaced by the same rectangle of the sample
    before it in the batch; its sides sqrt(1 - lam) of the sample's (lam ~ Beta(alpha, alpha) per sample),
    its centre anywhere, the part outside cut off; the class ids mixed into soft targets by the area kept
    (1 - rectangle / sample). Moves values only: runs on the stored codes.

    Example:
        >>> import torch
        >>> x, y = CutMix(num_classes=2)((torch.zeros(2, 1, 4, 4), torch.tensor([0, 1])))
        >>> y.shape
        torch.Size([2, 2])
    """
    alpha: float = 1.0
    num_classes: int | None = None
    layout: str = "CHW"
    mixes = True

    def __post_init__(self):
        MixUp.__post_init__(self)
        _check("layout", self.layout, self.layout in LAYOUTS, f"one of {LAYOUTS}")

    def draw(self, n, size, generator):
        lam = _beta(self.alpha, n, generator)
        cut = torch.sqrt(1 - lam.double())                            # the rectangle's side, over the sample's
        ch, cw = (cut * size[0]).long(), (cut * size[1]).long()
        cy = torch.randint(0, size[0], (n,), generator=generator)
        cx = torch.randint(0, size[1], (n,), generator=generator)
        top, left = (cy - ch // 2).clamp(0, size[0]), (cx - cw // 2).clamp(0, size[1])
        bottom, right = (cy + ch - ch // 2).clamp(0, size[0]), (cx + cw - cw // 2).clamp(0, size[1])
        return {"top": top.int(), "left": left.int(), "height": (bottom - top).int(), "width": (right - left).int()}

    def apply(self, x, y, params, *, fill=None, num_classes=None, workspace=None, key=None, owned=False):
        soft = soft_targets(y, self.num_classes or num_classes, self)
        v = canonical(x, self.layout)
        height, width = params["height"], params["width"]
        out = K.paste_rects(v, params["top"], params["left"], height, width)
        kept = 1 - (height * width).float() / float(v.shape[2] * v.shape[3])
        return out.view(x.shape), K.mix(soft, kept)

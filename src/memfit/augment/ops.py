"""The augmentation ops that move or write values (crop, translate, flip, cutout): what each does to a sample,
the per-sample parameters it draws, and its batch-wide apply (`memfit.augment.kernels`); the ones that mix
samples are in `memfit.augment.mixing`.

An op is a small frozen dataclass. `op.draw(n, size, generator)` draws the parameters of n samples (CPU
tensors, one entry per sample) and `op.apply(x, y, params, ...)` applies them to a batch; `op(batch,
generator)` does both. `memfit.loader(..., augment=[...])` draws the parameters of every sample of an epoch
from a generator seeded by (seed, epoch) and looks them up by sample, so a sample is augmented the same
whatever the strategy, the batch size or the ranks.

Values the ops write (`fill`) are in the units of the data (0 is black for uint8 images); under a loader
they are written into the stored codes before the decode, so a normalised batch shows them normalised.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from memfit.augment import kernels as K
from memfit.augment.kernels import LAYOUTS, canonical, spatial_size, with_size

__all__ = ["Crop", "Cutout", "Flip", "Op", "Translate", "Workspace"]

MODES = ("zero", "reflect")


class Workspace:
    """Where an op's intermediate buffers come from: fresh tensors (`reuse=False`, an op called on its own), or
    buffers kept per key and reused from batch to batch (a loader's; `nbytes` counts them)."""

    def __init__(self, reuse: bool = False):
        self.reuse = reuse
        self._bufs: dict[object, torch.Tensor] = {}

    def get(self, key: object, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` + 1 values (the one past the end: a spare value that
        `fill_rects` writes what it leaves out into)."""
        if not self.reuse:
            return torch.empty(numel + 1, dtype=dtype, device=device)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel + 1 or buf.dtype != dtype or buf.device != device:
            with torch.inference_mode(False):       # written again later, outside inference mode too
                buf = self._bufs[key] = torch.empty(numel + 1, dtype=dtype, device=device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def _pair(value, name: str, lo: int) -> tuple[int, int]:
    vals = (value, value) if isinstance(value, (int, np.integer)) else tuple(value) if value is not None else ()
    if len(vals) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo for v in vals):
        raise ValueError(f"expected {name} to be an int >= {lo} or a pair (height, width) of them; found {value!r}")
    return int(vals[0]), int(vals[1])


def _check(name: str, value, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"expected {name} to be {expected}; found {value!r}")


def _fill_ok(fill) -> bool:
    number = isinstance(fill, (int, float, np.integer, np.floating)) and not isinstance(fill, bool)
    return number and math.isfinite(fill)


def _split(batch):
    """(x, y, given as a pair) of a batch given as a tensor or an (x, y) pair."""
    if isinstance(batch, torch.Tensor):
        return batch, None, False
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch[0], batch[1], True
    raise TypeError(f"expected a batch tensor (B, ...) or an (x, y) pair of them; found {type(batch).__name__}")


@dataclass(frozen=True)
class Op:
    """An augmentation op (the base class)."""
    stage = "codes"         # 'codes': moves or writes values, exact on the stored codes before the decode;
                            # 'values': computes new values (mixing), after the decode
    geometric = False       # moves pixels: per-pixel targets would have to move with them
    mixes = False           # mixes samples: class ids become soft targets

    def out_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """(H, W) of a sample after the op, for an input of (H, W) (raises when the op cannot apply)."""
        return size

    def draw(self, n: int, size: tuple[int, int], generator: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Parameters of n samples of spatial size `size`: {name: CPU tensor (n,)}."""
        raise NotImplementedError

    def apply(self, x: torch.Tensor, y, params: dict[str, torch.Tensor], *, fill: float | None = None,
              num_classes: int | None = None, workspace: Workspace | None = None, key: object = None,
              owned: bool = False):
        """(x, y) with the op applied: x a batch (B, ...), params this batch's (on x's device). `fill` in x's
        units (None: the op's own); `owned`: x may be written in place."""
        raise NotImplementedError

    def __call__(self, batch, generator: torch.Generator | None = None):
        """The op on one batch alone: a tensor (B, ...) or an (x, y) pair; parameters drawn from `generator`
        (None: torch's default). Returns what it was given, augmented (new tensors)."""
        x, y, pair = _split(batch)
        layout = getattr(self, "layout", "CHW")
        size = spatial_size(tuple(x.shape[1:]), layout) if self.stage == "codes" or self.geometric else (0, 0)
        params = {k: v.to(x.device) for k, v in self.draw(x.shape[0], size, generator).items()}
        x, y = self.apply(x, y, params)            # a mixing op refuses a batch without class ids
        return (x, y) if pair else x


def _workspace(workspace: Workspace | None) -> Workspace:
    return workspace if workspace is not None else Workspace()


@dataclass(frozen=True)
class Crop(Op):
    """Random crop: each sample padded by `padding` on every side, then a window of `size` cut at a random
    place (every position equally likely), as torchvision's `RandomCrop(size, padding)`.

    Args:
        size: output (height, width), or one int for a square; None: the input's size (a random translation).
        padding: values added on each side before cutting.
        mode: 'zero' (the padding is `fill`) or 'reflect' (mirrored, the edge not repeated: numpy's 'reflect').
        fill: the padding's value for mode 'zero', in the data's units.
        layout: 'CHW' (channels first, or (H, W) samples) or 'HWC' (channels last).

    Example:
        >>> import torch
        >>> x = torch.arange(2 * 3 * 5 * 5, dtype=torch.uint8).view(2, 3, 5, 5)
        >>> Crop(4, padding=1, mode="reflect")(x, torch.Generator().manual_seed(0)).shape
        torch.Size([2, 3, 4, 4])
    """
    size: object = None
    padding: int = 0
    mode: str = "zero"
    fill: float = 0
    layout: str = "CHW"
    geometric = True

    def __post_init__(self):
        if self.size is not None:
            _pair(self.size, "size", 1)
        _check("padding", self.padding, isinstance(self.padding, (int, np.integer)) and not isinstance(
            self.padding, bool) and self.padding >= 0, "an int >= 0")
        _check("mode", self.mode, self.mode in MODES, f"one of {MODES}")
        _check("fill", self.fill, _fill_ok(self.fill), "a finite number (in the data's units)")
        _check("layout", self.layout, self.layout in LAYOUTS, f"one of {LAYOUTS}")

    def out_size(self, size):
        return _crop_size(self, tuple(size))

    def _out_size(self, size):
        h, w = size if self.size is None else _pair(self.size, "size", 1)
        p = int(self.padding)
        if h > size[0] + 2 * p or w > size[1] + 2 * p:
            raise ValueError(f"{self!r}: a {h}x{w} window does not fit in a {size[0]}x{size[1]} sample padded by "
                             f"{p}; use a smaller size or more padding")
        if self.mode == "reflect" and p >= min(size):
            raise ValueError(f"{self!r}: reflect padding must be smaller than the sample's sides ({size[0]}x"
                             f"{size[1]}); use padding <= {min(size) - 1} or mode='zero'")
        return h, w

    def draw(self, n, size, generator):
        h, w = self.out_size(size)
        p = int(self.padding)
        return {"top": torch.randint(0, size[0] + 2 * p - h + 1, (n,), generator=generator, dtype=torch.int32),
                "left": torch.randint(0, size[1] + 2 * p - w + 1, (n,), generator=generator, dtype=torch.int32)}

    def apply(self, x, y, params, *, fill=None, num_classes=None, workspace=None, key=None, owned=False,
              flips=None):
        """`flips`: a `Flip`'s parameter "flip" of the same samples, to run it in the same gather (a loader
        does so for a Flip right after the Crop)."""
        ws = _workspace(workspace)
        v = canonical(x, self.layout)
        size = self.out_size(tuple(v.shape[2:4]))
        out_shape = (v.shape[0], v.shape[1], *size, v.shape[4])
        out = ws.get((key, "out"), math.prod(out_shape), x.dtype, x.device)
        p = int(self.padding)
        numel = K.crop_work_numel(tuple(v.shape), p, self.mode, flips is not None)
        work = ws.get((key, "work"), numel, x.dtype, x.device) if numel else None
        K.crop(v, params["top"], params["left"], size, p, self.mode,
               self.fill if fill is None else fill, out[:math.prod(out_shape)].view(out_shape), work, flips)
        shape = with_size(tuple(x.shape[1:]), self.layout, size)
        return out[:math.prod(out_shape)].view(x.shape[0], *shape), y


@functools.lru_cache(maxsize=256)
def _crop_size(op: Crop, size: tuple[int, int]) -> tuple[int, int]:
    """`Crop.out_size`, checked once per op and input size (not once per batch)."""
    return op._out_size(size)


class Translate(Crop):
    """Random translation by up to `shift` pixels in each direction, the sample's size kept: `Crop(None,
    padding=shift, mode, fill, layout)` (airbench's "translate": reflect padding of 2).

    Example:
        >>> import torch
        >>> Translate(shift=2, mode="reflect")(torch.zeros(4, 3, 8, 8)).shape
        torch.Size([4, 3, 8, 8])
    """

    def __init__(self, shift: int = 2, mode: str = "zero", fill: float = 0, layout: str = "CHW"):
        super().__init__(None, shift, mode, fill, layout)

    def __repr__(self) -> str:
        return f"Translate(shift={self.padding}, mode={self.mode!r}, fill={self.fill}, layout={self.layout!r})"


@dataclass(frozen=True)
class Flip(Op):
    """Random horizontal flip: each sample mirrored left-right with probability `p`.

    Example:
        >>> import torch
        >>> x = torch.arange(4.0).view(1, 1, 1, 4)
        >>> Flip(p=1.0)(x).flatten().tolist()
        [3.0, 2.0, 1.0, 0.0]
    """
    p: float = 0.5
    layout: str = "CHW"
    geometric = True

    def __post_init__(self):
        _check("p", self.p, isinstance(self.p, (int, float)) and not isinstance(self.p, bool) and 0 <= self.p <= 1,
               "a probability in [0, 1]")
        _check("layout", self.layout, self.layout in LAYOUTS, f"one of {LAYOUTS}")

    def draw(self, n, size, generator):
        return {"flip": torch.rand(n, generator=generator) < self.p}

    def apply(self, x, y, params, *, fill=None, num_classes=None, workspace=None, key=None, owned=False):
        ws = _workspace(workspace)
        v = canonical(x, self.layout)
        out = ws.get((key, "out"), v.numel(), x.dtype, x.device)[:v.numel()].view(v.shape)
        K.flip(v, params["flip"], out, ws.get((key, "work"), 2 * v.numel(), x.dtype, x.device))
        return out.view(x.shape), y


@dataclass(frozen=True)
class Cutout(Op):
    """Cutout (DeVries & Taylor, 2017): a `size` square (or (height, width) rectangle) of each sample set to
    `fill`, with probability `p`. Its centre is anywhere in the sample and the part outside is cut off
    (the original); `inside=True` keeps the whole rectangle inside (airbench's). A random-erasing of fixed size.

    Example:
        >>> import torch
        >>> x = Cutout(2, fill=9, inside=True)(torch.zeros(1, 1, 4, 4, dtype=torch.uint8))
        >>> int((x == 9).sum())
        4
    """
    size: object = 8
    fill: float = 0
    p: float = 1.0
    inside: bool = False
    layout: str = "CHW"

    def __post_init__(self):
        _pair(self.size, "size", 1)
        _check("fill", self.fill, _fill_ok(self.fill), "a finite number (in the data's units)")
        _check("p", self.p, isinstance(self.p, (int, float)) and not isinstance(self.p, bool) and 0 <= self.p <= 1,
               "a probability in [0, 1]")
        _check("inside", self.inside, isinstance(self.inside, bool), "True or False")
        _check("layout", self.layout, self.layout in LAYOUTS, f"one of {LAYOUTS}")

    def _most(self, size):
        return _cutout_most(self, tuple(size))

    def _check_most(self, size):
        h, w = _pair(self.size, "size", 1)
        if self.inside and (h > size[0] or w > size[1]):
            raise ValueError(f"{self!r}: a {h}x{w} rectangle does not fit inside a {size[0]}x{size[1]} sample; "
                             "use a smaller size or inside=False")
        return min(h, size[0]), min(w, size[1])

    def draw(self, n, size, generator):
        """The rectangle of each sample, inside the sample: top, left, height, width (int32; clipped)."""
        h, w = _pair(self.size, "size", 1)
        self._most(size)
        if self.inside:
            top = torch.randint(0, size[0] - h + 1, (n,), generator=generator, dtype=torch.int32)
            left = torch.randint(0, size[1] - w + 1, (n,), generator=generator, dtype=torch.int32)
        else:                       # the centre anywhere; the rectangle starts half its size before it
            top = torch.randint(0, size[0], (n,), generator=generator, dtype=torch.int32) - h // 2
            left = torch.randint(0, size[1], (n,), generator=generator, dtype=torch.int32) - w // 2
        bottom, right = (top + h).clamp(max=size[0]), (left + w).clamp(max=size[1])
        top, left = top.clamp(min=0), left.clamp(min=0)
        params = {"top": top, "left": left, "height": bottom - top, "width": right - left}
        if self.p < 1:
            params["on"] = torch.rand(n, generator=generator) < self.p
        return params

    def apply(self, x, y, params, *, fill=None, num_classes=None, workspace=None, key=None, owned=False):
        v = canonical(x, self.layout)
        most = self._most(tuple(v.shape[2:4]))
        if owned and x.is_contiguous() and "on" not in params:
            flat = x.view(-1)                      # written in place: every sample has its rectangle
        else:
            flat = _workspace(workspace).get((key, "out"), x.numel(), x.dtype, x.device)
            flat[:x.numel()].view(x.shape).copy_(x)
        K.fill_rects(flat, tuple(v.shape), params["top"], params["left"], params["height"], params["width"], most,
                     self.fill if fill is None else fill, params.get("on"))
        return flat[:x.numel()].view(x.shape), y


@functools.lru_cache(maxsize=256)
def _cutout_most(op: Cutout, size: tuple[int, int]) -> tuple[int, int]:
    """The largest rectangle of `op` in a sample of `size`, checked once per op and size."""
    return op._check_most(size)

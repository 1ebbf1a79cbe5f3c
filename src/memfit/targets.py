"""Targets: what a model's outputs are compared with, stored compactly beside the inputs, decoded per batch.

| kind     | given as                                          | decoded to                               |
|----------|---------------------------------------------------|------------------------------------------|
| `class`  | integer class ids (N,) (or (N, 1))                | int64 (N,)                               |
| `labels` | integer labels (N, ...): masks, token labels      | int64 (N, ...)                           |
| `float`  | float (or bool) targets (N,) or (N, ...)          | float32; float64 where float32 is inexact |
| a dict   | {name: any of the above}                          | {name: tensor}                           |
| `soft`   | never stored: class ids mixed by `MixUp`/`CutMix` | float32 (N, classes), each row sums to 1 |

`ignore_index` (-100 by default, as torch's cross_entropy; 255 for many segmentation sets) marks positions
without a label: it counts neither in `num_classes` nor in the metrics.

Each target is stored with the inputs' lossless `auto` codec (`memfit.codecs.auto_codec`: class ids in
uint8, a 0/1 mask in bits, float targets in fp16 when every value is exact there); a dict's targets are
packed side by side in one byte row per sample. A float array is never made class ids unless asked for
with `y_dtype=torch.int64` (which refuses values that are not whole numbers); `y_dtype=torch.float32`
stores float64 targets as float32 and reports the largest rounding error (`describe()`).

Example:
    >>> import numpy as np, torch
    >>> stored, t = encode_target(np.array([0.5, 2.0, 3.25]), 3)      # float64 data, exact in fp16
    >>> t.kind, t.codec.name, stored.dtype, t.decode(stored).dtype
    ('float', 'fp16', torch.float16, torch.float32)
    >>> stored, t = encode_target(np.array([[0, 1], [2, -100]]), 2)      # token labels
    >>> t.kind, t.num_classes, t.decode(stored).tolist()
    ('labels', 3, [[0, 1], [2, -100]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from memfit.arrays import as_array, iter_chunks, resolve_dtype
from memfit.codecs import CODECS, Codec, Float32Codec, IntCodec, auto_codec

__all__ = ["IGNORE_INDEX", "KINDS", "Target", "Targets", "check_count", "encode_target", "encode_targets"]

KINDS = ("class", "labels", "float", "soft")
IGNORE_INDEX = -100          # torch's cross_entropy default: a position without a label
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)     # float targets stored (float8: not)


@dataclass
class Target:
    """One target: how it is stored (`codec`, per-sample `shape`) and decoded (`dtype`).

    `ignore_index` and `num_classes` (the largest label other than ignore_index, plus one) are set for the
    integer kinds only."""
    kind: str
    shape: tuple[int, ...]
    codec: Codec
    dtype: torch.dtype
    ignore_index: int | None = None
    num_classes: int | None = None

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return tuple(self.codec.stored_shape(self.shape))

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.codec.stored_dtype

    @property
    def stored_nbytes(self) -> int:
        """Stored bytes of one sample's target."""
        return math.prod(self.stored_shape) * self.stored_dtype.itemsize

    @property
    def decoded_nbytes(self) -> int:
        """Decoded bytes of one sample's target."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def dense_nbytes(self) -> int:
        """One sample's target as a plain tensor: int64 labels, float32 (float64 where needed) targets."""
        return math.prod(self.shape) * (8 if self.kind != "float" else max(4, self.dtype.itemsize))

    def decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows (n, *stored_shape) -> targets (n, *shape) in `dtype`, on the rows' device; always new
        memory (never a view of the stored rows, which loaders reuse)."""
        codes = self.codec.unpack(stored, self.shape)
        out = codes.to(self.dtype, copy=True) if codes is stored else codes.to(self.dtype)
        return out.add_(self.codec.offset) if self.codec.offset else out

    def describe(self) -> str:
        shape = "one value" if not self.shape else f"shape {self.shape}"
        if self.kind == "soft":
            return (f"soft targets (class probabilities: class ids mixed per batch by the augmentation), "
                    f"{self.shape[0]} classes per sample, float32, made per batch (nothing stored)")
        what = {"class": "class ids", "labels": f"labels (ignore_index {self.ignore_index})",
                "float": "float targets"}[self.kind]
        return (f"{what}, {shape} per sample, stored as {self.codec.describe()}, decoded to "
                f"{str(self.dtype).replace('torch.', '')}")


class Targets:
    """A dataset's targets: one `Target` (`parts` is {None: target}) stored as its own rows, or a dict of
    them packed side by side into one uint8 row per sample (each at an offset aligned to its element size)."""

    def __init__(self, parts: dict[str | None, Target]) -> None:
        self.parts = parts
        self.single = None in parts
        self.offsets: dict[str, tuple[int, int]] = {}
        if self.single:
            t = parts[None]
            self.stored_shape, self.stored_dtype = t.stored_shape, t.stored_dtype
            return
        offset = 0
        for name, t in parts.items():
            item = t.stored_dtype.itemsize
            offset = -(-offset // item) * item
            self.offsets[name] = (offset, t.stored_nbytes)
            offset += t.stored_nbytes
        self.stored_shape, self.stored_dtype = (max(8, -(-offset // 8) * 8),), torch.uint8

    @property
    def kind(self) -> str | dict[str, str]:
        """'class', 'labels' or 'float'; {name: kind} for a dict of targets."""
        return self.parts[None].kind if self.single else {k: t.kind for k, t in self.parts.items()}

    @property
    def num_classes(self) -> int | None:
        """Class count of a single integer target (largest label + 1); None otherwise."""
        return self.parts[None].num_classes if self.single else None

    @property
    def ignore_index(self) -> int | None:
        return self.parts[None].ignore_index if self.single else None

    @property
    def stored_nbytes(self) -> int:
        return math.prod(self.stored_shape) * self.stored_dtype.itemsize

    @property
    def decoded_nbytes(self) -> int:
        return sum(t.decoded_nbytes for t in self.parts.values())

    @property
    def dense_nbytes(self) -> int:
        return sum(t.dense_nbytes for t in self.parts.values())

    def decode(self, stored: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """Stored rows (n, *stored_shape) -> decoded targets (a tensor, or {name: tensor})."""
        if self.single:
            return self.parts[None].decode(stored)
        n, out = stored.shape[0], {}
        for name, t in self.parts.items():
            off, nb = self.offsets[name]
            out[name] = t.decode(stored[:, off:off + nb].view(t.stored_dtype).view(n, *t.stored_shape))
        return out

    def describe(self) -> str:
        if self.single:
            return self.parts[None].describe()
        return "; ".join(f"{k!r}: {t.describe()}" for k, t in self.parts.items())

    @classmethod
    def soft(cls, num_classes: int) -> Targets:
        """What batches hold once class ids are mixed into class probabilities (MixUp, CutMix): float32
        (num_classes,) per sample; made per batch, never stored (its codec only says how it reads).

        Example:
            >>> t = Targets.soft(10)
            >>> t.kind, t.num_classes, t.decoded_nbytes
            ('soft', 10, 40)
        """
        return cls({None: Target("soft", (num_classes,), Float32Codec()._exact(), torch.float32,
                                 num_classes=num_classes)})

    @classmethod
    def plain(cls, y: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> Targets:
        """The targets of stored rows made elsewhere (a CompactDataset built from tensors): integer rows are
        class ids or labels decoded to int64 (`ignore_index` marks positions without a label), float rows float
        targets in their own float dtype."""
        if y.is_floating_point():
            codec = next(c() for c in CODECS.values() if getattr(c, "dtype", None) == y.dtype and
                         c.name.startswith(("f", "b")))
            codec.lossless = True
            dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
            return cls({None: Target("float", tuple(y.shape[1:]), codec, dtype)})
        codec = next((c(offset=0) for c in CODECS.values() if issubclass(c, IntCodec) and c.dtype == y.dtype), None)
        if codec is None:
            raise TypeError(f"stored targets must be an integer or float tensor; found {y.dtype} (build the dataset "
                            "with CompactDataset.from_arrays, which stores bool targets in bits)")
        kind = "class" if y.dim() == 1 else "labels"
        ignore = ignore_index
        kept = y[y != ignore]
        classes = int(kept.max()) + 1 if kept.numel() else None
        return cls({None: Target(kind, tuple(y.shape[1:]), codec, torch.int64, ignore, classes)})


def _integer_stats(arr, ignore_index: int, what: str) -> int | None:
    """Largest label other than ignore_index + 1 (None: none); raise on a negative label that is not ignored."""
    hi = None
    for _, chunk in iter_chunks(arr):
        kept = chunk[chunk != ignore_index]
        if not kept.numel():
            continue
        lo = int(kept.min())
        if lo < 0:
            raise ValueError(f"{what} holds label {lo}, which is neither a class id (>= 0) nor ignore_index "
                             f"{ignore_index}; pass ignore_index={lo} if it marks positions without a label, or "
                             "y_dtype=torch.float32 if y holds values to regress, not class ids")
        hi = max(hi or 0, int(kept.max()))
    return None if hi is None else hi + 1


def _whole_numbers(arr, what: str) -> np.ndarray | torch.Tensor:
    """Float targets asked for as class ids: every value finite and whole, then int64."""
    for start, chunk in iter_chunks(arr):
        bad = ~torch.isfinite(chunk) | (chunk != chunk.round())
        if bool(bad.any()):
            v = chunk[bad].flatten()[0].item()
            raise ValueError(f"{what}: y_dtype=torch.int64 asks for class ids, but y holds {v:g} (sample "
                             f"{start + int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0])}); class ids are "
                             "whole numbers: leave y_dtype=None to keep float targets")
    return arr.astype(np.int64) if isinstance(arr, np.ndarray) else arr.long()


def encode_target(y: object, n: int, *, y_dtype=None, ignore_index: int = IGNORE_INDEX,
                  what: str = "y") -> tuple[torch.Tensor, Target]:
    """One target array (N, ...) -> (stored rows on the CPU, its Target). See the module docstring."""
    arr = as_array(y, what)
    if arr.ndim == 0 or arr.shape[0] != n:
        found = "a scalar" if arr.ndim == 0 else f"{arr.shape[0]} entries"
        raise ValueError(f"{what} needs one target per sample ({n}, ...); found {found} (shape {tuple(arr.shape)})")
    if isinstance(arr, np.ndarray) and arr.dtype.kind not in "iubf":
        raise TypeError(f"{what}: expected integer class ids or labels, or float targets; found dtype {arr.dtype}; "
                        "convert them first, e.g. np.asarray(y, dtype=np.float32) (np.int64 for class ids)")
    dtype = torch.from_numpy(np.empty(0, arr.dtype)).dtype if isinstance(arr, np.ndarray) else arr.dtype
    if dtype.is_complex or (dtype.is_floating_point and dtype not in _FLOATS):
        raise TypeError(f"{what}: expected integer class ids or labels, or float targets (float16, bfloat16, "
                        f"float32 or float64); found dtype {dtype}; convert them first, e.g. y.float()")
    asked = None if y_dtype is None else resolve_dtype(y_dtype)
    if asked is not None and asked not in (torch.int64, torch.float32, torch.float64):
        keep = (f"leave y_dtype=None: {dtype} targets are then stored exactly and decoded to float32" if dtype in
                (torch.float16, torch.bfloat16) else "pass y_dtype=torch.float32 for float targets")
        raise ValueError(f"{what}: y_dtype {asked} is not offered: targets decode to int64 (class ids, labels), "
                         f"float32 or float64 (losses and metrics compare in those); found y_dtype={asked} for "
                         f"{dtype} targets; {keep}, or y_dtype=torch.int64 for class ids")
    integer = not dtype.is_floating_point and dtype != torch.bool
    if asked == torch.int64 and not integer:
        arr, integer = _whole_numbers(arr, what), True
    if integer and asked in (None, torch.int64):
        if arr.ndim == 2 and arr.shape[1] == 1:              # (N, 1): one class id per sample
            arr = arr[:, 0]
        classes = _integer_stats(arr, ignore_index, what)
        target = Target("class" if arr.ndim == 1 else "labels", tuple(arr.shape[1:]), auto_codec(arr),
                        torch.int64, ignore_index, classes)
    else:
        codec = auto_codec(arr)
        out = asked or (torch.float64 if codec.name == "float64" else torch.float32)
        if out == torch.float32 and codec.name == "float64":
            codec = Float32Codec()             # asked for: stored as float32, its worst rounding measured
        if out == torch.float32 and codec.name in ("int32", "int64"):     # stored wider than 16 bits: look
            big = max((int(c.abs().max()) for _, c in iter_chunks(arr) if c.numel()), default=0)
            if big > 2**24:
                raise ValueError(f"{what}: y_dtype=torch.float32 asked for, but y holds the integer {big}, beyond "
                                 "2**24 (16777216), which float32 cannot hold exactly; pass y_dtype=torch.float64")
        target = Target("float", tuple(arr.shape[1:]), codec, out)
    stored = torch.empty((n, *target.stored_shape), dtype=target.stored_dtype)
    try:
        for start, chunk in iter_chunks(arr):
            enc = target.codec.encode(chunk)
            stored[start:start + enc.shape[0]].copy_(enc)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return stored, target


def encode_targets(y: object, n: int, *, y_dtype=None, ignore_index: int = IGNORE_INDEX,
                   ) -> tuple[torch.Tensor, Targets]:
    """Targets `y` (an array (N, ...) or a dict of them) -> (stored rows on the CPU, Targets).

    `y_dtype` and `ignore_index` may be dicts {name: value} for a dict of targets.

    Raises:
        ValueError / TypeError naming the target, what was expected and what was found.
    """
    if not isinstance(y, dict):
        stored, t = encode_target(y, n, y_dtype=y_dtype, ignore_index=ignore_index)
        return stored, Targets({None: t})
    if not y:
        raise ValueError("y is an empty dict; give at least one target, e.g. {'label': labels}")
    for arg, name in ((y_dtype, "y_dtype"), (ignore_index, "ignore_index")):
        if isinstance(arg, dict) and set(arg) - set(y):
            raise ValueError(f"{name} names targets {sorted(set(arg) - set(y))} that y does not have; "
                             f"y has {sorted(y)}")
    pick = lambda arg, k, default: arg.get(k, default) if isinstance(arg, dict) else arg
    parts, rows = {}, {}
    for k, v in y.items():
        if not isinstance(k, str):
            raise TypeError(f"target names must be strings; found {k!r}")
        rows[k], parts[k] = encode_target(v, n, y_dtype=pick(y_dtype, k, None),
                                          ignore_index=pick(ignore_index, k, IGNORE_INDEX), what=f"y[{k!r}]")
    targets = Targets(parts)
    packed = torch.zeros((n, *targets.stored_shape), dtype=torch.uint8)
    for k, (off, nb) in targets.offsets.items():
        packed[:, off:off + nb].copy_(rows[k].reshape(n, -1).view(torch.uint8))
    return packed, targets


def check_count(y: object, n: int) -> None:
    """Raise when y (an array or a dict of arrays) does not hold n samples' targets."""
    for k, v in (y.items() if isinstance(y, dict) else [("y", y)]):
        if hasattr(v, "__len__") and len(v) != n:
            name = "y" if k == "y" else f"y[{k!r}]"
            raise ValueError(f"x has {n} samples but {name} has {len(v)} targets; they must match")


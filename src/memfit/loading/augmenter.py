"""A loader's augmentation: `memfit.augment` ops run inside the per-batch decode, on the stored codes.

The decode is split in two (`CompactDataset.decode`: the codec unpacks the stored rows into codes, then
`decode_codes` converts them and applies the per-channel affine that also normalises). The ops that only
move or write values (crop, translate, flip, cutout, cutmix) run between the halves, on the codes (uint8
for CIFAR: a quarter of float32's bytes to move); the per-channel decode commutes with them exactly, so a
batch is bit-identical to the same ops on the data itself, decoded. Ops that compute values (mixup) run
after the decode. Nothing of the dataset is copied: one batch of codes at a time, in reused buffers.

Parameters: every sample's, for an epoch, drawn from one generator seeded by (seed, epoch) (the ops in
order, each drawing for all `n_total` samples of the whole data), kept as one int32 and one float32 table
(`EpochParams`, counted in the loader's ledger) and looked up by sample: the same augmented sample under
every strategy, batch size and rank layout.

Example:
    >>> import numpy as np, torch, memfit
    >>> ds = memfit.CompactDataset.from_arrays(np.zeros((10, 3, 8, 8), np.uint8), np.arange(10), device="cpu")
    >>> aug = Augmenter((memfit.augment.Crop(6, padding=1), memfit.augment.Flip()), ds)
    >>> aug.sample_shape, aug.table_nbytes(10)
    ((3, 6, 6), 120)
"""

from __future__ import annotations

import math

import torch

from memfit.augment.kernels import canonical_shape, crop_work_numel, spatial_size, with_size
from memfit.augment.ops import Crop, Cutout, Flip, Op, Workspace
from memfit.compact import CompactDataset, decoded_batch_nbytes
from memfit.loading.order import epoch_seed
from memfit.targets import Targets

__all__ = ["Augmenter", "EpochParams", "check_ops", "fill_code"]

_SALT = 0x5DEECE66D          # the augmentation's generator is not the epoch order's (seeded by the same pair)


def check_ops(augment) -> tuple[Op, ...]:
    """`augment` as a tuple of ops, or a TypeError naming what was found."""
    if augment is None:
        return ()
    ops = (augment,) if isinstance(augment, Op) else tuple(augment) if isinstance(augment, (list, tuple)) else None
    if ops is None or not all(isinstance(op, Op) for op in ops):
        bad = augment if ops is None else next(op for op in ops if not isinstance(op, Op))
        raise TypeError(f"expected augment to be a list of memfit.augment ops (e.g. [memfit.augment.Crop(32, "
                        f"padding=4), memfit.augment.Flip()]); found {type(bad).__name__} {bad!r}")
    return ops


def fill_code(ds: CompactDataset, fill: float, op: Op) -> float:
    """The stored code that decodes (before normalisation) to `fill`, the same in every channel, or a ValueError."""
    a, b = ds.codec.affine()                                  # value = code * a + b, float64 per channel
    code = (float(fill) - b) / a
    dtype = ds.codec.stored_dtype
    c = float(code[0])
    exact = bool((code == c).all()) and bool(torch.equal(torch.tensor(c, dtype=torch.float64).to(dtype).double(),
                                                        torch.tensor(c, dtype=torch.float64)))
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        exact = exact and c == int(c) and info.min <= c <= info.max
    if not exact or not bool((torch.tensor(c, dtype=torch.float64) * a + b == float(fill)).all()):
        raise ValueError(f"{op!r}: fill={fill} is not a value the codec {ds.codec.describe()} stores exactly (the "
                         "ops write into the stored codes); give a fill the data can hold (e.g. an integer in "
                         "0..255 for uint8 images) or store the data with a lossless codec (codec='auto')")
    return int(c) if not dtype.is_floating_point else c


def _writes_fill(op: Op) -> bool:
    return isinstance(op, Cutout) or (isinstance(op, Crop) and op.mode == "zero" and op.padding > 0)


class EpochParams:
    """One epoch's parameters of every sample (of the whole data, by sample id), packed in two tables."""

    def __init__(self, params: list[dict[str, torch.Tensor]], device: torch.device):
        self.columns: list[dict[str, tuple[bool, int, torch.dtype]]] = []     # (float table?, column, dtype)
        ints, floats = [], []
        for p in params:
            cols = {}
            for name, t in p.items():
                table = floats if t.is_floating_point() else ints
                cols[name] = (table is floats, len(table), t.dtype)
                table.append(t.float() if t.is_floating_point() else t.int())
            self.columns.append(cols)
        n = len(next(iter(params[0].values()))) if params and params[0] else 0
        self.ints = torch.stack(ints, 1).to(device) if ints else torch.empty(n, 0, dtype=torch.int32, device=device)
        self.floats = torch.stack(floats, 1).to(device) if floats else None

    def take(self, ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """The parameters of samples `ids` (whole-data ids, on the tables' device), per op."""
        ints = self.ints.index_select(0, ids)
        floats = None if self.floats is None else self.floats.index_select(0, ids)
        out = []
        for cols in self.columns:
            p = {}
            for name, (is_float, i, dtype) in cols.items():
                col = floats[:, i] if is_float else ints[:, i]
                p[name] = col.bool() if dtype == torch.bool else col
            out.append(p)
        return out


class Augmenter:
    """The ops of one loader, checked against its data, with the buffers they reuse from batch to batch."""

    def __init__(self, ops: tuple[Op, ...], template: CompactDataset):
        if template.fields is not None:
            raise ValueError("augment applies to image batches; this dataset holds several inputs per sample "
                             f"(fields {sorted(template.fields)}); augment them before storing, or drop augment")
        self.ops, self.template = tuple(ops), template
        stages = [op.stage for op in ops]
        if "values" in stages and "codes" in stages[stages.index("values"):]:
            first = stages.index("values")
            later = ops[stages.index("codes", first)]
            raise ValueError(f"{ops[first]!r} mixes decoded values, so it must come after the ops that move or "
                             f"write values on the stored codes; found it before {later!r}: put MixUp last")
        shape = tuple(template.sample_shape)
        layouts = {op.layout for op in ops if hasattr(op, "layout")}
        if len(layouts) > 1:
            raise ValueError(f"the ops name different layouts ({sorted(layouts)}); one dataset has one: give every op "
                             "the same layout ('CHW' channels first, 'HWC' channels last)")
        self.layout = layouts.pop() if layouts else "CHW"
        self.sizes = [spatial_size(shape, self.layout)] if layouts or any(op.stage == "codes" for op in ops) else []
        for op in ops:
            if op.stage == "codes":
                self.sizes.append(op.out_size(self.sizes[-1]))     # raises naming the op when it cannot apply
        self.sample_shape = shape if not self.sizes else with_size(shape, self.layout, self.sizes[-1])
        self._check_targets(template.targets)
        self._check_channels(template)
        self.fills = [fill_code(template, op.fill, op) if _writes_fill(op) else None for op in ops]
        mixing = [op for op in ops if op.mixes]
        self.num_classes = None
        if mixing:
            asked = {op.num_classes for op in mixing} - {None}
            self.num_classes = max(asked) if asked else template.targets.num_classes
            if template.targets.num_classes and self.num_classes < template.targets.num_classes:
                raise ValueError(f"{mixing[0]!r}: num_classes={self.num_classes}, but the data has class ids up "
                                 f"to {template.targets.num_classes - 1}; leave num_classes=None (the data's) or "
                                 "give the true count")
        self.targets = Targets.soft(self.num_classes) if mixing else template.targets
        self.workspace = Workspace(reuse=True)
        # a Flip right after a Crop runs inside the crop's gather (the windows of a mirrored copy)
        self._fused = {k + 1 for k in range(len(ops) - 1) if isinstance(ops[k], Crop) and isinstance(ops[k + 1], Flip)}

    def _check_targets(self, targets: Targets | None) -> None:
        kinds = [] if targets is None else list(targets.kind.values()) if isinstance(targets.kind, dict) \
            else [targets.kind]
        moves = next((op for op in self.ops if op.geometric or op.mixes), None)
        if moves is not None and "labels" in kinds:
            raise ValueError(f"{moves!r} moves pixels, but the targets are per-position labels (segmentation "
                             "masks, token labels), which would stay where they were: augment them together "
                             "before storing, or use ops that do not move pixels")
        mixing = next((op for op in self.ops if op.mixes), None)
        if mixing is not None and kinds != ["class"]:
            found = "no targets" if not kinds else f"targets of kind {targets.kind!r}"
            raise ValueError(f"{mixing!r} mixes class ids into soft targets; found {found}; it needs one class id "
                             "per sample (integer y of shape (N,))")
        if mixing is not None and not self.template.dtype.is_floating_point and any(op.stage == "values"
                                                                                     for op in self.ops):
            raise ValueError(f"MixUp mixes decoded values; this data decodes to {self.template.dtype}: decode to "
                             "float (dtype=torch.float32), or use CutMix")

    def _check_channels(self, ds: CompactDataset) -> None:
        """Channels last: the per-channel decode runs along axis 1 (channels first), which a crop would cut."""
        if self.layout != "HWC" or len(ds.sample_shape) != 3:
            return
        a, b = ds.codec.affine()
        parts = [a, b] + ([] if ds.mean is None else [torch.as_tensor(ds.mean), torch.as_tensor(ds.std)])
        if not all(bool((t == t.flatten()[0]).all()) for t in parts):
            raise ValueError("channels-last data (layout='HWC') is decoded per channel along axis 1, its rows "
                             "here, with different scales per row (a per-channel codec or normalisation), which "
                             "the ops would move; store channels first (x.transpose(0, 3, 1, 2)) or without "
                             "per-channel normalisation")

    # ---- per epoch, per batch --------------------------------------------------------------------------
    def draw_each(self, seed: int, epoch: int, n_total: int) -> list[dict[str, torch.Tensor]]:
        """Every sample's parameters for epoch `epoch`, one dict per op, from one generator seeded by (seed, epoch)
        (the ops in order, each drawing for all n_total samples)."""
        g = torch.Generator().manual_seed(epoch_seed(seed, epoch) ^ _SALT)
        sizes = iter(self.sizes)
        size = next(sizes, (0, 0))
        params = []
        for op in self.ops:
            params.append(op.draw(n_total, size, g))
            if op.stage == "codes":
                size = next(sizes)
        return params

    def draw(self, seed: int, epoch: int, n_total: int, device: torch.device | None = None) -> EpochParams:
        """`draw_each`, packed into the tables a loader looks batches up in, on `device` (None: the CPU)."""
        return EpochParams(self.draw_each(seed, epoch, n_total), device or torch.device("cpu"))

    def batch(self, codes: torch.Tensor, y, params: list[dict[str, torch.Tensor]], out=None, work=None):
        """(x, y) of one batch: codes (m, *sample_shape) as the codec unpacks them (written over), stored targets
        decoded -> the augmented, decoded batch."""
        ws = self.workspace
        for k, (op, p) in enumerate(zip(self.ops, params, strict=True)):
            if op.stage != "codes" or k in self._fused:
                continue
            kw = {"flips": params[k + 1]["flip"]} if k + 1 in self._fused else {}     # crop and flip: one gather
            codes, y = op.apply(codes, y, p, fill=self.fills[k], num_classes=self.num_classes, workspace=ws, key=k,
                                owned=True, **kw)
        x = self.template.decode_codes(codes, out=out, work=work)
        for op, p in zip(self.ops, params, strict=True):
            if op.stage == "values":
                x, y = op.apply(x, y, p, num_classes=self.num_classes)
        return x, y

    # ---- bytes -----------------------------------------------------------------------------------------
    def table_nbytes(self, n_total: int) -> int:
        """One epoch's parameter tables: 4 bytes per parameter per sample."""
        probe = self.draw(0, 0, 1)
        width = probe.ints.shape[1] + (0 if probe.floats is None else probe.floats.shape[1])
        return 4 * width * n_total

    def scratch_nbytes(self, m: int) -> int:
        """The most bytes the ops hold for one batch of m samples: the buffers they reuse (the input with its
        columns padded, a crop, the batch and its flipped copy, ...) and what they allocate per batch (a
        rolled copy to mix with, the mixed result), summed over the ops."""
        codes = self.template.codec.stored_dtype.itemsize
        shape = tuple(self.template.sample_shape)
        total = 0
        for k, (op, size_in, size_out) in enumerate(zip(self.ops, self.sizes, self.sizes[1:], strict=False)):
            n_in = m * math.prod(with_size(shape, self.layout, size_in))
            n_out = m * math.prod(with_size(shape, self.layout, size_out))
            if isinstance(op, Crop):
                work = crop_work_numel((m, *canonical_shape(with_size(shape, self.layout, size_in), self.layout)),
                                       int(op.padding), op.mode, k + 1 in self._fused)
                total += codes * (n_out + 1 + (work + 1 if work else 0))
            elif k in self._fused:                                     # Flip: inside the crop before it
                continue
            elif op.geometric:                                         # Flip: out, the batch and its flipped copy
                total += codes * (n_out + 1 + 2 * n_in + 1 + n_in)
            elif op.mixes:                                             # CutMix: a rolled copy and the result
                total += codes * 2 * n_in
            else:                                                      # Cutout: a copy with a spare value
                total += codes * (n_out + 1)
        if any(op.stage == "values" for op in self.ops):              # MixUp: a rolled copy and the result
            total += 2 * m * math.prod(self.sample_shape) * self.template.dtype.itemsize
        return total

    def batch_nbytes(self, m: int) -> int:
        """One augmented, decoded batch of m samples, its targets included."""
        return decoded_batch_nbytes(m, self.sample_shape, self.template.dtype,
                                    0 if self.targets is None else self.targets.decoded_nbytes)

    def describe(self) -> str:
        ops = ", ".join(map(repr, self.ops))
        where = "on the stored codes before the decode" if all(op.stage == "codes" for op in self.ops) else \
            "on the stored codes before the decode, MixUp on the decoded values"
        shape = "" if self.sample_shape == tuple(self.template.sample_shape) else \
            f"; samples {tuple(self.template.sample_shape)} -> {self.sample_shape}"
        soft = f"; targets: {self.targets.describe()}" if self.num_classes else ""
        return (f"augment: {ops} ({where}; each sample's parameters drawn per epoch from (seed, epoch), the same "
                f"under every strategy, batch size and rank layout{shape}){soft}")



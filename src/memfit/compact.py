"""CompactDataset: a dataset held compactly on the device, decoded per batch just before use.

Compact storage: 8-bit pixels take a quarter of the bytes of float32, so four times more data fits on a
small GPU. The stored rows stay compact; `batch(indices)` gathers them with one indexing op on
the device and decodes them (convert + one per-channel multiply-add that also normalises).

Example:
    >>> import numpy as np, torch
    >>> x = np.random.default_rng(0).integers(0, 256, (100, 1, 8, 8), dtype=np.uint8)
    >>> y = np.arange(100) % 10
    >>> ds = CompactDataset.from_arrays(x, y, normalize=([127.5], [64.0]), device="cpu")
    >>> ds.codec.name, ds.nbytes < ds.dense_nbytes / 3
    ('uint8', True)
    >>> xb, yb = ds.batch(torch.tensor([3, 1, 4]))
    >>> xb.shape, xb.dtype, yb.dtype
    (torch.Size([3, 1, 8, 8]), torch.float32, torch.int64)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memfit.budget import format_bytes
from memfit.codecs import Codec
from memfit.device.machine import resolve_device
from memfit.encoding import (  # noqa: F401  (their public home was here)
    Encoding,
    as_words,
    check_encoding,
    check_integer_output,
    decoded_batch_nbytes,
    encode_arrays,
    prepare_encoding,
    stored_row_nbytes,
)
from memfit.fields import Field, unpack
from memfit.samples import SampleList, Samples
from memfit.targets import IGNORE_INDEX, Targets

__all__ = ["CompactDataset", "Encoding", "SampleList", "Samples", "ShardInfo", "as_words", "check_encoding",
           "check_integer_output", "decoded_batch_nbytes", "prepare_encoding", "run_affine", "stored_row_nbytes"]


def run_affine(steps: list[tuple[torch.Tensor, float, torch.Tensor]]) -> None:
    """x = shift + scale * x in place, each step one fused pass over its view (`CompactDataset.affine_steps`)."""
    for shift, scale, view in steps:
        torch.add(shift, view, alpha=scale, out=view)


@dataclass(frozen=True)
class ShardInfo:
    """Which part of a whole dataset a shard holds: `indices` are positions in the whole (CPU); `checksums`
    the whole's (`memfit.rank_data.whole_checksums`), so that ranks holding shards can check one whole."""
    rank: int
    world_size: int
    mode: str
    n_total: int
    indices: torch.Tensor
    checksums: tuple[int, int] = (0, 0)


class CompactDataset(torch.utils.data.Dataset):
    """Samples stored compactly on a device, decoded per batch. Build with `from_arrays`.

    Attributes: `x` (stored rows, (N, *stored_shape)), `y` (stored targets (N, ...), or None; a dict of
    targets is packed into uint8 rows), `targets` (how y decodes: kind, codec, dtype; `memfit.targets`),
    `codec`, `sample_shape`, `dtype` (decoded), `device`, `mean`/`std` (per-channel, raw units).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None, codec: Codec, sample_shape: tuple[int, ...],
                 dtype: torch.dtype, mean: torch.Tensor | None = None, std: torch.Tensor | None = None,
                 fields: dict[str, Field] | None = None, targets: Targets | None = None):
        self.x, self.y, self.codec = x, y, codec
        # how the stored targets decode; rows made elsewhere (plain label tensors) decode as they are
        self.targets = targets if targets is not None or y is None else Targets.plain(y)
        self.fields = fields        # several inputs per sample, packed in one byte row (memfit.fields)
        if fields is None:
            self.sample_shape, self.dtype = tuple(sample_shape), dtype
        else:                       # per field: {name: shape}, {name: dtype}
            self.sample_shape = {k: f.template.sample_shape for k, f in fields.items()}
            self.dtype = {k: f.template.dtype for k, f in fields.items()}
        self.mean, self.std = mean, std
        self.shard_info: ShardInfo | None = None     # set by shard(): which part of which whole
        self.num_classes = None if self.targets is None else self.targets.num_classes
        self._x_words = as_words(x)     # the rows as 8-byte words, for gathers (None: as they are)
        self._set_affine()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_arrays(cls, x, y=None, *, codec: str | Codec = "auto", normalize=None, device=None,
                    dtype: torch.dtype | str | None = None, progress: bool | None = None, y_dtype=None,
                    ignore_index: int = IGNORE_INDEX) -> CompactDataset:
        """Encode `x` (N, ...) with `codec` and store it with targets `y` on `device`.

        Args:
            x: numpy array, memmap or tensor of shape (N, C, ...) or (N, D); read in chunks.
            y: optional targets, stored with the lossless auto codec (`memfit.targets`): integer class ids
                (N,) or labels (N, ...) (segmentation masks, token labels; `ignore_index` marks positions
                without one), decoded to int64; float targets of any shape, decoded to float32 (float64
                where float32 cannot hold them); or a dict of these, decoded to a dict.
            codec: 'auto' (lossless: the narrowest exact integer type for integer data, uint8 for 8-bit
                images, fp16/bf16 only where every value is exact, else float32; `memfit.codecs.auto_codec`)
                or a name in `memfit.codecs.CODECS`; a lossy one ('q8', 'q4', 'fp16' on float32 data)
                reports its error bound in `codec.max_abs_error` and `explain()`.
            normalize: None or 'none' (raw values), 'dataset' (per-channel mean/std of x) or
                (mean, std), each one value per channel (axis 1), in the units of x.
            device: where to store; None = the current CUDA device when there is one, else the CPU.
            dtype: decoded dtype: None (int64 for integer data such as token ids; float64 for float64 data
                that float32 cannot hold exactly, as codec='auto' stores it; float32 otherwise), float32,
                float16, bfloat16, float64, or int64/int32 (integer codecs, no normalize). float32 (or half)
                asked for such float64 data stores it as float32, with the rounding bound in `explain()`.
            progress: a progress bar counting encoded samples, for large inputs (over 2**28 values) and
                only on a terminal; False never shows one.
            y_dtype: None (integers: int64, floats: float) or asked for: torch.int64 makes float targets
                class ids (each must be a whole number), torch.float32 stores float64 targets as float32
                (the worst rounding is in `explain()`); a dict per target for a dict of targets.
            ignore_index: the integer label meaning "no label here" (default -100, torch's; 255 for many
                segmentation sets): not counted in `num_classes` nor by the metrics.

        Raises:
            ValueError / TypeError naming what was expected and found; nothing is kept on error.
        """
        return encode_arrays(cls, x, y, codec=codec, normalize=normalize, device=device, dtype=dtype,
                             progress=progress, y_dtype=y_dtype, ignore_index=ignore_index)

    def _set_affine(self) -> None:
        """Fold the codec's dequantisation and the normalisation into one multiply-add per channel."""
        if self.fields is not None:                        # each field decodes with its own
            self._a = self._b = torch.zeros(0, dtype=torch.float64)
            self._ops, self._scale, self._shift = {}, torch.zeros(0), torch.zeros(0)
            return
        a, b = self.codec.affine()                         # value = code * a + b, float64 (C,)
        if self.mean is not None:
            a, b = a / self.std, (b - self.mean) / self.std  # (value - mean) / std
        self._a, self._b = a, b
        self._ops: dict[tuple[torch.device, torch.dtype], tuple] = {}
        scale, shift, _ = self._affine_on(self.device)
        self._scale, self._shift = scale, shift            # (1, C, 1, ..) float32 on the device

    def _affine_on(self, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple:
        """(scale, shift, per-channel ops) on `device` in `dtype`, cached: rows may be decoded where they land."""
        if (device, dtype) not in self._ops:
            a, b = self._a, self._b
            shape = (1, -1) + (1,) * (len(self.sample_shape) - 1)
            scale = a.to(dtype).view(shape).to(device)
            shift = b.to(dtype).view(shape).to(device)
            # One fused pass per channel: add(shift, x, alpha=scale) computes shift + scale * x in a
            # single vectorised kernel (mul_ then add_ is two passes; broadcast addcmul is slower).
            if bool((a == 1).all() and (b == 0).all()):
                ops = []
            elif bool((a == a[0]).all() and (b == b[0]).all()):
                ops = [(None, float(a[0]), shift.flatten()[0])]
            elif len(a) <= 16:
                ops = [(c, float(a[c]), shift.flatten()[c]) for c in range(len(a))]
            else:   # many channels (flat features): two broadcast passes beat hundreds of small ops
                ops = None
            self._ops[device, dtype] = (scale, shift, ops)
        return self._ops[device, dtype]

    # ---- the hot path -------------------------------------------------------------------------
    def decode(self, rows: torch.Tensor, out: torch.Tensor | None = None, work: torch.Tensor | None = None,
               codes: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows (n, *stored_shape) on any device -> samples (n, *sample_shape) in `self.dtype`
        on that device (so compact rows can be copied to a GPU first and decoded there).

        `out` (n, *sample_shape) in `self.dtype` receives the samples instead of a new tensor; `work`,
        float32 of the same shape, is the intermediate for half dtypes; `codes`, uint8, receives what
        the codec unpacks (q4, bits1: see `Codec.unpacked_width`). Loaders pass reused buffers: no
        allocation per batch (fresh batch-sized allocations fragment the host heap). A dataset of
        fields decodes to a dict of new tensors (`out`/`work`/`codes` are not used)."""
        if self.fields is not None:
            return unpack(rows, self.fields)              # {name: (n, *shape)}
        return self.decode_codes(self.codec.unpack(rows, self.sample_shape, out=codes), out=out, work=work)

    def decode_codes(self, codes: torch.Tensor, out: torch.Tensor | None = None,
                     work: torch.Tensor | None = None) -> torch.Tensor:
        """The second half of `decode`: codes as the codec unpacks them, (n, *shape) (a sample's shape, or that
        shape moved or cut along its spatial axes: augmentation runs between the halves) -> values in
        `self.dtype`; never a view of `codes`."""
        if not self.dtype.is_floating_point:          # integer outputs (token ids): exact, no affine
            if out is not None:
                x = out.copy_(codes)
            else:
                x = codes.to(self.dtype)
                if x is codes:
                    x = x.clone()
            return x.add_(self.codec.offset) if self.codec.offset else x
        compute = torch.float64 if self.dtype == torch.float64 else torch.float32
        x = out if self.dtype == compute else work
        if x is None:
            x = codes.to(compute)           # one convert: uint8 reads are 4x cheaper than float32 reads
            if x is codes:                  # float32 codec: never hand out the stored rows themselves
                x = x.clone()
        else:
            x.copy_(codes)                  # the same convert, into the caller's buffer
        steps = self.affine_steps(x)
        if steps is None:
            scale, shift, _ = self._affine_on(x.device, x.dtype)
            x.mul_(scale).add_(shift)
        else:
            run_affine(steps)
        # half types are computed in float32 and rounded once, the most accurate result
        if x.dtype == self.dtype:
            return x
        return x.to(self.dtype) if out is None else out.copy_(x)

    def affine_steps(self, x: torch.Tensor) -> list[tuple[torch.Tensor, float, torch.Tensor]] | None:
        """The decode's multiply-add on x ((n, *shape), converted codes in float32 or float64) as steps (shift,
        scale, a view of x) that `run_affine` runs: one per channel, one for all where the channels agree, none
        for raw values; None where two broadcast passes do it (many channels). A loader makes them once per
        buffer it reuses."""
        _, _, ops = self._affine_on(x.device, x.dtype)
        return None if ops is None else [(b, a, x if c is None else x[:, c]) for c, a, b in ops]

    def rows(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored rows for valid indices on `self.device`: (n, *stored_shape), one gather (into `out`,
        contiguous (n, *stored_shape), when given)."""
        # Rows are moved as 8-byte words when their size allows (`as_words`): 8x fewer elements to copy.
        if out is not None:
            out_words = None if self._x_words is None else as_words(out)
            if out_words is None:
                return torch.index_select(self.x, 0, idx, out=out)
            torch.index_select(self._x_words, 0, idx, out=out_words)
            return out
        if self._x_words is None:
            return self.x.index_select(0, idx)
        words = self._x_words.index_select(0, idx)
        return words.view(self.x.dtype).view(idx.shape[0], *self.x.shape[1:])

    def gather(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoded batch for a LongTensor of valid indices already on `self.device` (no checks)."""
        return self.decode(self.rows(idx)), self.targets_at(idx)

    def targets_at(self, idx: torch.Tensor):
        """Decoded targets of valid indices on `self.device` (a tensor, a dict of them, or None)."""
        return None if self.y is None else self.targets.decode(self.y.index_select(0, idx))

    def index(self, indices: object) -> torch.Tensor:
        """Indices (int list, numpy, tensor, slice, bool mask) -> checked LongTensor on the device."""
        n = len(self)
        if isinstance(indices, slice):
            return torch.arange(*indices.indices(n), device=self.device)
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.asarray(indices))
        if idx.dtype == torch.bool:
            if idx.shape != (n,):
                raise ValueError(f"a boolean mask must have shape ({n},); found {tuple(idx.shape)}")
            idx = idx.nonzero().squeeze(1)
        if idx.is_floating_point() or idx.is_complex():
            raise TypeError(f"indices must be integers; found dtype {idx.dtype}")
        idx = idx.reshape(-1).long()
        if idx.device.type == "cpu" and idx.numel():   # device tensors are trusted: checking would sync
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -n or hi >= n:
                raise IndexError(f"index {hi if hi >= n else lo} is out of range for a dataset of {n} samples")
            if lo < 0:
                idx = torch.where(idx < 0, idx + n, idx)
        return idx.to(self.device, non_blocking=True)

    def batch(self, indices: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoded `(x, y)` for the given indices: one gather on the device, then decode.

        `x` is (n, *sample_shape) in `self.dtype`; `y` the decoded targets (int64 class ids (n,) or labels
        (n, ...), float targets, a dict of them), or None without targets.
        """
        return self.gather(self.index(indices))

    # ---- torch Dataset protocol ---------------------------------------------------------------
    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i):
        """`ds[i]` is one sample `(x, y)` (x alone without labels); `ds[indices]` a decoded batch `(x, y)`."""
        if isinstance(i, (int, np.integer)):
            return Samples(*self.batch([int(i)]))[0]
        return self.batch(i)

    def __getitems__(self, indices: Sequence[int]) -> Samples:
        """Called by torch's DataLoader with a whole batch of indices: one gather + decode for the batch.

        The result is a sequence of per-sample `(x, y)` views of that batch, so DataLoader's default
        `collate_fn` stacks it as it would any dataset's samples; `collate_fn=CompactDataset.collate`
        takes the batch as it is (no views, no stack: the fastest).
        """
        x, y = self.batch(indices)
        if y is None and not isinstance(x, dict):
            return SampleList(x)     # default collate stacks tensor samples with torch.stack: needs a list
        return Samples(x, y)

    @staticmethod
    def collate(batch):
        """`collate_fn` for DataLoader: the `(x, y)` batch that `__getitems__` gathered, unchanged."""
        if isinstance(batch, SampleList):
            return batch.x
        if isinstance(batch, Samples):
            return batch.x, batch.y
        return torch.utils.data.default_collate(batch)

    # ---- memory -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def nbytes(self) -> int:
        """Bytes held: stored rows, targets and the per-channel decode parameters."""
        return (self.x.nbytes + (0 if self.y is None else self.y.nbytes)
                + self._scale.nbytes + self._shift.nbytes)

    @property
    def dense_nbytes(self) -> int:
        """What the same data takes as plain tensors: float32 samples (int64 for integer data), int64 labels,
        float32 (float64 where needed) float targets."""
        labels = 0 if self.y is None else self.targets.dense_nbytes * len(self)
        if self.fields is not None:
            return sum(len(self) * f.template.dense_nbytes_per_sample for f in self.fields.values()) + labels
        return len(self) * self.dense_nbytes_per_sample + labels

    @property
    def dense_nbytes_per_sample(self) -> int:
        """Bytes of one sample as a plain tensor (float32, float64 for float64 batches, or int64 for integer
        data), no target."""
        return (max(4, self.dtype.itemsize) if self.dtype.is_floating_point else 8) * math.prod(self.sample_shape)

    @property
    def row_nbytes(self) -> int:
        """Stored bytes of one sample (its targets included)."""
        return stored_row_nbytes(self.x.shape[1:], self.x.dtype, 0 if self.y is None else self.targets.stored_nbytes)

    def batch_nbytes(self, n: int) -> int:
        """Bytes of one decoded batch of n samples (x in `dtype`, targets decoded)."""
        return decoded_batch_nbytes(n, self.sample_shape, self.dtype,
                                    0 if self.targets is None else self.targets.decoded_nbytes)

    def _replace(self, x: torch.Tensor, y: torch.Tensor | None) -> CompactDataset:
        out = type(self)(x, y, self.codec, self.sample_shape, self.dtype, self.mean, self.std, self.fields,
                         self.targets)
        out.num_classes = self.num_classes           # a part keeps the whole's class count
        out.shard_info = self.shard_info
        return out

    def to(self, device, non_blocking: bool = False) -> CompactDataset:
        """The same dataset held on another device (a new object; this one is unchanged)."""
        dev = resolve_device(device)
        if dev == self.device:
            return self
        move = lambda t: None if t is None else t.to(dev, non_blocking=non_blocking)
        return self._replace(move(self.x), move(self.y))

    def pin_memory(self) -> CompactDataset:
        """A copy in pinned (page-locked) host memory, for asynchronous copies to a CUDA device."""
        if self.device.type != "cpu":
            raise ValueError(f"pin_memory needs a dataset on the CPU; this one is on {self.device}; "
                             "call .to('cpu') first")
        if not torch.cuda.is_available():
            raise ValueError("pinned memory needs CUDA, and this machine or torch build has none")
        pin = lambda t: None if t is None else t.pin_memory()
        return self._replace(pin(self.x), pin(self.y))

    @property
    def is_pinned(self) -> bool:
        return self.device.type == "cpu" and torch.cuda.is_available() and self.x.is_pinned()

    def subset(self, indices: object) -> CompactDataset:
        """A new dataset holding only the given samples (compact rows copied, no decode)."""
        idx = self.index(indices)
        return self._replace(self.rows(idx), None if self.y is None else self.y.index_select(0, idx))

    def shard(self, rank: int | None = None, world_size: int | None = None, *,
              mode: str = "contiguous") -> CompactDataset:
        """Only this rank's part of the data (a copy; `nbytes` shrinks to about 1/world_size). It keeps the
        whole's checksums (`shard_info.checksums`): `evaluate` and `loader` with distributed=True check that every
        rank's shard comes from the same whole.

        `rank`/`world_size` default to the initialised process group. `mode` 'contiguous' keeps a
        balanced block of consecutive samples, 'strided' every world_size-th sample.

        Example:
            >>> import numpy as np
            >>> ds = CompactDataset.from_arrays(np.zeros((10, 4), np.uint8), np.arange(10), device="cpu")
            >>> part = ds.shard(1, 3)
            >>> len(part), part.shard_info.indices.tolist()
            (3, [4, 5, 6])
        """
        from memfit.distributed import rank_world, shard_indices
        if self.shard_info is not None:
            raise ValueError(f"this dataset is already shard {self.shard_info.rank} of "
                             f"{self.shard_info.world_size}; shard the whole dataset instead")
        from memfit.rank_data import whole_checksums
        r, w = rank_world(rank, world_size)
        idx = shard_indices(len(self), r, w, mode)
        part = self.subset(idx.to(self.device))
        # the whole's checksums, taken now (one read of its stored bytes): ranks holding shards compare them
        part.shard_info = ShardInfo(r, w, mode, len(self), idx, whole_checksums(self))
        return part

    def explain(self) -> str:
        """How the samples are stored and decoded, with the codec's error bound when it is lossy."""
        targets = "" if self.targets is None else f"; targets: {self.targets.describe()}"
        if self.fields is not None:
            parts = "; ".join(f"{k}: {f.template.explain_sample()}" for k, f in self.fields.items())
            return (f"{len(self)} samples of {len(self.fields)} fields packed in {self.x.shape[1]}-byte rows, "
                    f"{format_bytes(self.nbytes)} ({self.nbytes / self.dense_nbytes:.3f}x plain tensors); "
                    f"{parts}{targets}")
        if not len(self):              # a file source's template: the rows stay on disk
            return f"samples of {self.explain_sample()}{targets}"
        return (f"{len(self)} samples of {self.explain_sample()}, {format_bytes(self.nbytes)} "
                f"({self.nbytes / self.dense_nbytes:.3f}x plain tensors){targets}")

    def explain_sample(self) -> str:
        norm = "" if self.mean is None else ", normalised per channel"
        return (f"shape {self.sample_shape} stored as {self.codec.describe()}, decoded to "
                f"{str(self.dtype).replace('torch.', '')}{norm}")

    def __repr__(self) -> str:
        codec = self.codec.name if self.codec.lossless or not self.codec.max_abs_error else self.codec.describe()
        dtype = str(self.dtype).replace("torch.", "")
        if self.fields is not None:
            codec = {k: f.template.codec.name for k, f in self.fields.items()}
            dtype = "{" + ", ".join(f"{k!r}: {str(d).replace('torch.', '')}" for k, d in self.dtype.items()) + "}"
        return (f"CompactDataset(n={len(self)}, sample_shape={self.sample_shape}, codec={codec!r}, "
                f"dtype={dtype}, device={self.device}, "
                f"nbytes={format_bytes(self.nbytes)} ({self.nbytes / self.dense_nbytes:.3f}x float32))")

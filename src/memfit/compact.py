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

from memfit.arrays import (
    as_array,
    iter_chunks,
    no_normalisation,
    normalisation,
    resolve_dtype,
    to_tensor,
)
from memfit.budget import format_bytes, resolve_device
from memfit.codecs import Codec, Float32Codec, QuantCodec, auto_codec, make_codec
from memfit.fields import Field, PackedCodec, check_fields, pack, unpack
from memfit.progress import progress_bar
from memfit.targets import IGNORE_INDEX, Targets, check_count, encode_targets

__all__ = ["CompactDataset", "Encoding", "SampleList", "Samples", "ShardInfo", "as_words", "check_encoding",
           "check_integer_output", "decoded_batch_nbytes", "prepare_encoding", "stored_row_nbytes"]


def as_words(t: torch.Tensor) -> torch.Tensor | None:
    """Rows of `t` (N, ...) as int64 words (N, row_bytes / 8), a view, when their layout allows it; else None.

    An index_select over words moves 8x fewer elements than over bytes (a 784-byte MNIST row is 98
    words). Needs contiguous rows of a whole number of words, in a dtype narrower than a word.
    """
    if t.dim() < 1 or not t.is_contiguous() or t.element_size() >= 8 or t.shape[0] == 0:
        return None
    row = t[:1].nbytes
    return t.view(t.shape[0], -1).view(torch.int64) if row % 8 == 0 and row > 0 else None


def stored_row_nbytes(stored_shape: tuple[int, ...], stored_dtype: torch.dtype, target_nbytes: int) -> int:
    """Stored bytes of one sample: its compact row plus its stored targets (`target_nbytes`, 0: none)."""
    return math.prod(stored_shape) * stored_dtype.itemsize + target_nbytes


def decoded_batch_nbytes(n: int, sample_shape, dtype, target_nbytes: int) -> int:
    """Bytes of n decoded samples: x in `dtype` (per field for a dataset of fields: `sample_shape` and
    `dtype` are then {name: ...}) plus `target_nbytes` of decoded targets per sample (0: none)."""
    if isinstance(sample_shape, dict):
        x = sum(n * dtype[k].itemsize * math.prod(shape) for k, shape in sample_shape.items())
    else:
        x = n * dtype.itemsize * math.prod(sample_shape)
    return x + n * target_nbytes


def check_integer_output(codec: Codec, dtype: torch.dtype, normalize: object) -> None:
    """Integer outputs (token ids) come only from integer codecs, unnormalised: they must be exact."""
    if codec.offset is None:
        raise ValueError(f"dtype {dtype} needs integer data and an integer codec (codec='auto'); found codec "
                         f"{codec.name!r}; use a float dtype (e.g. dtype=torch.float32) for float data")
    if not no_normalisation(normalize):
        raise ValueError(f"normalize applies to float outputs; dtype {dtype} yields the integers themselves "
                         "(token ids): pass normalize=None, or a float dtype to normalise")


@dataclass
class Encoding:
    """How arrays become a CompactDataset, decided once from the whole of x: the one set-up shared by
    `CompactDataset.from_arrays` (in memory) and the loaders' file source (memory-mapped), so both store
    the same codes and decode them to the same values.

    `codec` is fitted (q8/q4 know every channel's range); `y` are the stored targets on the CPU
    (`memfit.targets`), `targets` how they decode; `mean`/`std` are float64 (C,) in the units of x, or None."""
    x: np.ndarray | torch.Tensor
    codec: Codec
    dtype: torch.dtype
    sample_shape: tuple[int, ...]
    y: torch.Tensor | None
    targets: Targets | None
    mean: torch.Tensor | None
    std: torch.Tensor | None
    auto: bool                     # the codec was chosen by `auto_codec` (exact for every value of x)


def prepare_encoding(x: np.ndarray | torch.Tensor, y: object, codec: str | Codec, normalize: object,
                     dtype: torch.dtype | str | None, chunk_rows: int | None = None, y_dtype=None,
                     ignore_index: int = IGNORE_INDEX) -> Encoding:
    """Check x (N, ...), choose and fit the codec, resolve the output dtype, encode the targets and
    resolve the normalisation; reads x in chunks of `chunk_rows` rows (default about `CHUNK_BYTES`).

    Raises:
        ValueError / TypeError naming what was expected and found.
    """
    if x.ndim < 2:
        raise ValueError(f"expected x of shape (N, C, ...) or (N, D) with one row per sample; found shape "
                         f"{tuple(x.shape)} (a single sample? add a batch axis: x[None]; a 1-D array of "
                         "scalars: x.reshape(-1, 1))")
    if x.shape[0] == 0:
        raise ValueError("x has no samples (shape[0] == 0); pass at least one sample")
    auto = isinstance(codec, str) and codec == "auto"
    codec = auto_codec(x) if auto else make_codec(codec)
    if auto and codec.name == "float64":
        # float64 data that float32 cannot hold: decoded as float64 by default (lossless, as stored); float32
        # (or half) batches asked for are stored as float32, its worst rounding measured while encoding
        if dtype is None:
            dtype = torch.float64
        elif resolve_dtype(dtype).is_floating_point and resolve_dtype(dtype) != torch.float64:
            codec = Float32Codec()
    dtype = resolve_dtype(dtype, x)
    if not dtype.is_floating_point:
        check_integer_output(codec, dtype, normalize)
    y_rows, targets = (None, None) if y is None else encode_targets(y, x.shape[0], y_dtype=y_dtype,
                                                                    ignore_index=ignore_index)
    stats = normalisation(normalize, x)                 # one streaming pass for normalize='dataset'
    if isinstance(codec, QuantCodec):                   # q8/q4 need the range of all the data first
        for _, chunk in iter_chunks(x, chunk_rows):
            codec.fit(chunk)
    else:                                               # fixed codecs only learn the channel count
        codec.fit(to_tensor(x[:1]))
    mean, std = stats if stats is not None else (None, None)
    return Encoding(x, codec, dtype, tuple(x.shape[1:]), y_rows, targets, mean, std, auto)


def check_encoding(enc: Encoding, chunk_rows: int | None = None) -> None:
    """Encode all of x once and drop the codes: every value is checked (a value the codec cannot hold
    raises here, not in the middle of a run) and a lossy codec's error bound covers all of x (so
    `explain()` reports it before any batch is read). `from_arrays` does this while it stores x.

    Skipped where no value can fail: a codec `auto_codec` chose as exact for x (it read every value),
    except float64, which it also picks for float64 data holding NaN or infinity."""
    if enc.auto and enc.codec.lossless and enc.codec.name != "float64":
        return
    for _, chunk in iter_chunks(enc.x, chunk_rows):
        enc.codec.encode(chunk)


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


class Samples(Sequence):
    """A decoded batch seen as a sequence of samples: `[i]` is `(x[i], y[i])` (views; x alone without
    targets, a dict of views for a dataset of fields or a dict of targets). `x`, `y` hold the whole batch."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        first = next(iter(self.x.values())) if isinstance(self.x, dict) else self.x
        return first.shape[0]

    def __getitem__(self, i):
        if not isinstance(i, (int, np.integer)):
            raise TypeError(f"samples are indexed by an int; found {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} is out of range for a batch of {len(self)}")
        x = {k: v[i] for k, v in self.x.items()} if isinstance(self.x, dict) else self.x[i]
        if self.y is None:
            return x
        return x, ({k: v[i] for k, v in self.y.items()} if isinstance(self.y, dict) else self.y[i])


class SampleList(list):
    """An unlabelled batch as a list of per-sample views (what torch.stack takes); `x` is the batch."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__(x.unbind(0))
        self.x = x


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
            device: where to store; None = first CUDA device when there is one, else the CPU.
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
        if isinstance(x, dict):
            return cls._from_fields(x, y, codec=codec, normalize=normalize, device=device, dtype=dtype,
                                    progress=progress, y_dtype=y_dtype, ignore_index=ignore_index)
        dev = resolve_device(device)
        x = as_array(x, "x")
        if y is not None and x.ndim >= 1:
            check_count(y, x.shape[0])
        prep = prepare_encoding(x, y, codec, normalize, dtype, y_dtype=y_dtype, ignore_index=ignore_index)
        x, codec, sample_shape = prep.x, prep.codec, prep.sample_shape
        n = x.shape[0]
        stored = torch.empty((n, *codec.stored_shape(sample_shape)), dtype=codec.stored_dtype, device=dev)
        bar = progress_bar(n, "encoding", unit="sample",
                           enabled=progress if n * math.prod(sample_shape) > 2**28 else False)
        for start, chunk in iter_chunks(x):             # pass 2: encode (checks every value)
            enc = codec.encode(chunk)
            stored[start:start + enc.shape[0]].copy_(enc)
            bar.update(enc.shape[0])
        bar.close()
        y_rows = None if prep.y is None else prep.y.to(dev)
        return cls(stored, y_rows, codec, sample_shape, prep.dtype, prep.mean, prep.std, targets=prep.targets)

    @classmethod
    def _from_fields(cls, x: dict, y, *, codec, normalize, device, dtype, progress, y_dtype,
                     ignore_index) -> CompactDataset:
        """Each field encoded on its own, then packed into one byte row per sample (memfit.fields)."""
        n = check_fields(x)
        per = lambda arg, name: arg.get(name, "auto" if arg is codec else None) if isinstance(arg, dict) else arg
        for arg, what in ((codec, "codec"), (normalize, "normalize"), (dtype, "dtype")):
            if isinstance(arg, dict) and set(arg) - set(x):
                raise ValueError(f"{what} names fields {sorted(set(arg) - set(x))} that x does not have; "
                                 f"x has {sorted(x)}")
        parts = {}
        for name, arr in x.items():
            try:
                parts[name] = cls.from_arrays(arr, None, codec=per(codec, name), normalize=per(normalize, name),
                                              device="cpu", dtype=per(dtype, name), progress=progress)
            except (ValueError, TypeError) as e:
                raise type(e)(f"field {name!r}: {e}") from None
        rows, fields = pack(parts, resolve_device(device))
        if y is not None:
            check_count(y, n)
        y_rows, targets = (None, None) if y is None else encode_targets(y, n, y_dtype=y_dtype,
                                                                        ignore_index=ignore_index)
        packed = PackedCodec({k: p.codec for k, p in parts.items()})
        return cls(rows, None if y_rows is None else y_rows.to(rows.device), packed, tuple(rows.shape[1:]),
                   torch.uint8, fields=fields, targets=targets)

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
        codes = self.codec.unpack(rows, self.sample_shape, out=codes)
        if not self.dtype.is_floating_point:          # integer outputs (token ids): exact, no affine
            if out is not None:
                x = out.copy_(codes)
            else:
                x = codes.to(self.dtype)
                if x is rows:
                    x = x.clone()
            return x.add_(self.codec.offset) if self.codec.offset else x
        compute = torch.float64 if self.dtype == torch.float64 else torch.float32
        x = out if self.dtype == compute else work
        if x is None:
            x = codes.to(compute)           # one convert: uint8 reads are 4x cheaper than float32 reads
            if x is rows:                   # float32 codec: never hand out the stored rows themselves
                x = x.clone()
        else:
            x.copy_(codes)                  # the same convert, into the caller's buffer
        scale, shift, ops = self._affine_on(rows.device, x.dtype)
        if ops is None:
            x.mul_(scale).add_(shift)
        else:
            for c, a, b in ops:
                xc = x if c is None else x[:, c]
                torch.add(b, xc, alpha=a, out=xc)
        # half types are computed in float32 and rounded once, the most accurate result
        if x.dtype == self.dtype:
            return x
        return x.to(self.dtype) if out is None else out.copy_(x)

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

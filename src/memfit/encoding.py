"""How arrays become a CompactDataset: the encoding decided once from the whole of x (`Encoding`,
`prepare_encoding`, `check_encoding`), the encode itself (`encode_arrays`, `encode_fields`, behind
`CompactDataset.from_arrays`) and the byte counts of stored rows and decoded batches.

Example:
    >>> import numpy as np
    >>> enc = prepare_encoding(np.zeros((10, 3, 4, 4), np.uint8), None, "auto", None, None)
    >>> enc.codec.name, enc.sample_shape, enc.dtype
    ('uint8', (3, 4, 4), torch.float32)
"""

from __future__ import annotations

import math
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
from memfit.codecs import Codec, Float32Codec, QuantCodec, auto_codec, make_codec
from memfit.device.machine import resolve_device
from memfit.fields import PackedCodec, check_fields, pack
from memfit.progress import progress_bar
from memfit.targets import IGNORE_INDEX, Targets, check_count, encode_targets

__all__ = ["Encoding", "as_words", "check_encoding", "check_integer_output", "decoded_batch_nbytes", "encode_arrays",
           "encode_fields", "prepare_encoding", "stored_row_nbytes"]


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


def encode_arrays(cls, x, y, *, codec, normalize, device, dtype, progress, y_dtype, ignore_index):
    """`cls.from_arrays` (a CompactDataset class): x checked, the encoding prepared, every row encoded in chunks
    into storage on `device` (the arguments as there)."""
    if isinstance(x, dict):
        return encode_fields(cls, x, y, codec=codec, normalize=normalize, device=device, dtype=dtype,
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


def encode_fields(cls, x: dict, y, *, codec, normalize, device, dtype, progress, y_dtype, ignore_index):
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

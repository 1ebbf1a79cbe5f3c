"""Several inputs per sample (`input_ids` + `attention_mask`, an image + metadata) in one CompactDataset.

Each field is encoded on its own (its own codec, sample shape, decoded dtype, normalisation), then
the fields' stored bytes are packed side by side into ONE uint8 row per sample, each field at an
offset aligned to its stored element size and the row padded to a multiple of 8 bytes. A batch is
then still one gather of whole rows (as 8-byte words), on any strategy of the loaders (resident,
stream, macro move rows without knowing what is in them); decoding views each field's bytes in its
stored dtype (no copy) and decodes it, giving a dict batch that a `transformers` model takes as
`model(**batch)`.

Example:
    >>> import numpy as np, torch
    >>> from memfit.compact import CompactDataset
    >>> ids = np.array([[101, 2023, 102], [101, 7592, 102]])           # (N=2, L=3) token ids
    >>> ds = CompactDataset.from_arrays({"input_ids": ids, "attention_mask": np.ones_like(ids)}, [0, 1],
    ...                                 device="cpu")
    >>> xb, yb = ds.batch([1, 0])
    >>> xb["input_ids"].dtype, xb["input_ids"].tolist(), ds.x.shape     # int16 + uint8 stored in 16-byte rows
    (torch.int64, [[101, 7592, 102], [101, 2023, 102]], torch.Size([2, 16]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memfit.codecs import Codec

__all__ = ["Field", "PackedCodec", "check_fields", "field_offsets", "pack", "unpack"]


@dataclass(frozen=True)
class Field:
    """Where one input lives in the packed row: bytes [offset, offset + nbytes), decoded by `template`
    (a CompactDataset with no rows: its codec, sample_shape, dtype and mean/std are the field's)."""
    template: object
    offset: int
    nbytes: int


class PackedCodec(Codec):
    """The codec of a packed dataset: rows of bytes; each field's own codec says how it is stored."""
    name = "fields"

    def __init__(self, codecs: dict[str, Codec]) -> None:
        super().__init__()
        self.codecs = codecs
        self.lossless = all(c.lossless or c.max_abs_error == 0 for c in codecs.values())
        self.max_abs_error = max(c.max_abs_error for c in codecs.values())

    def describe(self) -> str:
        return "fields: " + ", ".join(f"{k} {c.describe()}" for k, c in self.codecs.items())


def field_offsets(parts: dict[str, object]) -> tuple[dict[str, tuple[int, int]], int]:
    """{name: (offset, nbytes)} of each field's stored row, aligned to its element size, and the
    row size rounded up to 8 bytes (so rows move as int64 words and every view is aligned)."""
    out, offset = {}, 0
    for name, part in parts.items():
        item = part.x.element_size()
        offset = -(-offset // item) * item
        nbytes = math.prod(part.x.shape[1:]) * item
        out[name] = (offset, nbytes)
        offset += nbytes
    return out, max(8, -(-offset // 8) * 8)


def pack(parts: dict[str, object], device: torch.device) -> tuple[torch.Tensor, dict[str, Field]]:
    """(packed rows (N, row_bytes) uint8 on `device`, {name: Field}) from per-field CompactDatasets."""
    where, row = field_offsets(parts)
    n = len(next(iter(parts.values())))
    x = torch.zeros((n, row), dtype=torch.uint8, device=device)
    fields = {}
    for name, part in parts.items():
        off, nb = where[name]
        x[:, off:off + nb].copy_(part.x.reshape(n, -1).view(torch.uint8))    # the field's bytes, as stored
        template = type(part)(part.x[:0].cpu(), None, part.codec, part.sample_shape, part.dtype, part.mean, part.std)
        fields[name] = Field(template, off, nb)
    return x, fields


def unpack(rows: torch.Tensor, fields: dict[str, Field]) -> dict[str, torch.Tensor]:
    """Packed rows (n, row_bytes) -> {name: decoded field (n, *sample_shape)} on the rows' device."""
    n, out = rows.shape[0], {}
    for name, f in fields.items():
        t = f.template
        stored = rows[:, f.offset:f.offset + f.nbytes].view(t.x.dtype).view(n, *t.x.shape[1:])
        out[name] = t.decode(stored)
    return out


def check_fields(x: dict) -> int:
    """The common sample count of a dict of arrays; raise naming the field that differs."""
    if not x:
        raise ValueError("x is an empty dict; give at least one field, e.g. {'input_ids': ids}")
    counts = {}
    for name, arr in x.items():
        if not isinstance(name, str):
            raise TypeError(f"field names must be strings (they become keyword arguments); found {name!r}")
        if not hasattr(arr, "shape") and not isinstance(arr, (list, tuple)):
            raise TypeError(f"field {name!r}: expected a numpy array or tensor; found {type(arr).__name__}")
        counts[name] = len(arr)
    n = next(iter(counts.values()))
    bad = {k: v for k, v in counts.items() if v != n}
    if bad:
        raise ValueError(f"every field needs one row per sample; found sample counts {counts}")
    return n

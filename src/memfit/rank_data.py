"""The data each rank holds, and the check that the ranks hold what they must.

What a rank holds (`data_identity`) is one of four kinds: one whole set (each rank then takes its shard),
this rank's shard of a whole set (`CompactDataset.shard()`), its own part split beforehand (sharded=True), or
batches of its own (an iterable, nothing to compare). Ranks must agree on:

- the layout, for every kind but batches: everything that decides how a stored row decodes (stored row shape
  and dtype, codec and its fitted scale and shift, normalisation, decoded shape and dtype) and how targets
  decode (kind, codec, dtype, ignore index). Parts encoded on their own ranks differ here when, say, q8 was
  fitted to each part's range or 'auto' chose uint8 on one and int16 on another.
- the content, for a whole set or the shards of one: a checksum of every stored byte of x and of y
  (`content_checksum`, crc32 over 16 MiB chunks; a shard carries its whole's, taken when it was cut), so sets
  of one size that differ anywhere, rows in another order included, are told apart.

Example:
    >>> import numpy as np
    >>> from memfit.compact import CompactDataset
    >>> ds = CompactDataset.from_arrays(np.arange(40, dtype=np.uint8).reshape(10, 4), device="cpu")
    >>> data_identity(ds, False)[:2], data_identity(ds.subset(range(5)), True)[:2]
    ((0, 10), (2, 5))
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "KIND_NAMES", "check_same_data", "content_checksum", "data_identity", "gathered_layouts",
           "layout_hash", "layout_of", "whole_checksums"]

# What a rank holds
WHOLE, SHARD, PART, BATCHES = 0, 1, 2, 3
KIND_NAMES = {WHOLE: "the whole set", SHARD: "its shard of a whole set", PART: "its own part (sharded=True)",
              BATCHES: "its own batches (an iterable)"}
CHUNK_BYTES = 1 << 24       # checksummed per 16 MiB: a device's rows come to the host a chunk at a time

_MASK = (1 << 63) - 1       # values shared in an agreement are int64


def content_checksum(data: torch.Tensor | np.ndarray | None, crc: int = 0) -> int:
    """crc32 of every byte of `data` (a tensor on any device, or a numpy array or memmap), with its shape,
    read in chunks of `CHUNK_BYTES` (a device tensor is copied to the host one chunk at a time). None: `crc`."""
    if data is None:
        return crc
    crc = zlib.crc32(repr((tuple(data.shape), str(data.dtype).replace("torch.", ""))).encode(), crc)
    if isinstance(data, torch.Tensor):
        flat = data.detach().contiguous().reshape(-1)
        flat = (flat.to(torch.uint8) if flat.dtype == torch.bool else flat).view(torch.uint8)
        for s in range(0, flat.numel(), CHUNK_BYTES):
            crc = zlib.crc32(flat[s:s + CHUNK_BYTES].cpu().numpy(), crc)
        return crc
    rows = max(1, CHUNK_BYTES // max(1, data[:1].nbytes))
    for s in range(0, data.shape[0] if data.ndim else 1, rows):
        crc = zlib.crc32(np.ascontiguousarray(data[s:s + rows] if data.ndim else data), crc)
    return crc


def whole_checksums(ds) -> tuple[int, int]:
    """(checksum of the stored rows x, of the stored targets y) of a whole CompactDataset, as int64 values."""
    return content_checksum(ds.x) & _MASK, content_checksum(ds.y) & _MASK


def _affine_crc(ds) -> str:
    """The decode's per-channel scale and shift (codec and normalisation folded: `CompactDataset._a/_b`), per
    field for a dataset of fields, as a crc32 in hex."""
    parts = [ds] if ds.fields is None else [f.template for f in ds.fields.values()]
    crc = 0
    for p in parts:
        for t in (getattr(p, "_a", None), getattr(p, "_b", None), p.mean, p.std):
            crc = content_checksum(None if t is None else t.to(torch.float64), crc)
    return f"{crc:08x}"


def layout_of(ds) -> dict[str, str]:
    """What decides how a CompactDataset's rows and targets decode, by name (what `check_same_data` names
    when ranks differ)."""
    return {"stored rows": f"{tuple(ds.x.shape[1:])} {str(ds.x.dtype).replace('torch.', '')}",
            "codec": ds.codec.describe(),
            "decoded samples": f"{ds.sample_shape} {ds.dtype}".replace("torch.", ""),
            "decode scale and shift (codec fit, normalisation)": _affine_crc(ds),
            "targets": "none" if ds.targets is None else ds.targets.describe()}


def layout_hash(ds) -> int:
    return zlib.crc32(json.dumps(layout_of(ds), sort_keys=True).encode())


def data_identity(data: object, sharded: bool) -> tuple[int, int, int, int, int]:
    """(kind, samples, layout hash, content checksum of x, of y) of what this rank was given, for
    `check_same_data`.

    Samples: the whole set's for a whole set or a shard of one, this rank's own for a part, 0 for batches
    (unknown). Layout: `layout_hash` (0 for batches). Content: the whole set's `whole_checksums` (a shard's
    were taken from its whole by `CompactDataset.shard`); 0 for a part or batches. Cost: one read of the
    stored bytes of a whole set (about 0.13 s for 60,000 x 784 uint8 on a loaded 2-core machine)."""
    if not (hasattr(data, "shard_info") and hasattr(data, "x")):        # batches: nothing to compare
        if getattr(data, "distributed", True) is False and not sharded:   # a memfit Loader over the whole set
            raise ValueError("evaluate(distributed=True) was given a Loader built without distributed=True: every "
                             "rank would count all of its samples. Build it with loader(..., distributed=True) "
                             "(each rank iterates its shard), or pass sharded=True when each rank's loader holds "
                             "only that rank's own part")
        return BATCHES, 0, 0, 0, 0
    layout = layout_hash(data)
    if sharded:
        return PART, len(data), layout, 0, 0
    info = data.shard_info
    if info is not None:
        return SHARD, info.n_total, layout, *info.checksums
    return WHOLE, len(data), layout, *whole_checksums(data)


def gathered_layouts(data) -> Callable[[], list[dict[str, str]]]:
    """For `check_same_data`: every rank's `layout_of` its data ({} for batches), gathered when called."""
    def gather() -> list[dict[str, str]]:
        from memfit.distributed import all_gather_text
        mine = layout_of(data) if hasattr(data, "shard_info") and hasattr(data, "x") else {}
        return [json.loads(t) for t in all_gather_text(json.dumps(mine), "data layouts")]
    return gather


def _how(call: str) -> str:
    return (f"pass every rank the same whole set (the same files, read and encoded alike, rows in the same order; "
            f"each {call}s its shard of it), or, when each rank holds only its own part (split beforehand), pass "
            f"sharded=True: each {call}s all of its part and the result is over the union of the parts")


def check_same_data(ranks: list[tuple[int, ...]], call: str,
                    layouts: Callable[[], list[dict[str, str]]] | None = None) -> None:
    """Raise ValueError (the same one on every rank: it reads every rank's `data_identity`) unless the ranks
    hold one whole set (whole, or shards of it) of one size and content, laid out alike, or each its own part
    laid out alike. `layouts()`, called on every rank only when the layouts differ, gathers every rank's
    `layout_of` (a collective) so that the error says what differs."""
    kinds = [v[0] for v in ranks]
    listed = lambda i: ", ".join(f"rank {r}: {v[i]}" for r, v in enumerate(ranks))    # noqa: E731
    own = {PART, BATCHES}
    if any(k in own for k in kinds) and not all(k in own for k in kinds):
        found = ", ".join(f"rank {r}: {KIND_NAMES[k]}" for r, k in enumerate(kinds))
        raise ValueError(f"{call}(distributed=True): some ranks were given their own part and others a whole set "
                         f"({found}); {_how(call)}")
    laid = [(r, v[2]) for r, v in enumerate(ranks) if v[0] != BATCHES]
    if len({h for _, h in laid}) > 1:
        raise ValueError(f"{call}(distributed=True): the ranks' data are encoded differently, so a sample would "
                         f"decode differently on each ({_layout_difference(laid, layouts)}); every rank must hold "
                         "the same kind of samples, encoded alike: encode the whole set once (or pass the same "
                         "codec=, normalize=, dtype= and y_dtype= on every rank; a q8/q4 codec fitted to each "
                         "part's range differs)")
    if kinds and kinds[0] in own:
        return
    if len({v[1] for v in ranks}) > 1:
        raise ValueError(f"{call}(distributed=True): the ranks were given whole sets of different sizes "
                         f"({listed(1)} samples); {_how(call)}")
    for i, what in ((3, "samples (x)"), (4, "targets (y)")):
        if len({v[i] for v in ranks}) > 1:
            odd = [r for r, v in enumerate(ranks) if v[i] != ranks[0][i]]
            raise ValueError(f"{call}(distributed=True): the ranks were given different whole sets of the same size "
                             f"({ranks[0][1]} samples): the stored {what} of rank{'s' * (len(odd) > 1)} "
                             f"{', '.join(map(str, odd))} differ from rank 0's (checksums {listed(i)}); {_how(call)}")


def _layout_difference(laid: list[tuple[int, int]], layouts) -> str:
    """Which ranks differ from the first, and in what ('codec: rank 0 uint8 (lossless), rank 1 int16 ...')."""
    first = laid[0][1]
    odd = [r for r, h in laid if h != first]
    head = f"rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} differ{'s' * (len(odd) == 1)} from rank {laid[0][0]}"
    if layouts is None:
        return f"{head}; layout hashes {', '.join(f'rank {r}: {h}' for r, h in laid)}"
    every = layouts()
    base = every[laid[0][0]]
    what = [f"{k}: rank {laid[0][0]} {base.get(k)}, rank {r} {every[r].get(k)}"
            for r in odd for k in sorted(set(base) | set(every[r])) if every[r].get(k) != base.get(k)]
    return f"{head} in {'; '.join(what)}"

"""torch.distributed helpers: shard bounds, agreement between ranks, exact metric reduction.

Every collective memfit makes has a timeout and is preceded by an agreement (`agree`): the local steps
that can fail run first, then every rank says whether it failed in one fixed-size all_gather, so a
rank that fails makes the others fail at once with a clear error naming it instead of hanging in a
collective.

Example (pure arithmetic, no process group needed):
    >>> [shard_indices(10, r, 3).tolist() for r in range(3)]
    [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    >>> shard_indices(10, 1, 3, mode="strided").tolist()
    [1, 4, 7]
"""

from __future__ import annotations

import datetime
import os
import zlib

import torch
import torch.distributed as dist

from memfit.messages import first_line

__all__ = ["MESSAGE_BYTES", "RankFailed", "VALUES", "agree", "all_gather",
           "all_gather_text", "all_reduce", "collective_timeout", "epoch_batch_sizes",
           "is_distributed", "rank_world", "reduce_states", "shard_data", "shard_indices", "shard_sizes", "smallest"]

DEFAULT_TIMEOUT_S = 120.0


def collective_timeout() -> float:
    """Seconds memfit's collectives wait for the other ranks: MEMFIT_DIST_TIMEOUT, else 120. Read at each wait,
    not at import: a process may set it after importing memfit (ranks forked from a server that had)."""
    value = os.environ.get("MEMFIT_DIST_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"expected MEMFIT_DIST_TIMEOUT to be a number of seconds above 0; found {value!r}: set it "
                         "so (e.g. 120) or unset it for the default 120 s")
    return seconds


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size), each taken from the initialised process group when not given."""
    if rank is None or world_size is None:
        if not is_distributed():
            raise ValueError("rank and world_size were not given and torch.distributed is not initialised; "
                             "call torch.distributed.init_process_group (torchrun does the environment) or pass both")
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if isinstance(rank, bool) or isinstance(world_size, bool) or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"expected 0 <= rank < world_size and world_size >= 1; found rank={rank}, "
                         f"world_size={world_size}")
    return int(rank), int(world_size)


def shard_sizes(n: int, world_size: int) -> list[int]:
    """Balanced sizes: the first n % world ranks get one sample more."""
    q, r = divmod(n, world_size)
    return [q + (i < r) for i in range(world_size)]


def shard_indices(n: int, rank: int, world_size: int, mode: str = "contiguous") -> torch.Tensor:
    """The indices of rank's part: a contiguous block (balanced sizes) or every world_size-th sample."""
    if mode == "contiguous":
        sizes = shard_sizes(n, world_size)
        start = sum(sizes[:rank])
        return torch.arange(start, start + sizes[rank])
    if mode == "strided":
        return torch.arange(rank, n, world_size)
    raise ValueError(f"shard mode must be 'contiguous' or 'strided'; found {mode!r}")


def shard_data(data: object, rank: int, world_size: int) -> tuple[object, range, int]:
    """This rank's part of a whole dataset: (the part, its positions in the whole, the whole's size).

    A whole dataset (a `CompactDataset`: anything with `shard_info` None and `shard(rank, world_size)`)
    is sharded, a copy of a contiguous block; one already sharded passes when it is this rank's shard.
    Anything else (an iterable of batches, a distributed `Loader`) passes as it is, with no positions.

    Example:
        >>> import numpy as np
        >>> from memfit.compact import CompactDataset
        >>> part, where, n = shard_data(CompactDataset.from_arrays(np.zeros((10, 4), np.uint8), device="cpu"), 1, 3)
        >>> len(part), where, n
        (3, range(4, 7), 10)
    """
    if not (hasattr(data, "shard_info") and hasattr(data, "shard")):
        return data, range(0), 0
    info = data.shard_info
    if info is None:
        data = data.shard(rank, world_size)
        info = data.shard_info
    elif (info.rank, info.world_size) != (rank, world_size):
        raise ValueError(f"the dataset is shard {info.rank} of {info.world_size}, but this process is rank "
                         f"{rank} of {world_size}; pass the whole dataset or this rank's shard")
    if info.mode == "strided":
        return data, range(rank, info.n_total, world_size), info.n_total
    start = int(info.indices[0]) if len(info.indices) else 0
    return data, range(start, start + len(info.indices)), info.n_total


def epoch_batch_sizes(n_local: int, n_min: int, n_max: int, batch_size: int, drop_last: bool) -> list[int]:
    """Batch sizes of one rank so that every rank yields the same number of batches.

    Shards hold n_min or n_max samples (they differ by at most one). With drop_last every rank yields
    n_min // batch_size full batches. Otherwise every rank yields ceil(n_max / batch_size) batches: full
    ones, then the remainder; a rank whose samples run out a batch early splits its largest batch in
    two instead, so no batch is empty and no sample is repeated or padded (DistributedSampler pads by
    repeating samples, which biases metrics).

    Raises:
        ValueError: drop_last with fewer samples than one batch (no batch at all), or shards too small
            to fill the batches without an empty one.

    Example:
        >>> epoch_batch_sizes(5, 4, 5, 2, False), epoch_batch_sizes(4, 4, 5, 2, False)
        ([2, 2, 1], [2, 1, 1])
    """
    if drop_last:
        if n_min < batch_size:
            where = f"the smallest shard holds {n_min}" if n_min != n_max else f"there are {n_min}"
            raise ValueError(f"drop_last=True with batch_size={batch_size} would yield no batch: {where} samples, "
                             f"fewer than one batch; pass drop_last=False (one batch of {n_local}) or a "
                             f"batch_size <= {n_min}")
        return [batch_size] * (n_min // batch_size)
    k = -(-n_max // batch_size)
    sizes = [batch_size] * (n_local // batch_size) + ([n_local % batch_size] if n_local % batch_size else [])
    while len(sizes) < k:
        i = max(reversed(range(len(sizes))), key=lambda j: sizes[j])   # the last of the largest
        if sizes[i] < 2:
            raise ValueError(f"a shard of {n_local} samples cannot fill {k} batches without an empty one; "
                             "use drop_last=True, a batch size of at least 2, or fewer processes")
        sizes[i:i + 1] = [sizes[i] - sizes[i] // 2, sizes[i] // 2]
    return sizes


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# The last collective's work, kept until the next one. gloo's worker thread may drop its reference to a work after
# the caller's wait has returned; when that drop is the last, destroying the work's tensors takes the GIL, and a
# thread that waits for the GIL while the interpreter shuts down aborts the process ("terminate called without
# an active exception", SIGABRT after a script's last evaluate). Held here, the work is freed by this thread.
# The cost: the last collective's tensors (memfit's own are a few counts) live until the next collective.
_last_work = None


def _wait(work, what: str, timeout_s: float) -> None:
    global _last_work
    if dist.get_backend() != "nccl":        # memfit's collectives run on gloo then (`_device_for`): the race is
        _last_work = work                   # gloo's; an NCCL work is not kept past its process group
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(f"memfit: {what} failed on rank {dist.get_rank()}: another rank stopped "
                           f"or did not answer within {timeout_s:.0f} s ({first_line(e, with_type=False)})") from None
    if ok is False:
        raise RuntimeError(f"memfit: {what} timed out after {timeout_s:.0f} s on rank {dist.get_rank()}; "
                           "another rank may have crashed")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all_reduce",
               timeout_s: float | None = None) -> torch.Tensor:
    """In-place all_reduce on the backend's device, with a timeout; returns t (on its own device)."""
    dev = _device_for(dist.get_backend())
    buf = t.to(dev) if t.device != dev else t
    timeout_s = timeout_s or collective_timeout()          # a bad MEMFIT_DIST_TIMEOUT fails before the collective
    _wait(dist.all_reduce(buf, op=op, async_op=True), what, timeout_s)
    if buf is not t:
        t.copy_(buf)
    return t


class RankFailed(RuntimeError):
    """Raised on the ranks that did not fail when another one did (every rank knows: agree no further)."""


VALUES = 6                  # int64 values a rank can share in an agreement
MESSAGE_BYTES = 512         # the first bytes of a failed rank's error message


def agree(error: BaseException | None, what: str, values: tuple[int, ...] = (),
          timeout_s: float | None = None) -> list[tuple[int, ...]]:
    """Every rank says whether it failed and shares up to `VALUES` ints, in one collective with a timeout.

    Call it from every rank after the local steps that can fail, before the collectives that need them,
    with the exception this rank hit (or None). Every agreement is the same all_gather of one fixed-size
    record (failed flag, a tag naming the point, the values, the message), so a rank that failed early
    and went straight to a later agreement still meets the others: nobody waits on a collective that
    will never come. Raises on every rank when any failed: the failed ranks their own error, the others
    `RankFailed` naming them; also when the ranks reached different agreement points.

    Returns:
        Every rank's `values`, by rank.
    """
    if len(values) > VALUES:
        raise ValueError(f"an agreement shares at most {VALUES} values; found {len(values)}")
    record = torch.zeros(3 + VALUES + MESSAGE_BYTES // 8, dtype=torch.int64)
    record[0] = error is not None
    record[1] = zlib.crc32(what.encode())        # the agreement point: ranks must be at the same one
    record[2] = len(values)
    record[3:3 + len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
    if error is not None:
        text = first_line(error).encode()[:MESSAGE_BYTES]
        record[3 + VALUES:].view(torch.uint8)[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    records = all_gather(record, f"{what} (agreement)", timeout_s)
    failed = [(r, _message(rec)) for r, rec in enumerate(records) if int(rec[0])]
    if failed:
        if error is not None:
            raise error
        names = "; ".join(f"rank {r}: {m}" for r, m in failed)
        raise RankFailed(f"memfit: {what} stopped because another rank failed ({names})")
    tags = {int(rec[1]) for rec in records}
    if len(tags) > 1:
        raise RankFailed(f"memfit: the ranks reached different agreement points ({what!r} here on rank "
                         f"{dist.get_rank()}); every rank must make the same memfit calls in the same order")
    return [tuple(int(v) for v in rec[3:3 + int(rec[2])]) for rec in records]


def smallest(value: int, what: str, timeout_s: float | None = None) -> int:
    """The smallest of every rank's `value` (an agreement: a rank that failed earlier stops all)."""
    return min(v[0] for v in agree(None, what, (value,), timeout_s))


def _message(record: torch.Tensor) -> str:
    return bytes(record[3 + VALUES:].view(torch.uint8).tolist()).rstrip(b"\0").decode(errors="replace")


def all_gather(t: torch.Tensor, what: str, timeout_s: float | None = None) -> list[torch.Tensor]:
    """Every rank's `t` (same shape and dtype on every rank), by rank, on the CPU; with a timeout."""
    dev = _device_for(dist.get_backend())
    buf = t.to(dev)
    out = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
    timeout_s = timeout_s or collective_timeout()          # a bad MEMFIT_DIST_TIMEOUT fails before the collective
    _wait(dist.all_gather(out, buf, async_op=True), what, timeout_s)
    return [o.cpu() for o in out]


def reduce_states(states: list[dict[str, torch.Tensor]], timeout_s: float | None = None) -> None:
    """Sum every metric state tensor across ranks, in place (sums and counts add up exactly).

    A rank that saw no sample (an empty shard, a loader with no batch on this rank) has empty states: it
    adds zeros shaped as the other ranks' states, so every rank makes the same all_reduces (a missing one
    would pair with another collective, and hang or mix values). Raises on every rank when ranks that saw
    samples hold states of different shapes (e.g. models with different class counts)."""
    layouts = all_gather_text(_layout(states), "metric state layouts", timeout_s)
    seen = [(r, text) for r, text in enumerate(layouts) if text]
    if not seen:                                  # no rank saw a sample: nothing to add up
        return
    if any(text != seen[0][1] for _, text in seen):
        found = "; ".join(f"rank {r}: {text}" for r, text in seen)
        raise ValueError(f"the ranks' metric states differ, so they cannot be summed ({found}); every rank must "
                         "evaluate the same model with the same metrics")
    if not layouts[dist.get_rank()]:
        _zeros_like_layout(states, seen[0][1])
    for st in states:
        for key in sorted(st):
            st[key] = all_reduce(st[key].clone(), what=f"metric state {key!r}", timeout_s=timeout_s)


def _layout(states: list[dict[str, torch.Tensor]]) -> str:
    """'metric|key|dtype|shape' for every state tensor, ';'-separated; '' when no metric has state yet."""
    if not any(states):
        return ""
    return ";".join(f"{i}|{key}|{str(st[key].dtype).replace('torch.', '')}|{','.join(map(str, st[key].shape))}"
                    for i, st in enumerate(states) for key in sorted(st))


def _zeros_like_layout(states: list[dict[str, torch.Tensor]], layout: str) -> None:
    """Fill empty states with zeros of the layout another rank reported (`_layout`)."""
    for item in layout.split(";"):
        i, key, dtype, shape = item.split("|")
        dims = tuple(int(d) for d in shape.split(",")) if shape else ()
        states[int(i)][key] = torch.zeros(dims, dtype=getattr(torch, dtype))


def all_gather_text(text: str, what: str, timeout_s: float | None = None) -> list[str]:
    """Every rank's `text` (any length), by rank: the lengths first, then the bytes padded to the longest."""
    data = text.encode()
    lengths = all_gather(torch.tensor([len(data)], dtype=torch.int64), f"{what} (lengths)", timeout_s)
    longest = max(int(n) for n in lengths)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    parts = all_gather(buf, what, timeout_s)
    return [bytes(p[:int(n)].tolist()).decode() for p, n in zip(parts, lengths, strict=True)]

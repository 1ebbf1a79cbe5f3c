"""torch.distributed helpers: shard bounds, agreement between ranks, exact metric reduction.

Every collective memfit makes has a timeout and is preceded by an agreement step, so a rank that
fails makes the others fail with a clear error naming it instead of hanging in a collective.

Example (pure arithmetic, no process group needed):
    >>> [shard_indices(10, r, 3).tolist() for r in range(3)]
    [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    >>> shard_indices(10, 1, 3, mode="strided").tolist()
    [1, 4, 7]
"""

from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

TIMEOUT_S = float(os.environ.get("MEMFIT_DIST_TIMEOUT", "120"))


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


def epoch_batch_sizes(n_local: int, n_min: int, n_max: int, batch_size: int, drop_last: bool) -> list[int]:
    """Batch sizes of one rank so that every rank yields the same number of batches.

    Shards hold n_min or n_max samples (they differ by at most one). With drop_last every rank yields
    n_min // batch_size full batches. Otherwise every rank yields ceil(n_max / batch_size) batches: full
    ones, then the remainder; a rank whose samples run out a batch early splits its largest batch in
    two instead, so no batch is empty and no sample is repeated or padded (DistributedSampler pads by
    repeating samples, which biases metrics).

    Example:
        >>> epoch_batch_sizes(5, 4, 5, 2, False), epoch_batch_sizes(4, 4, 5, 2, False)
        ([2, 2, 1], [2, 1, 1])
    """
    if drop_last:
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


def _wait(work, what: str, timeout_s: float) -> None:
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(f"memfit: {what} failed on rank {dist.get_rank()}: another rank stopped "
                           f"or did not answer within {timeout_s:.0f} s ({str(e).splitlines()[0]})") from None
    if ok is False:
        raise RuntimeError(f"memfit: {what} timed out after {timeout_s:.0f} s on rank {dist.get_rank()}; "
                           "another rank may have crashed")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, what: str = "all_reduce",
               timeout_s: float | None = None) -> torch.Tensor:
    """In-place all_reduce on the backend's device, with a timeout; returns t (on its own device)."""
    dev = _device_for(dist.get_backend())
    buf = t.to(dev) if t.device != dev else t
    _wait(dist.all_reduce(buf, op=op, async_op=True), what, timeout_s or TIMEOUT_S)
    if buf is not t:
        t.copy_(buf)
    return t


def agree(error: BaseException | None, what: str, timeout_s: float | None = None) -> None:
    """Every rank says whether it failed; when any did, all raise an error naming the failed ranks.

    Call it from every rank at the same point, with the exception this rank hit (or None).
    """
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    all_reduce(flag, what=f"{what} (agreement)", timeout_s=timeout_s)
    if int(flag) == 0:
        return
    mine = None if error is None else f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    messages: list = [None] * dist.get_world_size()
    dist.all_gather_object(messages, mine)
    failed = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    if error is not None:
        raise error
    raise RuntimeError(f"memfit: {what} stopped because another rank failed ({failed})")


def reduce_states(states: list[dict[str, torch.Tensor]], timeout_s: float | None = None) -> None:
    """Sum every metric state tensor across ranks, in place (sums and counts add up exactly)."""
    for st in states:
        for key in sorted(st):
            st[key] = all_reduce(st[key].clone(), what=f"metric state {key!r}", timeout_s=timeout_s)


def format_exc_short(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()

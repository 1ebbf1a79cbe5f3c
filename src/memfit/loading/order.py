"""Epoch orders: which samples each batch holds, as pure functions of (seed, epoch).

Two orders:

- **global**: one permutation of all samples (int32 below 2**31 samples: 4 bytes a sample on the
  host); any batch may hold any samples. The default: `resident`, `stream`, and `macro` from host
  memory (gathering a macro block costs the same whatever rows it holds, so the best shuffle is free
  there; the batches are then the same as `resident`'s for the same seed).
- **blocks** (macro-batch shuffling): contiguous blocks of the macro size in a shuffled order, the
  samples shuffled within each block, the partial block last, made one block at a time: host memory
  proportional to the macro-batch, not to the data (a billion samples would take 4 GB of int32
  permutation). The default for `macro` from a file: each block is then one sequential read.

Distributed: every rank draws the same order from the shared seed and keeps, in that order, the
samples of its own shard (`restrict`: a range of the whole, so no lookup table), so the ranks' batches
partition the epoch exactly.

Example:
    >>> permutation(6, seed=0, epoch=0).sort().values.tolist()
    [0, 1, 2, 3, 4, 5]
    >>> a, b = permutation(50, 0, 1), permutation(50, 0, 2)
    >>> torch.equal(a, permutation(50, 0, 1)), torch.equal(a, b)
    (True, False)
    >>> pack([4, 4, 4, 4, 3], 8)
    [[4, 4], [4, 4], [3]]
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["blocks", "epoch_seed", "generator", "index_dtype", "pack", "permutation", "rechunk", "restrict"]

_MIX = 0x9E3779B97F4A7C15    # golden-ratio constant: neighbouring (seed, epoch) pairs get unrelated streams


def epoch_seed(seed: int, epoch: int) -> int:
    """One 63-bit generator seed per (seed, epoch) pair."""
    return (int(seed) * _MIX + int(epoch) * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator for (seed, epoch): the order is the same on every device and every rank."""
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


def index_dtype(n: int) -> torch.dtype:
    """int32 indices below 2**31 samples (half the bytes of int64), else int64."""
    return torch.int32 if n < 2**31 else torch.int64


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Global order of n samples, (n,) on the CPU in `index_dtype(n)`: a seeded permutation, or 0..n-1."""
    if not shuffle:
        return torch.arange(n, dtype=index_dtype(n))
    return torch.randperm(n, generator=generator(seed, epoch), dtype=index_dtype(n))


def blocks(n: int, block: int, seed: int, epoch: int, shuffle: bool = True) -> Iterator[torch.Tensor]:
    """The 'blocks' order, one block at a time: blocks of `block` consecutive samples in a shuffled order,
    each shuffled inside; the partial block (when block does not divide n) comes last, so that the blocks
    line up with macro-batches. Memory: one block, and 8 bytes per block for their order.

    Example:
        >>> o = list(blocks(10, 4, seed=1, epoch=0))
        >>> [len(b) for b in o], sorted(o[0].tolist()) in ([0, 1, 2, 3], [4, 5, 6, 7]), sorted(o[2].tolist())
        ([4, 4, 2], True, [8, 9])
    """
    if block < 1:
        raise ValueError(f"expected a block size >= 1; found {block}")
    dt, full = index_dtype(n), n // block
    g = generator(seed, epoch)
    starts = torch.randperm(full, generator=g) if shuffle else torch.arange(full)      # (n // block,) int64
    inner = (lambda m: torch.randperm(m, generator=g, dtype=dt)) if shuffle else (lambda m: torch.arange(m, dtype=dt))
    for s in starts.tolist():
        yield inner(block).add_(s * block)
    if n > full * block:
        yield inner(n - full * block).add_(full * block)


def restrict(order: torch.Tensor, members: range) -> torch.Tensor:
    """The positions (0..len(members)-1) of `members` (a shard: a range of the whole) in the order they
    appear in `order`; no table of the whole's size is built.

    Example:
        >>> restrict(torch.tensor([5, 0, 3, 1, 4, 2]), range(3, 6)).tolist()
        [2, 0, 1]
        >>> restrict(torch.tensor([5, 0, 3, 1, 4, 2]), range(1, 6, 2)).tolist()   # strided: 1, 3, 5
        [2, 1, 0]
    """
    keep = order >= members.start
    keep &= order < members.stop
    if members.step != 1:
        keep &= torch.remainder(order - members.start, members.step) == 0
    pos = order[keep].sub_(members.start)
    return pos if members.step == 1 else pos.div_(members.step, rounding_mode="floor")


def rechunk(pieces: Iterable[torch.Tensor], sizes: Iterable[int]) -> Iterator[torch.Tensor]:
    """Consecutive runs of `sizes` indices from a stream of pieces (views where a piece holds the run);
    what follows the last run (drop_last's tail) is never read.

    Example:
        >>> [t.tolist() for t in rechunk([torch.arange(3), torch.arange(3, 7)], [2, 3, 1])]
        [[0, 1], [2, 3, 4], [5]]
    """
    it = iter(pieces)
    have = torch.empty(0, dtype=torch.int64)
    for size in sizes:
        parts = [have]
        got = len(have)
        while got < size:
            p = next(it, None)
            if p is None:
                raise RuntimeError(f"memfit: the epoch order ran out after {got} of {size} samples of a block; "
                                   "please report this with the loader's explain()")
            parts.append(p)
            got += len(p)
        whole = parts[0] if len(parts) == 1 else torch.cat([t for t in parts if len(t)])
        yield whole[:size]
        have = whole[size:]


def pack(sizes: list[int], capacity: int) -> list[list[int]]:
    """Group consecutive batches into blocks of at most `capacity` samples (a batch is never split)."""
    blocks: list[list[int]] = []
    room = 0
    for s in sizes:
        if not blocks or s > room:
            blocks.append([])
            room = capacity
        blocks[-1].append(s)
        room -= s
    return blocks

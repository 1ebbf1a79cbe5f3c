"""Epoch orders: which samples each batch holds, as pure functions of (seed, epoch).

Two shuffles:

- **global**: one permutation of all samples; any batch may hold any samples. Used by `resident`,
  `stream`, and `macro` from host memory (gathering a macro block costs the same whatever rows it holds,
  so the best shuffle is free there; the batches are then the same as `resident`'s for the same seed).
- **blocks** (macro-batch shuffling): contiguous blocks of the macro size in a permuted order,
  the samples permuted within each block, the partial block last. Used by `macro` from a file: each
  block is then one sequential read instead of thousands of scattered ones.

Distributed: every rank draws the same global order from the shared seed and keeps, in that order,
the samples of its own shard (`restrict`), so the ranks' batches partition the epoch exactly.

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

import torch

_MIX = 0x9E3779B97F4A7C15    # golden-ratio constant: neighbouring (seed, epoch) pairs get unrelated streams


def epoch_seed(seed: int, epoch: int) -> int:
    """One 63-bit generator seed per (seed, epoch) pair."""
    return (int(seed) * _MIX + int(epoch) * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def generator(seed: int, epoch: int) -> torch.Generator:
    """A CPU generator for (seed, epoch): the order is the same on every device and every rank."""
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Global order of n samples, int64 (n,) on the CPU: a seeded permutation, or 0..n-1."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=generator(seed, epoch))


def block_permutation(n: int, block: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Blocks of `block` consecutive samples in a permuted order, each permuted inside; the partial
    block (when block does not divide n) comes last, so that the blocks line up with macro-batches.

    Example:
        >>> o = block_permutation(10, 4, seed=1, epoch=0)
        >>> sorted(o[:4].tolist()) in ([0, 1, 2, 3], [4, 5, 6, 7]), sorted(o[8:].tolist())
        (True, [8, 9])
    """
    if block < 1:
        raise ValueError(f"expected a block size >= 1; found {block}")
    if not shuffle:
        return torch.arange(n)
    g = generator(seed, epoch)
    full = n // block
    starts = torch.randperm(full, generator=g) * block                          # (full,) block starts
    inner = torch.rand(full, block, generator=g).argsort(dim=1)                 # (full, block) within-block order
    out = (starts[:, None] + inner).reshape(-1)
    rest = n - full * block
    if rest:
        out = torch.cat([out, full * block + torch.randperm(rest, generator=g)])
    return out


def restrict(order: torch.Tensor, members: torch.Tensor, n_total: int) -> torch.Tensor:
    """The positions (0..len(members)-1) of `members` in the order they appear in a global `order`.

    Example:
        >>> restrict(torch.tensor([5, 0, 3, 1, 4, 2]), torch.tensor([3, 4, 5]), 6).tolist()
        [2, 0, 1]
    """
    local = torch.full((n_total,), -1, dtype=torch.int64)
    local[members] = torch.arange(len(members))
    pos = local[order]
    return pos[pos >= 0]


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

"""Offsets in one byte arena for tensors with known sizes and lifetimes: pure functions.

A lifetime is the closed interval of op indices `[first, last]`: the op that writes the tensor and
the last op that reads it. Two tensors whose intervals share an op are live together and must not
overlap in memory; this is what keeps an op's output off its own inputs (a GEMM whose output
shares memory with its input returns wrong numbers).

Algorithms (Pisarchyk & Lee 2020, "Efficient Memory Management for Deep Neural Net Inference"):
- `naive`: every tensor its own region, one after another (the baseline).
- `greedy_by_size`: largest first; each goes into the smallest gap left by the already placed
  tensors whose lifetimes overlap its own, or above them all (TFLite's arena planner). When that
  leaves the arena above the lower bound, seeded shuffles of the order are tried as well
  (`shuffles(n)`: up to 256, fewer for large graphs).
- `best`: greedy with several orderings (size, lifetime length, first use, size x length, then the
  seeded shuffles); the smallest arena wins. Both stop as soon as an order reaches the bound.

Example:
    >>> bufs = [Buffer("a", 32, 0, 1), Buffer("b", 28, 1, 4), Buffer("c", 36, 2, 5)]
    >>> offsets, size = assign_offsets(bufs, "greedy_by_size", alignment=1)
    >>> verify(bufs, offsets)
    >>> size, lower_bound(bufs, alignment=1)
    (64, 64)
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ALGORITHMS", "Buffer", "OverlapError", "align", "assign_offsets", "cheaper_outside", "live_profile",
           "lower_bound", "verify"]

ALGORITHMS = ("naive", "greedy_by_size", "best")


class OverlapError(RuntimeError):
    """Two tensors that are live at the same op were given overlapping bytes of the arena."""


@dataclass(frozen=True)
class Buffer:
    """One region to place: `size` bytes, live from op `first` to op `last` (both included)."""
    name: str
    size: int
    first: int
    last: int

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.first <= other.last and other.first <= self.last


def align(n: int, alignment: int) -> int:
    """`n` rounded up to a multiple of `alignment`.

    Example:
        >>> align(65, 64), align(64, 64), align(0, 64)
        (128, 64, 0)
    """
    return -(-n // alignment) * alignment


def _check(buffers: Sequence[Buffer], alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1 (bytes); found {alignment!r}")
    for b in buffers:
        if b.size < 0 or b.first > b.last:
            raise ValueError(f"buffer {b.name!r} needs size >= 0 and first <= last; found size {b.size}, "
                             f"lifetime ({b.first}, {b.last})")


def live_profile(buffers: Sequence[Buffer], alignment: int = 64) -> list[int]:
    """Bytes live at each op (sizes rounded up to `alignment`), from op 0 to the last op.

    Example:
        >>> live_profile([Buffer("a", 10, 0, 1), Buffer("b", 5, 1, 2)], alignment=1)
        [10, 15, 5]
    """
    _check(buffers, alignment)
    if not buffers:
        return []
    delta = [0] * (max(b.last for b in buffers) + 2)
    for b in buffers:
        delta[b.first] += align(b.size, alignment)
        delta[b.last + 1] -= align(b.size, alignment)
    out, cur = [], 0
    for d in delta[:-1]:
        cur += d
        out.append(cur)
    return out


def lower_bound(buffers: Sequence[Buffer], alignment: int = 64) -> int:
    """The most bytes live at any one op: no arena can be smaller (it may have to be larger).

    Example:
        >>> lower_bound([Buffer("a", 10, 0, 1), Buffer("b", 5, 1, 2)], alignment=1)
        15
    """
    return max(live_profile(buffers, alignment), default=0)


def cheaper_outside(arena: Sequence[Buffer], outside: Sequence[Buffer], movable: dict[str, tuple[int, ...]],
                    alignment: int = 64) -> list[str]:
    """Names of `movable` arena buffers that are cheaper outside the arena, by the peak bytes of both.

    The arena is held for the whole call at its peak, while a tensor outside it (allocated by torch,
    freed after its last reader) costs memory only while it lives. Where the outside peak comes at
    another time than the arena's (a model output, a stem of convolutions with no `out=` kernel),
    the arena's peak tensors fit under the outside peak for free: moving them out lowers
    `max(arena) + max(outside)`. Greedy: take a buffer live at the arena's peak, the one that
    lowers the sum most (ties: the largest), while the sum does not grow; return the moves up to the
    smallest sum (bytes: arena sizes padded to `alignment`, outside sizes exact, as the report counts).

    `movable` maps a buffer's name to the ops that write over it in place: outside the arena they
    write a copy, so the buffer counts twice at those ops.

    Example:
        >>> arena = [Buffer("a", 10, 0, 1), Buffer("b", 4, 2, 3)]
        >>> cheaper_outside(arena, [Buffer("out", 12, 3, 3)], {"a": (), "b": ()}, alignment=1)  # 10 + 12 -> 4 + 12
        ['a']
    """
    _check([*arena, *outside], alignment)
    n = max((b.last + 1 for b in [*arena, *outside]), default=0)
    inside = np.zeros(n + 1, dtype=np.int64)
    out = np.zeros(n + 1, dtype=np.int64)
    for b in arena:
        inside[b.first:b.last + 1] += align(b.size, alignment)
    for b in outside:
        out[b.first:b.last + 1] += b.size
    left = {b.name: b for b in arena if b.name in movable and b.size}

    def outside_bytes(b: Buffer) -> np.ndarray:
        add = np.zeros(n + 1, dtype=np.int64)
        add[b.first:b.last + 1] = b.size
        add[list(movable[b.name])] += b.size
        return add

    def total_without(b: Buffer) -> int:
        live = slice(b.first, b.last + 1)
        rest = max(inside[:b.first].max(initial=0), inside[b.last + 1:].max(initial=0))
        return int(max(rest, inside[live].max() - align(b.size, alignment)) + (out + outside_bytes(b)).max())

    moved: list[str] = []
    best = current = int(inside.max() + out.max())
    keep = 0
    while left and inside.max() > 0:
        t = int(inside.argmax())
        candidates = [b for b in left.values() if b.first <= t <= b.last]
        if not candidates:
            break
        b = min(candidates, key=lambda b: (total_without(b), -b.size))
        new = total_without(b)
        if new > current:
            break
        inside[b.first:b.last + 1] -= align(b.size, alignment)
        out += outside_bytes(b)
        moved.append(b.name)
        del left[b.name]
        current = new
        if new < best:
            best, keep = new, len(moved)
    return moved[:keep]


def _greedy(buffers: Sequence[Buffer], order: Sequence[int], alignment: int) -> tuple[list[int], int]:
    """Place buffers in `order`: each in the smallest fitting gap among time-overlapping placed ones."""
    offsets: list[int] = [0] * len(buffers)
    placed: list[int] = []
    arena = 0
    for i in order:
        b = buffers[i]
        if b.size == 0:
            continue
        size = align(b.size, alignment)
        busy = sorted((offsets[j], offsets[j] + align(buffers[j].size, alignment)) for j in placed
                      if b.overlaps_in_time(buffers[j]))
        best, best_gap, prev_end = None, None, 0
        for start, end in busy:
            gap = start - prev_end
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = prev_end, gap
            prev_end = max(prev_end, end)
        offsets[i] = prev_end if best is None else best
        placed.append(i)
        arena = max(arena, offsets[i] + size)
    return offsets, arena


_ORDERS: dict[str, Callable[[Buffer], tuple]] = {
    "size": lambda b: (-b.size, b.first),
    "length": lambda b: (-(b.last - b.first), -b.size),
    "first_use": lambda b: (b.first, -b.size),
    "area": lambda b: (-b.size * (b.last - b.first + 1), -b.size),
}


def assign_offsets(buffers: Sequence[Buffer], algorithm: str = "greedy_by_size",
                   alignment: int = 64) -> tuple[list[int], int]:
    """Offsets (bytes, multiples of `alignment`) for `buffers` and the arena size they need.

    Args:
        buffers: the regions to place, with sizes in bytes and lifetimes in op indices.
        algorithm: "naive", "greedy_by_size" or "best" (see the module docstring).
        alignment: every offset is a multiple of this, and every region is padded to it.

    Example:
        >>> assign_offsets([Buffer("a", 10, 0, 0), Buffer("b", 10, 1, 1)], "naive", alignment=16)
        ([0, 16], 32)
        >>> assign_offsets([Buffer("a", 10, 0, 0), Buffer("b", 10, 1, 1)], alignment=16)
        ([0, 0], 16)
    """
    _check(buffers, alignment)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; found {algorithm!r}")
    if algorithm == "naive":
        offsets, end = [], 0
        for b in buffers:
            offsets.append(end)
            end += align(b.size, alignment)
        return offsets, end
    bound = lower_bound(buffers, alignment)
    best = None
    for order in _orders(buffers, algorithm):
        result = _greedy(buffers, order, alignment)
        if best is None or result[1] < best[1]:
            best = result
        if best[1] <= bound:                  # no arena is smaller than the bound: stop
            break
    return best


SHUFFLE_WORK = 1_000_000    # seeded shuffles tried x buffers^2 (one greedy pass costs ~0.2 us x buffers^2): <= ~0.2 s


def shuffles(n_buffers: int) -> int:
    """How many seeded shuffles to try after the named orders: at least 8, at most 256, fewer for
    large graphs (a greedy pass costs about n^2). A 4-block GPT-2 (54 buffers) needs 13 to 22."""
    return max(8, min(256, SHUFFLE_WORK // max(n_buffers, 1) ** 2))


def _orders(buffers: Sequence[Buffer], algorithm: str):
    """Placement orders to try, best first: the named ones, then seeded shuffles (deterministic).
    Largest-first leaves gaps on some graphs (a GPT-2 block: 1.076x the bound: every block's three
    MLP tensors go to offset 0, so the residual streams of consecutive blocks, live together for an
    op, stack above them); another order closes the gap; shuffles find one cheaply, and the loop
    stops once the bound is reached."""
    idx = range(len(buffers))
    for k in ("size",) if algorithm == "greedy_by_size" else tuple(_ORDERS):
        yield sorted(idx, key=lambda i, k=k: _ORDERS[k](buffers[i]))
    for seed in range(shuffles(len(buffers))):
        order = list(idx)
        random.Random(seed).shuffle(order)
        yield order


def verify(buffers: Sequence[Buffer], offsets: Sequence[int], alignment: int = 1) -> None:
    """Raise `OverlapError` when two buffers live at the same op share a byte.

    Example:
        >>> verify([Buffer("a", 8, 0, 1), Buffer("b", 8, 1, 2)], [0, 8])      # fine: no error
        >>> verify([Buffer("a", 8, 0, 1), Buffer("b", 8, 1, 2)], [0, 4])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        memfit.planner.arena.OverlapError: 'a' (bytes [0, 8), ops 0..1) and 'b' (bytes [4, 12), ops 1..2) ...
    """
    if len(offsets) != len(buffers):
        raise ValueError(f"expected one offset per buffer ({len(buffers)}); found {len(offsets)}")
    items = sorted((b.first, i) for i, b in enumerate(buffers) if b.size > 0)
    active: list[int] = []          # sweep over time: buffers whose lifetime has started and not ended
    for first, i in items:
        active = [j for j in active if buffers[j].last >= first]
        b, lo = buffers[i], offsets[i]
        if lo % alignment:
            raise OverlapError(f"{b.name!r} at offset {lo} is not aligned to {alignment} bytes")
        for j in active:
            o = buffers[j]
            if lo < offsets[j] + o.size and offsets[j] < lo + b.size:
                raise OverlapError(
                    f"{o.name!r} (bytes [{offsets[j]}, {offsets[j] + o.size}), ops {o.first}..{o.last}) and "
                    f"{b.name!r} (bytes [{lo}, {lo + b.size}), ops {b.first}..{b.last}) are live together at op "
                    f"{max(o.first, b.first)} but overlap; a planner bug: please report it")
        active.append(i)

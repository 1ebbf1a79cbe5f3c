"""The fewest FSDP2 ranks whose per-rank peak fits a budget (`ranks_needed`), read off one rank's memory model.

FSDP2 pads shards that do not split evenly, so the per-rank peak is not monotone in the world size (three
1024-wide linears, AdamW, 4 samples a rank: 20.0 MB at 4 ranks, 21.9 MB at 5, 16.3 MB at 8): a search that
skips sizes can miss the fewest. One rank's model at `BASE_WORLD` ranks gives every other world size by a few
array operations (`RankMemoryModel.at_world`), so every size from `at_least` to `max_world` is tried in turn and
the answer is the fewest. Where the model says the runs do not give other world sizes (`unscalable`), each size
tried is a fake run of its own: then every size up to `LINEAR_SCAN` above `at_least`, then doubling and
bisection between the last size that did not fit and the first that did (the answer fits, but a size the
search skipped may fit too), up to `DIRECT_MAX` ranks.
"""

from __future__ import annotations

from memfit.budget import check_count, format_bytes, parse_bytes
from memfit.memory.ranks import BASE_WORLD, DIRECT_MAX, rank_memory_model

__all__ = ["LINEAR_SCAN", "NoWorldFits", "ranks_needed"]

LINEAR_SCAN = 16      # where each size is a run: sizes tried one by one above `at_least` before doubling


class NoWorldFits(ValueError):
    """`ranks_needed` found no world size up to its `max_world` whose per-rank peak fits (activations do not
    shard)."""


def ranks_needed(model, example, budget: int | str, batch_per_rank: int, *, max_world: int = 1024,
                 at_least: int = 1, **options) -> int:
    """The fewest FSDP2 ranks, from `at_least` to `max_world`, whose per-rank peak at `batch_per_rank` fits
    `budget`; `options` go to `memfit.memory.ranks.rank_memory_model` (see the module docstring for the search).
    `at_least`: a world size known not to be above the answer (fewer ranks are not tried). Raises `NoWorldFits`
    (a ValueError) if even `max_world` ranks do not fit (activations do not shard).

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        >>> opt = torch.optim.AdamW(m.parameters())
        >>> ranks_needed(m, (256,), "2MiB", 4, optimizer=opt)
        2
    """
    budget = parse_bytes(budget)
    n = check_count("batch_per_rank", batch_per_rank, 1)
    max_world = check_count("max_world", max_world, 1)
    lo = min(check_count("at_least", at_least, 1), max_world)
    base = rank_memory_model(model, example, parallel="fsdp", world_size=BASE_WORLD, probes=(n,), **options)
    seen: dict[int, int] = {}

    def need(w: int) -> int:
        if w not in seen:
            seen[w] = base.at_world(w).total_bytes(n)
        return seen[w]

    def none_fits(w: int, why: str = "") -> NoWorldFits:
        return NoWorldFits(f"expected some world size <= {w} to fit {format_bytes(budget)} per rank at a batch of "
                           f"{n} per rank; found {format_bytes(need(w))} at {w} ranks{why}; lower the batch per rank "
                           "or raise the budget")
    if not base.unscalable:                   # every size costs a few array operations: the fewest, none skipped
        w = next((w for w in range(lo, max_world + 1) if need(w) <= budget), None)
        if w is None:
            raise none_fits(max_world)
        return w
    top = max(min(max_world, DIRECT_MAX), lo)  # each size a fake run of its own, up to DIRECT_MAX ranks
    for w in range(lo, min(lo + LINEAR_SCAN, top) + 1):
        if need(w) <= budget:
            return w
    lo, w = w + 1, min(2 * w, top)
    while need(w) > budget:
        if w >= top:
            raise none_fits(w, "" if top == max_world else f" (each world size is run for itself, up to {DIRECT_MAX} "
                            f"ranks, the runs at {BASE_WORLD} not giving others: {base.unscalable})")
        lo, w = w + 1, min(2 * w, top)
    return _smallest(need, budget, lo, w)


def _smallest(need, budget: int, lo: int, hi: int) -> int:
    """The smallest w in [lo, hi] with need(w) <= budget, need(hi) <= budget (bisection)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return hi

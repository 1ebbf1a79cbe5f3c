"""`evaluate` on several ranks: the ranks agree on the data before any work (one whole set, or each its own
part), each takes its chunks, they agree on one chunk size, and the sums and counts are all-reduced."""

from __future__ import annotations

from dataclasses import replace

import torch

from memfit.compact import CompactDataset
from memfit.evaluation.chunks import as_chunks
from memfit.evaluation.decision import Decision
from memfit.targets import IGNORE_INDEX

__all__ = ["agreed_chunk_size", "agreed_data", "local_chunks", "reduce_results"]


class _NoChunks(tuple):
    """An empty shard's chunks: none, with the targets the other ranks have (their kind picks the metrics)."""
    targets = None


def agreed_data(data, sharded: bool, asked: tuple[int, str] | None = None):
    """The data as a CompactDataset (arrays are encoded whole, so every rank decodes with the same codec and
    normalisation), after the ranks agreed that they hold one whole set of one size and content, or each its
    own part (sharded=True); arrays get the ignore index asked for (`asked[0]`, else -100). Raises on every
    rank when they do not, or when one failed preparing its data."""
    from memfit import distributed as mdist
    error, identity = None, (0, 0, 0, 0)
    try:
        if isinstance(data, tuple) and len(data) == 2:
            data = CompactDataset.from_arrays(*data, device="cpu",
                                              ignore_index=IGNORE_INDEX if asked is None else asked[0])
        identity = mdist.data_identity(data, sharded)
    except Exception as e:
        error = e
    mdist.check_same_data(mdist.agree(error, "memfit.evaluate data", identity), "evaluate")
    return data


def local_chunks(data, dev, sharded: bool):
    """This rank's chunks: its shard of a whole set; its own part (sharded) or batches as they are. An empty
    shard (fewer samples than ranks) is no chunk at all: the rank still makes every agreement and reduction,
    adding nothing."""
    from memfit.distributed import rank_world, shard_data
    part = data if sharded else shard_data(data, *rank_world())[0]
    if isinstance(part, CompactDataset) and len(part) == 0:
        empty = _NoChunks()
        empty.targets = part.targets
        return empty
    return as_chunks(part, dev)


# What a rank without chunks of its own (a loader, an empty shard) offers when the ranks agree on a chunk size
NO_CHUNK = 2**62


def agreed_chunk_size(d: Decision) -> Decision:
    """One chunk size for all ranks (the smallest), so a rank's back-off never waits on another's. Every rank
    agrees, one with no chunks too (a loader, an empty shard): the ranks must make the same collectives."""
    from memfit import distributed as mdist
    agreed = mdist.smallest(d.chunk_size or NO_CHUNK, "memfit.evaluate chunk size")   # also stops all if one failed
    if d.chunk_size and agreed != d.chunk_size:
        return replace(d, chunk_size=agreed, reason=f"{d.reason}; the smallest over ranks ({agreed}) is used")
    return d


def reduce_results(error: Exception | None, mets: dict, res: dict) -> None:
    """Every rank learns whether one failed (then all raise), then the metrics' states and the counts are summed
    over the ranks, in place."""
    from memfit import distributed as mdist
    mdist.agree(error, "memfit.evaluate")
    mdist.reduce_states([m.state for m in mets.values() if m.reduce])
    for m in mets.values():
        if m.reduce and "n" in m.state:
            m.n = int(m.state["n"])
    counts = torch.tensor([res["n"], res["chunks"], res["retries"]], dtype=torch.int64)
    mdist.all_reduce(counts, what="evaluate counts")
    res["n"], res["chunks"], res["retries"] = (int(v) for v in counts)
    if res["n"] == 0:          # every rank has the same sum: every rank raises, none waits
        raise ValueError("the data is empty on every rank: nothing to evaluate")

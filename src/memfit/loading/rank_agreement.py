"""What the ranks of a distributed loader must agree on before the first batch: the same data (size, encoding,
content checksums), the same seed, and for sharded=True parts that make one whole. Each check raises the same
ValueError on every rank (every rank reads every rank's values), listing each rank's value and how to fix it.
"""

from __future__ import annotations

import torch

from memfit.compact import CompactDataset
from memfit.distributed import agree
from memfit.loading.sources import Source

__all__ = ["agreed_parts", "agreed_seed", "same_on_every_rank", "source_identity"]


def agreed_seed(error: BaseException | None, seed: int | None, n_total: int, identity: tuple) -> int:
    """The agreement of a distributed loader: raises on every rank when one failed, when the ranks hold
    different data (size, layout, content: `source_identity`) or were given different seeds; else the seed (rank 0's
    draw when None)."""
    drawn = int(torch.randint(0, 2**62, (1,)))
    given = -1 if seed is None or error is not None else seed
    ranks = agree(error, "memfit.loader", (given, drawn, n_total, *identity))
    whole = ("with distributed=True pass every rank the whole dataset (or its own shard of the same whole): each "
             "keeps its part of one shared order; when each rank holds only its own part (split beforehand), pass "
             "sharded=True")
    same_on_every_rank([v[2] for v in ranks], "data of different sizes", str, whole)
    same_on_every_rank([v[3] for v in ranks], "data encoded differently (layout hashes of the codec, its fit, the "
                        "normalisation, the decoded and target dtypes)", str,
                        "pass the same codec=, normalize=, dtype= and y_dtype= on every rank")
    for i, what in ((4, "samples (x)"), (5, "targets (y)")):
        same_on_every_rank([v[i] for v in ranks], f"different whole sets of the same size (checksums of the stored "
                            f"{what})", str, whole + " (the same files, rows in the same order)")
    same_on_every_rank([v[0] for v in ranks], "different seeds", lambda s: "None" if s < 0 else str(s),
                        "pass the same seed on every rank (or None on all: rank 0's draw is shared), else samples "
                        "repeat or go missing")
    return ranks[0][1] if ranks[0][0] < 0 else ranks[0][0]


def source_identity(src: Source, whole: bool) -> tuple[int, ...]:
    """(layout hash, checksums of the whole's stored x and y) of a source (`memfit.rank_data`): what every rank
    must share; (layout hash,) for a rank's own part (whole=False)."""
    from memfit.arrays import release_pages
    from memfit.rank_data import content_checksum, layout_hash, whole_checksums
    layout = layout_hash(src.template)
    if not whole:
        return (layout,)
    ds = getattr(src, "original", None)
    if isinstance(ds, CompactDataset):
        return layout, *(ds.shard_info.checksums if ds.shard_info is not None else whole_checksums(ds))
    mask = (1 << 63) - 1          # a file: its values as read (one more read of the file), its stored targets
    sums = layout, content_checksum(src.x) & mask, content_checksum(src.y) & mask
    release_pages(src.x)          # the pages read stay in the OS cache, not in this process's memory
    return sums


def agreed_parts(n: int, rank: int, layout: int) -> tuple[range, int, int, int]:
    """sharded=True: every rank's own part, in rank order, makes the whole. (this rank's positions in it, the
    whole's size, the smallest and the largest part), from one agreement, which also checks that every part is
    encoded alike (each rank encodes its own: an 'auto' or q8 codec fitted to each part can differ)."""
    ranks = agree(None, "memfit.loader parts", (n, layout))
    same_on_every_rank([v[1] for v in ranks], "parts encoded differently (layout hashes of the codec, its fit, the "
                        "normalisation, the decoded and target dtypes)", str,
                        "each rank encodes its own part, so pass codec= (a fixed one, e.g. codec='uint8', or a codec "
                        "fitted to the whole), normalize=(mean, std) of the whole, dtype= and y_dtype= on every rank")
    sizes = [v[0] for v in ranks]
    start = sum(sizes[:rank])
    return range(start, start + n), sum(sizes), min(sizes), max(sizes)


def same_on_every_rank(values: list[int], what: str, show, fix: str) -> None:
    """Raise ValueError listing every rank's value when they differ."""
    if len(set(values)) > 1:
        ranks = ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
        raise ValueError(f"the ranks were given {what} ({ranks}); {fix}")

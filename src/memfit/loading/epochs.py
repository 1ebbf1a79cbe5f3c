"""One epoch of a loader: the batches of `resident` (gathered from the data on the device) and of `stream` /
`macro` (decoded from blocks copied in the background), augmented where the loader has ops. `resident` decodes an
epoch's targets at once, in its order, where each sample has one (`targets_per_epoch`).

A batch's augmentation parameters are looked up by the ids of its samples in the whole data (`whole_ids`:
a rank's shard is a range of the whole), so they do not depend on the strategy, the batch size or the ranks.
`Unaugmented`: a loader's epoch read without its augmentation (what `memfit.evaluate` reads).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from memfit.compact import CompactDataset
from memfit.loading import order as order_mod
from memfit.loading.augmenter import EpochParams
from memfit.loading.pool import Decoder
from memfit.loading.prefetch import Inline, Prefetcher, Slots
from memfit.loading.sources import Source
from memfit.targets import Targets

__all__ = ["LoadedBatch", "Unaugmented", "epoch_targets", "pipeline_epoch", "resident_epoch", "targets_per_epoch",
           "whole_ids"]

LoadedBatch = tuple[torch.Tensor, torch.Tensor | None]


def whole_ids(positions: torch.Tensor, members: range | None) -> torch.Tensor:
    """Ids in the whole data of positions in a part of it (`members`: the part, a range of the whole; None:
    the part is the whole).

    Example:
        >>> whole_ids(torch.tensor([0, 2]), range(10, 20, 3)).tolist()
        [10, 16]
    """
    if members is None:
        return positions
    return positions.to(torch.int64) * members.step + members.start


def targets_per_epoch(targets: Targets | None) -> bool:
    """Whether the resident strategy decodes an epoch's targets at once, in its order (its batches' targets are then
    views of them: one slice a batch instead of a gather and a convert): for one value per sample (class ids, a
    float target), whose epoch takes `n * targets.decoded_nbytes` bytes (8 a sample for int64 class ids, in the
    ledger); larger targets (labels per position, several values, dicts) are decoded per batch."""
    return targets is not None and targets.single and targets.parts[None].shape == ()


def epoch_targets(ds: CompactDataset, order: torch.Tensor) -> torch.Tensor | None:
    """The decoded targets of `order` (`targets_per_epoch`), or None (decoded per batch)."""
    if ds.y is None or not targets_per_epoch(ds.targets):
        return None
    with torch.inference_mode(False):       # the epoch's batches may be read in and outside inference mode
        return ds.targets.decode(ds.y.index_select(0, order))


def resident_epoch(ds: CompactDataset, order: torch.Tensor, sizes: list[int], decode: Decoder,
                   params: EpochParams | None = None, members: range | None = None) -> Iterator[LoadedBatch]:
    # the order was made on the CPU and copied once per epoch: the same order on every device, strategy
    # and rank; each batch is then one gather + decode on the device (into reused buffers on the CPU)
    if params is None:
        ys, start = epoch_targets(ds, order), 0
        for idx in torch.split(order, sizes):
            m = idx.shape[0]
            yield decode.gather(idx), ds.targets_at(idx) if ys is None else ys[start:start + m]
            start += m
        return
    ids = whole_ids(order, members)
    for idx, who in zip(torch.split(order, sizes), torch.split(ids, sizes), strict=True):
        yield decode.batch(decode.rows_of(idx), None if ds.y is None else ds.y.index_select(0, idx), params.take(who))


def pipeline_epoch(source: Source, pieces: Iterator[torch.Tensor], sizes: list[int], capacity: int,
                   device: torch.device, prefetch: bool, decode: Decoder, spare: list[Slots],
                   params: EpochParams | None = None, members: range | None = None) -> Iterator[LoadedBatch]:
    """One epoch of `stream` or `macro`; its slots come from `spare` (the loader's, left by the last epoch)
    and go back there at the end: an epoch started while another runs makes its own. `params` (on the CPU,
    beside the order) are looked up per micro-batch and copied to the device with it."""
    blocks = order_mod.pack(sizes, capacity)
    totals = [sum(b) for b in blocks]
    idx = order_mod.rechunk(pieces, totals)          # made as the copies need them (on the copy thread)
    slots = spare.pop() if spare else Slots(source, capacity, device, count=2 if prefetch else 1, decode=decode)
    fetch = Prefetcher(slots, idx) if prefetch else Inline(slots, idx)
    try:
        for block, total in zip(blocks, totals, strict=True):
            slot = fetch.get()
            start = 0
            for m in block:
                p = None
                if params is not None:
                    p = [{k: v.to(device, non_blocking=True) for k, v in op.items()}
                         for op in params.take(whole_ids(slots.ids[slot][start:start + m], members))]
                batch = slots.batch(slot, start, m, p)
                start += m
                if start == total:               # last read of the slot is queued: hand it back first
                    fetch.release(slot)
                yield batch
                batch = None                     # hold no batch: its buffer is reused once the consumer drops it
    finally:                                     # break, consumer error, background error: stop the thread
        fetch.close()
        if not spare:                            # the thread has stopped: nothing writes the slots now
            spare.append(slots)


class Unaugmented:
    """A loader read without its augmentation: iterating gives the batches of the loader's next epoch (its
    order), decoded but not augmented, and does not count as one (the training epochs keep their seeds and
    orders). Every other attribute is the loader's."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self) -> Iterator[LoadedBatch]:
        ld = self.loader
        epoch = ld._epoch
        it = ld._run(epoch, augment=False)
        ld._epoch = epoch
        return it

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)

    def __repr__(self) -> str:
        return f"Unaugmented({self.loader!r})"

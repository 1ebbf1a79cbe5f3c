"""`loader()` and `Loader`: minibatches decoded on the device, by the strategy the budget allows.

Three ways to feed a computation, picked by budget:

| strategy   | where the compact data lives        | per batch                              |
|------------|-------------------------------------|----------------------------------------|
| `resident` | all on the device                   | one gather + decode there              |
| `stream`   | host; 2 batch buffers on the device | host gather -> compact copy -> decode  |
| `macro`    | host; 2 macro-batch buffers         | decode a view of the resident block    |

`stream` and `macro` share one pipeline: blocks of samples (one batch for `stream`, a macro-batch
for `macro`) are gathered on the host and copied compact into a slot in the background (a thread; on
CUDA through pinned staging and a side stream) while the consumer decodes micro-batches from the
other slot. Run: `python -m pytest -q tests/loading/test_minibatches.py`.

Example:
    >>> import numpy as np
    >>> x = np.random.default_rng(0).integers(0, 256, (1000, 1, 8, 8), dtype=np.uint8)
    >>> ld = loader((x, np.arange(1000) % 10), 128, device="cpu", seed=0, budget="64MiB")
    >>> ld.strategy, len(ld)
    ('resident', 8)
    >>> xb, yb = next(iter(ld))
    >>> xb.shape, xb.dtype, yb.dtype
    (torch.Size([128, 1, 8, 8]), torch.float32, torch.int64)
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from memfit.budget import check_count, resolve_budget
from memfit.compact import CompactDataset
from memfit.device.machine import resolve_device
from memfit.distributed import RankFailed, epoch_batch_sizes, is_distributed, rank_world, shard_sizes
from memfit.loading import order as order_mod
from memfit.loading.augmenter import Augmenter, check_ops
from memfit.loading.epochs import LoadedBatch, Unaugmented, pipeline_epoch, resident_epoch, targets_per_epoch
from memfit.loading.pool import Decoder
from memfit.loading.prefetch import Slots
from memfit.loading.rank_agreement import agreed_parts, agreed_seed, source_identity
from memfit.loading.sources import CompactSource, Source, make_source
from memfit.loading.strategy import Needs, StrategyChoice, check_names, choose
from memfit.targets import IGNORE_INDEX, Targets

__all__ = ["LoadedBatch", "Loader", "LoaderConfig", "Unaugmented", "loader"]

log = logging.getLogger("memfit.loader")


def _uses_dataset_statistics(normalize) -> bool:
    return normalize == "dataset" or (isinstance(normalize, dict) and "dataset" in normalize.values())


@dataclass(frozen=True)
class LoaderConfig:
    """How `loader` makes its minibatches: every option once, checked here (see `loader` for each in full).

    Example:
        >>> LoaderConfig(64, strategy="macro").prefetch
        True
        >>> LoaderConfig(64, shufle=True)
        Traceback (most recent call last):
        ...
        TypeError: LoaderConfig.__init__() got an unexpected keyword argument 'shufle'
        >>> LoaderConfig(0).checked()
        Traceback (most recent call last):
        ...
        ValueError: expected batch_size to be an int >= 1; found 0
    """
    batch_size: int                          # samples per batch
    strategy: str = "auto"                   # 'auto', 'resident', 'stream' or 'macro'
    budget: int | str | None = None          # device bytes; None: the device's free memory minus a margin
    device: object = None                    # where batches are decoded; None: the current CUDA device, else the CPU
    shuffle: bool = True                     # a new permutation each epoch, from `seed` and the epoch
    seed: int | None = None                  # None: drawn from torch's generator (rank 0's when distributed)
    drop_last: bool = False                  # leave out the last incomplete batch
    macro_batch: int | None = None           # samples per macro-batch; None: the largest that fits
    prefetch: bool = True                    # copy the next block in the background
    distributed: bool = False                # iterate this rank's shard
    codec: str = "auto"                      # how (x, y) arrays are encoded (see CompactDataset.from_arrays)
    normalize: object = None                 # ... normalised
    dtype: torch.dtype | str | None = None   # ... and decoded
    order: str = "auto"                      # 'auto', 'global' or 'blocks'
    sharded: bool = False                    # with distributed: data is this rank's own part, split beforehand
    y_dtype: torch.dtype | str | None = None  # how targets decode (None: from the array: class ids, labels, floats)
    ignore_index: int = IGNORE_INDEX         # the label that counts nowhere (-100; 255 in many segmentation sets)
    augment: tuple = ()                      # memfit.augment ops, applied in this order to every batch iterated

    def __post_init__(self):
        for name in ("distributed", "sharded"):        # needed first: they decide whether errors are agreed on
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"expected {name} to be True or False; found {getattr(self, name)!r}")
        if self.sharded and not self.distributed:
            raise ValueError("sharded=True says each rank holds its own part, so it needs distributed=True; found "
                             "distributed=False")

    def checked(self) -> LoaderConfig:
        """This config with every value checked (numpy ints as ints), or a ValueError / TypeError naming the
        option. (A `Loader` checks inside its construction, so that with `distributed` the ranks agree on
        a rank's bad option instead of waiting for it.)"""
        check_names(self.strategy, self.order)        # before the data is encoded (choose checks them again later)
        for name in ("shuffle", "drop_last", "prefetch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"expected {name} to be True or False; found {getattr(self, name)!r}")
        return replace(self, batch_size=check_count("batch_size", self.batch_size, 1),
                       seed=None if self.seed is None else check_count("seed", self.seed, 0),
                       augment=check_ops(self.augment))


class Loader:
    """Minibatches `(x, y)` decoded on `device`; build with `memfit.loader(...)`.

    Attributes:
        strategy: 'resident', 'stream' or 'macro' (what was chosen; `explain()` says why).
        macro_batch: samples per macro-batch (macro only), else None.
        order: the epoch order, 'global' or 'blocks'.
        choice: the `StrategyChoice` (strategy, byte ledger, why as fields; `.reason` in words); `nbytes`
            its device bytes; `budget` its budget.
        dataset: the CompactDataset that decodes the batches (codec, sample_shape, mean/std, num_classes).
        augment: the `memfit.augment` ops every iterated batch goes through, in order (empty: none);
            `targets` says what the batches' targets are (soft targets where MixUp or CutMix mix them);
            `unaugmented()` reads the same data without them (what `memfit.evaluate` does).
    """

    def __init__(self, data, config: LoaderConfig):
        self.config = config
        distributed = config.distributed
        if distributed and not is_distributed():
            raise ValueError("distributed=True needs an initialised torch.distributed process group; call "
                             "torch.distributed.init_process_group first (torchrun sets the environment)")
        # Distributed: every local step that can fail runs first, then one agreement (with a timeout)
        # shares the seed and the data size; a rank that failed makes every rank raise, none hangs.
        error = None
        try:
            self._build(data, config)
        except Exception as e:
            if not distributed or isinstance(e, RankFailed):      # every rank already knows: agree no further
                raise
            error = e
        if distributed:
            self.seed = agreed_seed(error, getattr(self, "seed", None), getattr(self, "_n_total", 0),
                                    getattr(self, "_identity", (0, 0, 0)) if error is None else (0, 0, 0))
        elif config.seed is None:
            self.seed = int(torch.randint(0, 2**62, (1,)))

    def _build(self, data, cfg: LoaderConfig) -> None:
        self.config = cfg = cfg.checked()
        self.batch_size = cfg.batch_size
        budget, macro_batch, strategy, order = cfg.budget, cfg.macro_batch, cfg.strategy, cfg.order
        distributed, drop_last, prefetch = cfg.distributed, cfg.drop_last, cfg.prefetch
        self.seed = cfg.seed
        self.device = resolve_device(cfg.device)
        self.shuffle, self.drop_last, self.prefetch, self.distributed = cfg.shuffle, drop_last, prefetch, distributed
        self.rank, self.world_size = 0, 1
        # the whole data is encoded (a file: its codec fitted, its statistics taken) before it is sharded:
        # every rank then decodes a sample as the whole decodes it, whichever shard holds it
        sharded = cfg.sharded
        if sharded and _uses_dataset_statistics(cfg.normalize):
            raise ValueError("normalize='dataset' with sharded=True would normalise each rank's part by its own "
                             "statistics, not the whole's; pass normalize=(mean, std) of the whole, or give every "
                             "rank the whole set (without sharded=True) so that it is normalised as one")
        self.source: Source = make_source(data, codec=cfg.codec, normalize=cfg.normalize, dtype=cfg.dtype,
                                          y_dtype=cfg.y_dtype, ignore_index=cfg.ignore_index)
        self._members, self._n_total = None, self.source.n
        if distributed:
            self.rank, self.world_size = rank_world()
            self._identity = source_identity(self.source, whole=True) if not sharded else (0, 0, 0)
            if not sharded:
                self.source, self._members, self._n_total = self.source.shard(self.rank, self.world_size)
        src = self.source
        if sharded:                     # the parts, in rank order, make the whole: one order over all of them
            self._members, self._n_total, self._n_min, self._n_max = agreed_parts(src.n, self.rank,
                                                                                  *source_identity(src, whole=False))
        else:
            sizes = shard_sizes(self._n_total, self.world_size)
            self._n_min, self._n_max = min(sizes), max(sizes)
        # every rank yields the same number of batches; without shards n_min = n_max = n (full, then the rest)
        self._sizes = epoch_batch_sizes(src.n, self._n_min, self._n_max, self.batch_size, drop_last)
        on_device = isinstance(src, CompactSource) and src.original.device == self.device
        limit = resolve_budget(budget, self.device)
        if budget is None and on_device:          # free memory no longer counts what the data already holds
            limit += src.original.nbytes
        self.budget = limit
        # On a CPU device, host and device are one memory: a background copy from memory competes with
        # the consumer for the same cores and measured slower than copying inline (0.4x vs 1.0x resident on
        # 2 cores), so the thread runs only where there is something to overlap: a bus copy or file reads.
        self.threaded = prefetch and (self.device.type == "cuda" or src.sequential)
        self.augment = cfg.augment
        self._augmenter = Augmenter(cfg.augment, src.template) if cfg.augment else None
        self.choice: StrategyChoice = choose(self._needs(on_device), limit, strategy, macro_batch, order)
        self.strategy, self.macro_batch, self.order = self.choice.strategy, self.choice.macro_batch, self.choice.order
        self.threaded = self.threaded and self.strategy != "resident"     # resident has nothing to copy
        self.dataset: CompactDataset = src.template
        self._resident = src.dataset(self.device) if self.strategy == "resident" else None
        if self.strategy == "resident":
            self.dataset = self._resident
        # decoded batches (and, resident, the gathered rows) go into reused host buffers: fresh
        # batch-sized allocations would fragment malloc's heap and grow host memory past the budget
        self._decode = Decoder(self.dataset, self.batch_size, self.device, self._augmenter,
                               resident=self.strategy == "resident")
        # the block buffers (two macro-batches, or two batches) outlive an epoch: one epoch's, freed into
        # malloc's heap (below glibc's 32 MiB mmap ceiling), had the labels and outputs the consumer keeps
        # land in them, and the next epoch's were new heap: anonymous memory grew ~2 blocks an epoch
        self._spare_slots: list[Slots] = []
        self._epoch = 0
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._closed = False
        log.info("memfit loader: %s", self.choice.reason)

    def _needs(self, on_device: bool) -> Needs:
        """What the strategy choice weighs: the data's and the batches' bytes, and where they are."""
        src, b, aug = self.source, self.batch_size, self._augmenter
        batch_nbytes, scratch = src.batch_nbytes(b), Decoder.scratch_nbytes(src.template, b)
        items, table = (), 0
        if aug is not None:
            items = (("augmentation buffers (1 batch)", aug.scratch_nbytes(b)),)
            if aug.sample_shape != tuple(src.template.sample_shape):    # unaugmented reads decode at full size
                items += (("unaugmented batches (2, for evaluate)", 2 * batch_nbytes + scratch),)
            batch_nbytes = aug.batch_nbytes(b)
            scratch = Decoder.scratch_nbytes(src.template, b, aug.sample_shape)
            table = aug.table_nbytes(self._n_total)
        targets = src.n * src.targets.decoded_nbytes if targets_per_epoch(src.targets) else 0
        return Needs(n=src.n, batch_size=b, row_nbytes=src.row_nbytes, batch_nbytes=batch_nbytes,
                     device_type=self.device.type, read_nbytes=src.read_nbytes, slots=2 if self.threaded else 1,
                     scratch_nbytes=scratch, n_total=self._n_total, distributed=self.distributed,
                     sequential=src.sequential, on_device=on_device, prefetch=self.prefetch,
                     augment_items=items, augment_table=table, epoch_targets=targets)

    # ---- public ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch (the same on every rank when distributed)."""
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes memfit holds on the device for this loader at the peak of an epoch (the choice's ledger)."""
        return self.choice.nbytes

    def explain(self) -> str:
        """Why this strategy: the byte figures of the choice and every buffer with its bytes; then how the
        data is stored (a lossy codec's error bound included) and augmented."""
        aug = "" if self._augmenter is None else "\n" + self._augmenter.describe()
        return self.choice.explain() + "\ndata: " + self.dataset.explain() + aug

    @property
    def targets(self) -> Targets | None:
        """What the iterated batches' targets are: the data's (`dataset.targets`), or soft targets (kind 'soft',
        float32 (B, classes)) where MixUp or CutMix mix the class ids."""
        return self.dataset.targets if self._augmenter is None else self._augmenter.targets

    def augment_parameters(self, epoch: int) -> list[dict[str, torch.Tensor]]:
        """Every sample's augmentation parameters in epoch `epoch`, one dict per op ({name: CPU tensor
        (n_total,)}, indexed by the sample's position in the whole data): what the batches of that epoch use."""
        if self._augmenter is None:
            return []
        return self._augmenter.draw_each(self.seed, check_count("epoch", epoch, 0), self._n_total)

    def unaugmented(self) -> Unaugmented:
        """The same loader read without its augmentation (what `memfit.evaluate` reads from an augmenting loader)."""
        return Unaugmented(self)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next `iter()` runs (its order is a function of `seed` and `epoch`)."""
        self._epoch = check_count("epoch", epoch, 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The positions (in this loader's data or shard) in the order epoch `epoch` visits them, whole
        (the loader itself makes a 'blocks' order one block at a time)."""
        return torch.cat(list(self._order_pieces(epoch)))

    def _order_pieces(self, epoch: int) -> Iterator[torch.Tensor]:
        """The epoch order in pieces: one for 'global', a block at a time for 'blocks'; this rank's samples."""
        n = self._n_total
        if self.order == "blocks":
            pieces = order_mod.blocks(n, self.macro_batch, self.seed, epoch, self.shuffle)
        else:
            pieces = iter([order_mod.permutation(n, self.seed, epoch, self.shuffle)])
        if self._members is None:
            return pieces
        return (order_mod.restrict(p, self._members) for p in pieces)

    def __iter__(self) -> Iterator[LoadedBatch]:
        return self._run(self._epoch, augment=True)

    def _run(self, epoch: int, augment: bool) -> Iterator[LoadedBatch]:
        """The batches of `epoch` (augmented where the loader has ops and `augment`); the next `iter()` runs
        the epoch after it."""
        if self._closed:
            raise ValueError("this loader is closed; build a new one with memfit.loader(...)")
        self._epoch = epoch + 1
        pieces = self._order_pieces(epoch)
        resident = self.strategy == "resident"
        params = None
        if augment and self._augmenter is not None:    # resident: looked up on the device; else beside the order
            params = self._augmenter.draw(self.seed, epoch, self._n_total, self.device if resident else None)
        if resident:           # global order, one piece: to the device once per epoch
            order = next(pieces)[:sum(self._sizes)]    # drop_last leaves the tail of the order out
            it = resident_epoch(self._resident, order.to(self.device, non_blocking=True), self._sizes,
                                self._decode, params, self._members)
        else:
            cap = self.macro_batch if self.strategy == "macro" else self.batch_size
            it = pipeline_epoch(self.source, pieces, self._sizes, cap, self.device, self.threaded, self._decode,
                                self._spare_slots, params, self._members)
        self._live.add(it)
        return it

    def close(self) -> None:
        """Stop every running epoch (joins its thread, frees its buffers) and drop the device data."""
        for it in list(self._live):
            it.close()
        self._live = weakref.WeakSet()
        self._resident = self._decode = None
        self._spare_slots.clear()
        self._closed = True

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Loader(strategy={self.strategy!r}, batch_size={self.batch_size}, macro_batch={self.macro_batch}, "
                f"batches={len(self)}, device={self.device}, nbytes={self.nbytes})")


def loader(data, batch_size: int, **options) -> Loader:
    """Minibatches of `data` decoded on `device`, by the strategy that fits `budget`.

    Args:
        data: a CompactDataset (on the CPU, pinned, or on the device), or an (x, y) tuple of arrays;
            a memory-mapped x (`memfit.readers.load_array('big.npy')`) stays on disk and is read
            macro-batch by macro-batch, encoded on the way. y may be None.
        batch_size: samples per batch.
        **options: the fields of `LoaderConfig` (an unknown name is refused):
        strategy: 'auto' (resident if it fits, else macro with the largest macro-batch, else stream),
            'resident', 'stream' or 'macro'.
        budget: device bytes (int or '2GiB'); default: the device's free memory minus a safety margin.
        device: where batches are decoded; None = the current CUDA device (cuda:0 unless
            torch.cuda.set_device chose another), else the CPU.
        shuffle: a new permutation each epoch (a function of `seed` and the epoch), else data order.
        seed: makes the orders reproducible; None draws one from torch's generator (rank 0's when
            distributed).
        drop_last: leave out the last incomplete batch.
        macro_batch: samples per macro-batch (a multiple of batch_size); None = the largest that fits.
        prefetch: copy the next block in the background (a thread; a side CUDA stream on GPU). On a CPU
            device it applies to file sources only (from memory, inline copies are faster: no overlap to win).
        distributed: iterate this rank's shard of the data. The ranks draw the same global permutation
            from the shared seed and each keeps its own samples in that order, so every sample is seen
            once per epoch across ranks. Every rank yields the same number of batches: when shards
            differ by one sample, a rank that would run out a batch early splits its last full batch
            in two (nothing is repeated or padded); with drop_last every rank yields
            smallest_shard // batch_size full batches. Arrays and files are encoded as a whole (codec
            range, normalisation, class count) before each rank keeps its shard, so a sample decodes
            the same on every rank (a file is read whole once for a q8/q4 range or normalize="dataset").
            The ranks must be given the same whole set (or their `CompactDataset.shard()`): sizes that
            differ raise on every rank.
        sharded: with `distributed`, `data` is this rank's own part, split beforehand (parts of any
            sizes): the parts in rank order make the whole, so the shared order, the equal batch counts
            (with drop_last: smallest_part // batch_size full batches, a larger part leaves more out) and
            "every sample once per epoch" hold over their union. Each rank encodes its own part:
            normalize="dataset" is refused (pass the whole's (mean, std)).
        augment: `memfit.augment` ops applied to every batch iterated, in the order given (e.g.
            `[memfit.augment.Crop(32, padding=4, mode="reflect"), memfit.augment.Flip()]`), on the device,
            from the stored codes (no float copy of the data). Each sample's parameters are drawn per epoch
            from (seed, epoch), so an augmented sample is the same under every strategy, batch size and rank
            layout. `memfit.evaluate` reads the loader unaugmented (`unaugmented()`); pass `iter(loader)` to
            evaluate augmented batches.
        codec, normalize, dtype, y_dtype, ignore_index: how (x, y) arrays are encoded and decoded (see
            `CompactDataset.from_arrays`: y may be class ids, labels, float targets or a dict of them); a
            CompactDataset keeps its own.
        order: the epoch order. 'global': one permutation of all samples (4 bytes a sample on the host;
            distributed, every rank draws the whole one: 9 bytes a sample of the whole while it is made).
            'blocks' (macro only): macro-batches of consecutive samples in a shuffled order, shuffled
            within, made one block at a time: host memory proportional to the macro-batch, for sets
            whose order would not fit in RAM. 'auto': 'blocks' for macro-batches read from a file,
            else 'global'. `explain()` says which one is used.

    Returns:
        A `Loader`: iterate it for `(x, y)` (x float (B, ...) normalised, y the decoded targets: int64 class
            ids (B,) or labels (B, ...), float targets, or a dict of them); `len()` is the
        number of batches; `.strategy`, `.explain()`, `.nbytes` say what it chose and holds.

    Raises:
        ValueError / TypeError: bad arguments (an unknown strategy is named).
        BudgetExceeded: a forced strategy (or any, for 'auto') does not fit the budget; the message
            lists every buffer and its bytes.

    Example:
        >>> import numpy as np
        >>> x = np.random.default_rng(0).integers(0, 256, (1000, 1, 8, 8), dtype=np.uint8)
        >>> ld = loader((x, np.arange(1000) % 10), 100, strategy="macro", macro_batch=300, device="cpu", seed=0)
        >>> ld.strategy, ld.macro_batch, len(ld), sum(len(y) for _, y in ld)
        ('macro', 300, 10, 1000)
    """
    return Loader(data, LoaderConfig(batch_size, **options))

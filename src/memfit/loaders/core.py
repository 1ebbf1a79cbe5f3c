"""`loader()` and `Loader`: minibatches decoded on the device, by the strategy the budget allows.

Seed 002 compares three ways to feed a computation; memfit names them and picks one by budget:

| strategy   | seed 002       | where the compact data lives       | per batch                              |
|------------|----------------|------------------------------------|----------------------------------------|
| `resident` | shared_all     | all on the device                  | one gather + decode there              |
| `stream`   | input          | host; 2 batch buffers on the device | host gather -> compact copy -> decode  |
| `macro`    | shared_batched | host; 2 macro-batch buffers        | decode a view of the resident block    |

`stream` and `macro` share one pipeline: blocks of samples (one batch for `stream`, a macro-batch
for `macro`) are gathered on the host and copied compact into a slot in the background (a thread; on
CUDA through pinned staging and a side stream) while the consumer decodes micro-batches from the
other slot. Run: `python -m pytest -q tests/test_loaders.py`.

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
from dataclasses import replace

import torch

from memfit.budget import check_count, resolve_budget, resolve_device
from memfit.dataset import CompactDataset
from memfit.distributed import all_reduce, epoch_batch_sizes, is_distributed, rank_world, shard_indices, shard_sizes
from memfit.loaders import order as order_mod
from memfit.loaders.plan import Needs, Plan, choose
from memfit.loaders.prefetch import Inline, Prefetcher, Slots
from memfit.loaders.source import CompactSource, Source, make_source

log = logging.getLogger("memfit.loader")

Batch = tuple[torch.Tensor, torch.Tensor | None]


def _shared_seed(seed: int | None, distributed: bool) -> int:
    """The seed, or one drawn from torch's generator (rank 0's, broadcast, when distributed)."""
    if seed is not None:
        return check_count("seed", seed, 0)
    drawn = int(torch.randint(0, 2**62, (1,)))
    if not distributed:
        return drawn
    t = torch.tensor([drawn if rank_world()[0] == 0 else 0], dtype=torch.int64)
    return int(all_reduce(t, what="loader seed")[0])


def _shard(data: object, rank: int, world: int) -> tuple[object, torch.Tensor, int]:
    """(this rank's part, its indices in the whole, the whole's size). Arrays are sliced (a memmap stays
    a memmap); a whole CompactDataset is sharded (copied); an already sharded one passes through."""
    if isinstance(data, CompactDataset):
        info = data.shard_info
        if info is None:
            part = data.shard(rank, world)
            return part, part.shard_info.indices, len(data)
        if (info.rank, info.world_size) != (rank, world):
            raise ValueError(f"the dataset is shard {info.rank} of {info.world_size}, but this process is rank "
                             f"{rank} of {world}; pass the whole dataset or this rank's shard")
        return data, info.indices, info.n_total
    if isinstance(data, tuple) and len(data) == 2 and hasattr(data[0], "__len__"):
        n = len(data[0])
        idx = shard_indices(n, rank, world)
        a, b = (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)
        y = data[1]
        if y is not None and len(y) != n:
            raise ValueError(f"x has {n} samples but y has {len(y)} labels; they must match")
        return (data[0][a:b], None if y is None else y[a:b]), idx, n
    return data, torch.empty(0, dtype=torch.int64), 0       # make_source names the bad type


class Loader:
    """Minibatches `(x, y)` decoded on `device`; build with `memfit.loader(...)`.

    Attributes:
        strategy: 'resident', 'stream' or 'macro' (what was chosen; `explain()` says why).
        macro_batch: samples per macro-batch (macro only), else None.
        plan: the `Plan` (strategy, byte ledger, reason); `nbytes` its device bytes; `budget` its budget.
        dataset: the CompactDataset that decodes the batches (codec, sample_shape, mean/std, num_classes).
    """

    def __init__(self, data, batch_size: int, *, strategy: str = "auto", budget: int | str | None = None,
                 device=None, shuffle: bool = True, seed: int | None = None, drop_last: bool = False,
                 macro_batch: int | None = None, prefetch: bool = True, distributed: bool = False,
                 codec: str = "auto", normalize=None, dtype: torch.dtype | str | None = None):
        self.batch_size = check_count("batch_size", batch_size, 1)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last), ("prefetch", prefetch),
                           ("distributed", distributed)):
            if not isinstance(flag, bool):
                raise TypeError(f"expected {name} to be True or False; found {flag!r}")
        self.device = resolve_device(device)
        self.shuffle, self.drop_last, self.prefetch, self.distributed = shuffle, drop_last, prefetch, distributed
        self.rank, self.world_size = 0, 1
        if distributed:
            if not is_distributed():
                raise ValueError("distributed=True needs an initialised torch.distributed process group; call "
                                 "torch.distributed.init_process_group first (torchrun sets the environment)")
            self.rank, self.world_size = rank_world()
            data, self._members, self._n_total = _shard(data, self.rank, self.world_size)
            sizes = shard_sizes(self._n_total, self.world_size)
            self._n_min, self._n_max = min(sizes), max(sizes)
        self.seed = _shared_seed(seed, distributed)
        self.source: Source = make_source(data, codec=codec, normalize=normalize, dtype=dtype)
        src = self.source
        if not distributed:
            self._members, self._n_total = None, src.n
            self._n_min = self._n_max = src.n
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
        needs = Needs(n=src.n, batch_size=self.batch_size, row_nbytes=src.row_nbytes,
                      batch_nbytes=src.batch_nbytes(self.batch_size), device_type=self.device.type,
                      read_nbytes=src.read_nbytes, slots=2 if self.threaded else 1)
        wanted = strategy
        if strategy == "auto" and on_device and self.device.type == "cuda":
            wanted = "resident"                   # already there: copying it back to stream it makes no sense
        self.plan: Plan = choose(needs, limit, wanted, macro_batch)
        if wanted != strategy:
            self.plan = _relabel(self.plan, strategy, f"the dataset is already on {self.device}")
        if prefetch and not self.threaded and self.plan.strategy != "resident":
            self.plan = replace(self.plan, reason=self.plan.reason + "; copies run inline (prefetch needs a CUDA "
                                "device or a file to overlap with: on the CPU a copy thread only competes for cores)")
        self.strategy, self.macro_batch = self.plan.strategy, self.plan.macro_batch
        self.threaded = self.threaded and self.strategy != "resident"     # resident has nothing to copy
        self.dataset: CompactDataset = src.template
        self._resident = src.dataset(self.device) if self.strategy == "resident" else None
        if self.strategy == "resident":
            self.dataset = self._resident
        self._epoch = 0
        self._live: weakref.WeakSet = weakref.WeakSet()
        self._closed = False
        log.info("memfit loader: %s", self.plan.reason)

    # ---- public ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch (the same on every rank when distributed)."""
        return len(self._sizes)

    @property
    def nbytes(self) -> int:
        """Bytes memfit holds on the device for this loader at the peak of an epoch (the plan's ledger)."""
        return self.plan.nbytes

    def explain(self) -> str:
        """Why this strategy: the byte figures of the choice and every buffer with its bytes."""
        return self.plan.explain()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next `iter()` runs (its order is a function of `seed` and `epoch`)."""
        self._epoch = check_count("epoch", epoch, 0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The positions (in this loader's data or shard) in the order epoch `epoch` visits them."""
        n = self._n_total
        if self.source.sequential and self.strategy == "macro":
            glob = order_mod.block_permutation(n, self.macro_batch, self.seed, epoch, self.shuffle)
        else:
            glob = order_mod.permutation(n, self.seed, epoch, self.shuffle)
        return glob if self._members is None else order_mod.restrict(glob, self._members, n)

    def __iter__(self) -> Iterator[Batch]:
        if self._closed:
            raise ValueError("this loader is closed; build a new one with memfit.loader(...)")
        epoch = self._epoch
        self._epoch += 1
        order = self.epoch_order(epoch)
        used = sum(self._sizes)             # drop_last leaves the tail of the order out
        if self.strategy == "resident":
            it = _resident_epoch(self._resident, order[:used].to(self.device, non_blocking=True), self._sizes)
        else:
            cap = self.macro_batch if self.strategy == "macro" else self.batch_size
            it = _pipeline_epoch(self.source, order[:used], self._sizes, cap, self.device, self.threaded)
        self._live.add(it)
        return it

    def close(self) -> None:
        """Stop every running epoch (joins its thread, frees its buffers) and drop the device data."""
        for it in list(self._live):
            it.close()
        self._live = weakref.WeakSet()
        self._resident = None
        self._closed = True

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Loader(strategy={self.strategy!r}, batch_size={self.batch_size}, macro_batch={self.macro_batch}, "
                f"batches={len(self)}, device={self.device}, nbytes={self.nbytes})")


def _relabel(plan: Plan, requested: str, why: str) -> Plan:
    return replace(plan, requested=requested, reason=f"strategy '{plan.strategy}' ({requested}): {why}; "
                                                      + plan.reason.split(": ", 1)[1])


def _resident_epoch(ds: CompactDataset, order: torch.Tensor, sizes: list[int]) -> Iterator[Batch]:
    # the order was made on the CPU and copied once per epoch (8 bytes a sample): the same order on
    # every device, strategy and rank; each batch is then one gather + decode on the device
    for idx in torch.split(order, sizes):
        yield ds.gather(idx)


def _pipeline_epoch(source: Source, order: torch.Tensor, sizes: list[int], capacity: int,
                    device: torch.device, prefetch: bool) -> Iterator[Batch]:
    blocks = order_mod.pack(sizes, capacity)
    idx = torch.split(order, [sum(b) for b in blocks])
    slots = Slots(source, capacity, device, count=2 if prefetch else 1)
    fetch = Prefetcher(slots, idx) if prefetch else Inline(slots, idx)
    try:
        for block, rows in zip(blocks, idx, strict=True):
            slot = fetch.get()
            start = 0
            for m in block:
                batch = slots.batch(slot, start, m)
                start += m
                if start == len(rows):           # last read of the slot is queued: hand it back first
                    fetch.release(slot)
                yield batch
    finally:                                     # break, consumer error, background error: stop the thread
        fetch.close()


def loader(data, batch_size: int, *, strategy: str = "auto", budget: int | str | None = None, device=None,
           shuffle: bool = True, seed: int | None = None, drop_last: bool = False, macro_batch: int | None = None,
           prefetch: bool = True, distributed: bool = False, codec: str = "auto", normalize=None,
           dtype: torch.dtype | str | None = None) -> Loader:
    """Minibatches of `data` decoded on `device`, by the strategy that fits `budget`.

    Args:
        data: a CompactDataset (on the CPU, pinned, or on the device), or an (x, y) tuple of arrays;
            a memory-mapped x (`memfit.datasets.load_array('big.npy')`) stays on disk and is read
            macro-batch by macro-batch, encoded on the way. y may be None.
        batch_size: samples per batch.
        strategy: 'auto' (resident if it fits, else macro with the largest macro-batch, else stream),
            'resident', 'stream' or 'macro'.
        budget: device bytes (int or '2GiB'); default: the device's free memory minus a safety margin.
        device: where batches are decoded; None = first CUDA device, else the CPU.
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
            smallest_shard // batch_size full batches.
        codec, normalize, dtype: how (x, y) arrays are encoded and decoded (see
            `CompactDataset.from_arrays`); a CompactDataset keeps its own.

    Returns:
        A `Loader`: iterate it for `(x, y)` (x float (B, ...) normalised, y int64 (B,)); `len()` is the
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
    return Loader(data, batch_size, strategy=strategy, budget=budget, device=device, shuffle=shuffle, seed=seed,
                  drop_last=drop_last, macro_batch=macro_batch, prefetch=prefetch, distributed=distributed,
                  codec=codec, normalize=normalize, dtype=dtype)

"""The real peak bytes of one training step on this rank of a running process group (DDP or FSDP2), counted
at the CPU allocator: what the per-rank memory model (`memfit.memory.ranks`) is checked against.

`measure_rank_step(build, example, make_optimizer)` builds the model (and its wrapping: `build` returns the
`DistributedDataParallel` or `fully_shard`-ed module) and the optimizer, runs one step unmeasured (optimizer
state and the wrappers' lazy state exist after it: DDP rebuilds its buckets, FSDP2 initialises its root) and
returns the most bytes live during a second step, counted from before the model was built: everything the
rank holds at that moment (parameters, shards, optimizer state, DDP's buckets, FSDP's buffers) is in it.

The bytes are `memfit.memory.measure.track_memory`'s, with every_thread=True: the allocator's running total
of every thread, since gloo's worker threads free tensors the rank's thread allocated (a collective's
tensors, held by its work object) and a count of this thread's events alone would only grow. Op outputs are
not enough here: FSDP2 frees and re-allocates its unsharded parameters by resizing storages (no op output),
and DDP's reducer keeps its buckets in C++.

Known limitations: the total is read at the rank thread's allocations and frees, so a peak reached inside
gloo's threads between two of them is missed; gloo's own scratch buffers (not torch tensors) are not counted.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from memfit.memory.measure import track_memory
from memfit.memory.step import ExampleBatch, training_step

__all__ = ["measure_rank_step"]

_MARK = "memfit::measured_step"


def measure_rank_step(build: Callable[[], torch.nn.Module], example, make_optimizer: Callable,
                      loss_fn: Callable | None = None, target=None, *, n: int | None = None) -> int:
    """Bytes live at this rank's peak of one training step, counted at the allocator from before `build()`.

    Args:
        build: makes the model and wraps it (DDP, fully_shard), on the CPU.
        example: a batch (or a sample shape, with n).
        make_optimizer: `make_optimizer(params)` -> the optimizer.
        n: the batch size when `example` is a sample shape.
    """
    from torch.profiler import record_function
    gc.collect()
    with track_memory("cpu", every_thread=True) as mem:
        batch = ExampleBatch(example).at(n, torch.device("cpu")) if n is not None else example
        model = build()
        opt = make_optimizer(model.parameters())
        training_step(model, batch, opt, loss_fn, target)
        gc.collect()                           # garbage of the first step, as a running loop's collector would
        enabled = gc.isenabled()
        gc.disable()                           # as the prediction: cycles freed at the step's end, not mid-step
        try:
            with record_function(_MARK):
                training_step(model, batch, opt, loss_fn, target)
        finally:
            if enabled:
                gc.enable()
    return mem.peak_within(_MARK)

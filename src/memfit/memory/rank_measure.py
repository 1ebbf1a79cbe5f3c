"""The real peak bytes of one training step on this rank of a running process group (DDP or FSDP2), counted
at the CPU allocator: what the per-rank memory model (`memfit.memory.ranks`) is checked against.

`measure_rank_step(build, example, make_optimizer)` builds the model (and its wrapping: `build` returns the
`DistributedDataParallel` or `fully_shard`-ed module) and the optimizer, runs one step unmeasured (optimizer
state and the wrappers' lazy state exist after it: DDP rebuilds its buckets, FSDP2 initialises its root) and
returns the most bytes live during a second step, counted from before the model was built: everything the
rank holds at that moment (parameters, shards, optimizer state, DDP's buckets, FSDP's buffers) is in it.

Why the allocator and not `memfit.memory.measure.track_memory`'s op-output count: FSDP2 frees and
re-allocates its unsharded parameters by resizing storages (no op output), and DDP's reducer keeps its
buckets in C++ (their Python tensors die while the storage lives), so counting op outputs misses both. The
CPU allocator reports every allocation and free, resizes included, with its running total, to
`torch.profiler` (profile_memory); this module reads that total. Once `track_memory` counts what the
allocator counts, this can call it.

Known limitations: the total is read at the rank thread's allocations and frees, so a peak reached inside
gloo's threads between two of them is missed; gloo's own scratch buffers (not torch tensors) are not counted.
"""

from __future__ import annotations

import ctypes
import gc
import os
from collections.abc import Callable
from contextlib import contextmanager

import torch

from memfit.memory.step import ExampleBatch, training_step

__all__ = ["measure_rank_step"]

_MARK = "memfit::measured_step"


@contextmanager
def _every_thread_counted():
    """Have the CPU allocator's reporter keep its running total for every thread, not only the profiled one
    (c10's flag `caffe2_report_cpu_memory_usage`): gloo's threads free tensors the rank's thread allocated (a
    collective's input held by its work object), and a total that missed those frees would only grow."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)


def _peak_in(prof) -> int:
    """The allocator's most bytes (above the profile's start) at any allocation or free during the `_MARK`
    range of a finished profile."""
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    span = [(e.start_time_ns, e.end_time_ns) for e in events if e.name == _MARK]
    if len(span) != 1:
        raise RuntimeError(f"expected one '{_MARK}' range in the profile; found {len(span)}")
    allocs = sorted((e.start_time_ns, e.extra_fields.total_allocated, e.extra_fields.alloc_size)
                    for e in events if type(e.extra_fields).__name__ == "_ExtraFields_Allocation")
    if not allocs:
        raise RuntimeError("the profile holds no allocation: was profile_memory on?")
    base = allocs[0][1] - allocs[0][2]               # the total before the first allocation profiled
    t0, t1 = span[0]
    inside = [total for t, total, _ in allocs if t0 <= t <= t1]
    before = [total for t, total, _ in allocs if t < t0]
    return max(inside + before[-1:]) - base


def measure_rank_step(build: Callable[[], torch.nn.Module], example, make_optimizer: Callable,
                      loss_fn: Callable | None = None, target=None, *, n: int | None = None) -> int:
    """Bytes live at this rank's peak of one training step, counted at the allocator from before `build()`.

    Args:
        build: makes the model and wraps it (DDP, fully_shard), on the CPU.
        example: a batch (or a sample shape, with n).
        make_optimizer: `make_optimizer(params)` -> the optimizer.
        n: the batch size when `example` is a sample shape.
    """
    from torch.profiler import ProfilerActivity, profile, record_function
    gc.collect()
    with _every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    return _peak_in(prof)

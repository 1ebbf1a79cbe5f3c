"""PyTorch's CUDA caching allocator, replayed: what the real one would reserve, hand out and refuse for a sequence
of allocations and frees, from any machine (a pure function: no CUDA call).

`replay(events)` takes `(key, nbytes)` or `(key, nbytes, stream)` tuples in program order: nbytes > 0 allocates a
block for `key`, nbytes < 0 frees it (its bytes as allocated: the shape of `memory.storage_log`'s log), 0 is no
block (c10 hands out nullptr for 0 bytes). It gives the peak reserved bytes (`torch.cuda.max_memory_reserved`),
the peak allocated bytes (`torch.cuda.max_memory_allocated`: block sizes, rounded), the segments and the largest
cached free block when reserved first peaked, and, with a `capacity`, whether and where the allocator runs out of
memory. The rules, with where each comes from in c10, are in `memfit.device.cuda_blocks`; the settings
(`PYTORCH_CUDA_ALLOC_CONF`) in `memfit.device.cuda_alloc_conf`.

Simplified, said plainly:
- a freed block is reusable at once: `record_stream` and its events are not modelled (c10 holds a block used on
  a second stream until that stream's work ends), nor the free-memory callbacks, CUDA graph pools or IPC;
- each new segment lies above every earlier one (the driver's addresses are unknown): this only decides ties
  between cached free blocks of equal size in different segments;
- `throw_on_cudamalloc_oom:True` and `backend:cudaMallocAsync` are refused, not modelled;
  `per_process_memory_fraction` acts as `torch.cuda.set_per_process_memory_fraction` called before the events;
- under `expandable_segments` with `max_split_size_mb`, c10 asserts when it would free an oversize expandable
  block (`release_available_cached_blocks`); the replay skips that step;
- an expandable segment counts as one segment whatever its mapped ranges (c10's snapshot lists each range);
- the rules are c10's as stored at commit 001074d2 with torch 2.14.1's constants and settings: its
  `large_segment_size_mb` is applied where c10's XPU allocator of the same period applies it (the 1-10 MiB
  segments and the expandable large page); at its default (20 MiB) both are c10's kLargeBuffer.

Example:
    >>> r = replay([("a", 1 << 20), ("b", (1 << 20) + 1)])   # 1 MiB: the small pool; 1 MiB + 1 B: the large
    >>> r.peak_reserved == (2 << 20) + (20 << 20), r.peak_allocated == (2 << 20) + 512
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.device.cuda_alloc_conf import AllocatorConfig
from memfit.device.cuda_blocks import CachingAllocator, Segment, allocation_size, round_size

__all__ = ["OutOfMemory", "Replay", "replay"]


@dataclass(frozen=True)
class OutOfMemory:
    """The request the allocator could not serve, even after freeing its cache."""
    event: int          # index into the events replayed
    key: object
    requested: int      # bytes asked for
    segment: int        # the segment c10 tried to get (its "Tried to allocate")
    reserved: int       # reserved when it failed (after freeing the cache)
    allocated: int


@dataclass(frozen=True)
class Replay:
    """What the caching allocator does with a sequence of events (from `replay`), in bytes.

    `peak_reserved` / `peak_allocated` are torch.cuda.max_memory_reserved / max_memory_allocated over the
    events replayed (up to the failure, if any); the `_event` fields index the event that first reached them.
    """
    peak_reserved: int
    peak_allocated: int
    peak_reserved_event: int
    peak_allocated_event: int
    segments_at_peak: tuple[Segment, ...]   # the segments when reserved first peaked
    largest_free_at_peak: int               # the largest cached free block then (torch's cacheInfo)
    reserved: int                           # at the end
    allocated: int
    cuda_mallocs: int                       # segments allocated or pages mapped (num_device_alloc)
    cuda_frees: int                         # segments freed or pages unmapped (num_device_free)
    alloc_retries: int                      # cudaMalloc retried after freeing every cached segment
    oom: OutOfMemory | None
    config: AllocatorConfig

    @property
    def fits(self) -> bool:
        """Whether every request was served."""
        return self.oom is None


def replay(events, config: AllocatorConfig | str | None = None, capacity: int | None = None,
           device_total: int | None = None, memory_fraction: float | None = None) -> Replay:
    """Serve `events` as the CUDA caching allocator would and say what it reserves and hands out.

    Args:
        events: `(key, nbytes)` or `(key, nbytes, stream)` tuples; nbytes > 0 allocates for `key` (a key not live),
            nbytes < 0 frees it (the bytes it was allocated with), 0 is no block. Streams keep separate pools.
        config: an `AllocatorConfig`, a `PYTORCH_CUDA_ALLOC_CONF` string, or None for c10's defaults (the
            environment is not read here: `AllocatorConfig.from_env()` does).
        capacity: the bytes cudaMalloc can reserve in all (the device's free memory once the CUDA context and
            what lies outside the allocator are taken); None: unlimited.
        device_total: the device's total memory (`memory_fraction` is of it, as in c10; and the address space of an
            expandable segment); defaults to `capacity`.
        memory_fraction: as `torch.cuda.set_per_process_memory_fraction(memory_fraction)` before the events.

    Example:
        >>> r = replay([(0, 8 << 20), (0, -(8 << 20)), (1, 9 << 20)], capacity=20 << 20)
        >>> r.peak_reserved >> 20, r.fits         # both fit in one 20 MiB segment, the second in the cached block
        (20, True)
    """
    if not isinstance(config, AllocatorConfig):
        config = AllocatorConfig() if config is None else AllocatorConfig.parse(config)
    if config.backend != "native":
        raise ValueError(f"backend:{config.backend} hands memory to CUDA's own pool (cudaMallocAsync), which this "
                         "replay of the native caching allocator does not model; drop backend from the config")
    if config.throw_on_cudamalloc_oom:
        raise ValueError("throw_on_cudamalloc_oom:True refuses a cudaMalloc before trying it, by a rule this replay "
                         "does not model; drop it from the config to replay the default behaviour")
    a = CachingAllocator(config, capacity, device_total, memory_fraction)
    live: dict = {}
    peak_r = peak_a = 0
    peak_r_event = peak_a_event = -1
    segments, largest = (), 0
    oom = None
    for i, event in enumerate(events):
        key, nbytes = event[0], event[1]
        if nbytes > 0:
            if key in live:
                raise ValueError(f"event {i}: key {key!r} allocated while still live; free it first, or give "
                                 "each allocation its own key")
            block = a.malloc(nbytes, event[2] if len(event) > 2 else 0)
            if block is None:
                oom = OutOfMemory(i, key, nbytes, allocation_size(round_size(nbytes, config), config),
                                  a.reserved, a.allocated)
                break
            live[key] = block
            if a.allocated > peak_a:
                peak_a, peak_a_event = a.allocated, i
            if a.reserved > peak_r:
                peak_r, peak_r_event = a.reserved, i
                segments, largest = a.snapshot()
        elif nbytes < 0:
            block = live.pop(key, None)
            if block is None:
                raise ValueError(f"event {i}: key {key!r} freed but not live (never allocated, or freed already)")
            if block.orig != -nbytes:
                raise ValueError(f"event {i}: key {key!r} freed as {-nbytes} bytes but allocated as {block.orig}; "
                                 "a free gives the bytes of its allocation")
            a.free(block)
    return Replay(peak_r, peak_a, peak_r_event, peak_a_event, segments, largest, a.reserved, a.allocated,
                  a.mallocs, a.frees, a.retries, oom, config)

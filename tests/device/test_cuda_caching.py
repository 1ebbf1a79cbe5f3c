"""The CUDA caching allocator's replay: hand-worked traces for each of c10's rules (the figures worked out from
c10/cuda/CUDACachingAllocator.cpp by hand, in the comments) and properties over random traces."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit.device.cuda_alloc_conf import AllocatorConfig
from memfit.device.cuda_blocks import round_size
from memfit.device.cuda_caching import replay

MiB = 1 << 20


def test_one_mib_is_small_and_one_more_byte_is_large():
    small = replay([("a", MiB)])           # kSmallSize: 1 MiB is the largest small request -> a 2 MiB segment
    assert (small.peak_reserved, small.peak_allocated, small.largest_free_at_peak) == (2 * MiB, MiB, MiB)
    large = replay([("a", MiB + 1)])       # 1 MiB + 512 B: large pool, below 10 MiB -> a 20 MiB segment, split
    assert (large.peak_reserved, large.peak_allocated) == (20 * MiB, MiB + 512)
    assert large.largest_free_at_peak == 20 * MiB - (MiB + 512)
    assert [(s.size, s.pool) for s in large.segments_at_peak] == [(20 * MiB, "large")]


def test_a_split_serves_the_next_request_from_the_remainder():
    r = replay([("a", 3 * MiB), ("b", 3 * MiB)])     # one 20 MiB segment: 3 + 17, then 3 + 3 + 14
    assert (r.peak_reserved, r.peak_allocated, r.cuda_mallocs) == (20 * MiB, 6 * MiB, 1)


def test_freed_neighbours_merge_and_an_unsplit_remainder_counts_as_allocated():
    # both 3 MiB blocks freed merge back into the whole 20 MiB block; 19 MiB fits it, and the 1 MiB left is not
    # more than kSmallSize so it is not split off: the block handed out (and counted allocated) is 20 MiB
    r = replay([("a", 3 * MiB), ("b", 3 * MiB), ("a", -3 * MiB), ("b", -3 * MiB), ("c", 19 * MiB)])
    assert (r.peak_reserved, r.allocated, r.cuda_mallocs) == (20 * MiB, 20 * MiB, 1)
    unmerged = replay([("a", 3 * MiB), ("b", 3 * MiB), ("b", -3 * MiB), ("c", 19 * MiB)])  # a still holds the front
    assert unmerged.peak_reserved == 40 * MiB


def test_a_cached_block_too_small_means_a_new_segment():
    r = replay([("a", 12 * MiB), ("a", -12 * MiB), ("b", 13 * MiB)])  # 12 MiB cached < 13 MiB: a 14 MiB segment
    assert (r.peak_reserved, r.allocated, r.cuda_mallocs) == (26 * MiB, 14 * MiB, 2)
    fits = replay([("a", 12 * MiB), ("a", -12 * MiB), ("b", 11 * MiB)])  # 11 MiB takes the 12 MiB, 1 MiB not split
    assert (fits.peak_reserved, fits.allocated) == (12 * MiB, 12 * MiB)


def test_streams_do_not_share_cached_blocks():
    r = replay([("a", 3 * MiB, 1), ("a", -3 * MiB, 1), ("b", 3 * MiB, 0)])
    assert r.peak_reserved == 40 * MiB and len(r.segments_at_peak) == 2


def test_a_failed_cudamalloc_frees_the_cache_and_retries_once():
    # 12 MiB cached + a 16 MiB segment > 24 MiB: the cache is freed (num_alloc_retries 1) and the retry fits
    r = replay([("a", 12 * MiB), ("a", -12 * MiB), ("b", 16 * MiB)], capacity=24 * MiB)
    assert r.fits and (r.peak_reserved, r.reserved, r.alloc_retries, r.cuda_frees) == (16 * MiB, 16 * MiB, 1, 1)
    held = replay([("a", 12 * MiB), ("b", 16 * MiB)], capacity=24 * MiB)   # nothing cached to free: out of memory
    assert not held.fits and held.alloc_retries == 1
    assert (held.oom.event, held.oom.key, held.oom.segment, held.oom.reserved) == (1, "b", 16 * MiB, 12 * MiB)
    assert held.peak_reserved == 12 * MiB                                   # the peaks up to the failure


def test_expandable_segments_grow_one_segment_by_pages():
    # batch N then N + 1: three 21 MiB blocks freed, then three 23 MiB ones. Segments of their own: 22 MiB each
    # (1 MiB remainders not split), none of which fits 23 MiB: 3 x 22 + 3 x 24 = 138 MiB reserved.
    trace = [(i, 21 * MiB) for i in range(3)] + [(i, -21 * MiB) for i in range(3)] + \
        [(10 + i, 23 * MiB) for i in range(3)]
    assert replay(trace).peak_reserved == 138 * MiB
    # one segment grown by 20 MiB pages: 40 (21 + 19), 60 (21 + 21 + 18), 80 MiB (21 x 3 + 17); freed, the 80 MiB
    # merge into one block the 23 MiB requests split (remainders of at least 512 B are split under expandable)
    r = replay(trace, "expandable_segments:True")
    assert (r.peak_reserved, r.peak_allocated, r.cuda_mallocs) == (80 * MiB, 69 * MiB, 3)
    assert [(s.size, s.expandable) for s in r.segments_at_peak] == [(80 * MiB, True)]


def test_expandable_segments_unmap_free_pages_before_the_retry():
    # a = 30 MiB maps 2 pages (30 + 10); b = 25 MiB maps 1 more (60 MiB: 30 + 25 + 5); a freed. c = 35 MiB: no
    # cached block fits, growing from the 5 MiB at the end needs 2 pages (100 MiB > 80). The free pages go back:
    # page 0 lies whole inside a's 30 MiB (40 MiB reserved), and the retry maps the 2 pages (80 MiB)
    trace = [("a", 30 * MiB), ("b", 25 * MiB), ("a", -30 * MiB), ("c", 35 * MiB)]
    r = replay(trace, "expandable_segments:True", capacity=80 * MiB)
    assert r.fits and (r.peak_reserved, r.alloc_retries, r.cuda_frees) == (80 * MiB, 1, 1)
    assert not replay(trace, "expandable_segments:True", capacity=60 * MiB).fits
    # the same without expandable segments: 30 + 26 + 36 > 80, a's segment freed, 62 MiB
    flat = replay(trace, capacity=80 * MiB)
    assert flat.fits and (flat.peak_reserved, flat.alloc_retries) == (62 * MiB, 1)


def test_max_split_size_keeps_oversize_blocks_whole():
    trace = [("a", 50 * MiB), ("a", -50 * MiB), ("b", 12 * MiB)]
    assert replay(trace).peak_reserved == 50 * MiB                  # 12 MiB split off the cached 50 MiB block
    r = replay(trace, "max_split_size_mb:40")                         # a request below 40 MiB never takes it
    assert (r.peak_reserved, r.cuda_mallocs) == (62 * MiB, 2)
    # a request of at least max_split_size takes a block less than max_non_split_rounding (20 MiB) larger, whole
    big = replay([("a", 50 * MiB), ("a", -50 * MiB), ("b", 45 * MiB)], "max_split_size_mb:40")
    assert (big.peak_reserved, big.allocated) == (50 * MiB, 50 * MiB)
    far = replay([("a", 70 * MiB), ("a", -70 * MiB), ("b", 45 * MiB)], "max_split_size_mb:40")
    assert far.peak_reserved == 116 * MiB                              # 70 >= 45 + 20: a new 46 MiB segment
    # over capacity, the cached oversize block is freed first (release_available_cached_blocks), no full retry
    tight = replay(trace, "max_split_size_mb:40", capacity=60 * MiB)
    assert tight.fits and (tight.reserved, tight.alloc_retries, tight.cuda_frees) == (12 * MiB, 0, 1)


def test_roundup_power2_divisions_round_the_block():
    r = replay([("a", 1200 << 10)], "roundup_power2_divisions:4")    # 1 MiB..2 MiB in 4 steps: 1280 KiB
    assert r.peak_allocated == 1280 << 10 == round_size(1200 << 10, r.config)


def test_garbage_collection_frees_old_cached_blocks_under_a_memory_fraction():
    trace = [("a", 30 * MiB), ("b", 30 * MiB), ("a", -30 * MiB), ("b", -30 * MiB), ("c", 40 * MiB)]
    kept = replay(trace, device_total=100 * MiB, memory_fraction=1.0)
    assert (kept.peak_reserved, kept.reserved) == (100 * MiB, 100 * MiB)
    # 60 MiB reserved > 0.5 x 100 MiB: both cached blocks, as old as their average, are freed before the 40 MiB
    gc = replay(trace, "garbage_collection_threshold:0.5", device_total=100 * MiB, memory_fraction=1.0)
    assert (gc.peak_reserved, gc.reserved, gc.cuda_frees) == (60 * MiB, 40 * MiB, 2)
    # without a memory fraction c10 never collects
    assert replay(trace, "garbage_collection_threshold:0.5").reserved == 100 * MiB
    # the fraction itself is a limit: 0.5 x 100 MiB allowed
    assert not replay([("a", 30 * MiB), ("b", 30 * MiB)], device_total=100 * MiB, memory_fraction=0.5).fits


def test_bad_events_and_unmodelled_settings_are_refused():
    with pytest.raises(ValueError, match="key 'a' freed but not live"):
        replay([("a", -512)])
    with pytest.raises(ValueError, match="allocated while still live"):
        replay([("a", 512), ("a", 512)])
    with pytest.raises(ValueError, match="freed as 256 bytes but allocated as 512"):
        replay([("a", 512), ("a", -256)])
    with pytest.raises(ValueError, match="cudaMallocAsync"):
        replay([], "backend:cudaMallocAsync")
    with pytest.raises(ValueError, match="throw_on_cudamalloc_oom"):
        replay([], "throw_on_cudamalloc_oom:True")
    with pytest.raises(ValueError, match="give device_total"):
        replay([], memory_fraction=0.5)
    assert replay([("a", 0), ("a", 0)]).peak_reserved == 0          # 0 bytes: no block, as c10's nullptr


SIZES = st.one_of(st.integers(1, 4096), st.integers(1, MiB), st.integers(MiB, 12 * MiB), st.integers(MiB, 64 * MiB))
CONFIGS = st.sampled_from([None, "expandable_segments:True", "max_split_size_mb:24", "roundup_power2_divisions:4",
                           "max_split_size_mb:32,roundup_power2_divisions:[1:2,>:8]"])


@st.composite
def traces(draw):
    """Allocations and frees in a random order on one or two streams; each free of a live key."""
    events, live = [], []
    for i in range(draw(st.integers(1, 60))):
        if live and draw(st.booleans()):
            key, n, stream = live.pop(draw(st.integers(0, len(live) - 1)))
            events.append((key, -n, stream))
        else:
            live.append((i, draw(SIZES), draw(st.sampled_from([0, 0, 1]))))
            events.append(live[-1])
    return events, live


@settings(max_examples=40)
@given(traces(), CONFIGS)
def test_reserved_covers_allocated_and_blocks_are_rounded(trace, config):
    events, live = trace
    r = replay(events, config)
    assert r.peak_reserved >= r.peak_allocated and r.reserved >= r.allocated
    assert r.allocated % 512 == 0 and r.allocated >= sum(round_size(n, r.config) for _, n, _ in live)
    assert r.peak_reserved == max(r.reserved, r.peak_reserved) and r.largest_free_at_peak <= r.peak_reserved


@settings(max_examples=40)
@given(traces(), CONFIGS, st.data())
def test_peaks_are_monotone_in_the_trace_prefix(trace, config, data):
    events, _ = trace
    cut = data.draw(st.integers(0, len(events)))
    full, prefix = replay(events, config), replay(events[:cut], config)
    assert prefix.peak_reserved <= full.peak_reserved and prefix.peak_allocated <= full.peak_allocated


@settings(max_examples=40)
@given(traces(), CONFIGS)
def test_freeing_everything_leaves_nothing_allocated_and_the_segments_cached(trace, config):
    events, live = trace
    before = replay(events, config)
    after = replay(events + [(k, -n, s) for k, n, s in live], config)
    assert after.allocated == 0 and after.reserved == before.reserved and after.peak_reserved == before.peak_reserved


@settings(max_examples=40)
@given(traces(), CONFIGS)
def test_a_capacity_binds_only_below_the_peak(trace, config):
    events, _ = trace
    free = replay(events, config)
    roomy = replay(events, config, capacity=free.peak_reserved)
    assert roomy.fits and (roomy.peak_reserved, roomy.peak_allocated, roomy.segments_at_peak) == \
        (free.peak_reserved, free.peak_allocated, free.segments_at_peak)
    if free.peak_reserved:
        tight = replay(events, config, capacity=free.peak_reserved - 512)
        assert not tight.fits or tight.alloc_retries or tight.cuda_frees     # it had to give something back
        assert tight.peak_reserved <= free.peak_reserved - 512


@pytest.mark.cuda
def test_the_replay_equals_the_real_allocator():
    """The reference itself: a random trace served by torch's allocator on a fresh stream (its pools start empty,
    whatever the process cached before) under this process's PYTORCH_CUDA_ALLOC_CONF."""
    rng, events, live = random.Random(0), [], []
    for i in range(400):
        if live and rng.random() < 0.45:
            key, n = live.pop(rng.randrange(len(live)))
            events.append((key, -n))
        else:
            n = rng.choice([rng.randint(1, 4096), rng.randint(1, MiB), rng.randint(MiB, 12 * MiB),
                            rng.randint(MiB, 48 * MiB)])
            live.append((i, n))
            events.append(live[-1])
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    tensors = {}
    with torch.cuda.stream(stream):
        for key, n in events:
            if n > 0:
                tensors[key] = torch.empty(n, dtype=torch.uint8, device="cuda")
            else:
                del tensors[key]
    real = (torch.cuda.max_memory_reserved() - reserved, torch.cuda.max_memory_allocated() - allocated,
            torch.cuda.memory_reserved() - reserved, torch.cuda.memory_allocated() - allocated)
    r = replay(events, AllocatorConfig.from_env())
    assert real == (r.peak_reserved, r.peak_allocated, r.reserved, r.allocated)

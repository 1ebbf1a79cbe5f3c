"""The caching allocator's sizes and its state stepped by hand (the rules: memfit/device/cuda_blocks.py)."""

import pytest

from memfit.device.cuda_alloc_conf import AllocatorConfig
from memfit.device.cuda_blocks import CachingAllocator, allocation_size, round_size

MiB = 1 << 20


@pytest.mark.parametrize("nbytes, divisions, expected", [
    (1, 0, 512), (512, 0, 512), (513, 0, 1024), (MiB + 1, 0, MiB + 512),
    # c10's own comment: 1200 between 1024 and 2048 in 4 divisions rounds to 1280 (in MiB here: the first interval)
    (1200 << 10, 4, 1280 << 10), (1024 << 10, 4, 1024 << 10),      # a power of two stays
    (1536 << 10, 4, 1536 << 10),                                    # on a division: stays
    (1000, 4, 1024),            # not above 512 x divisions (2048): 512-byte rounding
    (3000, 4, 3072),            # above 2048: between 2048 and 4096 in steps of 512, 3072
])
def test_round_size(nbytes, divisions, expected):
    config = AllocatorConfig.parse(f"roundup_power2_divisions:{divisions}" if divisions else "")
    assert round_size(nbytes, config) == expected


def test_allocation_size_by_class_and_large_segment_size():
    assert [allocation_size(s) for s in (512, MiB, MiB + 512, 10 * MiB - 512, 10 * MiB, 11 * MiB + 512)] == \
        [2 * MiB, 2 * MiB, 20 * MiB, 20 * MiB, 10 * MiB, 12 * MiB]
    assert allocation_size(3 * MiB, AllocatorConfig.parse("large_segment_size_mb:32")) == 32 * MiB


def test_stepping_the_allocator_by_hand():
    a = CachingAllocator(capacity=24 * MiB)
    x = a.malloc(3 * MiB, stream=0)                     # 20 MiB segment, split 3 + 17
    y = a.malloc(512, stream=0)                         # small pool: its own 2 MiB segment
    assert (a.reserved, a.allocated, x.size, y.size) == (22 * MiB, 3 * MiB + 512, 3 * MiB, 512)
    assert a.malloc(17 * MiB + 1, stream=0) is None     # the 17 MiB remainder is too small; 22 + 18 > 24, nothing free
    assert a.retries == 1
    a.free(x)
    assert a.allocated == 512 and [s.size for s in a.snapshot()[0]] == [20 * MiB, 2 * MiB]
    assert a.snapshot()[1] == 20 * MiB                  # x merged back: the whole segment is the largest free block

"""What the allocators add to the bytes tensors hold: one home for those constants.

CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings) rounds every request up to 512
bytes (`kMinBlockSize`). Requests up to 1 MiB (`kSmallSize`) come from 2 MiB segments (`kSmallBuffer`) and take
exactly that; larger ones from 20 MiB segments (`kLargeBuffer`) below 10 MiB (`kMinLargeAlloc`), else from a
segment of their own rounded up to 2 MiB (`kRoundLarge`), and a block found for one is split only when more than
1 MiB would remain: a large request may take up to `CUDA_SPLIT` bytes more than its rounded size (an 11 MiB +
512 B request takes a whole fresh 12 MiB segment), and `torch.cuda.memory_allocated` counts the whole block. What
the segments reserve beyond the blocks is not a margin here: the memory models replay the allocator over the step's
allocations and frees (`memfit.device.cuda_caching`, `memfit.memory.cuda_step`).
The CPU allocator (c10/core/alignment.h, `gAlignment = 64`) aligns every allocation to 64 bytes, which the
planner's arena also uses between its tensors. An op given a Python number wraps it in a 0-d tensor (8 bytes) and
casts it to the op's dtype (up to 8 more), freed when the op returns: at most `CPU_SCALAR` bytes at any moment,
which no op's outputs show.
"""

from __future__ import annotations

import torch

__all__ = ["CPU_ALIGNMENT", "CPU_SCALAR", "CUDA_BLOCK", "CUDA_SPLIT", "cpu_margin", "rounder"]

CUDA_BLOCK = 512            # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
CUDA_SPLIT = 1 << 20        # requests above 1 MiB: a block's remainder of at most this much is not split off
CPU_ALIGNMENT = 64          # bytes: a cache line, and enough for any dtype's vector loads
CPU_SCALAR = 16             # a Python number wrapped as a 0-d double or int64 (8 bytes) and its cast (<= 8)


def rounder(device: torch.device):
    """The size a request of b bytes takes on `device`'s allocator, as a function of b.

    Example:
        >>> rounder(torch.device("cuda"))(1), rounder(torch.device("cpu"))(1)
        (512, 1)
    """
    if device.type == "cuda":
        return lambda b: -(-b // CUDA_BLOCK) * CUDA_BLOCK
    return lambda b: b


def cpu_margin() -> int:
    """The head-room added on the CPU to a prediction: one Python number wrapped by the op running (as
    `aten::div(t, 2.0)` does: 8 bytes, and 4 for its float32 cast), which the allocator serves inside the op.

    Example:
        >>> cpu_margin()
        16
    """
    return CPU_SCALAR

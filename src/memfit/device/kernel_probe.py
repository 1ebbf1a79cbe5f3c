"""One real kernel run on stand-in arguments, and the bytes it allocates beyond its outputs: the one probe every
byte figure that no fake tensor shows comes from, with the one cache of what it measured.

Fake tensors give a kernel's outputs; what the real CPU kernel allocates inside and frees before it returns
(oneDNN's reordered weights and workspaces, the float32 copy a half-precision kernel computes in, the indices max
pooling makes and drops) only the allocator sees. `inside_bytes` runs the kernel once on the given real arguments
under the allocator's events (`memfit.device.measure.track_memory`) and returns its peak above the start minus its
outputs' storages. `probe_bytes` is the same, kept per kernel, arguments (shapes, strides, dtypes and the other
values) and intra-op thread count (oneDNN sizes its scratch per thread: a convolution's backward took 22 KiB more
at 2 threads than at 1): every caller (the memory model's kernel scratch and workspaces, the planner's workspaces)
asks here, so a kernel is measured once per process whoever asks. `zeros` makes CPU stand-in arguments that cost
nothing until read.

Example:
    >>> import torch
    >>> x = zeros((64, 64), (64, 1), torch.float32)
    >>> probe_bytes(torch.ops.aten.add.Tensor, (x, x), {}) == 0       # an add allocates only its output
    True
"""

from __future__ import annotations

import numpy as np
import torch

from memfit.device.torch_private import storage_key, tree_flatten

__all__ = ["arguments_key", "forget", "inside_bytes", "probe_bytes", "zeros"]

_BYTES: dict = {}        # (kernel, arguments_key, threads) -> bytes measured beyond the outputs
_WARM: set = set()       # (kernel, its tensor arguments' dtypes, threads) run once in this process (`inside_bytes`)


def _leaves(tree) -> list:
    return tree_flatten(tree)[0]


def arguments_key(args, kwargs) -> tuple:
    """The arguments as a key: each tensor by shape, strides and dtype (what a kernel's scratch may depend on, its
    values aside), every other leaf as it is."""
    return tuple((tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in _leaves((args, kwargs)))


def inside_bytes(kernel, args, kwargs) -> int:
    """Bytes the real CPU `kernel` allocates beyond its outputs' storages while it runs on these real arguments,
    by the allocator's events (not kept: `probe_bytes` keeps them).

    The first call of a kernel on arguments of these dtypes at this thread count in the process runs untracked
    first: what it sets up once (oneDNN's state, caches) is not per call. At a new shape of a kernel that has run
    it is not run twice: its first call there allocates what every later one does (2,432 calls of every measured
    op of conv nets and of bf16 and float32 transformers, at 3 to 100 samples: the same bytes at the first, second
    and third call; tests/memory/test_fake_kernels.py checks it), and at a large batch the second run cost as
    much as the first (about two thirds of a real step of a CNN, per batch size asked about)."""
    from memfit.device.measure import track_memory
    first = (kernel, tuple(a.dtype for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)),
             torch.get_num_threads())
    if first not in _WARM:
        kernel(*args, **kwargs)
        _WARM.add(first)
    with track_memory("cpu") as mem:
        out = kernel(*args, **kwargs)
    outs = {storage_key(t.untyped_storage()): t.untyped_storage().nbytes()
            for t in _leaves(out) if isinstance(t, torch.Tensor)}
    return max(0, mem.peak - sum(outs.values()))


def probe_bytes(kernel, args, kwargs) -> int:
    """`inside_bytes(kernel, args, kwargs)`, measured once per kernel, `arguments_key` and intra-op thread count in
    the process. The caller sets the context the kernel runs in (no dispatch mode, no_grad or inference mode)."""
    key = (kernel, arguments_key(args, kwargs), torch.get_num_threads())
    if key not in _BYTES:
        _BYTES[key] = inside_bytes(kernel, args, kwargs)
    return _BYTES[key]


def forget() -> None:
    """Drop every byte figure measured so far, so that the next prediction measures again (and can be timed as a
    first one). What a kernel set up on its first call in this process is not undone."""
    _BYTES.clear()


def zeros(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """CPU zeros of this layout in memory the system hands out zeroed (numpy's calloc): nothing is written, so an
    argument costs no page faults and no memory until it is read (its pages map the one zero page), where
    `empty_strided(...).fill_(0)` wrote every byte (a CNN's arguments at batch 391: 0.8 s of the 3.9 s CPU of its
    kernels' measurement, the same bytes measured). Its own storage (offset 0), 64-byte aligned as c10's allocator
    aligns."""
    item = torch.empty((), dtype=dtype).element_size()
    nbytes = item * (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))) if all(shape) else 0
    block = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -block.ctypes.data % 64
    return torch.from_numpy(block[start:start + nbytes]).view(dtype).as_strided(shape, stride)

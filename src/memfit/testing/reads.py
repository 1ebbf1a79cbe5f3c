"""Reads of a tensor's value by the host, counted: each one is a device synchronisation on a GPU (the host waits
for every queued kernel, then the device waits for the host to queue more), so how many a training step makes
is part of what it costs there. Counted on any device, the CPU included, by patching the Python entry points
of a read: `item`, `tolist`, `bool()`, `float()`, `int()`, `__index__`, `nonzero` and indexing by a boolean
mask (its `nonzero`). A read made inside a C++ kernel, or by `.cpu()` / `.numpy()`, is not counted.

Example:
    >>> import torch
    >>> with counted_reads() as reads:
    ...     t = torch.ones(3)
    ...     _ = float(t.sum()), t[t > 0], t * 2
    >>> reads
    ['__float__', 'mask']
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["counted_reads"]

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero")


@contextlib.contextmanager
def counted_reads():
    """A list that gets the name of every read of a tensor's value while the block runs (this process, every
    thread: the patch is on the class)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in (*_READS, "__getitem__")}
    own = {name for name in originals if name in vars(torch.Tensor)}       # the others come from torch._C.TensorBase

    def counted(name, original):
        def read(t, *args, **kwargs):
            calls.append(name)
            return original(t, *args, **kwargs)
        return read

    def getitem(t, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            calls.append("mask")
        return originals["__getitem__"](t, index)
    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name, originals[name]))
        torch.Tensor.__getitem__ = getitem
        yield calls
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)

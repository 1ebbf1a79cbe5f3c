"""What memfit knows about the device and torch, below everything else: nothing here imports the rest of memfit.

Modules: `machine` (which device work runs on and how much memory it has: `resolve_device`, `device_memory`),
`allocators` (what the allocators add to the bytes tensors hold: the CPU's alignment, CUDA's rounding), `measure`
(the allocator's bytes of real runs: profiler events on the CPU, `torch.cuda` statistics on CUDA).
"""

from memfit.device.machine import device_memory

__all__ = ["device_memory"]

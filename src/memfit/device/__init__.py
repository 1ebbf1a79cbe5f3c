"""What memfit knows about the device and torch, below everything else: nothing here imports the rest of memfit.

Modules: `machine` (which device work runs on and how much memory it has: `resolve_device`, `device_memory`),
`allocators` (what the allocators add to the bytes tensors hold: the CPU's alignment, CUDA's rounding), `measure`
(the allocator's bytes of real runs: profiler events on the CPU, `torch.cuda` statistics on CUDA), `torch_private`
(every private torch name memfit uses), `replacements` (a torch function replaced for the threads inside only);
CUDA from any machine: `cuda_caching` (the CUDA caching allocator replayed: peak reserved and allocated, segments,
out of memory; its state machine in `cuda_blocks`, its settings, `PYTORCH_CUDA_ALLOC_CONF`, in `cuda_alloc_conf`),
`cuda_costs`
(the context, cuBLAS workspaces and NCCL buffers as named terms: stated defaults per GPU family, or measured),
`cuda_kernels` (the byte formulas of kernels that exist only on CUDA: flash and memory-efficient attention, fused
AdamW), `fake_cuda` (a training step on fake CUDA tensors where the torch build allows it, its backward without
autograd's engine).
"""

from memfit.device.machine import device_memory

__all__ = ["device_memory"]

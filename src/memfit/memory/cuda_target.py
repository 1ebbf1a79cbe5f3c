"""Which CUDA device a prediction is for (`cuda_device`): the GPU of this machine, or one it does not have.

- **The GPU is here** (and `gpu` is not given): the fake runs are the engine's own on fake CUDA tensors, the
  context is measured (`torch.cuda.mem_get_info`: the device memory used outside this process's caching
  allocator, other processes on the device included), the cuBLAS workspaces are c10's for the device's own
  compute capability and `CUBLAS_WORKSPACE_CONFIG`.
- **It is not** (`device="cuda"` on a machine without one, or `gpu=` naming another): the fixed costs are the
  stated defaults of a GPU family (`gpu=`: a name such as "H100", "A100-40GB", "RTX 4090", a compute capability
  such as (8, 6), or the GPU's memory such as "24GiB"; not given: compute capability 9.0's, the larger
  workspace); the fake runs put the tensors on CUDA where this torch build allows a step on fake CUDA tensors
  (a CUDA build: backward node by node, `memfit.device.fake_cuda`), else on the CPU with CUDA's kernels' bytes
  (`memfit.memory.fake_run.CudaTarget`).
The allocator's settings are this process's `PYTORCH_CUDA_ALLOC_CONF` (`AllocatorConfig.from_env`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.budget import parse_bytes
from memfit.device.cuda_alloc_conf import AllocatorConfig
from memfit.device.cuda_costs import GPUS, FixedCost, GpuFamily, context_cost, fixed_costs, gpu_family
from memfit.memory.fake_run import CudaTarget

__all__ = ["DEFAULT_GPU", "CudaDevice", "cuda_device", "cuda_device_for", "device_budget", "resolve_gpu",
           "sdp_backends"]

# gpu= not given and no GPU here: compute capability 9.0's stated defaults (the larger cuBLAS workspace, flash)
DEFAULT_GPU = GpuFamily("a GPU of compute capability 9.0 (gpu= not given: the larger cuBLAS workspace)", (9, 0), 0)


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA device a prediction is for, and how it is predicted."""
    device: torch.device                          # the device the figures are for
    fakes: torch.device                           # where the fake runs' tensors live
    target: CudaTarget | None                     # None: the GPU is here, the engine's own fake run
    family: GpuFamily
    costs: Callable[[int], list[FixedCost]]       # threads -> the fixed costs (`cuda_costs.fixed_costs`)
    config: AllocatorConfig
    source: str                                   # what the figures assume, in words (for `method`)

    @property
    def key(self) -> tuple:
        """What a kept prediction for this device depends on."""
        return self.device, self.fakes, self.target, self.family, self.config


def resolve_gpu(gpu) -> GpuFamily:
    """`gpu=` as a family: a name, a compute capability, or a memory (bytes or a string such as "24GiB").

    Example:
        >>> resolve_gpu("24GiB").capability, resolve_gpu("A100-40GB").memory >> 30
        ((8, 9), 40)
    """
    if gpu is None:
        return DEFAULT_GPU
    if isinstance(gpu, GpuFamily):
        return gpu
    if isinstance(gpu, str):
        try:
            return gpu_family(gpu)
        except ValueError:
            try:
                return gpu_family(parse_bytes(gpu))
            except ValueError:
                pass
    elif isinstance(gpu, (tuple, int)) and not isinstance(gpu, bool):
        return gpu_family(gpu)
    raise ValueError(f"expected gpu= a GPU's name ({', '.join(GPUS)}), a compute capability such as (8, 6), or its "
                     f"memory such as '24GiB'; found {gpu!r}")


def cuda_device(device: torch.device, gpu=None) -> CudaDevice:
    """The CUDA device `device` (type cuda) a prediction is for (see the module doc)."""
    config = AllocatorConfig.from_env()
    if torch.cuda.is_available():
        from memfit.device.machine import resolve_device
        dev = resolve_device(device)
        if gpu is None:
            cap = torch.cuda.get_device_capability(dev)
            context = context_cost(dev)
            family = GpuFamily(torch.cuda.get_device_name(dev), cap, torch.cuda.mem_get_info(dev)[1])
            costs = lambda k: [context, *(c for c in fixed_costs(cap, threads=k) if c.in_allocator)]   # noqa: E731
            return CudaDevice(dev, dev, None, family, costs, config, f"{family.name}, here")
        family = resolve_gpu(gpu)
        return CudaDevice(dev, dev, None, family, lambda k: fixed_costs(family.capability, threads=k), config,
                          f"{family.name}'s stated defaults of fixed costs, the fake runs on this machine's GPU")
    family = resolve_gpu(gpu)
    dev = torch.device("cuda", device.index or 0)
    if torch.version.cuda is not None:       # a CUDA build: fake CUDA tensors run a step, backward node by node
        fakes, how = dev, (f"torch {torch.__version__}'s fake CUDA tensors (no GPU here: backward run node by node, "
                           "memfit.device.fake_cuda)")
    else:                                    # a CPU build: autograd on a CUDA fake would abort the process
        fakes, how = torch.device("cpu"), (f"fake CPU tensors with CUDA's kernels' bytes (torch {torch.__version__} "
                                           "is a CPU build: the CPU's kernels' own workspaces left out; autocast's "
                                           "op lists the CPU's)")
    target = CudaTarget(family.capability, nodes=fakes.type == "cuda")
    return CudaDevice(dev, fakes, target, family, lambda k: fixed_costs(family.capability, threads=k), config,
                      f"predicted without the GPU for {family.name}: stated defaults of fixed costs; {how}")


def sdp_backends() -> tuple[bool, bool, bool]:
    """The attention backends enabled now (flash, memory-efficient, math: `torch.nn.attention.sdpa_kernel` sets
    them): part of what a kept CUDA prediction depends on."""
    return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
            torch.backends.cuda.math_sdp_enabled())


def cuda_device_for(model_device: torch.device, device, gpu) -> CudaDevice | None:
    """The CUDA device a prediction asked for with `device` (None: the model's) is for, or None for another device
    (then `gpu` must not be given)."""
    try:
        asked = torch.device(device) if device is not None else model_device
    except (RuntimeError, TypeError):
        asked = None                          # resolve_device says what was expected
    if asked is None or asked.type != "cuda":
        if gpu is not None:
            raise ValueError(f"gpu={gpu!r} names the GPU a CUDA prediction is for; found device={str(asked)!r}: "
                             "pass device='cuda' too, or drop gpu=")
        return None
    return cuda_device(asked, gpu)


def device_budget(who: str, budget, device, device_memory, gpu) -> tuple[int, object]:
    """(the budget in bytes, gpu) of a call given `budget` and/or `device_memory`, the memory of the GPU a CUDA
    prediction is for (device="cuda"): the budget when none is given (no more than it when one is), and the GPU
    family whose stated fixed costs apply when `gpu` is not given.

    Example:
        >>> device_budget("max_batch_size", None, "cuda", "24GiB", None)
        (25769803776, 25769803776)
        >>> device_budget("fit", "8GiB", None, None, None)
        (8589934592, None)
    """
    if device_memory is not None:
        device_memory = parse_bytes(device_memory)
        if device is None or torch.device(device).type != "cuda":
            raise ValueError(f"{who}: device_memory is the memory of the GPU a CUDA prediction is for; found device="
                             f"{str(device)!r}: pass device='cuda' too (or give the budget alone)")
        gpu = device_memory if gpu is None else gpu
    if budget is None and device_memory is None:
        raise ValueError(f"{who} needs a budget (bytes or a string such as '8GiB'), or device='cuda' with "
                         "device_memory= (the GPU's memory, then the budget)")
    limit = parse_bytes(budget if budget is not None else device_memory)
    if device_memory is not None and limit > device_memory:
        raise ValueError(f"{who}: budget {limit} bytes is more than device_memory {device_memory} bytes, the GPU's "
                         "memory; give a budget within it, or leave it out to use all of it")
    return limit, gpu

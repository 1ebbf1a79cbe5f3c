"""The bytes a CUDA process holds that no tensor accounts for, as named terms with where each figure comes from:
stated defaults for a GPU family on any machine (`fixed_costs`), measured on the device where there is one
(`measure_fixed_costs`).

- **CUDA context** (outside the caching allocator: in `mem_get_info`'s used bytes, never in `memory_reserved`):
  pytorch PR #86509 measured 287,047,680 B with lazy module loading and 666,632,192 B eager (its GPU not named).
  Lazy loading is the default since CUDA 12.2 on Linux (NVIDIA's CUDA programming guide, "Lazy Loading") unless
  `CUDA_MODULE_LOADING=EAGER`; lazily loaded kernels add to it as they are first used, so the stated figure is the
  context at initialisation, not at the peak.
- **cuBLAS workspace** (through the caching allocator: in `memory_reserved` and `memory_allocated`), one per cuBLAS
  handle and stream, made at the first cuBLAS call (aten/src/ATen/cuda/CublasHandlePool.cpp,
  `parseChosenWorkspaceSize`): 32 MiB (`4096 KiB x 8`) on compute capability 9.x, 10.x, 11.x and 12.x (Hopper,
  Blackwell), else `4096 KiB x 2 + 16 KiB x 8` = 8,519,680 B; `CUBLAS_WORKSPACE_CONFIG=:SIZE_KiB:COUNT...` sums
  SIZE x COUNT KiB. Handles are per thread: a training step has two (the main thread's forward and the autograd
  engine's device thread's backward). cuBLASLt shares it (`TORCH_CUBLASLT_UNIFIED_WORKSPACE`, default on), else
  adds `CUBLASLT_WORKSPACE_SIZE` KiB (1024 by default) per handle and stream.
- **cuDNN workspaces** are not a fixed cost: each convolution call allocates its algorithm's workspace through the
  caching allocator for the call's length (larger under `torch.backends.cudnn.benchmark`, which tries algorithms);
  they belong with the kernels (not modelled here).
- **NCCL buffers** (outside the caching allocator) are an estimate, asked for by name (`nccl_buffers`):
  `NCCL_BUFFSIZE` (4 MiB by default, NCCL's documentation "Environment Variables") for sending and receiving, per
  channel, per peer; NCCL picks its channels and protocols by topology, so measure them on the device.

Example:
    >>> costs = fixed_costs("NVIDIA H100 80GB HBM3", environ={})
    >>> [(c.name, c.nbytes >> 20, c.in_allocator) for c in costs]
    [('CUDA context', 273, False), ('cuBLAS workspace', 64, True)]
    >>> costs[1].source.split(" (")[0]
    'stated default for compute capability 9.0: 32 MiB per handle and stream x 2'
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

import torch

__all__ = ["GPUS", "FixedCost", "GpuFamily", "context_cost", "cublas_workspace", "fixed_costs", "gpu_family",
           "measure_fixed_costs", "nccl_buffers"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CONTEXT_LAZY = 287_047_680      # pytorch PR #86509: the context with CUDA_MODULE_LOADING=LAZY
CONTEXT_EAGER = 666_632_192     # ... and without it
NCCL_BUFFSIZE = 4 * MiB         # NCCL's documented default of NCCL_BUFFSIZE
_CUBLAS_SOURCE = "aten/src/ATen/cuda/CublasHandlePool.cpp"


@dataclass(frozen=True)
class FixedCost:
    """One named part of a CUDA process's memory that no tensor accounts for.

    Attributes:
        name: what it is ('CUDA context', 'cuBLAS workspace', 'NCCL buffers').
        nbytes: its bytes in all (`count` of them).
        source: where the figure comes from ('stated default ...', 'measured ...', 'estimate ...').
        in_allocator: whether the bytes pass through the caching allocator (then a replay of the allocator must
            hold them as blocks: they count in `memory_reserved`), or lie outside it (the context, NCCL's buffers).
        exact: False for an estimate (NCCL's buffers).
        count: how many (workspaces: handles x streams).
    """
    name: str
    nbytes: int
    source: str
    in_allocator: bool
    exact: bool = True
    count: int = 1


@dataclass(frozen=True)
class GpuFamily:
    """A GPU as the stated defaults see it: its compute capability and memory (the vendor's figures)."""
    name: str
    capability: tuple[int, int]
    memory: int                  # bytes the board has (cudaDeviceProp.totalGlobalMem is a little less)


GPUS = {g.name: g for g in (
    GpuFamily("H200", (9, 0), 141 * GiB), GpuFamily("H100", (9, 0), 80 * GiB),
    GpuFamily("A100-80GB", (8, 0), 80 * GiB), GpuFamily("A100-40GB", (8, 0), 40 * GiB),
    GpuFamily("A10G", (8, 6), 24 * GiB), GpuFamily("L40S", (8, 9), 48 * GiB), GpuFamily("L4", (8, 9), 24 * GiB),
    GpuFamily("RTX 4090", (8, 9), 24 * GiB), GpuFamily("RTX 3090", (8, 6), 24 * GiB),
    GpuFamily("V100", (7, 0), 32 * GiB), GpuFamily("T4", (7, 5), 16 * GiB),
    GpuFamily("B200", (10, 0), 180 * GiB), GpuFamily("RTX 5090", (12, 0), 32 * GiB),
)}


def gpu_family(gpu) -> GpuFamily:
    """A GPU by name ('H100', or torch.cuda.get_device_name's 'NVIDIA H100 80GB HBM3'), by compute capability
    ((9, 0): its memory unknown, 0), or by its memory in bytes: the families of the table with that memory, the
    one whose stated defaults are the largest (Hopper's 32 MiB cuBLAS workspace over Ampere's 8 MiB), named with
    the others; a memory no family has: compute capability 9.0's defaults (the larger workspace).

    Example:
        >>> gpu_family("NVIDIA A100-SXM4-40GB").memory >> 30, gpu_family("NVIDIA L40S").name
        (40, 'L40S')
        >>> gpu_family(80 << 30).capability, gpu_family(80 << 30).name
        ((9, 0), 'a GPU with 80 GiB (H100, A100-80GB): the H100 defaults')
    """
    if isinstance(gpu, tuple):
        return GpuFamily(f"compute capability {gpu[0]}.{gpu[1]}", (int(gpu[0]), int(gpu[1])), 0)
    if isinstance(gpu, int) and not isinstance(gpu, bool):
        if gpu <= 0:
            raise ValueError(f"expected a GPU's memory in bytes above 0; found {gpu}")
        same = [f for f in GPUS.values() if f.memory == gpu]
        size = f"{gpu / GiB:g} GiB" if gpu % MiB == 0 else f"{gpu} bytes"
        if not same:
            return GpuFamily(f"a GPU with {size} (no family of the table has it): compute capability 9.0's "
                             "defaults, the larger cuBLAS workspace", (9, 0), gpu)
        best = max(same, key=lambda f: (cublas_workspace(f.capability, {})[0], f.capability))
        names = ", ".join(f.name for f in same)
        return GpuFamily(f"a GPU with {size} ({names}): the {best.name} defaults", best.capability, gpu)
    text = str(gpu).upper()
    # whole words: 'L4' is not in 'L40S'; the A100's memory from its name, the 80 GB board when it does not say
    found = [f for name, f in GPUS.items() if re.search(rf"\b{re.escape(name.split('-')[0].upper())}\b", text)]
    if not found:
        raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}; or give its compute capability as a "
                         "tuple such as (9, 0)")
    sized = [f for f in found if "-" in f.name and f.name.split("-")[1] in text]
    return (sized or found)[0]


def cublas_workspace(capability: tuple[int, int], environ=None) -> tuple[int, str]:
    """The bytes of one cuBLAS workspace (per handle and stream) on a device of `capability`, and whence.

    Example:
        >>> cublas_workspace((8, 0), {})[0], cublas_workspace((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})[0]
        (8519680, 33554432)
    """
    environ = os.environ if environ is None else environ
    big = capability[0] in (9, 10, 11, 12)           # "32MiB for Hopper and Blackwell"
    default = 4096 * KiB * 8 if big else 4096 * KiB * 2 + 16 * KiB * 8
    text = environ.get("CUBLAS_WORKSPACE_CONFIG")
    if text is not None:
        pairs = re.findall(r":([0-9]+):([0-9]+)", text)
        if pairs:
            return sum(int(size) * KiB * int(count) for size, count in pairs), f"CUBLAS_WORKSPACE_CONFIG={text}"
        # torch warns and uses its default; so do we, and say so
        return default, (f"stated default for compute capability {capability[0]}.{capability[1]} "
                         f"(CUBLAS_WORKSPACE_CONFIG={text!r} unreadable: torch ignores it)")
    return default, f"stated default for compute capability {capability[0]}.{capability[1]}"


def fixed_costs(gpu, threads: int = 2, streams: int = 1, environ=None) -> list[FixedCost]:
    """The stated defaults for `gpu` (a name or a compute capability, see `gpu_family`): the CUDA context and the
    cuBLAS workspaces of `threads` threads (2: a training step's forward and backward) on `streams` streams.

    Example:
        >>> sum(c.nbytes for c in fixed_costs("T4", threads=1)) == 287_047_680 + 8_519_680
        True
    """
    environ = os.environ if environ is None else environ
    family = gpu_family(gpu)
    eager = environ.get("CUDA_MODULE_LOADING", "LAZY").upper() == "EAGER"
    context = FixedCost("CUDA context", CONTEXT_EAGER if eager else CONTEXT_LAZY,
                        f"stated default, {'eager' if eager else 'lazy'} module loading (pytorch PR #86509's "
                        "measurement; lazily loaded kernels add to it)", in_allocator=False)
    one, source = cublas_workspace(family.capability, environ)
    count = threads * streams
    costs = [context, FixedCost("cuBLAS workspace", one * count,
                                f"{source}: {one / MiB:g} MiB per handle and stream x {count} ({_CUBLAS_SOURCE})",
                                in_allocator=True, count=count)]
    unified = environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off", "no")
    if not unified:
        lt = int(environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * KiB
        costs.append(FixedCost("cuBLASLt workspace", lt * count,
                               f"CUBLASLT_WORKSPACE_SIZE {lt // KiB} KiB per handle and stream x {count} "
                               f"(TORCH_CUBLASLT_UNIFIED_WORKSPACE off; {_CUBLAS_SOURCE})", in_allocator=True,
                               count=count))
    return costs


def nccl_buffers(channels: int, peers: int = 2, environ=None) -> FixedCost:
    """An estimate of one NCCL communicator's buffers: NCCL_BUFFSIZE x 2 (send, receive) x `channels` x `peers`
    (a ring: 2). Not exact: NCCL adds buffers per protocol and picks channels by topology (measure it)."""
    environ = os.environ if environ is None else environ
    buffsize = int(environ.get("NCCL_BUFFSIZE", NCCL_BUFFSIZE))
    return FixedCost("NCCL buffers", buffsize * 2 * channels * peers,
                     f"estimate: NCCL_BUFFSIZE {buffsize / MiB:g} MiB x 2 x {channels} channels x {peers} peers "
                     "(NCCL's documented default; protocols and channel choice not modelled)",
                     in_allocator=False, exact=False)


def context_cost(device: torch.device) -> FixedCost:
    """The CUDA context measured on `device`: the device memory in use outside this process's caching allocator
    (`mem_get_info`; other processes on the device included). Taken after the first kernels ran it includes the
    modules loaded lazily since; taken before, it is a lower bound."""
    free, total = torch.cuda.mem_get_info(device)
    return FixedCost("CUDA context", max(0, total - free - torch.cuda.memory_reserved(device)),
                     "measured: mem_get_info's used bytes outside the caching allocator (other processes on the "
                     "device included)", in_allocator=False)


def measure_fixed_costs(device=None) -> list[FixedCost]:
    """The context and one cuBLAS workspace measured on a CUDA device: the device memory in use outside this
    process's caching allocator (`mem_get_info`; it includes other processes on the device), and what the first
    matmul on a new thread and stream (a new cuBLAS handle and stream: a new workspace) allocates besides its
    output."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_fixed_costs needs a CUDA device; without one use fixed_costs(gpu), the stated "
                           "defaults")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    context = context_cost(device)
    a = torch.ones(8, 8, device=device)
    delta = []

    def first_matmul():
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        with torch.cuda.stream(stream):
            out = a @ a
        torch.cuda.synchronize(device)
        block = -(-out.untyped_storage().nbytes() // 512) * 512           # the output's block (512 B rounding)
        delta.append(torch.cuda.memory_allocated(device) - before - block)

    worker = threading.Thread(target=first_matmul)
    worker.start()
    worker.join()
    return [context,
            FixedCost("cuBLAS workspace", delta[0], "measured: allocated by the first matmul of a new thread and "
                      "stream", in_allocator=True)]

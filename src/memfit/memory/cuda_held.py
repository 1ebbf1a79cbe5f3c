"""The blocks a CUDA step's replay holds before its first step (`memfit.memory.cuda_step`), in the order a training
loop makes them: the parameters and buffers as `model.to("cuda")` allocates them, the optimizer state and gradients
held, and DistributedDataParallel's gradient buckets (`ddp_buckets`); and the kinds a replay's blocks are sorted
into.

Example:
    >>> [b for _, b in prelude(torch.nn.Linear(4, 2), None, False)]      # Module._apply: the weight, then the bias
    [32, 8]
"""

from __future__ import annotations

import copy

import torch

from memfit.device.measure import _storage_key
from memfit.memory.fake_run import device_state
from memfit.memory.kinds import STEP_KINDS, MemoryKind

__all__ = ["INPUTS", "PARAMETERS", "WORKSPACES", "ddp_buckets", "prelude"]

# a trace's kinds: STEP_KINDS' columns, then these (workspaces after them, one kind per fixed cost, then the named
# kinds of held blocks: `CudaStep.named`)
PARAMETERS, INPUTS, WORKSPACES = len(STEP_KINDS), len(STEP_KINDS) + 1, len(STEP_KINDS) + 2
_OPTIMIZER, _GRADIENTS = STEP_KINDS.index(MemoryKind.OPTIMIZER_STATE), STEP_KINDS.index(MemoryKind.GRADIENTS)


def prelude(model: torch.nn.Module, optimizer, grads_held: bool) -> list[tuple[int, int]]:
    """(kind, bytes) of each block held before the step, in the order a loop makes them: the parameters and
    buffers as `model.to("cuda")` allocates them (`Module._apply`: children first, then the module's own parameters
    and buffers; a storage once), the optimizer's device state, the gradients held (`grads_held`)."""
    seen, out = set(), []

    def add(t: torch.Tensor, kind: int) -> None:
        key = _storage_key(t)
        if key is not None and key[0] not in seen:
            seen.add(key[0])
            out.append((kind, key[1]))

    def visit(m: torch.nn.Module) -> None:
        for child in m.children():
            visit(child)
        for p in m.parameters(recurse=False):
            add(p, PARAMETERS)
        for b in m.buffers(recurse=False):
            add(b, PARAMETERS)
    visit(model)
    for t in device_state(optimizer, torch.device("cuda")):
        add(t, _OPTIMIZER)
    if grads_held:
        for p in model.parameters():
            if p.requires_grad:
                out.append((_GRADIENTS, p.numel() * p.element_size()))
    return out


def ddp_buckets(single, model: torch.nn.Module, bucket_view: bool, first: int = 1 << 20, cap: int = 25 << 20):
    """A copy of the CUDA step model `single` (a `StepMemoryModel`) with DistributedDataParallel's gradient
    buckets held as blocks after the parameters: one flat buffer per bucket, filled with the trainable parameters
    per dtype in order until one reaches its cap (`first` for the first bucket, then `cap`: DDP's defaults, 1 MiB and
    `bucket_cap_mb=25`). With `bucket_view` the gradients held before the step are the buckets' views: their blocks
    are the buckets. The bucket boundaries are DDP's before its first rebuild (it rebuilds them in the order
    gradients were ready): the bytes are the same, the blocks may split otherwise."""
    buckets: list[int] = []
    open_: dict = {}                                   # dtype -> (bytes so far, its cap)
    seen = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        size, limit = open_.get(p.dtype, (0, first))
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(size)
            size, limit = 0, cap
        open_[p.dtype] = size, limit
    buckets += [size for size, _ in open_.values() if size]
    step = copy.copy(single._cuda)
    kind = WORKSPACES + len(step.workspaces) + len(step.named)
    held = [h for h in step.held if not (bucket_view and h[0] == _GRADIENTS)]
    at = sum(1 for k, _ in held if k == PARAMETERS)
    step.held = held[:at] + [(kind, b) for b in reversed(buckets)] + held[at:]
    step.named = (*step.named, MemoryKind.GRADIENT_BUCKETS.value)
    step._replays, step._traces = {}, {}
    step.how += f"; DDP's {len(buckets)} gradient buckets as blocks after the parameters"
    out = copy.copy(single)
    out._cuda = step
    return out

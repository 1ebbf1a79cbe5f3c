"""The kinds of memory a prediction names, and the interface every memory model gives.

A breakdown (`MemoryModel.breakdown(n)`) is a dict from a `MemoryKind`'s value to bytes; the values sum to
`total_bytes(n)`. `StepMemoryModel` (an eager forward or a whole training step, from fake-tensor runs),
`RankMemoryModel` (one rank's step) and the planner's `PlannedMemoryModel` (the planned forward's arena) implement
the interface.
"""

from __future__ import annotations

from enum import Enum
from typing import Protocol, runtime_checkable

import torch

from memfit.budget import format_bytes

__all__ = ["STEP_KINDS", "MemoryKind", "MemoryModel", "summary"]


class MemoryKind(Enum):
    """A kind of memory; its value is the key in a breakdown."""
    PARAMETERS = "parameters"
    SHARDED_PARAMETERS = "parameters (sharded)"
    UNSHARDED_PARAMETERS = "parameters (unsharded, in flight)"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"
    ARENA = "activations (arena)"
    OUTSIDE_ARENA = "activations (outside the arena)"
    GRADIENTS = "gradients"
    GRADIENT_BUCKETS = "gradient buckets (DDP)"
    COMMUNICATION = "communication buffers"
    OPTIMIZER_STATE = "optimizer state"
    BACKWARD_TRANSIENT = "backward transient"
    STEP_TRANSIENT = "step transient"
    KEPT_BY_MODEL = "kept by the model"
    ALLOCATOR_MARGIN = "allocator margin"
    # CUDA: what the caching allocator reserves beyond the blocks it hands out (segments' unused parts), and the
    # fixed costs (`memfit.device.cuda_costs`): a workspace in the allocator, the context outside it
    RESERVED_BEYOND = "allocator: reserved beyond allocated"
    CUBLAS_WORKSPACE = "cuBLAS workspace"
    CUDA_CONTEXT = "CUDA context"


# the kinds a fake-tensor run sorts every logged storage into, in the order of its columns
STEP_KINDS = (MemoryKind.ACTIVATIONS, MemoryKind.GRADIENTS, MemoryKind.OPTIMIZER_STATE,
              MemoryKind.BACKWARD_TRANSIENT, MemoryKind.STEP_TRANSIENT, MemoryKind.KEPT_BY_MODEL)


@runtime_checkable
class MemoryModel(Protocol):
    """Bytes a forward or a training step needs at any batch size n.

    Attributes:
        method: how sizes at other batch sizes are computed (exact placements, fitted lines, ...).
        param_bytes: parameters and buffers.
        device: the device the figures are for (on CUDA: the caching allocator's reserved bytes and the fixed
            costs, `memfit.memory.cuda_step`).
        train: True for a whole training step, False for a forward.
    """
    method: str
    param_bytes: int
    device: torch.device
    train: bool

    def total_bytes(self, n: int) -> int:
        """Bytes at the peak for a batch of n."""

    def breakdown(self, n: int) -> dict[str, int]:
        """Bytes at the peak for a batch of n by `MemoryKind` value; they sum to `total_bytes(n)`."""

    def explain(self, n: int = 1) -> str:
        """What the figure is, how it was computed, and the bytes by kind at a batch of n."""


def summary(model: MemoryModel, what: str) -> str:
    """A memory model's repr: what its figures are for, not its tables (per-op arrays: pages of numbers).

    Example:
        >>> import torch
        >>> from memfit.memory.step_model import step_memory_model
        >>> step_memory_model(torch.nn.Linear(8, 4), (8,), train=False)
        StepMemoryModel(one eager forward on cpu, parameters 144 B; total_bytes(n), breakdown(n), explain(n))
    """
    return (f"{type(model).__name__}({what} on {model.device}, parameters {format_bytes(model.param_bytes)}; "
            "total_bytes(n), breakdown(n), explain(n))")

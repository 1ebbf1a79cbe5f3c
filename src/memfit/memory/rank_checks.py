"""What the per-rank memory models (`memfit.memory.ranks`) refuse to predict, checked before anything runs: a
DistributedDataParallel wrapping whose bytes they do not count, FSDP2's CPU offload."""

from __future__ import annotations

from memfit.device.torch_private import ddp_comm_hook

__all__ = ["check_ddp_wrapping", "check_not_offloaded"]


def check_ddp_wrapping(ddp) -> None:
    """Raise ValueError for a `DistributedDataParallel` module whose wrapping the per-rank model does not count:
    `mixed_precision=` (DDP keeps a low-precision copy of every parameter and casts gradients back in a comm hook
    of its own) and any comm hook (`register_comm_hook`, a built-in one, `_register_fused_optim`), whose buffers
    (compressed copies of the buckets, PowerSGD's matrices and error feedback) are the hook's own. A prediction
    of DDP's default all-reduce would be returned for a step that holds other bytes, unsaid."""
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(f"expected a DistributedDataParallel without mixed_precision= (not modelled: DDP keeps a "
                         f"low-precision copy of every parameter and upcasts gradients in a hook of its own); found "
                         f"mixed_precision={ddp.mixed_precision}: for lower-precision compute train under "
                         "torch.autocast (predicted with autocast=torch.bfloat16), or use FSDP2 with a "
                         "MixedPrecisionPolicy (parallel='fsdp', mp_policy=)")
    name = ddp_comm_hook(ddp)
    if name is not None:
        raise ValueError(f"expected a DistributedDataParallel with its default all-reduce; found the comm hook "
                         f"{name}, which is not modelled (what it allocates, e.g. compressed copies of the buckets or "
                         "PowerSGD's state, is not counted): predict the DDP module before register_comm_hook for "
                         "the default all-reduce and check the hooked step with memfit.memory.measure_rank_step (with "
                         "memfit.accumulate, give micro_batch= a size instead of 'auto')")


def check_not_offloaded(offload_policy) -> None:
    """Raise ValueError for an FSDP2 offload policy other than none: its host bytes are not modelled."""
    from torch.distributed.fsdp import OffloadPolicy
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise ValueError(f"expected offload_policy None or OffloadPolicy() (no offload); found "
                         f"{type(offload_policy).__name__}: FSDP2's CPU offload is not modelled (parameters, "
                         "gradients and optimizer state would move to host memory, which this model does not "
                         "count apart); predict without it for the device's bytes with everything on it")

"""`accumulate(distributed=True)`: how the ranks agree, so that no rank waits in a collective another never joins.

1. One agreement before any micro-batch (`agree_start`): the samples (or terms) over every rank, one
   micro-batch size, the rounds.
2. Every micro-batch runs under DDP's `no_sync` (its backward is local) and each round ends with an
   agreement (`run_rounds`): a rank whose forward, loss or backward raised, the last micro-batch's backward
   included, raises its own error there and every other rank `RankFailed` naming it, within a round.
3. Only when every rank finished and every loss is finite are the gradients all-reduced, once, by DDP itself
   (`synchronise`: a forward through the DDP wrapper of a function of every parameter whose gradient is
   exactly zero, so DDP's buckets, communication hook and averaging do the reduction as they would in the
   last micro-batch). Cost: the all-reduce no longer overlaps the last backward.
"""

from __future__ import annotations

import struct

import torch

from memfit.accumulation.micro_step import MicroStep
from memfit.device.torch_private import own_children

__all__ = ["agree_start", "run_rounds", "synchronise"]


def agree_start(error, step, size: int, reason: str, auto: bool) -> tuple[int, int, str, int]:
    """(samples or terms over every rank, this rank's micro-batch size, why, rounds): one agreement, which
    raises on every rank when one failed preparing its step. An 'auto' size is the smallest over the ranks
    (one size for all, as when evaluating). Rounds: the most micro-batches any rank plans; every rank makes
    one agreement per round."""
    from memfit.distributed import agree
    # the terms may be a class-weighted sum (a float): shared as the bits of a float64, never rounded to an int
    terms = struct.unpack("<q", struct.pack("<d", float(step.n_total if step is not None else 0)))[0]
    mine = (0, 0, 0, 0) if step is None else (terms, step.n, size, int(auto))
    ranks = agree(error, "memfit.accumulate start", mine)
    autos = [v[2] for v in ranks if v[3]]
    if auto and min(autos) != size:
        size, reason = min(autos), f"{reason}; the smallest over ranks ({min(autos)}) is used"
    sizes = [min(autos) if v[3] else v[2] for v in ranks]
    rounds = max(-(-v[1] // m) for v, m in zip(ranks, sizes, strict=True))
    total = sum(struct.unpack("<d", struct.pack("<q", v[0]))[0] for v in ranks)
    return int(total) if total.is_integer() else total, size, reason, rounds


def run_rounds(step: MicroStep, size: int, rounds: int) -> int:
    """This rank's micro-batches in `rounds` rounds, each closed by an agreement (a rank with fewer micro-batches
    agrees idly). Every backward is local (no_sync), so a rank that fails anywhere in its step, inside the last
    backward too, raises its own error at the next agreement and the others `RankFailed` naming it. Returns
    the micro-batch size that worked last."""
    from memfit.distributed import agree
    starts = list(range(0, step.n, size))
    for r in range(rounds):
        error = None
        if r < len(starts):
            try:
                size = step.run_range(starts[r], starts[r + 1] if r + 1 < len(starts) else step.n, size, frozenset())
            except Exception as e:
                error = e
        agree(error, "memfit.accumulate micro-batch")
    return size


class _ZeroGradient(torch.autograd.Function):
    """A scalar 0 that depends on every parameter given, whose backward gives each an exactly zero gradient:
    an expanded 0-d zero, which AccumulateGrad adds in place without a parameter-sized buffer."""

    @staticmethod
    def forward(ctx, *params):
        ctx.specs = [(p.shape, p.dtype, p.device) for p in params]
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        return tuple(torch.zeros((), dtype=d, device=dev).expand(shape) for shape, d, dev in ctx.specs)


class _Touch(torch.nn.Module):
    """What DDP runs in place of the model for `synchronise`: no parameter of its own, the model's in its call."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.__dict__["params"] = params          # a plain attribute: not registered, not DDP's to see

    def forward(self):
        return _ZeroGradient.apply(*self.params)


def synchronise(ddp: torch.nn.parallel.DistributedDataParallel, params: list[torch.nn.Parameter]) -> None:
    """All-reduce the accumulated gradients the way DDP does in a synchronised backward (its buckets, its
    communication hook, its average over ranks): a forward through `ddp` of `_Touch`, then its backward, which
    adds an exact zero to every gradient and fires DDP's hooks. Every rank calls it after the agreement that
    every rank's micro-batches finished, so none can fail inside it and leave the others waiting."""
    model = ddp.module
    own_children(ddp)["module"] = _Touch(params)     # DDP.forward calls self.module(...)
    try:
        out = ddp()
    finally:
        own_children(ddp)["module"] = model
    out.backward()

"""Models and wrappings for the per-rank memory tests, importable by spawned rank processes."""
import functools

import torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 255), torch.nn.ReLU(),
                               torch.nn.Linear(255, 7))         # odd rows: padded shards


def build(parallel: str, factory=mlp):
    m = factory()
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(m)
    from torch.distributed.fsdp import fully_shard

    from memfit.memory.fsdp_run import default_units
    for u in default_units(m):
        fully_shard(u)
    return fully_shard(m)


def measure(rank, world, parallel, n):
    """This rank's real peak of one AdamW step of the MLP at a batch of n per rank."""
    from memfit.memory.rank_measure import measure_rank_step
    return measure_rank_step(functools.partial(build, parallel), (64,), torch.optim.AdamW, n=n)


def measure_cases(rank, world, cases):
    """`measure` for each (parallel, n) of `cases`, in one process: one spawn for them all."""
    return {case: measure(rank, world, *case) for case in cases}


def fail_on_rank_1(rank, world, parallel, n):
    """Rank 1 raises before its step; rank 0 must not hang in a collective waiting for it."""
    if rank == 1:
        raise RuntimeError("rank 1 fails while measuring")
    return measure(rank, world, parallel, n)

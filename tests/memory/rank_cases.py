"""Models and wrappings for the per-rank memory tests, importable by spawned rank processes."""
import functools

import torch


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 255), torch.nn.ReLU(),
                               torch.nn.Linear(255, 7))         # odd rows: padded shards


def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


FACTORIES = {"mlp": (mlp, (64,)), "encoder": (encoder, (8, 32))}
FROZEN = {"mlp": "0.weight", "encoder": "layers.0."}     # "fsdp-frozen": a weight beside a trainable bias; a unit


def fsdp_options(parallel: str) -> dict:
    """The `fully_shard` options of an FSDP2 wrapping of these tests (as `rank_memory_model` takes them)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return {"fsdp-no-reshard": {"reshard_after_forward": False},
            "fsdp-bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
            }.get(parallel, {})


def model(parallel: str, factory=mlp):
    m = factory()
    if parallel == "fsdp-frozen":
        for k, p in m.named_parameters():
            p.requires_grad_(not k.startswith(FROZEN[factory.__name__]))
    return m


def build(parallel: str, factory=mlp):
    m = model(parallel, factory)
    if parallel in ("ddp", "ddp-view"):
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(m, gradient_as_bucket_view=parallel == "ddp-view")
    from torch.distributed.fsdp import fully_shard

    from memfit.memory.fsdp_run import default_units
    for u in default_units(m):
        fully_shard(u, **fsdp_options(parallel))
    return fully_shard(m, **fsdp_options(parallel))


def measure(rank, world, parallel, n, name="mlp", settled=True):
    """This rank's real peak of one AdamW step of a model of `FACTORIES` at a batch of n per rank; `settled`:
    under `memfit.testing.ranks.settled_gloo` (each collective's tensors dropped by gloo as its call returns)."""
    from contextlib import nullcontext

    from memfit.memory.step import measure_rank_step
    from memfit.testing.ranks import settled_gloo
    factory, example = FACTORIES[name]
    with settled_gloo() if settled else nullcontext():
        return measure_rank_step(functools.partial(build, parallel, factory), example, torch.optim.AdamW, n=n)


def measure_cases(rank, world, cases):
    """`measure` for each (parallel, n, model name[, "unsettled", run]) of `cases`, in one process: one spawn
    for them all; under "reduce_scatter", one reduce-scatter as gloo runs it and as `settled_gloo` runs it."""
    import torch.distributed as dist

    from memfit.testing.ranks import settled_gloo
    x = torch.arange(12.0) * (rank + 1) - 5
    out = [torch.empty(12 // world) for _ in range(2)]
    dist.reduce_scatter_single(out[0], x)
    with settled_gloo():
        dist.reduce_scatter_single(out[1], x)
    return {"reduce_scatter": out, **{case: measure(rank, world, *case[:3], settled=len(case) == 3)
                                      for case in cases}}


def fail_or_wait(rank, world):
    """Rank 1 raises; rank 0 waits for it in a barrier that never completes (gloo's own timeout is 30 min)."""
    import torch.distributed as dist
    if rank == 1:
        raise RuntimeError("rank 1 fails while measuring")
    dist.barrier()
    return "passed a barrier rank 1 never reached"

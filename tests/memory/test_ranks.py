"""Per-rank memory of DDP and FSDP2 training steps: predicted in one process, checked against 2 gloo ranks."""
import math

import pytest
import rank_cases
import torch

from memfit import memory_model
from memfit.memory.ranks import ddp_bucket_bytes, rank_memory_model, ranks_needed
from memfit.testing.ranks import run_ranks


@pytest.fixture(scope="module")
def fsdp2():
    m = rank_cases.mlp()
    return m, rank_memory_model(m, (64,), optimizer=torch.optim.AdamW(m.parameters()), parallel="fsdp",
                                world_size=2, backend="gloo")


def test_ddp_buckets_hold_every_trainable_parameter_once():
    m = rank_cases.mlp()
    m[0].weight.requires_grad_(False)
    assert ddp_bucket_bytes(m) == sum(p.numel() * 4 for p in m.parameters() if p.requires_grad)
    mm = memory_model(m, (64,), train=True, optimizer=torch.optim.AdamW(m.parameters()), parallel="ddp",
                      world_size=4)
    single = memory_model(m, (64,), train=True, optimizer=torch.optim.AdamW(m.parameters()))
    assert mm.total_bytes(16) == single.total_bytes(16) + ddp_bucket_bytes(m)
    assert sum(mm.breakdown(16).values()) == mm.total_bytes(16)


def test_fsdp_rank0_holds_padded_shards_and_its_rows_of_state(fsdp2):
    m, mm = fsdp2
    # FSDP2 shards dim 0 with torch.chunk: ceil(rows / 2) rows each, padded; rank 0 has the full chunk
    shard = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * 4 for p in m.parameters())
    b = mm.breakdown(8)
    assert b["parameters (sharded)"] == mm.param_bytes == shard
    assert b["optimizer state"] == 2 * shard + 4 * len(list(m.parameters()))     # exp_avg, exp_avg_sq, step
    assert sum(b.values()) == mm.total_bytes(8)
    assert "exact at 8" in mm.method
    assert mm.total_bytes(64) > mm.total_bytes(8)


def test_fsdp_model_leaves_no_process_group_and_refuses_a_live_one(fsdp2):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    assert not dist.is_initialized()                 # the fixture's fake group is gone
    m = rank_cases.mlp()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(RuntimeError, match="already initialised"):
            rank_memory_model(m, (64,), optimizer=torch.optim.AdamW(m.parameters()), parallel="fsdp", world_size=2)
    finally:
        dist.destroy_process_group()


def test_options_are_checked():
    m = rank_cases.mlp()
    with pytest.raises(ValueError, match="expected parallel in"):
        rank_memory_model(m, (64,), parallel="zero3")
    with pytest.raises(ValueError, match="FSDP2 options"):
        rank_memory_model(m, (64,), parallel="ddp", reshard_after_forward=False)
    with pytest.raises(ValueError, match="pass train=True"):
        memory_model(m, (64,), parallel="ddp", world_size=2)


def test_ranks_needed_is_the_fewest_that_fit():
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(m.parameters())
    need = {w: rank_memory_model(m, (256,), optimizer=opt, world_size=w).total_bytes(4) for w in (1, 2)}
    assert need[1] > need[2]
    assert ranks_needed(m, (256,), need[2], 4, optimizer=opt) == 2


CASES = (("ddp", 32, "mlp"), ("fsdp", 16, "mlp"), ("fsdp", 128, "mlp"), ("ddp", 8, "encoder"), ("fsdp", 8, "encoder"))
# Known gap, not hidden: on the FSDP2 encoder, gloo holds one more communication buffer (27,536 bytes, 7% of the
# step) in some runs (2 of 3 here), which the prediction does not count; its row is checked on its own below.
GLOO_HELD = {("fsdp", 8, "encoder")}


def test_prediction_against_two_gloo_ranks(fsdp2):
    def predict(parallel, name):
        factory, example = rank_cases.FACTORIES[name]
        m = factory()
        return rank_memory_model(m, example, optimizer=torch.optim.AdamW(m.parameters()), parallel=parallel,
                                 world_size=2, backend="gloo")
    models = {("fsdp", "mlp"): fsdp2[1], **{(p, k): predict(p, k) for p, _, k in CASES if (p, k) != ("fsdp", "mlp")}}
    out = run_ranks(rank_cases.measure_cases, 2, CASES, timeout=120)
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    for parallel, n, name in CASES:
        predicted = models[parallel, name].total_bytes(n)
        worst = max(v[(parallel, n, name)] for _, v in out.values())
        if (parallel, n, name) in GLOO_HELD:      # the open gap above: within one held buffer, never more
            assert 0.9 <= predicted / worst <= 1.05, (parallel, n, name, predicted, worst)
            continue
        # from 5e-4 below to 5% above. Below: kernels' 0-d scalars that no op outputs (12-24 bytes), and on the
        # encoder under DDP 100 bytes of the reducer's own state not yet modelled (the single-process step
        # matches it exactly): an open gap, 2e-4 of this small model
        assert 1 - 5e-4 <= predicted / worst <= 1.05, (parallel, n, name, predicted, worst)


def test_a_failing_rank_does_not_hang_the_others():
    import time

    from memfit.cli.bench.rank_memory import spawn
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1: RuntimeError: rank 1 fails"):
        spawn(rank_cases.fail_or_wait, 2, timeout=60)
    assert time.perf_counter() - t0 < 50              # rank 0, stuck in a barrier for rank 1, was killed


def test_gloo_copies_are_logged_where_its_collectives_run_and_nccl_has_none():
    from memfit.memory.fsdp_run import RANK_KINDS, fsdp_fake_run
    from memfit.memory.kinds import MemoryKind
    from memfit.memory.step import ExampleBatch
    m = rank_cases.mlp()
    runs = {b: fsdp_fake_run(m, ExampleBatch((64,)), 4, world_size=2, rank=0,
                             optimizer=torch.optim.AdamW(m.parameters()), loss_fn=None, target=None, backend=b)
            for b in ("gloo", "nccl")}
    copies = [i for i, op in enumerate(runs["gloo"].ops) if str(op).startswith("<gloo's copy in all_gather")]
    assert copies and not any("gloo" in str(op) for op in runs["nccl"].ops)
    comm = RANK_KINDS.index(MemoryKind.COMMUNICATION)
    # the copy holds the whole all-gather output: the first unit's padded, unsharded parameters
    first = 2 * sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * 4 for p in m[0].parameters())
    assert runs["gloo"].live[copies[0], comm] - runs["gloo"].live[copies[0] - 1, comm] == first


def test_plan_cli_prints_the_per_rank_breakdown(capsys):
    import json

    from memfit.cli.plan import cli_plan
    from memfit.testing.zoo import lenet
    argv = ["memfit.testing.zoo:lenet", "--input", "8,1,28,28", "--train", "--parallel", "fsdp", "--world-size", "8"]
    assert cli_plan([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shard = sum(math.ceil(p.shape[0] / 8) * (p.numel() // p.shape[0]) * 4 for p in lenet().parameters())
    assert out["breakdown"]["parameters (sharded)"] == shard and out["world_size"] == 8
    assert sum(out["breakdown"].values()) == out["total_bytes"]
    assert cli_plan(argv) == 0
    text = capsys.readouterr().out
    assert "FSDP training step on 8 ranks" in text and "parameters (unsharded, in flight)" in text


def test_wrapping_options_reach_fully_shard():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from memfit.memory.fsdp_run import RANK_KINDS, fsdp_fake_run
    from memfit.memory.kinds import MemoryKind
    from memfit.memory.step import ExampleBatch
    m = rank_cases.mlp()
    opt = torch.optim.AdamW(m.parameters())
    unsharded = RANK_KINDS.index(MemoryKind.UNSHARDED_PARAMETERS)
    most = {}
    for dtype in (None, torch.bfloat16):
        run = fsdp_fake_run(m, ExampleBatch((64,)), 4, world_size=2, rank=0, optimizer=opt, loss_fn=None,
                            target=None, mp_policy=MixedPrecisionPolicy(param_dtype=dtype))
        most[dtype] = run.live[:, unsharded].max()
    # the all-gathered parameters are bf16 under the policy: half the bytes at every op
    assert 2 * most[torch.bfloat16] == most[None] > 0
    mm = memory_model(m, (64,), train=True, optimizer=opt, parallel="fsdp", world_size=2, reshard_after_forward=False)
    assert "reshard_after_forward=False" in mm.method
    with pytest.raises(ValueError, match="options of parallel"):
        memory_model(m, (64,), train=True, optimizer=opt, reshard_after_forward=False)
    with pytest.raises(TypeError, match="unexpected keyword"):
        memory_model(m, (64,), train=True, optimizer=opt, parallel="fsdp", reshard=False)


def test_max_batch_size_per_rank(fsdp2):
    from memfit import max_batch_size
    m, _ = fsdp2
    opt = torch.optim.AdamW(m.parameters())
    mm = rank_memory_model(m, (64,), optimizer=opt, parallel="fsdp", world_size=2)
    budget = mm.total_bytes(100)
    n = max_batch_size(m, (64,), budget, train=True, optimizer=opt, parallel="fsdp", world_size=2)
    assert mm.total_bytes(n) <= budget < mm.total_bytes(n + 1) and n >= 100

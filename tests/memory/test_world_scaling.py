"""FSDP2 at any world size from a run at 2 ranks: against the fake run at the world size itself, every op and kind
to the byte; in bounded time at 10,000 ranks; run for itself, or refused, where a run does not scale."""
import math

import numpy as np
import pytest
import rank_cases
import torch

from memfit import memory_model
from memfit.memory.cache import forget
from memfit.memory.fsdp_run import fsdp_fake_run
from memfit.memory.ranks import DIRECT_MAX, rank_memory_model
from memfit.memory.step import ExampleBatch
from memfit.memory.world_scaling import Scaled


def _norm(ops):
    """A run's ops, the pseudo-ops without the bytes their names carry."""
    return [op.split(":")[0] if isinstance(op, str) else op for op in ops]


@pytest.mark.parametrize(("parallel", "name", "backend", "worlds"), [
    # rows 256, 255, 7: at 3 ranks 255 splits evenly, 256 and 7 are padded; at 300 every parameter is one row a
    # rank, padded to 300 in the collectives; gloo: its copies and race at each size
    ("fsdp", "mlp", "gloo", (3, 300)),
    # a frozen unit (no gradient, no state), bf16 all-gathers reduced in float32 (fsdp.chunk_cat's converted copies)
    ("fsdp-frozen", "encoder", "nccl", (5,)), ("fsdp-bf16", "mlp", "nccl", (6,))])
def test_the_run_at_two_ranks_gives_every_other_world_size_to_the_byte(parallel, name, backend, worlds):
    factory, example = rank_cases.FACTORIES[name]
    m = rank_cases.model(parallel, factory)
    opt = torch.optim.AdamW(m.parameters())
    run = lambda w: fsdp_fake_run(m, ExampleBatch(example), 4, world_size=w, rank=0, optimizer=opt, loss_fn=None,
                                  target=None, backend=backend, **rank_cases.fsdp_options(parallel))
    base = run(2)
    assert base.scaling is not None, base.unscalable
    for w in worlds:
        real = run(w)
        assert _norm(real.ops) == _norm(base.ops)
        computed = base.live + base.scaling.shift(w)
        assert np.array_equal(computed, real.live), (w, np.argwhere(computed != real.live)[:5])
        assert base.scaling.race_at(w) == real.race_bytes


def test_ten_thousand_ranks_are_computed_not_run(monkeypatch):
    """world_size=10_000 gave no answer within 4 minutes (FSDP2 shards every parameter into 10,000 chunks on fake
    tensors); now the runs are at 2 ranks whatever the world size, and rank 0 holds one row of each parameter."""
    import memfit.memory.ranks as ranks
    worlds = []
    run = ranks.fsdp_fake_run
    monkeypatch.setattr(ranks, "fsdp_fake_run", lambda *a, **k: worlds.append(k["world_size"]) or run(*a, **k))
    m = rank_cases.mlp()
    mm = memory_model(m, (64,), train=True, optimizer=torch.optim.AdamW(m.parameters()), parallel="fsdp",
                      world_size=10_000, probes=(16,))
    assert set(worlds) == {2} and mm.world_size == 10_000 and "computed from those runs" in mm.method
    b = mm.breakdown(16)
    assert b["parameters (sharded)"] == mm.param_bytes == sum(p.numel() // p.shape[0] * 4 for p in m.parameters())
    # a step's all-gather output holds 10,000 padded chunks of a unit's parameters: at least the largest unit's
    largest = max(sum(p.numel() // p.shape[0] for p in u.parameters()) for u in m if list(u.parameters()))
    assert b["communication buffers"] >= 10_000 * largest * 4


def test_where_a_run_does_not_scale_each_world_size_runs_up_to_a_bound(monkeypatch):
    """A run with a storage whose size the shards do not give (a stand-in reason here) is not scaled: a world size
    up to DIRECT_MAX is run for itself, saying why; beyond, refused with the reason."""
    import memfit.memory.fsdp_run as fsdp_run
    m = rank_cases.mlp()
    opt = torch.optim.AdamW(m.parameters())
    computed = rank_memory_model(m, (64,), optimizer=opt, world_size=5, probes=(4,))
    monkeypatch.setattr(fsdp_run, "_scaling", lambda *a: (None, "a stand-in reason"))
    forget(m)                                           # the runs kept for m were made before the stand-in
    direct = rank_memory_model(m, (64,), optimizer=opt, world_size=5, probes=(4,))
    assert "run at 5 ranks, not computed from 2: a stand-in reason" in direct.method
    assert direct.total_bytes(4) == computed.total_bytes(4) and direct.unscalable == "a stand-in reason"
    with pytest.raises(ValueError, match=f"a stand-in reason.*up to {DIRECT_MAX} ranks"):
        rank_memory_model(m, (64,), optimizer=opt, world_size=DIRECT_MAX + 1, probes=(4,))


def test_an_optimizer_state_not_shaped_like_the_shard_is_not_scaled():
    """A storage that must scale and that no rule gives stops the scaling, and the run says which."""
    class RowState(torch.optim.SGD):                    # SGD with a state of one value per row of the shard
        @torch.no_grad()
        def step(self, closure=None):
            for p in self.param_groups[0]["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                self.state[p].setdefault("rows", torch.zeros(local.shape[:1]))
            return super().step(closure)
    m = rank_cases.mlp()
    run = fsdp_fake_run(m, ExampleBatch((64,)), 4, world_size=2, rank=0, optimizer=RowState(m.parameters(), lr=0.1),
                        loss_fn=None, target=None)
    assert run.scaling is None and "optimizer state 'rows'" in run.unscalable


def test_scaled_bytes_are_rank_zero_chunks():
    w = 7
    t = torch.zeros(255, 3)
    assert Scaled(4, False, ((255, 3),)).bytes_at(w) == t.chunk(w)[0].nbytes
    assert Scaled(4, True, ((255, 3),)).bytes_at(w) == w * t.chunk(w)[0].nbytes == math.ceil(255 / w) * w * 12

"""memfit.fit: the plan against plain PyTorch steps (gradient, dropout masks, BatchNorm statistics, RNG), its
real peak against the budget, and what fit leaves untouched."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.fitting.checkpointing import candidate_blocks, checkpointed
from memfit.memory.measure import optimizer_state, track_memory, unique_bytes

N, D = 24, 16


def mlp(dropout=0.0, bn=False, blocks=4):
    torch.manual_seed(0)
    def block():
        return nn.Sequential(nn.Linear(D, 64), *( [nn.BatchNorm1d(64)] if bn else []), nn.GELU(), nn.Dropout(dropout),
                             nn.Linear(64, D))
    return nn.Sequential(*[block() for _ in range(blocks)])


def data(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def plain_step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(x), y).backward()
    opt.step()


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def max_rel_error(a, b):
    return max(float((u - v).abs().max() / v.abs().max().clamp_min(1e-12)) for u, v in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def table():
    """Every alternative's predicted bytes for the dropout-free MLP (one exhaustive search)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.fit(model, opt, data(), F.mse_loss, "1GiB", exhaustive=True)
    return {(a.micro_batch, len(a.setting.checkpoint)): a.bytes for a in plan.alternatives}


def real_peak(plan, model, opt, batch) -> int:
    """Live bytes at the peak of plan.step: what is held before it plus the tracked peak inside it."""
    opt.zero_grad(set_to_none=True)          # as the step starts (the tracker cannot see frees of older storages)
    held = unique_bytes([*model.parameters(), *model.buffers(), *optimizer_state(opt), *batch])
    with track_memory("cpu") as mem:
        plan.step(batch)
    return held + mem.peak


def test_candidates_are_the_repeated_blocks():
    assert candidate_blocks(mlp()) == ["0", "1", "2", "3"]
    nested = nn.Sequential(nn.Linear(2, 2),
                           nn.ModuleList([nn.Sequential(nn.Linear(2, 2), nn.ReLU()) for _ in range(3)]))
    assert candidate_blocks(nested) == ["1.0", "1.1", "1.2"]
    assert candidate_blocks(nn.Linear(2, 2)) == []


def test_plain_step_when_it_fits(table):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.fit(model, opt, data(), F.mse_loss, table[(N, 0)])
    assert (plan.micro_batch, plan.checkpoint, plan.relative_time) == (N, (), 1.0)
    assert "the plain step fits" in plan.explain()


# OPEN, found when `measure` began counting what the allocator serves (issue 27): on these checkpointed and bf16
# plans the real step's allocator peak is 5-14% above plan.peak_bytes (a tiny MLP with 2 of 4 blocks checkpointed:
# predicted 89,812 B, op outputs 88,260 B, allocator 93,316 B, the peak inside the recomputed block's backward mm).
# strict: the day the memory model counts it, these pass and the mark must go.
UNDER_ALLOCATOR = pytest.mark.xfail(strict=True, reason="the step memory model is below the allocator's peak for "
                                    "checkpointed and bf16-autocast steps (open; see the comment above)")


@UNDER_ALLOCATOR
@pytest.mark.parametrize("fraction", [0, 1])
def test_tight_budget_chooses_a_plan_that_fits_really_and_gives_the_full_batch_gradient(table, fraction):
    # between the least any alternative needs and the plain step: a real choice
    budget = table[(N, 4)] if fraction else (min(table.values()) + table[(N, 4)]) // 2
    model, ref = mlp(), mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data()
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, budget)
    assert plan.peak_bytes <= budget and (plan.micro_batch < N or plan.checkpoint)
    peak = real_peak(plan, model, opt, (x, y))
    plain_step(ref, ref_opt, x, y)
    assert peak <= plan.peak_bytes <= budget
    assert max_rel_error(grads(model), grads(ref)) < 1e-5
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    assert all("forward" not in vars(m) for m in model.modules())          # checkpointing only while it ran


def test_checkpointed_dropout_draws_the_plain_steps_masks_and_leaves_the_rng_as_it_does():
    model, ref = mlp(dropout=0.3), mlp(dropout=0.3)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data()
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", candidates=["0", "2"])
    plan.checkpoint = ("0", "2")       # whatever was chosen: run this one with dropout inside checkpointed blocks
    torch.manual_seed(5)
    plan.step((x, y))
    after = torch.get_rng_state()
    torch.manual_seed(5)
    plain_step(ref, ref_opt, x, y)
    assert torch.equal(after, torch.get_rng_state())
    assert max_rel_error(grads(model), grads(ref)) < 1e-6


def test_fit_leaves_model_rng_and_optimizer_as_they_were():
    model = mlp(dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data()
    plain_step(model, opt, x, y)                      # optimizer state exists
    state, opt_state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    rng = torch.get_rng_state()
    grads_before = grads(model)
    memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", exhaustive=True)
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])
    assert max_rel_error(grads(model), grads_before) == 0
    after = opt.state_dict()
    for i, st in opt_state["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v)
    assert all("forward" not in vars(m) for m in model.modules())


def test_checkpointing_is_undone_after_an_error():
    model = mlp()
    with pytest.raises(RuntimeError, match="boom"), checkpointed(model, ["1", "2"]):
        assert "forward" in vars(model[1])
        raise RuntimeError("boom")
    assert all("forward" not in vars(m) for m in model.modules())
    with pytest.raises(ValueError, match="no module named"):
        with checkpointed(model, ["7"]):
            pass


def test_batchnorm_gets_checkpointing_only_and_its_statistics_move_once():
    model, ref = mlp(bn=True), mlp(bn=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data()
    big = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", exhaustive=True)
    assert {a.micro_batch for a in big.alternatives} == {N}              # batch statistics: no micro-batches
    assert "allow_batch_dependent" in big.reason
    tight = min(a.bytes for a in big.alternatives)
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, tight)
    assert plan.checkpoint and plan.micro_batch == N
    plan.step((x, y))
    plain_step(ref, ref_opt, x, y)
    for (k, v), w in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, msg=k)                   # running statistics updated once, as plain


def test_nothing_fits_raises_with_the_breakdown():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(memfit.BudgetExceeded, match=r"parameters \+ gradients \+ optimizer state alone") as e:
        memfit.fit(model, opt, data(), F.mse_loss, "100KiB")     # state 133 KiB; on 2 devices 78 KiB each
    assert dict(e.value.items)["optimizer state"] == 2 * dict(e.value.items)["parameters"]
    assert "2 devices sharding" in str(e.value) and "levers=" not in str(e.value)     # bf16 shrinks no state
    static = sum(v for _, v in e.value.items[:3])
    with pytest.raises(memfit.BudgetExceeded, match=r"the least any alternative needs") as e:
        memfit.fit(model, opt, data(), F.mse_loss, static + 16)
    assert "levers=('bf16',)" in str(e.value)


@UNDER_ALLOCATOR
def test_levers_are_opt_in_and_a_last_resort():
    # BatchNorm: the whole batch only, so only checkpointing and bf16 can shrink the activations
    model = mlp(bn=True, blocks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(128)
    with pytest.raises(ValueError, match="unknown lever"):
        memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", levers=("fp8",))
    plain = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", exhaustive=True)
    assert all(a.setting.autocast is None for a in plain.alternatives)
    both = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB", levers=("bf16",), exhaustive=True)
    assert both.autocast is None                              # the plain step fits: the lever is not used
    least32 = min(a.bytes for a in both.alternatives if a.setting.autocast is None)
    least16 = min(a.bytes for a in both.alternatives if a.setting.autocast == "bfloat16")
    assert all(not a.setting.checkpoint for a in both.alternatives if a.setting.autocast)    # never combined
    assert least16 < least32
    with pytest.raises(memfit.BudgetExceeded, match="levers="):
        memfit.fit(model, opt, (x, y), F.mse_loss, least16)
    tight = memfit.fit(model, opt, (x, y), F.mse_loss, least16, levers=("bf16",))
    assert tight.autocast == torch.bfloat16 and "bfloat16 autocast (asked for by levers=)" in tight.explain()
    assert "nothing at the step's own precision fits" in tight.reason
    assert real_peak(tight, model, opt, (x, y)) <= tight.peak_bytes


def test_accumulate_runs_a_batchnorm_model_whole_without_opt_in():
    """One micro-batch of the whole batch is the plain step: no BatchDependentError (it was raised before)."""
    model, ref = mlp(bn=True), mlp(bn=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data()
    memfit.accumulate(model, opt, (x, y), F.mse_loss, micro_batch=N)
    plain_step(ref, ref_opt, x, y)
    assert max_rel_error(grads(model), grads(ref)) < 1e-6
    with pytest.raises(memfit.BatchDependentError):
        memfit.accumulate(model, opt, (x, y), F.mse_loss, micro_batch=N // 2)


def _fit_rank(rank, world):
    model = mlp()
    x, y = data()
    part = (x[rank::world], y[rank::world])                 # 12 samples a rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp = nn.parallel.DistributedDataParallel(model)
    # rank 1's budget misses its plain step; rank 0's fits anything: both must take the same (rank 1's) plan
    buckets = sum(p.nbytes for p in model.parameters())     # DDP's gradient buckets, which fit counts under DDP
    budget = "1GiB" if rank == 0 else memfit.fit(model, opt, part, F.mse_loss, "1GiB").peak_bytes + buckets - 1
    plan = memfit.fit(ddp, opt, part, F.mse_loss, budget, distributed=True)
    r = plan.step(part)
    try:                           # rank 1's budget fits nothing: every rank stops, none waits for it
        memfit.fit(ddp, opt, part, F.mse_loss, "1GiB" if rank == 0 else "1KiB", distributed=True)
        stopped = "no error"
    except Exception as e:
        stopped = type(e).__name__
    return plan.micro_batch, plan.checkpoint, r.loss, [p.grad.tolist() for p in model.parameters()], stopped


def test_every_rank_gets_the_same_plan_and_the_global_batch_gradient():
    from memfit.testing.ranks import run_ranks
    out = run_ranks(_fit_rank, 2, timeout=90)
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    (m0, c0, loss0, g0, stop0), (m1, c1, _, g1, stop1) = out[0][1], out[1][1]
    assert (stop0, stop1) == ("RankFailed", "BudgetExceeded")
    assert (m0, c0) == (m1, c1) and (m0 < N // 2 or c0)
    ref = mlp()
    x, y = data()
    loss = F.mse_loss(ref(torch.cat([x[0::2], x[1::2]])), torch.cat([y[0::2], y[1::2]]))
    loss.backward()
    assert abs(loss0 - float(loss.detach())) < 1e-5
    for p, a, b in zip(ref.parameters(), g0, g1, strict=True):
        torch.testing.assert_close(torch.tensor(a), p.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(b), p.grad, rtol=1e-5, atol=1e-6)


def test_plans_are_kept_per_model_and_dropped_when_it_changes(monkeypatch):
    from memfit.fitting import fitter
    calls = []
    search = fitter._search
    monkeypatch.setattr(fitter, "_search", lambda *a, **k: calls.append(1) or search(*a, **k))
    model = mlp(blocks=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = memfit.fit(model, opt, data(), F.mse_loss, "1GiB")
    b = memfit.fit(model, opt, data(), F.mse_loss, "1GiB")
    assert len(calls) == 1
    assert (a.micro_batch, a.checkpoint, a.peak_bytes) == (b.micro_batch, b.checkpoint, b.peak_bytes)
    memfit.fit(model, opt, data(), F.mse_loss, "2GiB")                   # another budget: another search
    model[0][3].p = 0.5                                                  # the model changed: searched again
    memfit.fit(model, opt, data(), F.mse_loss, "1GiB")
    assert len(calls) == 3


def test_machine_rates_are_measured_without_touching_the_rng():
    from memfit.fitting import costs
    costs._MACHINES.clear()
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    m = costs.machine(torch.device("cpu"))
    assert torch.equal(rng, torch.get_rng_state())
    assert 0 < m.op_seconds < 1e-2 and m.flop_rate > 1e6 and m.byte_rate > 1e6


def test_a_checkpointed_plan_says_its_peak_may_be_below_the_allocators(table):
    """The open gap above is never silent: a plan that checkpoints warns and its explain() says so; a plain plan
    does not."""
    import warnings
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match="APPROXIMATE.*checkpoints"):
        plan = memfit.fit(model, opt, data(), F.mse_loss, table[(N, 4)])
    assert plan.checkpoint and "APPROXIMATE" in plan.explain()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        other = mlp()
        plain = memfit.fit(other, torch.optim.SGD(other.parameters(), lr=0.1), data(), F.mse_loss, table[(N, 0)])
    assert not plain.checkpoint and "APPROXIMATE" not in plain.explain()

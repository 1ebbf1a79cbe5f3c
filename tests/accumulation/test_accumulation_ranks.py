"""memfit.accumulation.ranks: accumulate across 2 gloo ranks against one process on the whole batch."""
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from accumulation.cases import (
    C,
    Gated,
    OOMInBackward,
    Tagger,
    assert_bitwise,
    data,
    held_grads,
    make,
    nan_on,
    pair,
    plain_step,
    state_of,
    token_loss,
)
from memfit.accumulation.run import accumulate
from memfit.testing.ranks import context as ranks_context
from memfit.testing.ranks import run_ranks

# ---- two processes ------------------------------------------------------------------------------------------
SIZES = (7, 4)                 # uneven batches on the two ranks


def _ddp_step(rank, oom_rank):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    model = make("mlp")
    ddp = nn.parallel.DistributedDataParallel(model)
    reductions = []                 # gradient buckets all-reduced: only in the last micro-batch

    def counting_hook(state, bucket):
        reductions.append(1)
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    x, y = data(sum(SIZES))
    s = sum(SIZES[:rank])
    if rank == oom_rank:            # this rank's first micro-batch (no_sync) runs out of memory once
        calls = {"n": 0}

        def once(n):
            calls["n"] += 1
            return calls["n"] != 1
        OOMInBackward.budget = staticmethod(once)
        model.register_forward_hook(lambda m, i, o: OOMInBackward.apply(o))
    r = accumulate(ddp, opt, (x[s:s + SIZES[rank]], y[s:s + SIZES[rank]]), F.cross_entropy, micro_batch=3,
                   distributed=True)
    return (r.loss, r.retries, r.micro_batches, len(reductions), [p.grad.tolist() for p in model.parameters()],
            [p.tolist() for p in model.parameters()])


def _ddp_rank(rank, world):
    return [_ddp_step(rank, None), _ddp_step(rank, 1)]


def test_two_gloo_ranks_step_like_one_process_on_the_whole_batch(ddp_checks):
    out = ddp_checks["step"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    ref, ref_opt, _, _ = pair("mlp")
    x, y = data(sum(SIZES))
    loss = plain_step(ref, ref_opt, x, y)
    for rank, (_, steps) in out.items():
        for oom_rank, (r_loss, retries, micro_batches, reductions, grads, params) in zip((None, 1), steps, strict=True):
            assert abs(r_loss - loss) < 1e-5
            assert retries == (1 if rank == oom_rank else 0)
            # 7 = 3 + 3 + 1, 4 = 3 + 1; the retried 3 on rank 1 runs as 1 + 1 + 1
            assert micro_batches == (3 if rank == 0 else 2 + 2 * (rank == oom_rank))
            assert reductions == 1
            for p, g, q in zip(ref.parameters(), grads, params, strict=True):
                assert torch.allclose(p.grad, torch.tensor(g), rtol=1e-5, atol=1e-7)
                assert torch.allclose(p, torch.tensor(q), rtol=1e-5, atol=1e-7)


def _token_set():
    """7 samples of token labels; samples 5 and 6 (rank 1's last micro-batch of 2) have none that count."""
    g = torch.Generator().manual_seed(3)
    ids, y = torch.randint(0, 20, (7, 6), generator=g), torch.randint(0, C, (7, 6), generator=g)
    y[torch.arange(6) >= torch.randint(1, 7, (7, 1), generator=g)] = -100
    y[5:] = -100
    return ids, y


def _ddp_terms(rank, world):
    model = Tagger()
    ddp = nn.parallel.DistributedDataParallel(model)
    ids, y = _token_set()
    s, e = ((0, 3), (3, 7))[rank]
    r = accumulate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), (ids[s:e], y[s:e]), token_loss, micro_batch=2,
                   distributed=True, terms=lambda x, y: (y != -100).sum())
    return r.loss, [p.grad.tolist() for p in model.parameters()]


def test_terms_across_two_ranks_give_the_token_mean_step_even_when_a_last_micro_batch_counts_none(ddp_checks):
    """A rank whose last micro-batch (the one that all-reduces) counts no terms still joins the all-reduce
    with a zero gradient, instead of leaving the other rank waiting."""
    out = ddp_checks["terms"]
    assert sorted(out) == [0, 1] and all(st == "ok" for st, _ in out.values()), out
    ref = Tagger()
    ids, y = _token_set()
    loss = token_loss(ref(ids), y)
    loss.backward()
    for _, (r_loss, grads) in out.values():
        assert abs(r_loss - loss.item()) <= 1e-5
        for p, g in zip(ref.parameters(), grads, strict=True):
            assert torch.allclose(p.grad, torch.tensor(g), rtol=1e-5, atol=1e-7)


def test_an_oom_in_the_last_micro_batch_backs_off_locally_under_no_sync(oom_budget):
    """With DDP every micro-batch, the last too, runs under no_sync (its backward is local), so an out-of-memory
    error in the last one backs off like any other (it used to be an error: the last backward all-reduced)."""
    from memfit.accumulation.micro_step import MicroStep
    entered = []

    class Local(Gated):
        def no_sync(self):
            import contextlib
            entered.append(1)
            return contextlib.nullcontext()
    mod = Local()
    x, y = data(10)
    oom_budget.budget = staticmethod(lambda n: n != 4)
    step = MicroStep(mod, list(mod.parameters()), F.cross_entropy, x, y, 10, 20, 2, torch.device("cpu"))
    assert step.run_range(0, 10, 6, frozenset()) == 2            # [0, 6), then the last 4 fail and run as 2 + 2
    assert step.retries == 1 and step.micro_batches == 3 and len(entered) == 4


# ---- a rank that fails, a rank whose loss is not finite -----------------------------------------------------
FAIL_CALLS = {"a middle micro-batch": 2, "the last, before its backward": 4, "inside the last backward": -4}


class _RaisesInBackward(torch.autograd.Function):
    """The loss as it is, whose backward raises (as a failing backward hook would)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("loss exploded on purpose")


def _ddp_fails(rank, world, released):
    """Rank 1's loss raises on its n-th micro-batch (of 4), in each case of FAIL_CALLS in a row, and rank 1 stays
    alive afterwards (as a process that catches the error would) until rank 0 is done, or 30 s."""
    out = {}
    for (case, call), done in zip(FAIL_CALLS.items(), released, strict=True):
        model = make("mlp")
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        x, y = data(8)
        calls = {"n": 0}

        def loss_fn(o, t, calls=calls, call=call):
            calls["n"] += 1
            if rank == 1 and calls["n"] == call:
                raise RuntimeError("loss exploded on purpose")
            if rank == 1 and calls["n"] == -call:        # DDP all-reduced inside this backward: rank 0 waited
                return _RaisesInBackward.apply(F.cross_entropy(o, t))
            return F.cross_entropy(o, t)
        t0 = time.perf_counter()
        try:
            accumulate(ddp, opt, (x, y), loss_fn, micro_batch=2, distributed=True)
            out[case] = ("no error", time.perf_counter() - t0)
        except Exception as e:
            out[case] = (f"{type(e).__name__}: {e}", time.perf_counter() - t0)
        if rank == 0:
            done.set()
        else:
            done.wait(30)
    return out


def test_a_rank_whose_loss_raises_makes_every_rank_raise_at_once_naming_it(ddp_checks):
    """Rank 0 used to wait in DDP's all-reduce until rank 1's process exited (here 30 s; with a rank that stays
    alive, the process-group timeout), then got gloo's 'Connection closed by peer'; inside the last backward
    (which all-reduced) it still did. Every backward is local now, and the ranks agree after each. (The last
    check of the `ddp_checks` spawn, under a 60 s collective timeout.)"""
    out = ddp_checks["fails"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    for case in FAIL_CALLS:
        (msg0, took0), (msg1, _) = out[0][1][case], out[1][1][case]
        assert msg1 == "RuntimeError: loss exploded on purpose", case
        assert msg0.startswith("RankFailed: memfit: memfit.accumulate") and \
            "another rank failed (rank 1: RuntimeError: loss exploded on purpose)" in msg0, (case, msg0)
        assert took0 < 5, f"{case}: rank 0 took {took0:.1f} s to learn that rank 1 failed"


def _ddp_nan(rank, world, bucket_view=False):
    model = make("mlp")
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = data(sum(SIZES))
    s = sum(SIZES[:rank])
    part = (x[s:s + SIZES[rank]], y[s:s + SIZES[rank]])
    if bucket_view:         # a step that changes nothing leaves DDP's bucket views as the gradients
        accumulate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), part, F.cross_entropy, micro_batch=3,
                   distributed=True)
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    else:
        held_grads(list(model.parameters()))
    grads = [p.grad for p in model.parameters()]
    before = state_of(model, opt)
    out = {}
    try:
        accumulate(ddp, opt, part, nan_on(2) if rank == 1 else F.cross_entropy, micro_batch=3, distributed=True,
                   restore_grads=True)
        out["raise"] = "no error"
    except Exception as e:
        out["raise"] = f"{type(e).__name__}: {e}"
    r = accumulate(ddp, opt, part, nan_on(2) if rank == 1 else F.cross_entropy, micro_batch=3, distributed=True,
                   nonfinite="skip", restore_grads=True)
    out["skip"] = r.skipped
    after = state_of(model, opt)
    assert_bitwise(after[0], before[0])                 # raised here: the driver reports it as this rank's error
    assert_bitwise(after[2], before[2])
    assert_bitwise(after[1], before[1])                 # the gradients held before, given back on every rank
    assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
    model.zero_grad(set_to_none=True)
    accumulate(ddp, opt, part, F.cross_entropy, micro_batch=3, distributed=True)     # DDP and the group still work
    out["params"] = [p.tolist() for p in model.parameters()]
    return out


@pytest.mark.parametrize("bucket_view", [False, True])
def test_a_nan_loss_on_one_rank_stops_every_rank_from_stepping(bucket_view, ddp_checks):
    """No rank steps, every rank's gradients are given back with restore_grads=True (also when DDP keeps them as
    views of its buckets, which its all-reduce would overwrite: none runs), and the next step is the plain one."""
    out = ddp_checks["nan_bucket_view" if bucket_view else "nan"]
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    ref = make("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x, y = data(sum(SIZES))
    plain_step(ref, ref_opt, x, y)                      # the first step that was taken: from the initial state
    for rank in (0, 1):
        r = out[rank][1]
        assert r["raise"].startswith("NonFiniteLossError: accumulate: the loss is not finite"), r["raise"]
        assert "rank 1: micro-batch 2 of 2 (samples 3..3 of its batch)" in r["raise"]
        assert "rank 1: micro-batch 2 of 2 (samples 3..3 of its batch)" in r["skip"]
        for p, q in zip(ref.parameters(), r["params"], strict=True):
            assert torch.allclose(p, torch.tensor(q), rtol=1e-5, atol=1e-7)


def _ddp_checks(rank, world, released):
    """The 2-rank checks, in one process group one after the other (starting the processes was most of each
    check's time), the one where rank 1 fails on purpose last: {check: its value, or the error that check raised}.
    Each runs under the collective timeout its own spawn had (MEMFIT_DIST_TIMEOUT, read at each wait): 30 s, and
    60 s for "fails"."""
    import os
    out = {}
    for name, check, timeout_s in (("step", _ddp_rank, 30.0), ("terms", _ddp_terms, 30.0),
                                   ("nan", lambda r, w: _ddp_nan(r, w, False), 30.0),
                                   ("nan_bucket_view", lambda r, w: _ddp_nan(r, w, True), 30.0),
                                   ("fails", lambda r, w: _ddp_fails(r, w, released), 60.0)):
        os.environ["MEMFIT_DIST_TIMEOUT"] = str(timeout_s)
        try:
            out[name] = ("ok", check(rank, world))
        except Exception as e:          # one check's failure must not hide the others' results
            out[name] = ("error", f"{type(e).__name__}: {e}")
    return out


@pytest.fixture(scope="module")
def ddp_checks():
    """{check: {rank: (status, value)}} from one spawn of 2 gloo ranks."""
    released = [ranks_context().Event() for _ in FAIL_CALLS]      # "fails": rank 1 waits for rank 0
    out = run_ranks(_ddp_checks, 2, released, timeout=120)
    assert sorted(out) == [0, 1] and all(s == "ok" for s, _ in out.values()), out
    return {name: {rank: value[name] for rank, (_, value) in out.items()} for name in out[0][1]}


def test_the_start_agreement_keeps_a_class_weighted_sum_of_terms_exact(tmp_path):
    """A class-weighted loss's terms are a float (the sum of its targets' weights): the agreement shares ints, and
    rounded the sum to one, so every micro-batch's weight was off. It shares the float's bits."""
    import types

    import torch.distributed as dist

    from memfit.accumulation.ranks import agree_start
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        step = types.SimpleNamespace(n_total=7.35, n=5)
        assert agree_start(None, step, 2, "given", False) == (7.35, 2, "given", 3)
        step.n_total = 12
        total = agree_start(None, step, 2, "given", False)[0]
        assert total == 12 and isinstance(total, int)
    finally:
        dist.destroy_process_group()

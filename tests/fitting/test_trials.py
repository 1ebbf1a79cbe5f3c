"""memfit.fitting.trials: real micro-steps timed for fit's leading alternatives, leaving the model, its gradients,
its buffers and torch's generator as they were."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memfit.fitting.search import Setting
from memfit.fitting.trials import draws, micro_steps


def model(dropout=0.3):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Dropout(dropout),
                                         nn.Linear(256, 64)) for _ in range(3)]).train()


def state(m):
    return ([p.detach().clone() for p in m.parameters()], [None if p.grad is None else p.grad.clone()
                                                           for p in m.parameters()],
            [b.clone() for b in m.buffers()], [sorted(vars(x)) for x in m.modules()])


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b, strict=True))
    return a == b


def test_micro_steps_are_timed_and_leave_everything_as_it_was():
    """Dropout, BatchNorm and checkpointing: the parameters, their gradients (held ones too), the running
    statistics, the modules' attributes and torch's generator are as before; a larger micro-batch takes longer."""
    m = model()
    x, y = torch.randn(1024, 64), torch.randn(1024, 64)
    F.mse_loss(m(x), y).backward()                         # gradients held by the caller
    before = state(m)
    rng = torch.get_rng_state()
    points = [(1024, Setting()), (2, Setting(("0", "1"))), (2, Setting())]
    timed = micro_steps(m, F.mse_loss, x, y, points)
    assert timed.why_not == "" and timed.runs == 2 and ("CPU time" in timed.clock or "wall" in timed.clock)
    assert set(timed.seconds) == set(points) and all(s > 0 for s in timed.seconds.values())
    assert timed.seconds[(1024, Setting())] > 4 * timed.seconds[(2, Setting())]       # 512x the samples
    assert same(state(m), before)
    assert torch.equal(torch.get_rng_state(), rng)


SEEN: list[int] = []      # the batch sizes FunctionalDropout's forwards ran at (a module's own list is copied)


class FunctionalDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        SEEN.append(x.shape[0])
        return F.dropout(self.lin(x), 0.5, self.training)


def test_a_model_that_draws_outside_its_dropout_modules_is_timed_and_draws_nothing_from_torch():
    """T5's attention dropout is functional: such a model was not timed at all (the time model's noise decided);
    now its micro-steps draw from generators of memfit's own, every round (not only the warm-ups)."""
    m = FunctionalDropout()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rng = torch.get_rng_state()
    timed = micro_steps(m, F.mse_loss, x, y, [(2, Setting()), (4, Setting())], rounds=3)
    assert timed.why_not == "" and set(timed.seconds) == {(2, Setting()), (4, Setting())} and timed.runs == 2
    assert timed.drawn == ("aten.bernoulli_",)                    # the op that drew (dropout decomposes to it)
    assert torch.equal(torch.get_rng_state(), rng)
    plain = micro_steps(nn.Sequential(nn.Linear(8, 8)), F.mse_loss, x, y, [(2, Setting()), (4, Setting())])
    assert plain.drawn == ()


class Attention(nn.Module):
    """Self-attention as transformers models call it: F.scaled_dot_product_attention, its dropout 0 (eval, or
    attention dropout 0). Its CPU kernel is tagged as a random op, but draws nothing at dropout_p 0."""

    def __init__(self, dropout_p=0.0):
        super().__init__()
        self.qkv, self.out, self.dropout_p = nn.Linear(32, 96), nn.Linear(32, 32), dropout_p

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 4, 8).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(x.shape))


def test_attention_at_dropout_0_is_timed_and_draws_nothing_from_torch():
    """GPT-2's and BERT's leading alternatives were never timed: the attention kernel counted as a draw."""
    m, x, y = Attention(), torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    rng = torch.get_rng_state()
    timed = micro_steps(m, F.mse_loss, x, y, [(2, Setting()), (4, Setting())])
    assert timed.why_not == "" and set(timed.seconds) == {(2, Setting()), (4, Setting())}
    assert torch.equal(torch.get_rng_state(), rng)
    q = torch.randn(1, 2, 4, 8)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not draws(flash, (q, q, q, 0.0), {}) and not draws(flash, (q, q, q), {})       # its default: 0
    assert draws(flash, (q, q, q, 0.1), {}) and draws(flash, (q, q, q), {"dropout_p": 0.1})
    assert draws(torch.ops.aten.native_dropout.default, (q, 0.0, True), {})    # no dropout_p: it draws at p 0 too


def test_the_smallest_micro_step_is_warmed_up_first_and_the_rounds_go_back_and_forth():
    """Points given largest first: one sample opens (untimed), the warm-ups run smallest first, the next round
    largest first (ABBA)."""
    SEEN.clear()
    timed = micro_steps(FunctionalDropout(), F.mse_loss, torch.randn(8, 8), torch.randn(8, 8),
                        [(8, Setting()), (4, Setting()), (2, Setting())], rounds=2)
    assert SEEN == [1, 2, 4, 8, 8, 4, 2] and len(timed.seconds) == 3


class Fails(nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin, self.error = nn.Linear(4, 4), error

    def forward(self, x):
        if x.shape[0] > 2:
            raise self.error
        return self.lin(x)


def test_an_out_of_memory_error_or_a_failure_stops_the_timing_and_says_why():
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    oom = micro_steps(Fails(torch.OutOfMemoryError("CUDA out of memory")), F.mse_loss, x, y,
                      [(2, Setting()), (4, Setting())])
    assert oom.seconds == {} and oom.why_not == "out of memory"
    assert oom.failed == (4, Setting())             # the point that raised (fit keeps no plain step that did)
    other = micro_steps(Fails(ValueError("bad shape")), F.mse_loss, x, y, [(2, Setting()), (4, Setting())])
    assert other.seconds == {} and other.why_not == "a micro-step failed (ValueError: bad shape)"
    assert micro_steps(Attention(), F.mse_loss, torch.randn(4, 16, 32), torch.randn(4, 16, 32),
                       [(2, Setting())]).failed is None


def test_a_point_whose_first_run_comes_as_its_warm_up_did_takes_no_second(monkeypatch):
    """On a fake clock (each micro-step 1 s, or 3 s where the call is slow): a point whose first timed run came
    within `timing.STEADY` of its warm-up takes the warm-up as its second sample and runs twice in all; one whose
    warm-up was slow (set-up: 3 s) runs a second timed micro-step; the figures are the least sample either way."""
    from memfit.fitting import trials
    ran, now = [], [0.0]
    slow = {1}                  # the smallest point's warm-up (the call before it opens the trials: BatchNorm, 2)

    def run(copy, params, loss_fn, x, y, key, device):
        now[0] += 3.0 if len(ran) in slow else 1.0
        ran.append(key[0])
    monkeypatch.setattr(trials, "_run", run)
    monkeypatch.setattr(trials, "clock", lambda device: lambda: now[0])
    m = model()
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    timed = micro_steps(m, F.mse_loss, x, y, [(2, Setting()), (8, Setting())])
    # the opener, warm-ups, a run each (ABBA), a second of 2 only (its warm-up 3 s)
    assert ran == [2, 2, 8, 8, 2, 2]
    assert timed.seconds == {(2, Setting()): 1.0, (8, Setting()): 1.0} and timed.steady == 1


def _fake_runs(monkeypatch, seconds):
    """trials' micro-steps on a fake clock: the i-th call takes seconds(i, m); returns the sizes run, in order."""
    from memfit.fitting import trials
    ran, now = [], [0.0]

    def run(copy, params, loss_fn, x, y, key, device):
        now[0] += seconds(len(ran), key[0])
        ran.append(key[0])
    monkeypatch.setattr(trials, "_run", run)
    monkeypatch.setattr(trials, "clock", lambda device: lambda: now[0])
    return ran


def test_rounds_after_the_first_run_only_within_the_allowance(monkeypatch):
    """Micro-steps of 2 s (micro-batch 8's first, 3 s): with 6 s allowed, a second round as long as the first (5 s)
    would pass it: each point's figure is its first micro-step, and `runs` says 0; with 12 s, a second round runs
    (9 s in all) and a third as long as their mean would pass it: each figure is the one timed run; with no
    allowance, the three rounds as before (2 steady, its warm-up its second sample; 8 not, run again)."""
    from memfit.fitting import trials
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    points = [(2, Setting()), (8, Setting())]
    slow_first = lambda i, m: 3.0 if i == 2 else 2.0      # 8's warm-up (after the opener and 2's warm-up) 3 s
    ran = _fake_runs(monkeypatch, slow_first)
    one = trials.micro_steps(model(), F.mse_loss, x, y, points, allowance=6.0)
    assert ran == [2, 2, 8] and one.runs == 0 and one.seconds == {(2, Setting()): 2.0, (8, Setting()): 3.0}
    ran = _fake_runs(monkeypatch, slow_first)
    two = trials.micro_steps(model(), F.mse_loss, x, y, points, allowance=12.0)
    assert ran == [2, 2, 8, 8, 2] and two.runs == 1 and two.seconds == {(2, Setting()): 2.0, (8, Setting()): 2.0}
    ran = _fake_runs(monkeypatch, slow_first)
    every = trials.micro_steps(model(), F.mse_loss, x, y, points)
    assert ran == [2, 2, 8, 8, 2, 8] and every.runs == 2 and every.steady == 1
    assert every.seconds == {(2, Setting()): 2.0, (8, Setting()): 2.0}


def test_short_rounds_all_run_whatever_the_allowance(monkeypatch):
    """Rounds that stay within `FLOOR` run whatever the allowance (a fit whose prediction was kept took none)."""
    from memfit.fitting import trials
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    ran = _fake_runs(monkeypatch, lambda i, m: 0.25 if i == 1 else 0.125)    # 2's warm-up 0.25 s: not steady
    timed = trials.micro_steps(model(), F.mse_loss, x, y, [(2, Setting()), (8, Setting())], allowance=0.0)
    assert 0.25 + 5 * 0.125 <= trials.FLOOR
    assert ran == [2, 2, 8, 8, 2, 2] and timed.runs == 2
    assert timed.seconds == {(2, Setting()): 0.125, (8, Setting()): 0.125}


def test_fit_s_trials_of_short_micro_steps_take_more_rounds_within_floor(monkeypatch):
    """With the time model's seconds (fit's trials), micro-steps of 50 ms take rounds past ROUNDS while all of them
    stay within FLOOR (at most SHORT); without them (a direct call), ROUNDS as asked. Every call 50 ms: the third
    round is steady (each warm-up its second sample), every later round runs both points."""
    from memfit.fitting import trials
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    points = [(2, Setting()), (8, Setting())]
    ran = _fake_runs(monkeypatch, lambda i, m: 0.05)
    fit_s = trials.micro_steps(model(), F.mse_loss, x, y, points, allowance=0.01,
                               predicted={k: 0.05 for k in points})
    assert trials.SHORT == 9 and fit_s.runs == trials.SHORT - 1 and len(ran) == 1 + 2 + 2 + 0 + 6 * 2
    assert 0.05 * len(ran) <= trials.FLOOR
    ran = _fake_runs(monkeypatch, lambda i, m: 0.05)
    direct = trials.micro_steps(model(), F.mse_loss, x, y, points, allowance=0.01)
    assert direct.runs == trials.ROUNDS - 1 and ran == [2, 2, 8, 8, 2]


def test_within_takes_the_first_two_then_each_further_point_while_the_predicted_first_steps_fit():
    from memfit.fitting.trials import LEAST, within
    a, b, c, d = ((m, Setting()) for m in (8, 4, 2, 1))
    predicted = {a: 10.0, b: 5.0, c: 2.0, d: 1.0}
    assert LEAST == 2
    assert within([a, b, c, d], predicted, 1.0) == ([a, b], [c, d])       # two whatever the allowance
    assert within([a, b, c, d], predicted, 17.0) == ([a, b, c], [d])
    assert within([a, b, c, d], predicted, 18.0) == ([a, b, c, d], [])
    # in the order given: the first past the allowance ends the list, a cheaper one after it is not taken
    assert within([a, b, c, d], {**predicted, c: 9.0}, 17.0) == ([a, b], [c, d])


def test_with_predicted_seconds_the_allowance_holds_in_the_time_models_seconds(monkeypatch):
    """Each micro-step takes twice what the time model predicted for it (a busy machine, or a model whose kernels
    run slower in a step): the allowance, given in the time model's seconds, is held in the clock's as twice that.
    Points 8 and 4 predicted 3 and 1.5 s (real 6 and 3); 2 predicted 0.75 s: with 5 s allowed, the first round of 8
    and 4 is predicted 4.5 s, so 2 is left out (5.25 s) and never runs; a second round (9 s of the time model's)
    would pass the allowance: one round, each figure its first micro-step, and the clock's seconds spent stay within
    the two points that always run."""
    from memfit.fitting import trials
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    eight, four, two = ((m, Setting()) for m in (8, 4, 2))
    predicted = {eight: 3.0, four: 1.5, two: 0.75}
    ran = _fake_runs(monkeypatch, lambda i, m: 2 * predicted[(m, Setting())])
    timed = trials.micro_steps(model(), F.mse_loss, x, y, [eight, four, two], allowance=5.0, predicted=predicted)
    assert ran == [4, 4, 8] and timed.left_out == [two] and timed.runs == 0
    assert timed.seconds == {eight: 6.0, four: 3.0}
    # with 14 s allowed all three are taken (5.25 s), and a second round fits (10.5 s of the time model's, 21 s of
    # the clock's), a third (15.75 s) does not; the clock's seconds spent: twice the time model's 10.5
    ran = _fake_runs(monkeypatch, lambda i, m: 2 * predicted[(m, Setting())])
    timed = trials.micro_steps(model(), F.mse_loss, x, y, [eight, four, two], allowance=14.0, predicted=predicted)
    assert ran == [2, 2, 4, 8, 8, 4, 2] and timed.left_out == [] and timed.runs == 1
    assert sum(2 * predicted[(m, Setting())] for m in ran[1:]) == 21.0 <= 2 * 14.0     # the opener not counted


def test_a_small_models_leading_points_are_all_timed_whatever_its_allowance(monkeypatch):
    """Points predicted a few ms each, an allowance of less than one of them: every point is timed, within FLOOR
    (which points run must not turn on the time model's noise where they cost nothing)."""
    from memfit.fitting import trials
    keys = [(m, Setting()) for m in (8, 4, 2)]
    ran = _fake_runs(monkeypatch, lambda i, m: 0.004)
    timed = trials.micro_steps(model(), F.mse_loss, torch.randn(8, 64), torch.randn(8, 64), keys, allowance=0.001,
                               predicted={k: 0.003 for k in keys})
    assert timed.left_out == [] and set(timed.seconds) == set(keys) and set(ran) == {2, 4, 8}


def test_a_point_left_out_is_never_chosen_and_the_choice_is_the_faster_measured(monkeypatch):
    """Trials stopped early decide between what they timed: the predicted best, measured slower than the second,
    gives way to it; the third, left out by the allowance (measured: None), is not chosen, however it was predicted."""
    from memfit.fitting import trials
    from memfit.fitting.search import Alternative, Choice, Cost, Machine, confirm
    step = Cost(ops=0, kernels=((1, 1.0), (8, 8.0)))
    alts = [Alternative(8, Setting(("0",)), 1.2, bytes=10), Alternative(4, Setting(), 1.25, bytes=10),
            Alternative(2, Setting(), 1.3, bytes=10)]
    choice = Choice(alts[0], alts, "predicted", list(alts))
    keys = [(a.micro_batch, a.setting) for a in alts]
    measured = {8: 10.0, 4: 4.0, 2: 0.5}                     # the third would be fastest, were it timed
    _fake_runs(monkeypatch, lambda i, m: measured[m])
    timed = trials.micro_steps(model(), F.mse_loss, torch.randn(8, 64), torch.randn(8, 64), keys, allowance=1.0,
                               predicted={k: 1.0 for k in keys})
    assert set(timed.seconds) == set(keys[:2]) and timed.left_out == keys[2:]
    picked = confirm(choice, timed.seconds, 8, step, {"0": Cost(ops=0)}, Machine(op_seconds=0.0))
    assert picked.best is alts[1] and alts[1].measured == pytest.approx(8.0) and alts[0].measured == 10.0
    assert alts[2].measured is None and "micro-batch 2" not in picked.reason


def test_one_untimed_sample_opens_the_trials_and_the_smallest_point_where_one_sample_fails(monkeypatch):
    """The process's first micro-step pays for memory touched for the first time (BERT 768x12: the trials' first
    point 1.21-1.30x its later runs): one sample of a model without batch statistics opens the trials, untimed, and
    no figure holds its time (on a fake clock it takes 10 s); a model that cannot take one sample is opened by the
    smallest point itself; an opener of one sample that fails names no point as failed."""
    from memfit.fitting import trials
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    points = [(2, Setting()), (8, Setting())]
    ran = _fake_runs(monkeypatch, lambda i, m: 10.0 if i == 0 else 1.0)
    timed = trials.micro_steps(nn.Linear(8, 8), F.mse_loss, x, y, points, allowance=2.0)
    assert ran == [1, 2, 8] and timed.runs == 0 and timed.seconds == {(2, Setting()): 1.0, (8, Setting()): 1.0}

    class NotOne(nn.Linear):
        def forward(self, x):
            if x.shape[0] == 1:
                raise ValueError("needs two samples")
            return super().forward(x)
    monkeypatch.undo()
    SEEN.clear()
    timed = micro_steps(NotOne(8, 8), F.mse_loss, x, y, points, rounds=1)
    assert timed.why_not == "" and set(timed.seconds) == set(points)

    class Small(nn.Linear):
        def forward(self, x):
            if x.shape[0] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return super().forward(x)
    oom = micro_steps(Small(8, 8), F.mse_loss, x, y, points)
    assert oom.why_not == "out of memory" and oom.failed is None and oom.seconds == {}

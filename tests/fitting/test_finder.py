"""memfit.fitting.finder: the search wired to a model, its progress line, and the leading alternatives timed for
real deciding the choice."""
import torch
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.fitting import finder


class Bar:
    """Records what a progress line would show."""

    def __init__(self, total, desc, **kwargs):
        self.desc, self.kwargs, self.said, self.n = desc, kwargs, [], 0

    def set_postfix_str(self, s, refresh=True):
        self.said.append(s)

    def update(self, n=1):
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(3)])


def test_a_long_search_shows_its_phases_on_a_progress_line(monkeypatch):
    """Shown after PROGRESS_AFTER seconds (on a terminal): the kernels timed, the host, each memory model built."""
    bars = []
    monkeypatch.setattr(finder, "progress_bar", lambda *a, **k: bars.append(Bar(*a, **k)) or bars[-1])
    model = mlp()
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, "1GiB")
    (bar,) = bars
    assert bar.desc == "memfit.fit" and bar.kwargs["delay"] == finder.PROGRESS_AFTER
    assert any("kernels timed at 6 micro-batch sizes" in s for s in bar.said)      # 1, 2, 4, 8, 16, 32
    assert "the host's work per op" in bar.said
    built = [s for s in bar.said if s.startswith("memory model")]
    assert built == ["memory model, 0/3 checkpointed"]                             # the plain step fits
    # a fourth phase only where the time model put an alternative close to the plain step (a busy machine can,
    # on this small MLP): then the leading ones are timed for real, and the line says so
    timed = [s for s in bar.said if s.endswith("alternatives timed for real")]
    assert bar.n == 3 + len(timed) and len(timed) <= 1


def test_a_fit_at_another_budget_counts_and_times_nothing_again_until_the_model_changes(monkeypatch):
    calls = []
    real = finder.step_costs
    monkeypatch.setattr(finder, "step_costs", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
    memfit.fit(model, opt, (x, y), F.mse_loss, "2GiB")
    assert len(calls) == 1
    model[0][0].weight.requires_grad_(False)          # what the step's gradients and state depend on
    memfit.fit(model, opt, (x, y), F.mse_loss, "2GiB")
    assert len(calls) == 2


def test_the_trials_get_the_leading_fastest_first_and_one_predicted_plain_step_to_keep_to(monkeypatch):
    """Wired to a model: the leading alternatives (every one that fits within `lead`, here made wide) go to the
    trials fastest predicted first (the plain step does not fit), each with its micro-step's predicted seconds, and
    the allowance is `TRIALS` times the plain step's forward and backward as predicted; `explain()` says how many of
    the leading were timed."""
    from memfit.fitting import trials
    model = mlp()
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    every = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, "1GiB",
                       exhaustive=True)
    plain = next(a for a in every.alternatives if a.micro_batch == 32 and not a.setting.checkpoint)
    monkeypatch.setattr(finder, "wide_lead", lambda plain_micro_step: 100.0)
    seen, predicted = {}, {}
    real_steps, real_seconds = finder.micro_steps, finder.micro_step_seconds

    def seconds(m, step, blocks, setting, machine):
        predicted[(m, setting)] = real_seconds(m, step, blocks, setting, machine)
        return predicted[(m, setting)]

    def steps(module, loss_fn, x, y, points, **kwargs):
        seen.update(points=list(points), **kwargs)
        return real_steps(module, loss_fn, x, y, points, **kwargs)
    monkeypatch.setattr(finder, "micro_step_seconds", seconds)
    monkeypatch.setattr(finder, "micro_steps", steps)
    model = mlp()                                    # another model: nothing kept, the search runs again
    plan = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, plain.bytes - 1)
    time_of = {(a.micro_batch, a.setting): a.time for a in plan.alternatives}
    points = seen["points"]
    assert len(points) == 3 and (32, plain.setting) not in points
    assert [time_of[k] for k in points] == sorted(time_of[k] for k in points)
    assert seen["predicted"] == {k: predicted[k] for k in points}
    assert seen["allowance"] == trials.TRIALS * predicted[(32, plain.setting)]
    timed = [a for a in plan.alternatives if a.measured is not None]
    assert 2 <= len(timed) <= 3 and f"then {len(timed)} of the 3 leading alternatives" in plan.explain()


def test_blocks_of_alike_worth_rank_in_forward_order_whatever_the_timing_noise():
    """`bench fit`'s CNN: its first block's worth (activation bytes per second of recomputation) came 0.94x, 0.97x and
    1.11x the other three's in fits in turn, so 2 of 4 checkpointed were ('0', '1') or ('1', '2'). Within TIE of the
    most worth left, forward order; a block clearly more worth goes first, one clearly less last."""
    from memfit.fitting.search import Cost, Machine
    machine = Machine(op_seconds=1e-6)
    block = lambda seconds, written=1000.0: Cost(ops=0, kernels=((1, seconds), (2, 2 * seconds)),
                                                 written=(0.0, written))
    for noise in (0.9, 0.97, 1.0, 1.11):
        alike = {"0": block(1e-3 * noise), "1": block(1e-3), "2": block(1e-3), "3": block(1e-3)}
        assert finder._ranked(alike, machine) == ["0", "1", "2", "3"]
    mixed = {"0": block(1e-3), "1": block(1e-3, written=3000.0), "2": block(1e-3, written=300.0), "3": block(1e-3)}
    assert finder._ranked(mixed, machine) == ["1", "0", "3", "2"]


def test_with_levers_and_exhaustive_the_table_shows_what_the_trials_measured(monkeypatch):
    """levers= with exhaustive=True: explain()'s table is the search with the levers, and the leading timed for
    real (at the step's own precision) show their measured seconds in it, as without levers."""
    monkeypatch.setattr(finder, "wide_lead", lambda plain_micro_step: 100.0)
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    model = mlp()
    every = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, "1GiB",
                       exhaustive=True)
    budget = next(a for a in every.alternatives if a.micro_batch == 32 and not a.setting.checkpoint).bytes - 1
    measured = {}
    for levers in ((), ("bf16",)):
        model = mlp()
        plan = memfit.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.mse_loss, budget,
                          exhaustive=True, levers=levers)
        assert "timed for real" in plan.explain()
        measured[levers] = sum(a.measured is not None for a in plan.alternatives)
        chosen = next(a for a in plan.alternatives if (a.micro_batch, a.setting.checkpoint)
                      == (plan.micro_batch, plan.checkpoint) and a.setting.autocast is None)
        assert chosen.measured is not None
    assert measured[("bf16",)] == measured[()] >= 2


def test_explain_names_the_dropout_added_only_where_a_timed_plan_recomputes_one():
    """`how_time` says a checkpointed block's Dropout work was added (predicted) only where a timed plan checkpoints
    a block whose Dropout modules run ops (`Cost.dropped`)."""
    from memfit.fitting.search import Cost, Setting
    from memfit.fitting.trials import Timed
    drop, none = Cost(ops=4, kernels=((1, 1e-4),)), Cost(ops=0)
    blocks = {"a": Cost(ops=20, dropped=drop), "b": Cost(ops=20, dropped=none)}
    timed = lambda *sets: Timed(seconds={(8, Setting(s)): 1.0 for s in sets})     # noqa: E731
    assert finder._dropped(timed(("a",), ()), blocks)
    assert not finder._dropped(timed(("b",), ()), blocks)            # its block runs no Dropout
    assert not finder._dropped(timed((),), blocks)                    # nothing recomputed

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

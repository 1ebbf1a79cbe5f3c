"""`memfit bench planner`'s rows: a plan with no arena (every op run by torch) is at its bound, and the
targets' geometric means take it (log(0) raised before)."""
import torch
from torch import nn

from memfit import plan
from memfit.cli.bench.planner import _row, verdicts


def test_a_plan_without_an_arena_is_at_its_bound_and_the_verdicts_take_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    x = torch.randn(2, 3, 8, 8)
    pm = plan(model, (x,))
    assert pm.report.arena_bytes == pm.report.lower_bound == 0
    row = _row("conv", model, pm, x, repeat=1, plan_s=0.0)
    assert row["arena/bound"] == 1.0
    lines = verdicts([row])
    assert lines[0].startswith("arena / lower bound, geometric mean 1.000")

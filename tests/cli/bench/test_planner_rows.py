"""`memfit bench planner`'s rows: a plan with no arena (every op run by torch) is at its bound, and the
targets' geometric means take it (log(0) raised before)."""
import torch
from torch import nn

from memfit import plan
from memfit.cli.bench.planner import _row, verdicts, verdicts_real


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


def test_the_capture_target_is_judged_on_the_cold_compile():
    row = {"model": "m", "batch": 8, "latency_ratio": 0.9, "total/eager": 0.9, "arena/bound": 1.0, "captures": 1,
           "model/real": 1.0, "predicted": 100, "planned_total": 100}
    fast = verdicts_real([{**row, "plan/cold": 0.2, "plan/warm": 0.6}])[-1]
    assert fast.startswith("first plan <= 0.33 of a fully cold compile") and fast.endswith("PASS")
    assert "0.60-0.60 of one with the C++ kernel cache warm" in fast
    assert verdicts_real([{**row, "plan/cold": 0.4, "plan/warm": 0.9}])[-1].endswith("MISS m (0.40)")


def test_a_memory_model_below_the_allocator_is_a_miss_naming_the_bytes():
    row = {"model": "m", "batch": 8, "latency_ratio": 0.9, "total/eager": 0.9, "arena/bound": 1.0, "captures": 1,
           "model/real": 1.0, "predicted": 100, "planned_total": 100}
    ok = [line for line in verdicts_real([row]) if line.startswith("memory_model / allocator")]
    assert ok[0].endswith("PASS")
    below = [line for line in verdicts_real([{**row, "model/real": 0.9, "predicted": 90}])
             if line.startswith("memory_model / allocator")]
    assert below[0].endswith("MISS m/8 (-10 B)")

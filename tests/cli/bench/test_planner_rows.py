"""`memfit bench planner`'s rows: a plan with no arena (every op run by torch) is at its bound, and the
targets' geometric means take it (log(0) raised before)."""
import torch
from torch import nn

from memfit import plan
from memfit.cli.bench.planner import verdicts, verdicts_real
from memfit.cli.bench.planner_rows import planned_row


def test_a_plan_without_an_arena_is_at_its_bound_and_the_verdicts_take_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    x = torch.randn(2, 3, 8, 8)
    pm = plan(model, (x,))
    assert pm.report.arena_bytes == pm.report.lower_bound == 0
    row = planned_row("conv", model, pm, x, repeat=1, plan_s=0.0)
    assert row["arena/bound"] == 1.0
    lines = verdicts([row])
    assert lines[0].startswith("arena / lower bound, geometric mean 1.000")
    # the target on sharing an arena (naive / arena >= 5x) has nothing to judge where no op writes into one
    lines = verdicts([{**row, "model": "resnet50", "batch": 1}])
    assert any(line.startswith("naive / arena, resnet50 batch 1: n/a") for line in lines), lines
    shared = {**row, "model": "resnet50", "batch": 1, "naive": 600, "arena": 100, "naive/arena": 6.0}
    assert "naive / arena, resnet50 batch 1: 6.0x (target >= 5x): PASS" in verdicts([shared])


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


def test_zoo_rows_carry_torch_compile_beside_the_plan(monkeypatch):
    """The zoo's rows measure torch.compile as `--real` does (`contenders.compiled_columns`), at the batches asked:
    its peak by the allocator over the planned one, PASS where planned <= compiled. A stand-in compiler that gives
    the model back keeps the test fast: its peak is eager's, which the plan stays under."""
    from memfit.cli.bench import contenders
    from memfit.cli.bench.planner import measure_zoo
    monkeypatch.setattr(torch, "compile", lambda model, **kw: model)
    rows = measure_zoo("mlp", (2, 4), None, 1, "cpu", compiled_at=(4,))    # any zoo model: the quickest
    assert "compiled" not in rows[0]
    row = rows[1]
    assert row["compiled"] == "inductor" and row["compiled_peak"] == row["eager_peak"]
    assert row["planned/compiled"] == row["planned_total"] / row["eager_peak"] <= 1
    assert row["vs compiled"] == "PASS"
    assert "planned peak <= torch.compile's for every model (1 rows): PASS" in verdicts(rows)
    assert "vs compiled" in contenders.compiled_table(rows)
    monkeypatch.setattr(contenders.shutil, "which", lambda name: None)       # no C compiler: a row saying why
    assert measure_zoo("mlp", (2,), None, 1, "cpu", compiled_at=(2,))[0]["compiled"].startswith("unavailable: ")


def test_planned_over_compiled_is_judged_per_row():
    from memfit.cli.bench.contenders import compiled_verdicts
    rows = [{"model": "a", "batch": 8, "planned/compiled": 0.5}, {"model": "b", "batch": 8, "planned/compiled": 1.2},
            {"model": "c", "batch": 8}]
    assert compiled_verdicts(rows) == ["planned peak <= torch.compile's for every model (2 rows): MISS b/8 (1.200)"]
    assert compiled_verdicts(rows[2:]) == []


def test_the_zoo_without_compile_has_no_compiled_columns(capsys, monkeypatch):
    from memfit.cli.bench import planner
    from memfit.cli.bench.planner import main
    # the model measured in this process: a fresh one (`in_own_process`, tested in test_common.py) is a second
    # interpreter importing torch, which the columns asked about here do not depend on
    monkeypatch.setattr(planner, "in_own_process", lambda fn, *args: fn(*args))
    assert main(["--quick", "--models", "mlp", "--batches", "2", "--no-compile", "--repeat", "1", "--json"]) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in out["rows"]] == [2] and not any("compile" in k for k in out["rows"][0])
    assert not any("torch.compile" in line for line in out["targets"])

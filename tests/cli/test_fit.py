"""`memfit plan --train --budget SIZE --fit`: the plan, its alternatives, JSON and the plot, as memfit.fit has them."""
import json

import pytest
import torch

import memfit
from memfit.cli import main

BLOCKS_FILE = '''
import torch
def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
                                 for _ in range(3)])
'''


def test_fit_prints_the_plan_of_the_python_api(tmp_path, capsys, monkeypatch):
    # the trials' micro-steps on a fake clock, a millisecond a sample: both fits then measure the same (real ones of
    # a few ms, on a VM loaded by the other worker, made the CLI and the Python API choose differently, 1 run in 14;
    # the trials themselves are tested in tests/fitting/test_trials.py)
    from memfit.fitting import trials
    now = [0.0]
    monkeypatch.setattr(trials, "_run", lambda copy, params, loss_fn, x, y, key, device: now.__setitem__(
        0, now[0] + 1e-3 * key[0]))
    monkeypatch.setattr(trials, "clock", lambda device: lambda: now[0])
    (tmp_path / "nets.py").write_text(BLOCKS_FILE)
    spec = f"{tmp_path}/nets.py:make"
    assert main(["plan", spec, "--input", "32,16", "--train", "--budget", "1GiB", "--fit", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["micro_batch"] == 32 and got["checkpoint"] == [] and "plain step fits" in got["reason"]
    model = memfit.cli.plan.load_factory(spec)()
    least = min(a["bytes"] for a in got["alternatives"] if a["bytes"] is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = memfit.fit(model, opt, (torch.zeros(32, 16), None), lambda out, y: out.sum(), got["peak_bytes"] - 1)
    code = main(["plan", spec, "--input", "32,16", "--train", "--budget", str(got["peak_bytes"] - 1), "--fit",
                 "--plot", str(tmp_path / "fit.png")])
    out = capsys.readouterr().out
    assert code == 0 and (tmp_path / "fit.png").stat().st_size > 1000
    assert f"micro-batch {ref.micro_batch} (" in out and "<- chosen" in out and "why: " in out
    assert ref.peak_bytes < got["peak_bytes"]
    # the plain step fits: its bytes are known; a setting's memory model is made only for one of its alternatives
    # the time model predicts no slower than the plain step (searched in time order up to the first that fits), and
    # then gives the bytes of its other micro-batches too (a slower one's, free): which settings depends on this
    # machine's kernel timings
    plain, = [a for a in got["alternatives"] if a["micro_batch"] == 32 and not a["checkpoint"]]
    assert plain["bytes"] == got["peak_bytes"] and any(a["bytes"] is None for a in got["alternatives"])
    built = {tuple(a["checkpoint"]) for a in got["alternatives"] if a["bytes"] is not None}
    assert all(min(a["time"] for a in got["alternatives"] if tuple(a["checkpoint"]) == c) <= 1.0 for c in built), \
        [(a["micro_batch"], a["checkpoint"], a["time"], a["bytes"]) for a in got["alternatives"]]
    assert least <= got["peak_bytes"]


def test_fit_plans_a_cuda_step_from_this_machine_as_the_python_api_does(tmp_path, capsys):
    (tmp_path / "nets.py").write_text(BLOCKS_FILE)
    spec = f"{tmp_path}/nets.py:make"
    argv = ["plan", spec, "--input", "32,16", "--train", "--fit", "--device", "cuda", "--device-memory", "1GiB"]
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    model = memfit.cli.plan.load_factory(spec)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = memfit.fit(model, opt, (torch.zeros(32, 16), None), lambda out, y: out.sum(), device="cuda",
                     device_memory="1GiB")
    assert (got["micro_batch"], got["checkpoint"], got["peak_bytes"]) == (ref.micro_batch, list(ref.checkpoint),
                                                                        ref.peak_bytes)
    assert got["device"] == "cuda" and got["budget"] == 1 << 30 and "no alternative timed for real" in got["how_time"]
    with pytest.raises(SystemExit):
        main(["plan", spec, "--input", "32,16", "--train", "--fit", "--gpu", "H100"])
    assert "--device-memory and --gpu go with --train --device cuda" in capsys.readouterr().err


def test_fit_runs_at_the_thread_count_given_and_puts_it_back(tmp_path, capsys, monkeypatch):
    """`--threads N` fits at N torch threads (the plan's kernels and micro-steps are timed at that count, as a
    Python process at N threads times them) and puts the count back."""
    from memfit.fitting import fitter
    (tmp_path / "nets.py").write_text(BLOCKS_FILE)
    seen, real_fit = [], fitter.fit
    monkeypatch.setattr(fitter, "fit", lambda *a, **k: (seen.append(torch.get_num_threads()), real_fit(*a, **k))[1])
    threads = torch.get_num_threads()
    other = 2 if threads == 1 else 1
    assert main(["plan", f"{tmp_path}/nets.py:make", "--input", "32,16", "--train", "--budget", "1GiB", "--fit",
                 "--threads", str(other)]) == 0
    assert seen == [other] and torch.get_num_threads() == threads
    assert f"{other} torch thread" in capsys.readouterr().out


@pytest.mark.parametrize("argv, match", [(["--fit"], "--fit goes with --train and --budget"),
                                         (["--train", "--fit"], "--fit goes with --train and --budget"),
                                         (["--bf16"], "--bf16 goes with --fit"),
                                         (["--train", "--budget", "1GiB", "--threads", "2"],
                                          "--threads goes with --fit"),
                                         (["--train", "--budget", "1GiB", "--fit", "--threads", "0"],
                                          "--threads: expected a positive number of threads; found 0")])
def test_fit_usage_errors(tmp_path, capsys, argv, match):
    (tmp_path / "nets.py").write_text(BLOCKS_FILE)
    assert main(["plan", f"{tmp_path}/nets.py:make", "--input", "4,16", *argv]) == 2
    assert match in capsys.readouterr().err


def test_bench_fit_budgets_are_the_three_the_issue_names():
    from memfit.cli.bench.fit import budgets
    from memfit.fitting.search import Alternative, Setting
    # bytes = 100 + m * (10 - 2 * checkpointed blocks), batch 8, two blocks
    alts = [Alternative(m, Setting(tuple("ab"[:k])), 1.0, 100 + m * (10 - 2 * k))
            for m in (1, 2, 4, 8) for k in (0, 1, 2)]
    plan = type("P", (), {"alternatives": alts})()
    b = budgets(plan, 8)
    assert b["plain fits"] == 180                            # m = 8, nothing checkpointed
    assert b["micro-batching fits"] == 140                   # m = 4 without checkpointing: the whole batch does not fit
    assert b["only checkpointing"] == (106 + 110) // 2       # below m = 1 without checkpointing, above m = 1 with both


def test_bench_fit_has_no_only_checkpointing_budget_where_checkpointing_saves_bytes_within_the_models_bounds():
    """BERT at batch 8 (bench fit --quick, transformers 5.x, CPU): the least checkpointed alternative predicted 32 B
    below the least unchecked one (micro-batch 1's loss buffer of 8 float64 against micro-batch 2's of 4), both at the
    optimizer step; micro-batch 2 unchecked was predicted 12 KB above its real step (the attention mask, counted
    for padded batches). A budget between the two made fit checkpoint, 0.78x the fastest real point."""
    from memfit.cli.bench.fit import budgets
    from memfit.fitting.search import Alternative, Setting
    peaks = {(8, 0): 8810164, (8, 1): 7747124, (4, 0): 8591036, (4, 1): 7859836, (2, 0): 7686860, (2, 1): 7674824,
             (1, 0): 7674856, (1, 1): 7674856}          # bench fit --quick's BERT, predicted
    alts = [Alternative(m, Setting(("bert.encoder.layer.0",)[:k]), 1.0, v) for (m, k), v in peaks.items()]
    b = budgets(type("P", (), {"alternatives": alts})(), 8)
    assert b["plain fits"] == 8810164 and b["micro-batching fits"] == 8591036
    assert b["only checkpointing"].startswith("checkpointing lowers the least predicted peak by 32 B only")


def test_bench_fit_says_why_a_budget_is_missing_as_it_is():
    """No block to checkpoint, and micro-batches that need no less than the plain step (its peak is the optimizer
    step's): each said as it is, not as BatchNorm's or micro-batch 1's doing."""
    from memfit.cli.bench.fit import budgets
    from memfit.fitting.search import Alternative, Setting
    flat = [Alternative(m, Setting(), 1.0, 1000) for m in (1, 2, 4, 8)]
    b = budgets(type("P", (), {"alternatives": flat})(), 8)
    assert b["only checkpointing"].startswith("no block to checkpoint")
    assert b["micro-batching fits"].startswith("no micro-batch without checkpointing needs less")
    whole = [Alternative(8, Setting(), 1.0, 1000)]
    assert budgets(type("P", (), {"alternatives": whole})(), 8)["micro-batching fits"].startswith("batch statistics")


def test_bench_fit_measures_the_time_model_at_every_grid_point_but_the_plain_step():
    """The error table's figures: predicted / measured - 1 per point, from the exhaustive plan's times and the grid's
    measured relative times (made up here: the reference is the arithmetic)."""
    from types import SimpleNamespace

    from memfit.cli.bench.fit import model_errors
    from memfit.fitting.search import Alternative, Setting
    alts = [Alternative(8, Setting(), 1.0), Alternative(4, Setting(), 1.5), Alternative(8, Setting(("a",)), 1.2),
            Alternative(8, Setting((), "bfloat16"), 0.7)]          # a lever's alternative: not on the grid
    measured = {(8, ()): (100, 1.0), (4, ()): (90, 1.25), (8, ("a",)): (80, 1.2)}
    got = model_errors(SimpleNamespace(name="m"), SimpleNamespace(alternatives=alts, n=8), measured)
    assert got["points"] == 2 and sorted(got["errors"]) == pytest.approx([0.0, 0.2])
    assert got["worst |err|"] == pytest.approx(0.2) and got["worst at"] == "m=4 ckpt 0"
    assert got["median |err|"] == pytest.approx(0.1) and got["mean err"] == pytest.approx(0.1)

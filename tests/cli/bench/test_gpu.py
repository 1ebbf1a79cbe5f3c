"""`memfit bench gpu` without a GPU: its search, its verdicts and its parts on the CPU side (`--dry-run`), where the
CPU's memory model is checked against the CPU's live bytes exactly as the GPU's against the allocator."""

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import memfit
from memfit.cli.bench import gpu
from memfit.cli.bench.gpu_cases import Case, CpuSide


@given(st.integers(0, 300), st.integers(1, 300), st.integers(1, 300))
def test_the_boundary_search_finds_the_largest_fitting_size_asking_each_once(threshold, start, upper):
    asked = []
    fits = lambda n: asked.append(n) or n <= threshold
    assert gpu.boundary(fits, start, upper) == min(threshold, upper)
    assert len(asked) == len(set(asked)) and all(1 <= n <= upper for n in asked)
    assert len(asked) <= 2 * upper.bit_length() + 2                      # doubling steps, then bisection


def tiny() -> Case:
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).train()
    return Case("tiny", build, lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,))), F.cross_entropy, (2, 4))


@pytest.fixture(scope="module", autouse=True)
def frozen_heap():
    """`CpuSide.run` collects garbage before each measured run, as a fresh process would start: here each collection
    walked every object pytest and the earlier tests left (0.29 s a call, 13 calls in two of these tests). Collected
    once, then inside one `garbage_since` block (those objects frozen: out of every later collection, which walks
    what this module makes; a frozen object is never freed, mid-run either, so what each run measures is unchanged)."""
    from memfit.memory.step import garbage_since
    gc.collect()
    with garbage_since():
        yield


@pytest.fixture(scope="module")
def kept():
    """The tiny case and its CPU memory model (`gpu._predict`), shared: one prediction for the module."""
    case = tiny()
    mm, model = gpu._predict(case, torch.device("cpu"))
    yield {case.name: (case, mm)}
    del model


class Inflated(CpuSide):
    """A device whose real peaks are 10% above the CPU's live bytes, and runs out of memory 10% earlier."""

    def run(self, work, fraction=None):
        real = super().run(work)
        if real is None or (fraction is not None and real[1] * 1.1 > fraction * self.total):
            return None
        return int(real[0] * 1.1), int(real[1] * 1.1)


def test_the_parts_pass_on_the_cpu_where_the_prediction_is_the_real_bytes(kept):
    side = CpuSide(1 << 30)
    rows = gpu.peaks(kept, side)
    assert [r["verdict"] for r in rows] == ["PASS", "PASS"] and all(1.0 <= r["pred/real"] <= 1.05 for r in rows)
    oom, = gpu.oom_boundaries(kept, side)
    assert oom["verdict"] == "PASS" and oom["pred largest"] == oom["real largest"] >= 4 * 4 - 1


def test_a_prediction_made_without_the_gpu_is_held_to_the_same_target(kept):
    case, mm = kept["tiny"]
    side = CpuSide(1 << 30)
    made = gpu._blind([case], "cpu")                    # what the process that sees no GPU prints, here for the CPU
    assert made == {f"tiny/{n}": mm.total_bytes(n) for n in case.batches}
    one = {"tiny": (dataclasses.replace(case, batches=(4,)), mm)}       # one real run per call
    assert [r["verdict"] for r in gpu.peaks(one, side, made)] == ["PASS"]
    row, = gpu.peaks(one, side, {"tiny/4": int(made["tiny/4"] * 1.1)})
    assert row["verdict"] == "MISS" and 1.0 <= row["pred/real"] <= 1.05 and row["no-GPU pred/real"] > 1.05
    assert gpu.peaks(one, side, {})[0]["verdict"] == "MISS"             # none made: a miss, not a pass
    ampere = gpu._blind([case], "8.0")                                   # for a GPU: its CUDA reserved bytes
    model = case.build()
    x, y = case.sample(2)
    reference = memfit.memory_model(model, x, train=True, optimizer=case.optimizer(model.parameters()),
                                    loss_fn=case.loss_fn, target=y, device="cuda", gpu=(8, 0))
    assert ampere == {f"tiny/{n}": reference.cuda(n).reserved for n in case.batches}


def test_a_failed_or_slow_prediction_without_the_gpu_is_a_miss_and_the_bench_goes_on(monkeypatch, capsys):
    """The process that sees no GPU failing or running past its time gave a traceback and no table at all: now its
    column is a MISS on every row (`peaks(..., {})`, above) and the reason is printed."""
    import subprocess

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], gpu.BLIND_TIMEOUT)
    monkeypatch.setattr(gpu.subprocess, "run", slow)
    assert gpu.blind_predictions(["tiny"], True, torch.device("cpu")) == {}
    assert "MISS  the predictions without the GPU failed" in capsys.readouterr().out
    monkeypatch.setattr(gpu.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a[0], 1, "", "boom"))
    assert gpu.blind_predictions(["tiny"], True, torch.device("cpu")) == {}
    assert "exit status 1: boom" in capsys.readouterr().out


def test_a_device_above_the_prediction_is_a_miss(kept):
    side = Inflated(1 << 30)
    assert {r["verdict"] for r in gpu.peaks(kept, side)} == {"MISS"}
    oom, = gpu.oom_boundaries(kept, side)
    assert oom["verdict"] == "MISS" and oom["real largest"] < oom["pred largest"]


def test_fits_plans_are_run_and_held_against_their_budgets(kept):
    side = CpuSide(1 << 30)
    rows = gpu.plans(kept, side)
    assert len(rows) == len(gpu.FIT_SHARES) and rows[0]["budget"] >= rows[-1]["budget"]
    run = [r for r in rows if "real" in r]
    assert len(run) == len(rows) and all(r["verdict"] == "PASS" and r["real"] <= r["budget"] for r in run)


def test_the_dry_run_runs_the_same_code_on_the_cpu_and_says_so(capsys):
    assert gpu.main(["--dry-run", "--quick", "--models", "mlp", "--parts", "oom"]) == 0
    out = capsys.readouterr().out
    assert "# 2. out-of-memory boundary" in out and "PASS" in out and "0 MISS" in out and "dry run" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs")
def test_without_a_gpu_it_asks_for_one_or_the_dry_run(capsys):
    assert gpu.main(["--quick", "--models", "mlp"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().out


def test_unknown_models_and_parts_are_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--models", "mlp,nope"])
    assert "unknown models ['nope']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.main(["--dry-run", "--parts", "peaks,nope"])
    assert "unknown parts ['nope']" in capsys.readouterr().err


def test_the_cases_include_a_conv_net_and_a_transformers_lm():
    pytest.importorskip("transformers")
    from memfit.cli.bench.gpu_cases import cases
    every = cases(quick=True)
    assert len(every) >= 6 and {"resnet18", "gpt2"} <= set(every)
    assert type(every["gpt2"].build().model).__name__ == "GPT2LMHeadModel"

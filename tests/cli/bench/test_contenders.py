"""The benchmarks' contenders: torch.compile and PyTorch's MemTracker, measured as memfit is."""
import torch
import torch.nn.functional as F

from memfit.cli.bench import contenders
from memfit.cli.bench.train_cases import Case


def test_compiled_columns_say_why_without_a_c_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(contenders.shutil, "which", lambda name: None)
    why = {"compiled": "unavailable: inductor's CPU code needs a C compiler (cc or gcc) on the PATH"}
    assert contenders.compiled_columns(torch.nn.Linear(4, 4), torch.zeros(2, 4), 100, repeat=1) == why
    for key in ("TORCHINDUCTOR_CACHE_DIR", *contenders._NO_GRAPH_CACHES):    # compile_seconds sets them
        monkeypatch.setenv(key, "")
    build = lambda: (torch.nn.Linear(4, 4), lambda n: torch.zeros(n, 4))     # noqa: E731
    assert contenders.compile_seconds(build, 2, str(tmp_path)) == why


def _mlp_case():
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return Case("mlp", make, lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))), F.cross_entropy)


def test_memtracker_predicts_an_mlp_step_near_the_allocator():
    from memfit.cli.bench.train_steps import adamw, measured_peak
    case = _mlp_case()
    real = measured_peak(case, 8)
    out = contenders.memtracker_columns(case, 8, adamw, real)
    assert out["MemTracker"] == "fake tensors", out
    assert 0.9 <= out["MemTracker/meas"] <= 1.1          # its own tests accept +-10% of CUDA's active bytes
    assert out["MemTracker s"] > 0


def test_memtracker_that_cannot_run_is_a_row_saying_why():
    case = _mlp_case()
    broken = Case("broken", case.make, case.batch, lambda out, y: out.sum().item() * F.cross_entropy(out, y))
    out = contenders.memtracker_columns(broken, 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 1000)
    assert out["MemTracker"].startswith("unavailable: ")

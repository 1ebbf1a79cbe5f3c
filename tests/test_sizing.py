"""`memory_model` / `max_batch_size` against what really runs: the user's own eager `model(x)`, the planned forward's
live bytes (planned=True), a real training step's live bytes (`memfit.device.measure`), a brute-force search, and the
budget errors."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import plan
from memfit.budget import format_bytes, largest_fitting
from memfit.device.measure import track_memory
from memfit.memory.step import measure_step
from memfit.memory.step_model import StepMemoryModel
from memfit.planner.arena_model import PlannedMemoryModel
from memfit.testing.zoo import build


@pytest.mark.parametrize("name", ["lenet", "transformer"])
def test_planned_prediction_holds_for_the_planned_forward(name):
    model, shape = build(name)
    model.eval()
    mm = memfit.memory_model(model, shape, planned=True)
    assert isinstance(mm, PlannedMemoryModel) and mm.method.startswith("planned arena")
    params = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    pm = plan(model, (torch.randn(3, *shape),))          # one capture, the batch symbolic: 13 planned from it too
    for n in (3, 13):                                    # rising: the shared arena is the plan at n's
        x = torch.randn(n, *shape)
        with torch.inference_mode():
            pm(x)                                        # placed at n and its arena grown, before the measured call
            with track_memory() as mem:
                y = pm(x)
                del y
        real = params + x.nbytes + pm.arena_bytes + mem.peak
        assert 1.0 <= mm.total_bytes(n) / real <= 1.05, (n, mm.total_bytes(n), real)
        assert sum(mm.breakdown(n).values()) == mm.total_bytes(n)
    assert "planned forward" in mm.explain(4) and "arena" in mm.explain(4)


def test_batch_one_is_predicted_from_its_own_capture_as_planned():
    """`plan` captures batch 1 on its own (a symbolic batch starts at 2), and its graph may differ: BERT computes its
    attention mask once for both layers there (held 32 B longer). The symbolic graph's sizes at 1 put the memory
    model at 0.9998x the planned call's allocator peak, below it. (Batch 2 and up, from the symbolic capture:
    `test_planned_prediction_holds_for_the_planned_forward`; a third BERT capture for them took 4-5 s.)"""
    pytest.importorskip("transformers")
    from memfit.testing.zoo import build_real
    model, tokens = build_real("bert", quick=True)
    mm = memfit.memory_model(model, tokens(2), planned=True)
    x = tokens(1)
    pm = plan(model, (x,))
    with torch.inference_mode():
        pm(x)
        with track_memory() as mem:
            y = pm(x)
            del y
    predicted = mm.arena_bytes(1) + mm.unplanned_bytes(1)
    assert 1.0 <= predicted / (pm.arena_bytes + mem.peak) <= 1.05, (predicted, pm.arena_bytes + mem.peak)


def _eager_peak(model, x) -> int:
    """What the user's own `model(x)` under no_grad holds at its peak, by the allocator: parameters, the input and
    the forward's live bytes."""
    with torch.no_grad(), track_memory() as mem:
        out = model(x)
        del out
    return sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) + x.nbytes + mem.peak


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 16 * 16, 10)).eval()


def test_the_default_inference_answer_is_for_the_users_own_eager_forward():
    """Last round `max_batch_size(model, (3, 64, 64), "64MiB")` answered for memfit's planned module: the user's own
    `model(x)` at that batch needed 2.4x the budget. The default is now the eager forward under no_grad, by the
    allocator; the planned module's answer (larger: its arena holds less) only with planned=True."""
    model, budget = small_cnn(), 16 << 20
    n = memfit.max_batch_size(model, (3, 64, 64), budget)
    mm = memfit.memory_model(model, (3, 64, 64))
    assert isinstance(mm, StepMemoryModel) and "model(x) under torch.no_grad()" in mm.explain(n)
    for k in (n, 5):
        real = _eager_peak(model, torch.randn(k, 3, 64, 64))
        assert 1.0 <= mm.total_bytes(k) / real <= 1.05, (k, mm.total_bytes(k), real)
    assert _eager_peak(model, torch.randn(n, 3, 64, 64)) <= budget
    assert _eager_peak(model, torch.randn(int(n / 0.95) + 1, 3, 64, 64)) > budget    # and at least 0.95 of the largest
    planned = memfit.max_batch_size(model, (3, 64, 64), budget, planned=True)
    assert planned > n
    assert "planned forward" in memfit.memory_model(model, (3, 64, 64), planned=True).explain(planned)


def test_training_arguments_without_train_are_refused_not_dropped():
    """`memory_model(model, batch, optimizer=opt)` gave the inference forward's figure, the optimizer counted
    nowhere (a GPT-2 of 2.6 MiB of parameters: 16.9 MB, where its AdamW step needs more than 20)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"optimizer= is for a training step.*pass train=True.*or drop optimizer="):
        memfit.memory_model(model, (8,), optimizer=opt)
    with pytest.raises(ValueError, match=r"loss_fn= and target= are for a training step"):
        memfit.max_batch_size(model, (8,), "1MiB", loss_fn=F.mse_loss, target=(4,))
    train = memfit.memory_model(model, (8,), train=True, optimizer=opt)       # the same call, train=True
    assert train.total_bytes(4) > memfit.memory_model(model, (8,)).total_bytes(4) + 2 * train.param_bytes


def test_a_memory_model_prints_what_it_is_for_not_its_tables():
    """print(memory_model(...)) printed the dataclass: per-op arrays, pages of numbers (GPT-2 of 3 layers: 60 KB)."""
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mm, what in ((memfit.memory_model(model, (3, 64, 64)), "one eager forward"),
                     (memfit.memory_model(model, (3, 64, 64), train=True, optimizer=opt), "one training step"),
                     (memfit.memory_model(model, (3, 64, 64), planned=True), "the planned forward")):
        text = repr(mm)
        assert text.startswith(f"{type(mm).__name__}({what} on cpu, parameters {format_bytes(mm.param_bytes)};")
        assert "\n" not in text and len(text) < 160, text


def test_planned_is_refused_where_it_cannot_answer_with_what_to_do():
    model = small_cnn()
    with pytest.raises(ValueError, match="training step is not planned"):
        memfit.memory_model(model, (3, 8, 8), train=True, planned=True)
    with pytest.raises(ValueError, match="one input tensor.*drop planned=True"):
        memfit.memory_model(model, {"x": torch.zeros(2, 3, 8, 8)}, planned=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast"):
        memfit.memory_model(model, (3, 8, 8), planned=True)


def test_a_compiled_model_is_predicted_through_the_module_it_wraps_and_never_crashes():
    """`memory_model(torch.compile(m), train=True)` crashed the process (inductor compiling for fake tensors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters())
    for train in (False, True):
        kw = dict(train=True, optimizer=opt, loss_fn=F.cross_entropy) if train else {}
        mine, plain = memfit.memory_model(compiled, (16,), **kw), memfit.memory_model(model, (16,), **kw)
        assert [mine.total_bytes(n) for n in (1, 7, 100)] == [plain.total_bytes(n) for n in (1, 7, 100)]
        assert "torch.compile'd: predicted for the Sequential it wraps" in mine.method
    assert memfit.max_batch_size(compiled, (16,), "1MiB") == memfit.max_batch_size(model, (16,), "1MiB")
    # accumulate's auto micro-batch predicts through it too, and runs the compiled module (dynamo alone: the test
    # needs the wrapper, not inductor's seconds of compiling)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    twin = copy.deepcopy(model)
    eager = memfit.accumulate(twin, torch.optim.SGD(twin.parameters(), lr=0.1), (x, y), F.cross_entropy,
                              budget="40KiB")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    mine = memfit.accumulate(torch.compile(model, backend="eager"), sgd, (x, y), F.cross_entropy, budget="40KiB")
    assert 1 < mine.micro_batch == eager.micro_batch < 64 and "torch.compile'd" in mine.reason


def test_fit_and_plan_take_a_compiled_model_and_step_it_as_the_module_it_wraps():
    """`fit(torch.compile(m))` raised a FakeRunError blaming torch: it plans for the module it wraps, and
    `plan.step` steps the compiled model to the weights a plain step gives; `memfit.plan` captures the wrapped
    module too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    twin = copy.deepcopy(model)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    compiled = torch.compile(model, backend="eager")
    plan = memfit.fit(compiled, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), F.cross_entropy, "1MiB")
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    F.cross_entropy(twin(x), y).backward()
    twin_opt.step()
    loss = plan.step((x, y)).loss
    assert plan.micro_batch == 32 and loss > 0
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    planned = memfit.plan(compiled, (torch.randn(8, 16),))
    torch.testing.assert_close(planned(x[:8]), model(x[:8]))


def test_several_inputs_use_the_fake_forward_and_hold_for_eager():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(16, 64)

        def forward(self, x, z):
            return torch.relu(self.a(x)) * self.b(z)

    model = Pair().eval()
    mm = memfit.memory_model(model, (torch.zeros(2, 16), torch.zeros(2, 16)))
    assert isinstance(mm, StepMemoryModel) and mm.method.startswith("fake-tensor run of one forward")
    for n in (5, 50):
        x, z = torch.randn(n, 16), torch.randn(n, 16)
        with torch.no_grad(), track_memory() as mem:
            out = model(x, z)
            del out
        real = sum(p.nbytes for p in model.parameters()) + x.nbytes + z.nbytes + mem.peak
        assert 1.0 <= mm.total_bytes(n) / real <= 1.05


def test_nothing_fits_raises_budget_exceeded_naming_what_is_needed():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    for budget in (0, "1KiB"):
        with pytest.raises(memfit.BudgetExceeded, match=r"not even a batch of 1 fits: it needs .*parameters 75.04 KiB"):
            memfit.max_batch_size(model, (64,), budget)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(memfit.BudgetExceeded, match=r"(?s)optimizer state.*gradients") as e:
        memfit.max_batch_size(model, (64,), "200KiB", train=True, optimizer=opt)
    assert e.value.needed > e.value.budget == 200 * 1024


def test_max_batch_size_for_training_fits_a_real_step_and_one_more_does_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 8 * 8, 10))
    opt = torch.optim.AdamW(model.parameters())
    target = torch.zeros(1, dtype=torch.long)
    budget = 300_000
    n = memfit.max_batch_size(model, (1, 8, 8), budget, train=True, optimizer=opt, loss_fn=F.cross_entropy,
                              target=target)
    assert n > 1

    def real(k):
        m = copy.deepcopy(model)
        return measure_step(m, torch.randn(k, 1, 8, 8), torch.optim.AdamW(m.parameters()), F.cross_entropy,
                            torch.zeros(k, dtype=torch.long))

    assert real(n) <= budget                                       # no out-of-memory at the predicted size
    assert real(int(n / 0.9) + 1) > budget                         # and at least 0.9 of the largest that fits
    mm = memfit.memory_model(model, (1, 8, 8), train=True, optimizer=opt, loss_fn=F.cross_entropy, target=target)
    assert mm.total_bytes(n) <= budget < mm.total_bytes(n + 1)
    # the search started from the model without its measured workspaces, a bound from below at every size
    assert all(mm.lower_bytes(k) <= mm.total_bytes(k) for k in (1, 2, 3, 8, 13, n, n + 1))
    assert n == largest_fitting(mm.total_bytes, budget, 2**31)       # what the plain doubling search finds


@pytest.mark.cuda
def test_cuda_prediction_holds_for_the_caching_allocator():
    from memfit.cli.bench.gpu_cases import CudaSide
    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(32 * 32 * 32, 10))
    model = build()
    mm = memfit.memory_model(model, (3, 32, 32), train=True, optimizer=torch.optim.AdamW(model.parameters()),
                             loss_fn=F.cross_entropy, target=torch.zeros(1, dtype=torch.long), device="cuda")
    assert "allocator: reserved beyond allocated" in mm.breakdown(8) and "CUDA context" in mm.breakdown(8)
    side = CudaSide(torch.device("cuda", torch.cuda.current_device()))

    def loop(n):
        def run(dev):
            m = build().to(dev)
            opt = torch.optim.AdamW(m.parameters())
            for _ in range(3):
                x, y = torch.randn(n, 3, 32, 32, device=dev), torch.zeros(n, dtype=torch.long, device=dev)
                F.cross_entropy(m(x), y).backward()
                opt.step()
                opt.zero_grad()
        return run
    for n in (8, 64):
        allocated, reserved = side.run(loop(n))
        assert reserved <= mm.cuda(n).reserved <= 1.05 * reserved


def test_plan_train_cli_prints_the_python_api_breakdown(capsys, tmp_path):
    import json

    from memfit.cli.plan import cli_plan
    assert cli_plan(["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--train", "--budget", "8MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, shape = build("mlp")
    mm = memfit.memory_model(model.train(), shape, train=True, optimizer=torch.optim.AdamW(model.parameters()))
    assert out["breakdown"] == mm.breakdown(8) and out["total_bytes"] == mm.total_bytes(8)
    assert out["largest_batch"] == largest_fitting(mm.total_bytes, 8 * 2**20, 2**31)
    assert cli_plan(["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--train"]) == 0
    text = capsys.readouterr().out
    assert "optimizer state" in text and "at the peak, during the" in text
    pytest.importorskip("matplotlib")
    cli_plan(["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--train", "--plot", str(tmp_path / "t.png")])
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_memory_draws_the_budget_and_the_largest_batch(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    from memfit.sizing import plot_memory
    model, shape = build("mlp")
    mm = memfit.memory_model(model.train(), shape, train=True, optimizer=torch.optim.AdamW(model.parameters()))
    budget = mm.total_bytes(64) + 100
    largest = largest_fitting(mm.total_bytes, budget, 2**31)
    assert largest == 64
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)         # keep the figure to read it back
    assert plot_memory(mm, tmp_path / "m.png", 2 * largest, budget, name="mlp", largest=largest).exists()
    ax = figures[0].axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == [f"budget {format_bytes(budget)}", f"largest batch within it: {largest}"]
    assert ax.get_lines()[1].get_xdata()[0] == largest
    assert ax.get_title(loc="left").startswith("mlp: one training step") and mm.method[:40] in ax.get_title(loc="left")


def test_plan_train_cli_predicts_a_cuda_step_from_any_machine(capsys):
    import json

    from memfit.cli.plan import cli_plan
    argv = ["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--train", "--device", "cuda", "--device-memory", "1GiB"]
    assert cli_plan([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, shape = build("mlp")
    mm = memfit.memory_model(model.train(), shape, train=True, optimizer=torch.optim.AdamW(model.parameters()),
                             device="cuda", gpu=1 << 30)
    assert out["breakdown"] == mm.breakdown(8) and out["cuda"]["reserved"] == mm.cuda(8).reserved
    largest = out["largest_batch"]
    assert mm.serves(largest, 1 << 30) and not mm.serves(largest + 1, 1 << 30)
    assert cli_plan(argv) == 0
    assert "caching allocator replayed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_plan(["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--gpu", "H100"])
    assert "--device-memory and --gpu go with --train --device cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            cli_plan(["memfit.testing.zoo:mlp", "--input", "8,1,28,28", "--device", "cuda"])
        assert "a CUDA training step is predicted from here with --train" in capsys.readouterr().err

"""memfit.memory.probes: the optimizer step of one `memfit.fit` runs once, in its first memory model's run at 4, and
is put into the others' (`StepProbes(steps=)`); every model's bytes are those of the same model built alone (its own
step), the held-gradients models derived from them too; a run whose gradients differ from the source's runs its own."""
import pytest
import torch
from model_checks import assert_same_model
from torch import nn
from torch.nn import functional as F

import memfit
from memfit.fitting.checkpointing import checkpointed
from memfit.memory import probes
from memfit.memory.step_model import forget_step_model, step_memory_model


class _Blocks(nn.Module):
    """Three blocks to checkpoint and a head; `unused`: a layer no forward reaches (no gradient: the held step's
    model cannot be derived from the plain one's, `held_grads`, and makes its own runs)."""

    def __init__(self, unused: bool = False):
        super().__init__()
        torch.manual_seed(0)
        block = lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())  # noqa: E731
        self.b0, self.b1, self.b2, self.head = block(), block(), block(), nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4) if unused else None

    def forward(self, x):
        return self.head(self.b2(self.b1(self.b0(x))))


OPTIMIZERS = {"adamw": lambda m: torch.optim.AdamW(m.parameters()),
              "sgd momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)}
SETTINGS = [((), None), (("b0",), None), (("b0", "b1"), None), ((), torch.bfloat16)]
X, Y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randint(0, 4, (8,))


@pytest.fixture
def step_runs(monkeypatch):
    """The fake runs made for memory models: (batch size, whether the optimizer step ran, gradients held)."""
    made = []
    real = probes.fake_run

    def counting(spec, n, **kw):
        made.append((n, kw["optimizer_step"], spec.grads_held))
        return real(spec, n, **kw)
    monkeypatch.setattr(probes, "fake_run", counting)
    return made


def _models(model, optimizer, names, autocast, steps, x=X):
    """(plain, held) memory models of accumulate's step with `names` checkpointed, the held one derived from the
    plain one's runs where it can be (as `training_peak` makes them), each from nothing kept."""
    forget_step_model(model)
    kw = dict(train=True, optimizer=optimizer, loss_fn=F.cross_entropy, target=Y[:2], keep_output=False,
              autocast=autocast, steps=steps)
    runs: dict = {}
    with checkpointed(model, names):
        return (step_memory_model(model, x[:2], plain_runs=runs, **kw),
                step_memory_model(model, x[:2], grads_held=True, plain_runs=runs, **kw))


@pytest.mark.parametrize("unused", [False, True], ids=["derived held", "own held runs"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_the_settings_of_a_fit_run_the_step_once_with_each_models_own_bytes(opt, unused, step_runs):
    """Checkpoint settings and bf16 autocast sharing one `steps`: the plain step runs the optimizer step once in all
    (the held step, where it makes its own runs, once too), and each model, plain and held, has the bytes of the same
    model built alone with its own step; `method` says where its step came from."""
    model = _Blocks(unused)
    optimizer = OPTIMIZERS[opt](model)
    steps: dict = {}
    shared = [_models(model, optimizer, names, cast, steps) for names, cast in SETTINGS]
    assert [(n, held) for n, ran, held in step_runs if ran] == [(4, False)] + [(4, True)] * unused
    assert all(m.held_runs.startswith("own runs" if unused else "derived") for _, m in shared)
    for plain, held in shared[1:]:
        for m in (plain, held):
            assert "put in at every batch size from the first memory model's run at 4 in this fit" in m.method
    step_runs.clear()
    for (names, cast), (plain, held) in zip(SETTINGS, shared, strict=True):
        alone = _models(model, optimizer, names, cast, None)
        assert_same_model(plain, alone[0])
        assert_same_model(held, alone[1])
    assert sum(ran for _, ran, _ in step_runs) == len(SETTINGS) * (1 + unused)       # each its own


def test_the_steps_measured_scratch_comes_with_it():
    """bfloat16 parameters: AdamW's kernels on them allocate scratch that is measured, not logged
    (`kernel_scratch`); a model whose step came from the source has those ops at their rows, as its own step had."""
    model = _Blocks().to(torch.bfloat16)
    optimizer = OPTIMIZERS["adamw"](model)
    steps: dict = {}
    x = X.to(torch.bfloat16)
    _models(model, optimizer, (), None, steps, x)
    source = next(iter(steps.values()))
    assert any(source.phase_ends["backward"] <= s[0] < source.phase_ends["step"] for s in source.scratch)
    plain, held = _models(model, optimizer, ("b0",), None, steps, x)
    assert "put in at every batch size from the first memory model's run at 4" in plain.method
    alone = _models(model, optimizer, ("b0",), None, None, x)
    assert_same_model(plain, alone[0])
    assert_same_model(held, alone[1])


def test_a_run_whose_gradients_differ_from_the_sources_runs_its_own_step(step_runs):
    """A layer frozen after the first model: the same module and optimizer, other gradient bytes (`step_differs`):
    that model's run at 4 is made again with its own step, and its bytes are those of the model built alone."""
    model = _Blocks()
    optimizer = OPTIMIZERS["adamw"](model)
    steps: dict = {}
    _models(model, optimizer, (), None, steps)
    model.b2.requires_grad_(False)
    step_runs.clear()
    plain, held = _models(model, optimizer, ("b0",), None, steps)
    assert [(n, ran) for n, ran, _ in step_runs] == [(4, False), (4, True), (1, False)]
    assert "its own, not the fit's first memory model's: its gradients take" in plain.method
    alone = _models(model, optimizer, ("b0",), None, None)
    assert_same_model(plain, alone[0])
    assert_same_model(held, alone[1])


def test_a_cuda_prediction_keeps_its_own_step():
    """A CUDA step predicted from here replays the step's allocations beside the others': it takes no step from
    another model and leaves none for them."""
    model = _Blocks()
    optimizer = OPTIMIZERS["adamw"](model)
    steps: dict = {}
    _models(model, optimizer, (), None, steps)
    source = dict(steps)
    assert len(source) == 1
    mm = step_memory_model(model, X[:2], optimizer=optimizer, loss_fn=F.cross_entropy, target=Y[:2],
                           keep_output=False, device="cuda", steps=steps)
    assert steps == source and "the optimizer step ran once, at batch 4" in mm.method


def test_memfit_fit_runs_the_optimizer_step_once(step_runs):
    """Over every checkpoint setting and micro-batch size of a fit (exhaustive), one fake run made the optimizer
    step."""
    model = _Blocks()
    plan = memfit.fit(model, OPTIMIZERS["sgd momentum"](model), (X, Y), F.cross_entropy, "1TiB", exhaustive=True)
    assert {a.setting.checkpoint for a in plan.alternatives if a.bytes is not None} == \
        {(), ("b0",), ("b0", "b1"), ("b0", "b1", "b2")}
    assert sum(ran for _, ran, _ in step_runs) == 1


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_a_model_whose_step_came_from_the_fits_source_matches_the_allocator(opt):
    """The reference is the allocator, not memfit's own count: a checkpointed setting's model built after the plain
    one, its optimizer step put in from the plain one's run, against a real step of the model so checkpointed
    (`measure_step`) at sizes it ran and did not run."""
    import copy

    model = _Blocks()
    optimizer = OPTIMIZERS[opt](model)
    steps: dict = {}
    kw = dict(train=True, optimizer=optimizer, loss_fn=F.cross_entropy, target=Y[:2], steps=steps)
    forget_step_model(model)
    step_memory_model(model, X[:2], **kw)                                   # the plain step: the source
    with checkpointed(model, ("b0", "b1")):
        shared = step_memory_model(model, X[:2], **kw)
    assert "put in at every batch size from the first memory model's run" in shared.method
    for n in (1, 3, 8):
        real_model = copy.deepcopy(model)
        with checkpointed(real_model, ("b0", "b1")):
            real = memfit.measure_step(real_model, X[:n].clone(), OPTIMIZERS[opt](real_model), F.cross_entropy,
                                       Y[:n].clone())      # a slice would hold the whole batch's storage
        assert 1.0 <= shared.total_bytes(n) / real <= 1.05, (n, shared.total_bytes(n), real)

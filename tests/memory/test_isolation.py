"""What a prediction leaves alone (`memfit.memory.isolation`): the user's module as other threads see it while
memfit predicts, plans and evaluates, and every RNG (a seeded run draws the same dropout masks whether or not
memfit was asked what fits)."""
import copy
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.memory import cache
from memfit.memory.isolation import kept_rng, structural_copy
from memfit.planner.kept import borrow_plan, give_back


def mlp(dropout: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 4))


def forget(model) -> None:
    """Drop what memfit keeps for the model: the next call predicts (or captures) again."""
    cache.forget(model)


class Hammer:
    """A thread running plain forwards of `model` on x until stopped, counting errors and wrong outputs."""

    def __init__(self, model, x):
        self.model, self.x, self.runs, self.failures, self.errors = model, x, 0, 0, []
        with torch.no_grad():
            self.reference = model(x)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.stop.is_set() or self.runs < 50:
            self.runs += 1
            try:
                with torch.no_grad():
                    ok = torch.equal(self.model(self.x), self.reference)
            except Exception as e:                   # what the user's own thread would see
                ok = False
                self.errors.append(f"{type(e).__name__}: {e}"[:200])
            self.failures += not ok
            time.sleep(0.0005)                       # leave the GIL to the thread that predicts

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


# ---- threads ----------------------------------------------------------------------------------------
def test_a_forward_in_another_thread_sees_the_real_model_while_a_training_step_is_predicted():
    model = mlp(0.0)                      # dropout 0: the forward is deterministic in training mode too
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Hammer(model, torch.randn(8, 16)) as h:
        for _ in range(2):
            forget(model)
            n = memfit.max_batch_size(model, (16,), "1MiB", train=True, optimizer=opt, loss_fn=lambda o: o.sum())
            mm = memfit.memory_model(model, (16,), train=True, optimizer=opt)
    assert h.failures == 0, (h.failures, h.runs, h.errors[:3])
    forget(model)                         # the same answers as a prediction with no thread beside it
    assert n == memfit.max_batch_size(model, (16,), "1MiB", train=True, optimizer=opt, loss_fn=lambda o: o.sum())
    assert mm.total_bytes(64) == memfit.memory_model(model, (16,), train=True, optimizer=opt).total_bytes(64)


def test_a_forward_in_another_thread_is_neither_changed_nor_traced_while_the_model_is_captured():
    model = mlp().eval()
    with Hammer(model, torch.randn(8, 16)) as h:
        pm = memfit.plan(model, torch.zeros(4, 16))        # torch.export's capture: no trace takes the thread's calls
    assert h.failures == 0, (h.failures, h.runs, h.errors[:3])
    x = torch.randn(4, 16)
    assert torch.equal(pm(x), model(x))


def test_two_threads_evaluating_the_same_model_with_a_budget_get_the_single_thread_result():
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
    rng = np.random.default_rng(0)
    data = (rng.integers(0, 256, (600, 1, 8, 8), dtype=np.uint8), np.arange(600) % 10)
    run = lambda: memfit.evaluate(model, data, budget="160KiB", planned=True, device="cpu", progress=False)
    alone = run()
    assert alone.runner == "planned" and alone.chunks > 1, alone
    forget(model)                                 # both threads size, capture and plan the model
    results, errors = [None, None], []

    def go(i):
        try:
            results[i] = run()
        except Exception as e:                    # what the test reports when it fails
            errors.append(f"{type(e).__name__}: {e}"[:300])
    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not errors, errors
    for r in results:
        assert r.metrics == alone.metrics and (r.n, r.chunk_size, r.chunks) == (alone.n, alone.chunk_size, alone.chunks)


def test_a_borrowed_plan_is_lent_to_one_caller_at_a_time():
    model = mlp().eval()
    x = torch.randn(8, 16)
    first = borrow_plan(model, torch.zeros(8, 16))
    second = borrow_plan(model, torch.zeros(8, 16))       # while the first is out: a plan of its own
    assert second is not first
    give_back(second)
    assert torch.equal(first(x), model(x))                # the other's give_back freed nothing of the first's
    give_back(first)
    assert borrow_plan(model, torch.zeros(8, 16)) is first  # given back: the cached plan is lent again
    give_back(first)


def test_a_structural_copy_shares_every_tensor_and_changes_nothing_of_the_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 3), nn.BatchNorm1d(4))
    model[0].memo = {}
    model.add_module("again", model[0])                   # one module registered twice stays one copy
    c = structural_copy(model)
    assert c[0] is not model[0] and c.again is c[0]
    assert all(a is b for a, b in zip(c.parameters(), model.parameters(), strict=True))
    assert all(a is b for a, b in zip(c.buffers(), model.buffers(), strict=True))
    c.eval()
    c[0].weight = nn.Parameter(torch.zeros(4, 4))
    c[0].memo["x"] = 1
    c[1].weight_hh_l0 = nn.Parameter(torch.zeros(12, 3))   # the LSTM's _flat_weights list is the copy's own
    assert model.training and all(m.training for m in model.modules())
    assert model[0].weight.abs().sum() > 0 and model[0].memo == {}
    assert all(w is p for w, p in zip(model[1]._flat_weights, model[1].parameters(), strict=True))


def test_a_hook_a_module_registered_as_its_own_method_runs_on_the_copy():
    class Scaled(nn.Linear):
        def __init__(self):
            super().__init__(4, 4)
            self.register_forward_hook(self._scale)

        def _scale(self, module, inputs, out):
            return out * self.weight.sum()          # reads the weight of the module it is bound to

    model = Scaled()
    c = structural_copy(model)
    c.weight = nn.Parameter(torch.ones(4, 4))
    x = torch.ones(1, 4)
    assert torch.equal(c(x), torch.nn.functional.linear(x, c.weight, c.bias) * 16)
    assert not torch.equal(model(x), c(x))


# ---- random generators ------------------------------------------------------------------------------
def entry_points(model, opt):
    """Every public call that only predicts, plans or captures, on a training-mode model with dropout."""
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    return {
        "memory_model": lambda: memfit.memory_model(model, (16,)),
        "memory_model train": lambda: memfit.memory_model(model, (16,), train=True, optimizer=opt),
        "max_batch_size": lambda: memfit.max_batch_size(model, (16,), "1MiB"),
        "max_batch_size train": lambda: memfit.max_batch_size(model, (16,), "1MiB", train=True, optimizer=opt),
        "activation_bytes": lambda: memfit.sizing.activation_bytes(model, (16,), [1, 8]),
        "plan": lambda: memfit.plan(model, torch.zeros(4, 16)),
        "evaluate": lambda: memfit.evaluate(model, (x.numpy(), y.numpy()), budget="1MiB", planned=True,
                                            device="cpu", progress=False),
    }


def test_no_entry_point_draws_from_torchs_random_generator():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, call in entry_points(model, opt).items():
        forget(model)
        model.train()
        before = torch.get_rng_state()
        try:
            call()
        except memfit.errors.CaptureError:          # a dropout in training mode does not plan: the attempt counts
            assert name == "plan"
        assert torch.equal(before, torch.get_rng_state()), name


def test_accumulate_draws_the_same_masks_whether_it_sizes_the_micro_batch_or_is_given_it():
    def step(micro_batch):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
        torch.manual_seed(1)
        r = memfit.accumulate(model, opt, (x, y), F.cross_entropy, budget="16KiB", micro_batch=micro_batch)
        return r.micro_batch, torch.get_rng_state(), [p.detach().clone() for p in model.parameters()]
    size, state, params = step("auto")                       # sized by fake runs of the step
    assert 1 < size < 64
    given_size, given_state, given_params = step(size)
    assert torch.equal(state, given_state)
    assert all(torch.equal(a, b) for a, b in zip(params, given_params, strict=True))


def test_check_prediction_draws_only_for_its_real_steps():
    model, x, y = mlp(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    memfit.memory.check_prediction(model, lambda n: x[:n], (4,), optimizer=opt, loss_fn=F.cross_entropy,
                            target_at=lambda n: y[:n])
    after = torch.get_rng_state()
    torch.manual_seed(1)                                      # the same real steps without the prediction
    m, o = copy.deepcopy((model, opt))
    memfit.measure_step(m, x[:4], o, F.cross_entropy, y[:4])
    memfit.memory.step.training_step(m, x[:4], o, F.cross_entropy, y[:4])
    assert torch.equal(after, torch.get_rng_state())


def test_a_seeded_training_run_draws_the_same_masks_with_and_without_asking_what_fits():
    def masks(ask: bool) -> list[torch.Tensor]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        out = []
        for step in range(3):
            if ask and step == 1:
                memfit.max_batch_size(model, (16,), "1MiB", train=True, optimizer=opt, loss_fn=lambda o: o.sum())
                memfit.memory_model(model, (16,))
            out.append(model(torch.ones(4, 16)).detach())
        return out
    assert all(torch.equal(a, b) for a, b in zip(masks(False), masks(True), strict=True))


def test_kept_rng_restores_the_generator_after_an_error():
    before = torch.get_rng_state()
    try:
        with kept_rng():
            torch.rand(10)
            raise KeyError("inside")
    except KeyError:
        pass
    assert torch.equal(before, torch.get_rng_state())


def test_kept_rng_reads_and_restores_every_cuda_device_only_once_cuda_is_initialised(monkeypatch):
    calls = []
    states = [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: calls.append("get") or states)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: calls.append(("set", s)))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with kept_rng():
        pass
    assert calls == []                        # reading CUDA's RNG would initialise CUDA
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with kept_rng():
        calls.append("inside")
    assert calls == ["get", "inside", ("set", states)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_prediction_draws_from_the_cuda_generator():
    model = mlp().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = torch.cuda.get_rng_state_all()
    memfit.memory_model(model, (16,), train=True, optimizer=opt, loss_fn=F.cross_entropy)
    memfit.max_batch_size(model, (16,), "1MiB")
    with kept_rng():
        torch.rand(8, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all(), strict=True))


def test_another_threads_draws_are_neither_taken_nor_rewound_by_a_prediction():
    """kept_rng saved torch's global generator around a prediction and restored it after: a thread that drew in
    between had its stream rewound, and drew the same numbers again (silently). Predictions now draw from
    generators of their own: the drawing thread sees exactly the seeded sequence."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    drawn, stop, started = [], threading.Event(), threading.Event()

    def draw():
        while not stop.is_set() or len(drawn) < 50:
            drawn.append(torch.rand(1).item())
            started.set()
            time.sleep(0.0002)
    torch.manual_seed(7)
    t = threading.Thread(target=draw)
    t.start()
    started.wait(10)
    try:
        for _ in range(3):
            forget(model)
            model.train()
            memfit.memory_model(model, (16,), train=True, optimizer=opt, loss_fn=F.cross_entropy)
            memfit.max_batch_size(model, (16,), "1MiB")
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    torch.manual_seed(7)
    assert drawn == torch.rand(len(drawn)).tolist()


def test_a_predictions_own_dropout_draws_and_real_ops_under_it_still_run():
    """own_rng: a real dropout inside draws from its own generator (same result every time, global untouched)."""
    from memfit.memory.isolation import own_rng
    x = torch.ones(1000)
    before = torch.get_rng_state()
    with own_rng():
        a = F.dropout(x, 0.5, training=True)
        r = torch.rand(3)
    with own_rng():
        b = F.dropout(x, 0.5, training=True)
    assert torch.equal(before, torch.get_rng_state()) and torch.equal(a, b) and r.shape == (3,)
    assert set(a.unique().tolist()) == {0.0, 2.0} and 400 < int((a == 0).sum()) < 600


def test_every_overload_of_a_random_op_draws_from_a_generator_of_its_own():
    """The overload taking a generator is found by its arguments, not its name: randint_like(x, low, high)'s is
    low_generator_dtype, rand(out=)'s generator_out (both drew from torch's generator inside a prediction)."""
    from memfit.memory.isolation import own_rng
    x = torch.ones(8)
    for draw in (lambda: torch.randint_like(x, 0, 10), lambda: torch.rand(8, out=torch.empty(8)),
                 lambda: torch.randint(0, 5, (8,), out=torch.empty(8, dtype=torch.long)),
                 lambda: torch.randint(0, 5, (8,)), lambda: torch.normal(x, x), lambda: torch.multinomial(x, 4)):
        before = torch.get_rng_state()
        with own_rng():
            a = draw()
        with own_rng():
            b = draw()
        assert torch.equal(before, torch.get_rng_state()) and torch.equal(a, b)


def test_a_training_prediction_passes_its_fake_ops_through_no_rng_mode(monkeypatch):
    """own_rng's dispatch mode is Python on every op it sees: nested once per predicting() and under the fake
    runs it made a training prediction a third slower (3,410 ops through it for an 8-block MLP). Fake sections
    (`fake_section`) step it aside, where nothing can draw; the ops outside still pass through it."""
    from memfit.memory import isolation
    seen = []
    original = isolation._OwnGenerators.__torch_dispatch__
    monkeypatch.setattr(isolation._OwnGenerators, "__torch_dispatch__",
                        lambda self, func, *a, **k: seen.append(func) or original(self, func, *a, **k))
    model = mlp()
    memfit.memory_model(model, (16,), train=True, optimizer=torch.optim.AdamW(model.parameters()))
    assert 0 < len(seen) < 50, len(seen)
    assert torch.ops.aten.addmm.default not in seen and torch.ops.aten.native_dropout.default not in seen


def test_the_planners_exactness_checks_pass_their_ops_through_no_rng_mode(monkeypatch):
    """The capture checks each block it may slice bit-identical on real tensors, whole and in slices of every size
    at four batch sizes: through own_rng's mode a fifth slower. A block with a random op is never sliceable
    (`planner.per_sample`), so the checks step the mode aside (`drawless_section`); the capture's other real runs
    (the stand-ins' values, the kernels' layouts) still pass through it, and torch's generator is left alone."""
    from memfit.memory import isolation
    from memfit.planner import slice_check
    from memfit.planner.captured import capture_model
    seen, checking = [], []
    original = isolation._OwnGenerators.__torch_dispatch__
    monkeypatch.setattr(isolation._OwnGenerators, "__torch_dispatch__",
                        lambda self, func, *a, **k: seen.append(bool(checking)) or original(self, func, *a, **k))
    exact_steps = slice_check.exact_steps

    def watched(*args, **kwargs):
        checking.append(True)
        try:
            return exact_steps(*args, **kwargs)
        finally:
            checking.pop()
    monkeypatch.setattr(slice_check, "exact_steps", watched)
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1)).eval()
    x = torch.randn(4, 3, 64, 64)
    before = torch.get_rng_state()
    assert capture_model(stem, x).sliced                                         # checked, and sliced
    assert False in seen and True not in seen
    assert torch.equal(before, torch.get_rng_state())


def test_a_prediction_imports_no_aot_tracing_and_a_tracer_inside_one_leaves_torchs_generators_alone():
    """own_rng no longer replaces AOT tracing's save and restore of torch's generators around the whole prediction
    (that imported torch's AOT tracing: 1.6 s of a fresh process's first fit, which traces nothing); a tracer inside a
    prediction (`traced_section`) has it replaced, in this thread only, and only there."""
    from memfit.device import torch_private
    from memfit.memory.isolation import own_rng, traced_section
    replacement = torch_private._AOT_RNG
    with traced_section():
        assert replacement._users == 0                 # no prediction around: torch's own behaviour
    with own_rng():
        assert replacement._users == 0
        with traced_section():
            assert replacement._users == 1
            from torch._functorch import aot_autograd
            with aot_autograd.preserve_rng_state():    # replaced: what another thread draws meanwhile stays drawn
                state = torch.get_rng_state()
                torch.rand(3)
            assert not torch.equal(torch.get_rng_state(), state)
        assert replacement._users == 0

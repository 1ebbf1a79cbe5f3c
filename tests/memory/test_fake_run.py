"""One step on fake tensors (`memfit.memory.fake_run.fake_run`) from its `StepSpec`: the optimizer step left
out and put back in gives the run with it, gradients held count from the start, and nothing real is touched."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from memfit.device.torch_private import FakeTensorMode
from memfit.memory.fake_run import COLUMN, StepSpec, fake_run
from memfit.memory.fit import with_step
from memfit.memory.step import ExampleBatch
from memfit.memory.storage_log import LoggingFakeMode


def spec(**kw) -> StepSpec:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return StepSpec(model, ExampleBatch((16,)), torch.device("cpu"), optimizer=opt, **kw)


def runs(s: StepSpec, *calls):
    mode, fakes = LoggingFakeMode(allow_non_fake_inputs=True), {}
    return [fake_run(s, n, mode=mode, fakes=fakes, optimizer_step=step) for n, step in calls]


def test_the_optimizer_step_left_out_and_put_back_is_the_run_with_it():
    s = spec()
    skipped, full4, full2 = runs(s, (2, False), (4, True), (2, True))
    b = skipped.phase_ends["backward"]
    assert skipped.phase_ends["step"] == b + 1                 # the step's marker alone
    assert full2.phase_ends["step"] > full2.phase_ends["backward"] + 1
    put_back = with_step(skipped, full4)
    assert put_back.ops == full2.ops and put_back.phase_ends == full2.phase_ends
    np.testing.assert_array_equal(put_back.live, full2.live)


def test_a_spec_is_frozen_and_nothing_real_is_touched():
    s = spec()
    before = [p.detach().clone() for p in s.model.parameters()]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.train = False
    run, = runs(s, (3, True))
    assert run.held["inputs"] == 3 * 16 * 4 and run.held["optimizer state"] == 0     # momentum made lazily
    assert all(p.grad is None for p in s.model.parameters()) and not s.optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(s.model.parameters(), before, strict=True))


def test_gradients_held_before_the_step_are_held_from_the_start():
    plain, = runs(spec(), (4, True))
    held, = runs(spec(grads_held=True), (4, True))
    params = plain.held["parameters"]
    assert "gradients" not in plain.held and held.held["gradients"] >= params      # rounded up to blocks
    assert held.grad_bytes == held.held["gradients"]
    g = COLUMN["gradients"]
    assert plain.live[:, g].max() == plain.grad_bytes == params      # made in backward
    assert held.live[:, g].max() == 0                  # backward adds into the held ones: no gradient storage made


def test_a_fake_tensors_device_is_answered_as_the_fake_mode_does_and_is_no_op_of_the_run():
    # autograd's engine asks the device of every gradient it moves: ~2,000 asks a BERT 768x12 backward, none an op
    (run,) = runs(spec(), (4, True))
    assert torch.ops.prim.device.default not in run.ops
    assert any(str(op).startswith("aten.addmm") for op in run.ops)        # the run's real ops are there
    plain = FakeTensorMode(allow_non_fake_inputs=True)
    logging = LoggingFakeMode(allow_non_fake_inputs=True)
    for mode in (plain, logging):
        with mode:
            fake = mode.from_tensor(torch.ones(2, 3))
            assert fake.device == torch.device("cpu")
            assert torch.ops.prim.device.default(fake) == torch.device("cpu")    # the dispatched ask itself


class ToSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(x.relu().to_sparse().to_dense())


def test_a_sparse_tensor_made_in_the_step_is_refused_naming_the_fix_not_predicted_without_it():
    """A sparse tensor owns no plain storage: the log could not count it. `.to_sparse()` in a forward was predicted
    below the real step (932 B against the allocator's 2,128); a sparse gradient crashed on None."""
    import memfit
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    model = ToSparse()
    real = memfit.measure_step(model, x, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, y)
    assert real > 0
    with pytest.raises(ValueError, match=r"memory model counts dense tensors only: .*torch.sparse_coo tensor "
                                         r"\(in the forward\).*\.to_sparse\(\), its dense form"):
        memfit.memory_model(model, x, train=True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            loss_fn=F.mse_loss, target=y)
    model = nn.Sequential(nn.Embedding(100, 8, sparse=True), nn.Flatten(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"torch.sparse_coo tensor \(in backward\).*sparse=False"):
        memfit.memory_model(model, torch.randint(0, 100, (8, 4)), train=True, optimizer=opt,
                            loss_fn=torch.nn.functional.mse_loss, target=torch.randn(8, 2))
    dense = nn.Sequential(nn.Embedding(100, 8), nn.Flatten(), nn.Linear(32, 2))   # the fix named: predicted
    opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    assert memfit.memory_model(dense, torch.randint(0, 100, (8, 4)), train=True, optimizer=opt,
                               loss_fn=torch.nn.functional.mse_loss, target=torch.randn(8, 2)).total_bytes(8) > 0

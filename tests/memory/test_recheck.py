"""memfit.memory.recheck: an APPROXIMATE step model's bytes at a batch size from a fake run at that size, which
max_batch_size uses to check its answer; what it keeps does not keep the user's model alive."""
import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import memfit
from memfit.device.allocators import cpu_margin
from memfit.memory.recheck import exact_total
from memfit.memory.step import measure_step


class Cubic(nn.Module):
    """A step whose memory grows as n^3 (the loss multiplies every triple of samples): no line in the batch."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).sum(1)


def cubic_loss(v, y):
    return (v[:, None, None] * v[None, :, None] * v[None, None, :]).mean()


def test_max_batch_size_checks_an_estimates_answer_by_a_run_at_it():
    """The estimate (an upper envelope of runs at 2-16) answered 11,513 for 64 MiB where one n^3 tensor is
    terabytes; checked by fake runs at the answer and below, it is the real boundary."""
    torch.manual_seed(0)
    model = Cubic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"its answer \d+ does not fit 64.00 MiB when run at \d+; (\d+) is the "
                                         "largest batch whose own fake run fits"):
        n = memfit.max_batch_size(model, (64,), "64MiB", train=True, optimizer=opt, loss_fn=cubic_loss,
                                  target=torch.zeros(2))
    real = lambda k: measure_step(model, torch.randn(k, 64), opt, cubic_loss, torch.zeros(k))      # noqa: E731
    assert real(n) <= 64 * 2**20 < real(n + 1), n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = memfit.memory_model(model, (64,), train=True, optimizer=opt, loss_fn=cubic_loss, target=torch.zeros(2))
    assert "APPROXIMATE" in mm.method and mm.total_bytes(300) < real(300) / 100        # the line alone: far below
    assert exact_total(mm, 120) == real(120) + cpu_margin()      # a run at 120: the real step, with the CPU's margin


def test_what_it_keeps_lets_the_model_and_its_loss_go():
    def predict():
        model = Cubic()
        loss = lambda v, y: cubic_loss(v, y) * 1.0                                     # noqa: E731
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mm = memfit.memory_model(model, (64,), train=True, loss_fn=loss, target=torch.zeros(2))
        return mm, weakref.ref(model), weakref.ref(loss)
    mm, model, loss = predict()
    gc.collect()
    assert model() is None and loss() is None
    assert exact_total(mm, 40) is None              # nothing to run: the estimate stands, as its warning says


def test_accumulates_auto_micro_batch_is_checked_by_runs_at_its_sizes():
    """accumulate's micro-batch (and so fit's) came from the same estimate: the whole batch of 400 'fit' 64 MiB at
    2.23 MiB predicted, where it needs 734 MiB. With runs at the sizes weighed, the step stays within the budget by
    the allocator."""
    from memfit.device.measure import held_bytes, track_memory
    torch.manual_seed(0)
    model = Cubic()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(400, 64), torch.zeros(400)
    held = held_bytes(model, opt, grads=True) + x.nbytes + y.nbytes
    with warnings.catch_warnings(), track_memory("cpu") as mem:
        warnings.simplefilter("ignore")
        r = memfit.accumulate(model, opt, (x, y), cubic_loss, budget="64MiB")
    assert 100 < r.micro_batch < 400 and "the whole batch of 400 needs" in r.reason
    assert held + mem.peak <= 64 * 2**20, (r.micro_batch, held + mem.peak)


def test_a_size_the_step_cannot_run_at_leaves_the_estimate_standing(monkeypatch):
    """A run that fails at the size asked about (BatchNorm at batch 1, say) must not fail the caller: no figure,
    the estimate stands (as its warning says)."""
    import memfit.memory.recheck as recheck
    model = Cubic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = memfit.memory_model(model, (64,), train=True, loss_fn=cubic_loss, target=torch.zeros(2))
    assert exact_total(mm, 30) is not None

    def fails(*args, **kwargs):
        raise ValueError("Expected more than 1 value per channel when training")
    monkeypatch.setattr(recheck, "fake_run", fails)
    assert exact_total(mm, 30) is None

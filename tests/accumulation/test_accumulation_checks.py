"""memfit.accumulation.checks: the loss's terms, batch-dependent modules, usage errors that say what was expected."""
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from accumulation.cases import C, D, Tagger, data, make, token_loss
from memfit.accumulation.checks import batch_dependent_modules
from memfit.accumulation.result import BatchDependentError
from memfit.accumulation.run import accumulate


def test_terms_say_what_they_need():
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, y = torch.randint(0, 20, (4, 6)), torch.full((4, 6), -100)
    with pytest.raises(ValueError, match="counts no terms in the whole batch"):
        accumulate(model, opt, (ids, y), token_loss, micro_batch=2, terms=lambda x, y: (y != -100).sum())
    with pytest.raises(TypeError, match=r"number of terms.*e.g. lambda x, y: \(y != -100\).sum\(\); found str"):
        accumulate(model, opt, (ids, y), token_loss, micro_batch=2, terms=lambda x, y: "many")     # as evaluate says
    with pytest.raises(ValueError, match=r"must count terms \(>= 0\); found -1"):
        accumulate(model, opt, (ids, y), token_loss, micro_batch=2, terms=lambda x, y: -1)
    x1, y1 = data(6)
    y1[:2] = -100                                  # one label per sample, two ignored: a mean over four
    with pytest.warns(UserWarning, match="ignores"):       # a lambda does not say what its mean is over
        accumulate((m := make("mlp")), torch.optim.SGD(m.parameters(), lr=0.1), (x1, y1),
                   lambda out, t: F.cross_entropy(out, t), micro_batch=3)
    per_sample = lambda out, y: F.cross_entropy(out.transpose(1, 2), y.clamp(min=0), reduction="none").mean(1)
    with pytest.raises(ValueError, match="terms= needs loss_fn to return the mean"):
        accumulate(model, opt, (ids, y.clamp(min=0)), per_sample, micro_batch=2, terms=lambda x, y: y.numel())


# ---- batch statistics ---------------------------------------------------------------------------------
def test_batchnorm_in_training_mode_is_refused_unless_asked():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.BatchNorm1d(8), nn.Linear(8, C))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(BatchDependentError, match=r"1 \(BatchNorm1d\).*allow_batch_dependent=True"):
        accumulate(model, opt, data(8), F.cross_entropy, micro_batch=4)
    with pytest.warns(UserWarning, match="not the full-batch step"):
        accumulate(model, opt, data(8), F.cross_entropy, micro_batch=4, allow_batch_dependent=True)
    model[1].eval()                                  # running statistics: no longer batch-dependent
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumulate(model, opt, data(8), F.cross_entropy, micro_batch=4)


def test_batch_dependence_lists_each_kind():
    m = nn.Sequential(nn.Conv2d(1, 2, 1), nn.SyncBatchNorm(2), nn.InstanceNorm2d(2, track_running_stats=True),
                      nn.InstanceNorm2d(2), nn.GroupNorm(1, 2), nn.LayerNorm(2))
    found = batch_dependent_modules(m)
    assert [f.split(" ")[1] for f in found] == ["(SyncBatchNorm):", "(InstanceNorm2d):"]


# ---- usage errors -----------------------------------------------------------------------------------------
def test_usage_errors_say_what_was_expected():
    mod = make("mlp")
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    x, y = data(4)
    with pytest.raises(ValueError, match="'auto' or an int >= 1; found 0"):
        accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=0)
    with pytest.raises(TypeError, match=r"batch must be \(x, y\)"):
        accumulate(mod, opt, x, F.cross_entropy, micro_batch=2)
    with pytest.raises(ValueError, match=r"same first \(batch\) dimension, its samples; found x 4, y 3\. Fix"):
        accumulate(mod, opt, (x, y[:3]), F.cross_entropy, micro_batch=2)
    with pytest.raises(ValueError, match=r"found x\['a'\] 4, x\['b'\] 2, y 4\. Fix"):     # each place named
        accumulate(mod, opt, ({"a": x, "b": x[:2]}, y), F.cross_entropy, micro_batch=2)
    with pytest.raises(TypeError, match=r"found numpy arrays at x\['a'\], y\. Fix: torch.from_numpy"):
        accumulate(mod, opt, ({"a": x.numpy()}, y.numpy()), F.cross_entropy, micro_batch=2)
    with pytest.raises(ValueError, match="mean loss over the micro-batch"):
        accumulate(mod, opt, (x, y), lambda o, t: o, micro_batch=2)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=2, distributed=True)
    with pytest.raises(ValueError, match="no parameters: there is nothing to train"):
        accumulate(nn.Identity(), opt, (x, y), F.mse_loss, micro_batch=2)


def test_an_optimizer_of_another_models_parameters_is_refused_before_anything_changes():
    """An optimizer built before the model was copied steps nothing of it: refused (accumulate and fit), the
    model's weights and .grad untouched; an optimizer holding only some of them (a frozen backbone) is fine."""
    import copy

    import memfit
    mod = make("mlp")
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    other = copy.deepcopy(mod)
    before = [p.detach().clone() for p in other.parameters()]
    x, y = data(4)
    for call in (lambda: accumulate(other, opt, (x, y), F.cross_entropy, micro_batch=2),
                 lambda: memfit.fit(other, opt, (x, y), F.cross_entropy, "1GiB")):
        with pytest.raises(ValueError, match=r"optimizer holds none of the model's 4 trainable parameters \(it "
                                             r"holds 4 others\).*build it from model.parameters\(\)"):
            call()
        assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
        assert all(p.grad is None for p in other.parameters())
    head = list(other.parameters())[-2:]
    r = accumulate(other, torch.optim.SGD(head, lr=0.1), (x, y), F.cross_entropy, micro_batch=2)
    assert r.loss > 0 and not torch.equal(head[0], before[-2])        # the head stepped


@pytest.mark.parametrize("off", [torch.no_grad, torch.inference_mode, lambda: torch.set_grad_enabled(False)],
                         ids=["no_grad", "inference_mode", "set_grad_enabled(False)"])
def test_a_step_with_autograd_off_around_it_is_refused(off):
    """With autograd off around the call no micro-batch gets a gradient: the step returned a loss and left the
    weights as they were (a plain step moves them; a plain loop's backward raises there). Refused, the weights and
    gradients untouched; plan.step too, which runs it."""
    import memfit
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with off(), pytest.raises(RuntimeError, match=r"autograd is off around the call"):
        accumulate(model, opt, (x, y), F.mse_loss, micro_batch=2)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    with off(), pytest.raises(RuntimeError, match=r"memfit.fit plans a training step, and autograd is off"):
        memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")      # it raised FakeRunError, saying nothing of why
    plan = memfit.fit(model, opt, (x, y), F.mse_loss, "1GiB")
    with off(), pytest.raises(RuntimeError, match=r"autograd is off around the call"):
        plan.step((x, y))
    accumulate(model, opt, (x, y), F.mse_loss, micro_batch=2)           # outside: a step that moves the weights
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

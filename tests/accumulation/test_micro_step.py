"""memfit.accumulation.micro_step: out-of-memory back-off of one micro-batch, class ids the loss ignores unsaid, the
gradients held before a call given back when no step is taken (restore_grads=True), None otherwise."""
import copy
import warnings

import pytest
import torch
from torch.nn import functional as F

from accumulation.cases import (
    C,
    D,
    Gated,
    Tagger,
    assert_bitwise,
    assert_same_step,
    data,
    held_grads,
    make,
    nan_on,
    plain_step,
    state_of,
    token_loss,
)
from memfit.accumulation.result import NonFiniteLossError
from memfit.accumulation.run import accumulate


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_oom_retries_only_the_failed_micro_batch_without_its_partial_gradient(oom_budget, where):
    ref, mod = Gated(where), Gated(where)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    x, y = data(13)
    plain_step(ref, ref_opt, x, y)
    oom_budget.budget = staticmethod(lambda n: n <= 3)          # the emulated device holds 3 samples
    got = []
    mod.head.weight.register_post_accumulate_grad_hook(lambda p: got.append(p.grad.clone()))
    r = accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=8)
    # [0, 8) fails -> its first 4 fail -> 2, 2, 2, 2; then the 5 left at size 2: 2, 2, 1
    assert r.oom_sizes == [8, 4] and r.retries == 2 and r.final_micro_batch == 2 and r.micro_batch == 8
    assert r.micro_batches == 7
    assert_same_step(ref, mod)
    # in backward, head got samples [0, 8) before the gate failed, and nothing more of them (frozen while
    # they are retried), then one per micro-batch of the rest; in forward, one per micro-batch
    assert len(got) == (1 + 3 if where == "backward" else 7)


def test_oom_once_mid_backward(oom_budget):
    calls = {"n": 0}

    def once(n):
        calls["n"] += 1
        return calls["n"] != 2                 # the second micro-batch's backward fails, once
    ref, mod = Gated(), Gated()
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    x, y = data(12)
    plain_step(ref, ref_opt, x, y)
    oom_budget.budget = staticmethod(once)
    r = accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4)
    assert r.retries == 1 and r.oom_sizes == [4] and r.micro_batches == 5   # 4, (2, 2), 2, 2
    assert abs(r.loss - F.cross_entropy(ref(x), y).item()) < 0.05         # ref stepped: close, not equal
    assert_same_step(ref, mod)
    assert all(p.requires_grad for p in mod.parameters())                 # nothing left frozen


def test_a_single_sample_that_does_not_fit_raises(oom_budget):
    mod = Gated()
    oom_budget.budget = staticmethod(lambda n: False)
    with pytest.raises(torch.OutOfMemoryError, match="single sample"):
        accumulate(mod, torch.optim.SGD(mod.parameters(), lr=0.1), data(4), F.cross_entropy, micro_batch=4)
    assert all(p.requires_grad for p in mod.parameters())


def test_the_whole_batch_split_by_an_out_of_memory_error_is_checked_as_micro_batches_are(oom_budget):
    """One micro-batch of the whole batch is the plain step: its labels are not read beforehand (nothing to warn of)
    nor its modules walked for batch statistics. Where an out-of-memory error splits it, both matter again: labels
    ignoring a different number of positions per sample are warned of, and a model with BatchNorm is not split."""
    torch.manual_seed(0)
    m = Tagger()
    ids, y = torch.randint(0, 20, (8, 6)), torch.randint(0, C, (8, 6))
    y[0, :3] = -100
    m.register_forward_hook(lambda mod, i, o: oom_budget.apply(o))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert accumulate(m, opt, (ids, y), token_loss, micro_batch=8).micro_batches == 1
    oom_budget.budget = staticmethod(lambda n: n < 8)          # the whole batch does not fit
    with pytest.warns(UserWarning, match=r"ignores \(-100\) a different number of positions per sample"):
        assert accumulate(m, opt, (ids, y), token_loss, micro_batch=8).micro_batches == 2
    bn = torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, C))
    bn.register_forward_hook(lambda mod, i, o: oom_budget.apply(o))
    with pytest.raises(torch.OutOfMemoryError, match="batch statistics"):
        accumulate(bn, torch.optim.SGD(bn.parameters(), lr=0.1), data(8), F.cross_entropy, micro_batch=8)


def test_other_errors_are_not_swallowed():
    mod = make("mlp")
    with pytest.raises(RuntimeError, match="mat1 and mat2"):
        accumulate(mod, torch.optim.SGD(mod.parameters(), lr=0.1), (torch.randn(4, D + 1), torch.zeros(4).long()),
                   F.cross_entropy, micro_batch=2)


@pytest.mark.parametrize("restore", [True, False])
@pytest.mark.parametrize("how", ["raise", "skip", "error"])
def test_no_step_gives_back_the_gradients_held_before_the_call_when_asked(how, restore):
    """With restore_grads=True, the same tensors (None stays None, a zero tensor stays one) with the same values,
    after a non-finite loss or an error mid-step. By default the gradients end as None, as zero_grad leaves them
    (the previous ones were let go when the step began, and the failed step's partial sums are dropped);
    parameters and optimizer state are as they were either way."""
    mod = make("mlp")
    opt = torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9)
    x, y = data(10)
    plain_step(mod, opt, x, y)
    params = list(mod.parameters())
    grads = held_grads(params)
    before = state_of(mod, opt)
    if how == "error":
        def loss_fn(o, t, calls=[]):               # noqa: B006  (counts calls)
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("broken on purpose")
            return F.cross_entropy(o, t)
        with pytest.raises(RuntimeError, match="broken on purpose"):
            accumulate(mod, opt, (x, y), loss_fn, micro_batch=4, restore_grads=restore)
    elif how == "raise":
        said = "the gradients too" if restore else "the gradients None: restore_grads=True gives them back"
        with pytest.raises(NonFiniteLossError, match=rf"parameters and optimizer state are as they were before "
                                                     rf"the call, {said}"):
            accumulate(mod, opt, (x, y), nan_on(2), micro_batch=4, restore_grads=restore)
    else:
        assert accumulate(mod, opt, (x, y), nan_on(3), micro_batch=4, nonfinite="skip", restore_grads=restore).skipped
    assert all(p.grad is (g if restore else None) for p, g in zip(params, grads, strict=True))
    after = state_of(mod, opt)
    assert_bitwise(after[0], before[0])
    assert_bitwise(after[2], before[2])
    if restore:
        assert_bitwise(after[1], before[1])


def test_a_class_id_the_loss_ignores_unsaid_is_refused_and_terms_give_the_full_batch_gradient():
    # a lambda's own ignore_index (255 marks void pixels) is invisible to accumulate: weighting micro-batches by
    # samples gave a gradient 7.9e-3 off the full-batch step, silently
    torch.manual_seed(0)
    x = torch.randn(12, 3, 5, 5)
    y = torch.randint(0, 4, (12, 5, 5))
    y[torch.rand(12, 5, 5) < 0.5] = 255

    def loss_fn(o, t):
        return F.cross_entropy(o, t, ignore_index=255)

    ref = torch.nn.Conv2d(3, 4, 1)
    m = copy.deepcopy(ref)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError, match=r"label 255, outside the output's 4 classes.*terms=lambda x, y: \(y != 255\)"):
        accumulate(m, opt, (x, y), loss_fn, micro_batch=4)
    assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))      # no step taken
    accumulate(m, opt, (x, y), loss_fn, micro_batch=4, terms=lambda x, y: (y != 255).sum())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_fn(ref(x), y).backward()
    ref_opt.step()
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # labels all in range, or the same number of void pixels in every sample: runs as before
    y_even = torch.randint(0, 4, (12, 5, 5))
    y_even[:, 0, 0] = 255
    accumulate(m, opt, (x, y_even), loss_fn, micro_batch=4)


def test_class_ids_ignored_unsaid_are_looked_for_when_an_out_of_memory_retry_splits_the_whole_batch(oom_budget):
    # the whole batch at once is exact; its retry in halves is weighted by samples: the check must still run
    torch.manual_seed(0)
    x = torch.randn(12, 3, 5, 5)
    y = torch.randint(0, 4, (12, 5, 5))
    y[torch.rand(12, 5, 5) < 0.5] = 255
    m = torch.nn.Conv2d(3, 4, 1)
    seen = []
    oom_budget.budget = staticmethod(lambda n: seen.append(n) or n < 12)     # the whole batch does not fit
    m.register_forward_hook(lambda mod, i, o: oom_budget.apply(o))
    with pytest.raises(ValueError, match="label 255, outside the output's 4 classes"):
        accumulate(m, torch.optim.SGD(m.parameters(), lr=0.1), (x, y),
                   lambda o, t: F.cross_entropy(o, t, ignore_index=255), micro_batch=12)
    assert seen[0] == 12 and seen[1] < 12      # the whole batch ran out of memory once, then a part ran


def test_token_logits_with_the_classes_last_are_not_taken_for_labels_outside_the_classes():
    """A token model's (N, T, V) logits, transposed inside loss_fn: the check for labels the loss ignores unsaid read
    the classes on dimension 1 (T = 20), took every token id >= 20 for an ignored label and refused the step. The
    classes are on the dimension whose rest matches the labels (V = 50): the full-batch step, no error; a label
    outside all 50 (255, ignored by the lambda) is still refused."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))       # (N, T) -> (N, T, 50)
    m = copy.deepcopy(ref)
    x, y = torch.randint(0, 50, (12, 20)), torch.randint(0, 50, (12, 20))
    loss_fn = lambda o, t: F.cross_entropy(o.transpose(1, 2), t, ignore_index=255)
    accumulate(m, torch.optim.SGD(m.parameters(), lr=0.0), (x, y), loss_fn, micro_batch=5)
    loss_fn(ref(x), y).backward()
    for a, b in zip(m.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    y[:3, :7] = 255
    with pytest.raises(ValueError, match=r"label 255, outside the output's 50 classes"):
        accumulate(m, torch.optim.SGD(m.parameters(), lr=0.0), (x, y), loss_fn, micro_batch=5)

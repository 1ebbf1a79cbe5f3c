"""memfit.accumulation.result: a non-finite loss takes no step and the error or the StepResult names the
micro-batch."""
import pytest
import torch
from torch.nn import functional as F

from accumulation.cases import (
    C,
    Tagger,
    assert_bitwise,
    assert_same_step,
    data,
    make,
    nan_on,
    pair,
    plain_step,
    state_of,
    token_loss,
)
from memfit.accumulation.result import NonFiniteLossError
from memfit.accumulation.run import accumulate


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_micro_batch_with_a_nan_loss_takes_no_step_and_names_it(value):
    """It used to step: every weight NaN, silently. Now parameters and AdamW's state are bitwise as before (a
    plain PyTorch step before, so the state is not empty), no gradient is left for a later opt.step(), and the
    error names the micro-batch."""
    ref, ref_opt, mod, opt = pair("mlp", "adamw")
    x, y = data(10)
    plain_step(ref, ref_opt, x, y)
    plain_step(mod, opt, x, y)
    mod.zero_grad(set_to_none=True)
    before = state_of(mod, opt)
    with pytest.raises(NonFiniteLossError,
                       match=r"not finite \((nan|inf)\) in micro-batch 2 of 3 \(samples 4\.\.7 of the batch\).*"
                             r"nonfinite='skip'"):
        accumulate(mod, opt, (x, y), nan_on(2, value), micro_batch=4)        # 4 + 4 + 2
    assert_bitwise(state_of(mod, opt), before)
    opt.step()                                          # no gradient left: the caller's own step changes nothing
    assert_bitwise(state_of(mod, opt)[0], before[0])
    # the next step starts from an intact state: it is the plain step
    plain_step(ref, ref_opt, x, y)
    r = accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4)
    assert r.skipped == "" and r.micro_batches == 3
    assert_same_step(ref, mod)


def test_nonfinite_skip_returns_the_reason_and_keeps_the_state():
    ref, ref_opt, mod, opt = pair("mlp", "sgd")           # SGD with momentum: state after the first step
    x, y = data(10)
    plain_step(mod, opt, x, y)
    before = state_of(mod, opt)
    r = accumulate(mod, opt, (x, y), nan_on(3), micro_batch=4, nonfinite="skip", restore_grads=True)
    assert r.loss != r.loss and "micro-batch 3 of 3 (samples 8..9 of the batch)" in r.skipped
    assert str(r).startswith("no step on 10 samples: accumulate: the loss is not finite")
    assert_bitwise(state_of(mod, opt), before)              # the gradients of the plain step too (restore_grads)
    accumulate(mod, opt, (x, y), nan_on(3), micro_batch=4, nonfinite="skip")
    after = state_of(mod, opt)                              # by default: the gradients None, the rest as it was
    assert_bitwise([after[0], after[2]], [before[0], before[2]])
    assert all(g is None for g in after[1])
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('raise', 'skip'\); found 'ignore'"):
        accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4, nonfinite="ignore")


def test_the_micro_batch_named_counts_those_with_no_terms_too():
    """A micro-batch that counts no terms adds nothing to the loss sum, but it is still micro-batch 1."""
    ids, y = torch.randint(0, 20, (4, 6)), torch.randint(0, C, (4, 6))
    y[:2] = -100
    calls = {"n": 0}

    def loss_fn(out, t):
        calls["n"] += 1
        return token_loss(out, t) * (float("nan") if calls["n"] == 2 else 1.0)
    model = Tagger()
    with pytest.raises(NonFiniteLossError, match=r"in micro-batch 2 of 2 \(samples 2\.\.3 "):
        accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), (ids, y), loss_fn, micro_batch=2,
                   terms=lambda x, y: (y != -100).sum())


def test_infinite_losses_of_opposite_sign_name_the_first():
    """+inf then -inf: the sum is NaN; the first micro-batch that was not finite is named."""
    mod = make("mlp")
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    x, y = data(4)
    signs = iter([1.0, -1.0])
    with pytest.raises(NonFiniteLossError, match=r"\(nan\) in micro-batch 1 of 2 \(samples 0\.\.1 "):
        accumulate(mod, opt, (x, y), lambda o, t: F.cross_entropy(o, t) * 0 + next(signs) * float("inf"),
                   micro_batch=2)

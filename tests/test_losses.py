"""The 'loss' metric against torch's own loss modules on the whole set: torch's mean is not always
sum / numel (ignore_index, class weights, KLDivLoss 'batchmean'), and any chunking must give its value."""
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit import evaluate
from memfit.metrics import Loss

C, T = 5, 3


class TokenModel(torch.nn.Module):
    """(N, T, 4) -> (N, C, T) token logits, as CrossEntropyLoss wants them."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, C)

    def forward(self, x):
        return self.lin(x).permute(0, 2, 1)


class LogSoftmaxModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, C)

    def forward(self, x):
        return F.log_softmax(self.lin(x), dim=1)


def problem(kind, n, seed):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if kind == "tokens":
        x, model = torch.randn(n, T, 4, generator=g), TokenModel()
        y = torch.randint(0, C, (n, T), generator=g)
        y[torch.rand(n, T, generator=g) < 0.4] = -100           # padding
        y[0, 0] = 1                                                # never all padding
    elif kind == "kl":
        x, model = torch.randn(n, 4, generator=g), LogSoftmaxModel()
        y = torch.softmax(torch.randn(n, C, generator=g), dim=1)   # target probabilities
    else:
        x, model = torch.randn(n, 4, generator=g), torch.nn.Linear(4, C)
        if kind == "logprobs":
            model = LogSoftmaxModel()
        y = torch.randint(0, C, (n,), generator=g)
        if kind == "ignored":
            y[torch.rand(n, generator=g) < 0.3] = 7                # the loss's ignore_index below
            y[0] = 2
        if kind == "padded":
            y[torch.rand(n, generator=g) < 0.3] = -100
            y[0] = 2
    return model.eval(), x, y


W = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25])
CASES = {
    "plain CE": ("classes", torch.nn.CrossEntropyLoss()),
    "CE ignore_index": ("ignored", torch.nn.CrossEntropyLoss(ignore_index=7)),
    "CE weight": ("classes", torch.nn.CrossEntropyLoss(weight=W)),
    "CE weight + -100": ("padded", torch.nn.CrossEntropyLoss(weight=W)),
    "CE weight + label_smoothing + -100": ("padded", torch.nn.CrossEntropyLoss(weight=W, label_smoothing=0.1)),
    "CE tokens -100": ("tokens", torch.nn.CrossEntropyLoss()),
    "CE tokens weight -100": ("tokens", torch.nn.CrossEntropyLoss(weight=W)),
    "NLL weight": ("logprobs", torch.nn.NLLLoss(weight=W)),
    "KL batchmean": ("kl", torch.nn.KLDivLoss(reduction="batchmean")),
    "F.cross_entropy -100": ("padded", F.cross_entropy),
    "partial CE weight": ("padded", functools.partial(F.cross_entropy, weight=W, reduction="mean")),
    "partial kl batchmean": ("kl", functools.partial(F.kl_div, reduction="batchmean")),
}


def chunked(x, y, sizes):
    """(x, y) batches cut by `sizes`, cycled: any chunking, ragged last chunk included."""
    out, i, k = [], 0, 0
    while i < len(x):
        j = min(i + sizes[k % len(sizes)], len(x))
        out.append((x[i:j], y[i:j]))
        i, k = j, k + 1
    return out


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=8, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), sizes=st.lists(st.integers(1, 15), min_size=1, max_size=4))
def test_loss_equals_torch_on_the_whole_set(case, n, sizes):
    kind, loss_fn = CASES[case]
    model, x, y = problem(kind, n, seed=n)
    with torch.no_grad():
        ref = loss_fn(model(x), y).item()
    r = evaluate(model, chunked(x, y, sizes), metrics=("loss",), loss_fn=loss_fn, device="cpu", progress=False)
    assert r.metrics["loss"] == pytest.approx(ref, rel=1e-6)


def test_loss_with_chunk_size_on_arrays_ignores_padding():
    model, x, y = problem("padded", 101, seed=3)
    loss_fn = torch.nn.CrossEntropyLoss(weight=W)
    with torch.no_grad():
        ref = loss_fn(model(x), y).item()
    for size in (1, 7, 50, 101):
        r = evaluate(model, (x, y), metrics=("loss",), loss_fn=loss_fn, chunk_size=size, device="cpu",
                     progress=False)
        assert r.metrics["loss"] == pytest.approx(ref, rel=1e-6)


def test_the_denominator_is_state_that_adds_up():
    """Distributed evaluate all-reduces every state key: the divisor must be one of them."""
    m = Loss(torch.nn.CrossEntropyLoss(weight=W))
    part = m.contribution(torch.randn(4, C), torch.tensor([0, -100, 3, 1]))
    assert set(part) == {"sum", "count", "n"}
    assert part["count"].dtype == torch.float64 and float(part["count"]) == pytest.approx(0.5 + 3.0 + 2.0)


def test_all_targets_ignored_is_nan_as_in_torch():
    m = Loss(torch.nn.CrossEntropyLoss())
    m.commit(m.contribution(torch.randn(3, C), torch.full((3,), -100)))
    assert m.compute() != m.compute()


def test_a_loss_whose_mean_cannot_be_reproduced_is_refused():
    with pytest.raises(ValueError, match=r"expected a loss whose mean.*found CTCLoss.*Fix: pass a plain function"):
        Loss(torch.nn.CTCLoss())


@pytest.mark.parametrize("n", [4, 12])       # 4: as many samples as classes, where a mask would not even raise
def test_class_weights_with_uint8_class_ids_divide_as_torch(n):
    """uint8 class ids from a loader with CrossEntropyLoss(weight=...): the count is sum(weight[y]), as torch's
    mean (old: weight[y] with uint8 y indexed as a mask, a crash or a wrong count)."""
    torch.manual_seed(0)
    model, w = torch.nn.Linear(3, 4), torch.tensor([1.0, 2.0, 3.0, 4.0])
    x, y = torch.randn(n, 3), torch.randint(0, 4, (n,))
    y[0] = 3                                        # a mask of all ones would not tell
    with torch.no_grad():
        ref = F.cross_entropy(model(x).double(), y, weight=w.double())
    res = evaluate(model, [(x, y.to(torch.uint8))], metrics=["loss"], loss_fn=torch.nn.CrossEntropyLoss(weight=w),
                   progress=False)
    assert res["loss"] == pytest.approx(float(ref), rel=1e-6)

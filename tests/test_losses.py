"""The 'loss' metric against torch's own loss modules on the whole set: torch's mean is not always
sum / numel (ignore_index, class weights, KLDivLoss 'batchmean'), and any chunking must give its value."""
import copy
import functools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit import accumulate, evaluate
from memfit.metrics import Loss
from memfit.targets import Targets

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


# ---- outputs and targets that torch would broadcast: (N, 1) against (N,) -------------------------------------
class Squeezed(torch.nn.Module):
    """A regression head that returns (N,) (old habit: .squeeze(1) in forward)."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(x).squeeze(1)


BROADCASTING = {
    "MSELoss": (torch.nn.MSELoss(), None),
    "F.mse_loss": (F.mse_loss, None),
    "partial l1": (functools.partial(F.l1_loss, reduction="mean"), None),
    "SmoothL1Loss": (torch.nn.SmoothL1Loss(), None),
    "a lambda around F.mse_loss": (lambda out, y: F.mse_loss(out, y), "mean"),
}


@pytest.mark.parametrize("head", ["(N, 1) outputs, (N,) targets", "(N,) outputs, (N, 1) targets"])
@pytest.mark.parametrize("case", list(BROADCASTING))
def test_outputs_and_targets_torch_would_broadcast_are_refused_in_evaluate_and_accumulate(case, head):
    """torch's mse_loss of (N, 1) against (N,) averages all N * N pairs and only warns: evaluate gave that number
    (1.94 for a true 1.88) and accumulate stepped on it. Both refuse, naming the shapes and the fix; the 'mse'
    metric compares value for value in either orientation, as torch does on matching shapes."""
    loss_fn, reduction = BROADCASTING[case]
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40)
    model = torch.nn.Linear(3, 1) if head.startswith("(N, 1)") else Squeezed()
    targets = y if head.startswith("(N, 1)") else y[:, None]
    fix = r"squeeze the output \(out.squeeze\(1\)" if head.startswith("(N, 1)") else r"squeeze the targets"
    with pytest.raises(ValueError, match=r"need one shape; found outputs \(7, ?1?\) and targets \(7, ?1?\).*"
                                         r"every pair.*Fix: " + fix):
        evaluate(model, (x, targets), metrics=("loss",), loss_fn=loss_fn, loss_reduction=reduction, chunk_size=7,
                 progress=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"need one shape; found outputs .*Fix: " + fix):
        accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, targets), loss_fn, micro_batch=8)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))      # no step
    with torch.no_grad():
        out = model(x)
    ref = F.mse_loss(out.reshape(-1).double(), y.double()).item()
    r = evaluate(model, (x, targets), metrics=("mse",), chunk_size=7, progress=False)
    assert r["mse"] == pytest.approx(ref, rel=1e-6)


def test_max_batch_size_refuses_a_target_the_loss_would_broadcast():
    """A training-step memory model whose loss broadcast (N, 1) outputs against an (N,) example target held an
    (N, N) tensor: max_batch_size said 359 where 21,843 fit (the loss itself was wrong too). Refused, as in
    accumulate; the target built from the output (none given) still works."""
    import memfit
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"need one shape; found outputs \(\d+, 1\) and targets \(\d+,\)"):
        memfit.max_batch_size(model, (8,), "1MiB", train=True, optimizer=opt, loss_fn=torch.nn.MSELoss(),
                              target=torch.zeros(1))
    assert memfit.max_batch_size(model, (8,), "1MiB", train=True, optimizer=opt, loss_fn=torch.nn.MSELoss()) > 10_000


def test_matching_shapes_still_give_torchs_loss_and_no_warning_is_made_an_error_elsewhere():
    """The check only refuses broadcasting: (N, 1) against (N, 1) is torch's loss, and torch's warning is an
    error only inside memfit's call (the user's own mse_loss after it still just warns)."""
    torch.manual_seed(0)
    model, x, y = torch.nn.Linear(3, 1), torch.randn(20, 3), torch.randn(20, 1)
    with torch.no_grad():
        ref = F.mse_loss(model(x), y).item()
    r = evaluate(model, (x, y), metrics=("loss",), loss_fn=lambda o, t: F.mse_loss(o, t), loss_reduction="mean",
                 chunk_size=6, progress=False)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)
    with pytest.warns(UserWarning, match="Using a target size"):
        F.mse_loss(torch.zeros(3, 1), torch.zeros(3))


def test_the_broadcast_check_leaves_other_threads_and_the_warnings_filters_alone():
    """The check of a user's loss callable made torch's broadcast warning an error process-wide while it ran:
    another thread's own F.mse_loss on (4, 1) against (4,) raised instead of warning. Now it still warns there,
    while the callable in flight is refused."""
    import threading
    import warnings

    from memfit.losses import call_loss
    inside, seen = threading.Event(), []

    def slow(out, y):
        inside.set()
        assert other.join(timeout=30) is None and not other.is_alive()     # the other thread ran meanwhile
        return F.mse_loss(out, y)

    def elsewhere():
        assert inside.wait(timeout=30)
        try:
            F.mse_loss(torch.zeros(4, 1), torch.zeros(4))
            seen.append("ran")
        except Exception as e:          # noqa: BLE001 - what the other thread saw is the assertion
            seen.append(type(e).__name__)

    other = threading.Thread(target=elsewhere, daemon=True)
    other.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # the other thread's warning is not this test's output
        with pytest.raises(ValueError, match=r"found outputs \(4, 1\) and targets \(4,\)"):
            call_loss(slow, torch.zeros(4, 1), torch.zeros(4))
    assert seen == ["ran"]


# ---- a loss that returns the chunk's mean over tokens: weighted by the terms it is over -------------------------
def padded_tokens(ignore: int, n: int = 30, seed: int = 0):
    """A token model (N, T, 4) -> (N, C, T) and labels (N, T) padded on the right with `ignore`, 1..T tokens
    each, so chunks hold different numbers of counted tokens."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x, y = torch.randn(n, T + 3, 4, generator=g), torch.randint(1, C, (n, T + 3), generator=g)
    lengths = torch.randint(1, T + 4, (n,), generator=g)
    y[torch.arange(T + 3)[None] >= lengths[:, None]] = ignore
    return TokenModel().eval(), x, y


def test_a_mean_over_tokens_is_weighted_by_tokens_with_terms_and_refused_without():
    """loss_reduction='mean' on padded token labels: chunks weighted by samples gave 2.668 for a whole-set 2.670
    (any chunking differed). With terms= (as accumulate takes it) every chunking gives the one-batch value;
    without it evaluate refuses and says how to fix it."""
    model, x, y = padded_tokens(-100)
    mean = lambda out, t: F.cross_entropy(out, t)                  # the mean over the tokens that count
    with torch.no_grad():
        ref = mean(model(x), y).item()
    for size in (1, 4, 7, 30):
        r = evaluate(model, (x, y), metrics=("loss",), loss_fn=mean, loss_reduction="mean", chunk_size=size,
                     terms=lambda x, t: (t != -100).sum(), progress=False)
        assert r["loss"] == pytest.approx(ref, rel=1e-6)
    with pytest.raises(ValueError, match=r"different number of positions per sample .*ignore_index -100.*Fix: pass "
                                         r"terms=lambda x, y: \(y != -100\).sum\(\)"):
        evaluate(model, (x, y), metrics=("loss",), loss_fn=mean, loss_reduction="mean", chunk_size=7, progress=False)
    per_token = lambda out, t: F.cross_entropy(out, t, reduction="none")     # (N, T), 0 where ignored
    with pytest.raises(ValueError, match=r"one loss per target position.*would count the ignored ones"):
        evaluate(model, (x, y), metrics=("loss",), loss_fn=per_token, chunk_size=7, progress=False)
    r = evaluate(model, (x, y), metrics=("loss",), loss_fn=per_token, chunk_size=7,
                 terms=lambda x, t: (t != -100).sum(), progress=False)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)
    summed = lambda out, t: F.cross_entropy(out, t, reduction="sum")
    r = evaluate(model, (x, y), metrics=("loss",), loss_fn=summed, loss_reduction="sum", chunk_size=7,
                 terms=lambda x, t: (t != -100).sum(), progress=False)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)


def test_a_mean_over_samples_with_as_many_terms_each_is_not_refused():
    """Every sample counting as many positions: weighting by samples is exact, nothing to refuse."""
    model, x, y = padded_tokens(-100)
    y[:, -2:] = -100                                   # the same two ignored positions in every sample
    y[:, :-2] = y[:, :-2].clamp(min=0)
    mean = lambda out, t: F.cross_entropy(out, t)
    with torch.no_grad():
        ref = mean(model(x), y).item()
    r = evaluate(model, (x, y), metrics=("loss",), loss_fn=mean, loss_reduction="mean", chunk_size=7, progress=False)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)


# ---- the user's ignore index, everywhere ---------------------------------------------------------------------------
@pytest.mark.parametrize("ignore", [0, -1])
def test_the_loss_ignore_index_is_every_metrics_ignore_index(ignore):
    """CrossEntropyLoss(ignore_index=0 or -1): loss, accuracy and perplexity all leave those positions out, as
    torch on the whole set (old: -1 labels were refused as negative, 0 labels counted as a class by accuracy and
    perplexity); evaluate(ignore_index=) says the same without a loss_fn; the two differing raise."""
    model, x, y = padded_tokens(ignore)
    with torch.no_grad():
        logits = model(x)
    keep = y != ignore
    ce = F.cross_entropy(logits.double(), y, ignore_index=ignore).item()
    acc = ((logits.argmax(1) == y) & keep).sum().item() / keep.sum().item()
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=ignore)
    r = evaluate(model, (x, y), metrics=("loss", "accuracy", "perplexity"), loss_fn=loss_fn, chunk_size=7,
                 progress=False)
    assert r["loss"] == pytest.approx(ce, rel=1e-6) and r["accuracy"] == acc
    assert r["perplexity"] == pytest.approx(math.exp(ce), rel=1e-6)
    r = evaluate(model, (x, y), metrics=("loss", "accuracy"), ignore_index=ignore, chunk_size=7, progress=False)
    assert r["loss"] == pytest.approx(ce, rel=1e-6) and r["accuracy"] == acc
    with pytest.raises(ValueError, match=rf"ignore_index={ignore}, but loss_fn ignores -100.*"
                                         rf"CrossEntropyLoss\(ignore_index={ignore}\)"):
        evaluate(model, (x, y), metrics=("loss",), loss_fn=torch.nn.CrossEntropyLoss(), ignore_index=ignore,
                 progress=False)
    stored = Targets.plain(y.to(torch.int8), ignore_index=ignore)
    assert stored.ignore_index == ignore and stored.num_classes == int(y[keep].max()) + 1


@pytest.mark.parametrize("ignore", [0, -1])
def test_accumulate_weighs_uneven_padding_by_the_losses_ignore_index(ignore):
    """accumulate's warning that samples hold different numbers of counted tokens looked for -100 only: padding
    marked 0 (or -1) for CrossEntropyLoss(ignore_index=0) went unsaid, and the micro-batch gradient was not the
    full-batch one. A torch cross entropy says what its mean is over: its micro-batches are now weighted by the
    tokens it counts (its own ignore index): the full-batch step, with nothing to warn about."""
    model, x, y = padded_tokens(ignore, n=8)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=ignore)
    ref = copy.deepcopy(model)
    loss_fn(ref(x), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = accumulate(model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y), loss_fn, micro_batch=3)
    assert r.loss == pytest.approx(loss_fn(ref(x), y).item(), rel=1e-6)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_a_loss_that_would_count_the_datas_ignored_positions_is_refused():
    """Data built with ignore_index=0 (padding 0) and CrossEntropyLoss() (ignoring -100, torch's default): the loss
    counted every pad as class 0 while accuracy left them out, silently; now an error names both indices. With
    255 (segmentation) the old error was torch's 'Target 255 is out of bounds'."""
    from memfit import CompactDataset
    model, x, y = padded_tokens(0)
    ds = CompactDataset.from_arrays(x.numpy(), y.numpy(), ignore_index=0, device="cpu")
    with pytest.raises(ValueError, match=r"marks positions without a label with 0 \(its ignore_index\), but loss_fn "
                                         r"ignores -100 \(torch's default\).*CrossEntropyLoss\(ignore_index=0\)"):
        evaluate(model, ds, metrics=("loss", "accuracy"), loss_fn=torch.nn.CrossEntropyLoss(), progress=False)
    with torch.no_grad():
        ref = F.cross_entropy(model(x), y, ignore_index=0).item()
    r = evaluate(model, ds, metrics=("loss",), loss_fn=torch.nn.CrossEntropyLoss(ignore_index=0), chunk_size=7,
                 progress=False)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)


def test_a_loss_fn_written_for_the_whole_output_says_evaluate_gives_it_the_logits():
    """accumulate's loss_fn(out, y) reads out.logits; evaluate gives loss_fn the logits: the error said only
    "'Tensor' object has no attribute 'logits'"."""
    model, x, y = padded_tokens(-100)
    with pytest.raises(TypeError, match=r"loss_fn reads .logits of what it is given, but evaluate gives it the "
                                        r"logits \(a tensor of shape \(7, 5, 6\)"):
        evaluate(model, (x, y), metrics=("loss",), loss_fn=lambda out, t: F.cross_entropy(out.logits, t),
                 loss_reduction="mean", terms=lambda x, t: (t != -100).sum(), chunk_size=7, progress=False)



@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_loss_fn_ignoring_a_label_memfit_was_not_told_is_refused(reduction):
    """lambda o, t: F.cross_entropy(o, t, ignore_index=255) on masks with 255 voids, no ignore_index given: memfit
    counted positions by -100, so a chunk mean weighted by samples gave 1.4726 for 1.4692 and per-position values
    averaged over every position 1.035, silently. A label outside the output's classes that the loss ran on is one
    it ignores: refused, saying to pass ignore_index=255; with it (and terms=) the whole-set value comes back."""
    torch.manual_seed(0)
    model, x = torch.nn.Conv2d(3, 4, 1).eval(), torch.randn(23, 3, 5, 5)
    y = torch.randint(0, 4, (23, 5, 5))
    y[torch.rand(23, 5, 5) < 0.3] = 255
    loss_fn = lambda o, t: F.cross_entropy(o, t, ignore_index=255, reduction=reduction)    # noqa: E731
    with torch.no_grad():
        ref = F.cross_entropy(model(x).double(), y, ignore_index=255).item()
    kw = dict(metrics=("loss",), loss_fn=loss_fn, loss_reduction=reduction if reduction == "mean" else None,
              chunk_size=5, progress=False)
    with pytest.raises(ValueError, match=r"label 255, outside the 4 classes.*pass ignore_index=255"):
        evaluate(model, (x, y), **kw)
    r = evaluate(model, (x, y), ignore_index=255, terms=lambda x, t: (t != 255).sum(), **kw)
    assert r["loss"] == pytest.approx(ref, rel=1e-6)
    r = evaluate(model, (x, torch.where(y == 255, 0, y)), **kw)     # labels in range: run as before
    with torch.no_grad():
        plain = F.cross_entropy(model(x).double(), torch.where(y == 255, 0, y)).item()
    assert r["loss"] == pytest.approx(plain, rel=1e-6)


def test_a_class_weighted_mean_inside_a_lambda_is_refused_and_exact_with_terms():
    """evaluate(loss_fn=lambda: F.cross_entropy(..., weight=w), loss_reduction='mean') weighted each chunk's mean by
    its samples: 1.539 for the whole set's 1.485, silently. Refused now; terms= summing the weights is exact (a
    float, never rounded)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4).eval()
    x, y = torch.randn(30, 6), torch.randint(0, 4, (30,))
    w = torch.tensor([1.0, 5.0, 0.1, 2.0])
    lam = lambda out, t: F.cross_entropy(out, t, weight=w)
    with torch.no_grad():
        whole = lam(model(x), y).item()
    with pytest.raises(ValueError, match=r"class weights inside.*terms=lambda x, y: w\[y\[y != -100\]\]\.sum\(\)"):
        evaluate(model, (x.numpy(), y.numpy()), metrics=("loss",), loss_fn=lam, loss_reduction="mean", chunk_size=7,
                 progress=False)
    r = evaluate(model, (x.numpy(), y.numpy()), metrics=("loss",), loss_fn=lam, loss_reduction="mean",
                 terms=lambda x, t: w[t].sum(), chunk_size=7, progress=False)
    assert r["loss"] == pytest.approx(whole, rel=1e-6)

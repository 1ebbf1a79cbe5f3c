"""Metrics for every task (dense accuracy and loss with an ignore index, perplexity, IoU, mse, mae) against a
plain PyTorch reference computed in float64 on the dataset's own decoded batches: exact under any chunking
(hypothesis draws the chunk size) and across 2 gloo ranks whose shards differ by one sample."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from memfit import CompactDataset, evaluate, metrics
from memfit.testing.ranks import run_ranks

N = 29                                     # odd: 2 ranks hold 15 and 14 samples


def seg_data():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (N, 3, 5, 6), dtype=np.uint8)
    y = rng.integers(0, 4, (N, 5, 6))
    y[rng.random((N, 5, 6)) < 0.2] = 255                      # void pixels
    return x, y


def seg_model():
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, 4, 1)                           # (N, 4, 5, 6): classes on dimension 1


class TokenLM(torch.nn.Module):
    """(N, T) token ids -> (N, T, V) logits: classes last, as a language model's."""

    def __init__(self, vocab=11):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(vocab, 8), torch.nn.Linear(8, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def token_data():
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 11, (N, 7))
    labels = np.roll(ids, -1, axis=1)                         # next token, aligned with the logits
    labels[:, -1] = -100
    labels[rng.random((N, 7)) < 0.25] = -100                  # padding
    return ids, labels


def reg_data(shape=(3,)):
    rng = np.random.default_rng(3)
    return rng.normal(size=(N, 6)).astype(np.float32), rng.normal(size=(N, *shape))     # float64 targets


def reg_model(out=3):
    torch.manual_seed(0)
    return torch.nn.Linear(6, out)


def decoded(ds):
    """The whole set as the dataset decodes it, and the model's outputs in float64."""
    return ds.batch(slice(None))


def seg_reference(model, ds):
    x, y = decoded(ds)
    with torch.no_grad():
        z = model(x).double()
    keep = y != 255
    pred = z.argmax(1)
    iou = []
    for c in range(4):
        inter = ((pred == c) & (y == c) & keep).sum().item()
        union = (((pred == c) | (y == c)) & keep).sum().item()
        if union:
            iou.append(inter / union)
    return {"accuracy": (pred == y)[keep].double().mean().item(),
            "loss": F.cross_entropy(z, y, ignore_index=255).item(), "iou": float(np.mean(iou))}


def token_reference(model, ds):
    x, y = decoded(ds)
    with torch.no_grad():
        z = model(x).double()
    ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y.reshape(-1), ignore_index=-100).item()
    keep = y != -100
    return {"accuracy": (z.argmax(-1) == y)[keep].double().mean().item(), "loss": ce, "perplexity": np.exp(ce)}


def reg_reference(model, ds):
    x, y = decoded(ds)
    with torch.no_grad():
        z = model(x).double().reshape(y.shape)
    return {"mse": ((z - y.double()) ** 2).mean().item(), "mae": (z - y.double()).abs().mean().item()}


def check(res, ref):
    """Counts (accuracy, IoU) exactly; sums of errors and losses to float32 rounding: the model's float32
    outputs themselves change with the chunk size (another conv/matmul blocking).
    `test_metric_sums_are_exact_for_any_partition` checks the metrics alone, on fixed float64 outputs, to
    summation order."""
    for k, v in ref.items():
        if k in ("accuracy", "iou"):
            assert res[k] == pytest.approx(v, rel=1e-15), k
        else:
            assert res[k] == pytest.approx(v, rel=1e-6), k


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, N))
def test_segmentation_metrics_are_exact_under_any_chunking(chunk):
    x, y = seg_data()
    ds = CompactDataset.from_arrays(x, y, ignore_index=255, device="cpu")
    model = seg_model()
    res = evaluate(model, ds, metrics=("accuracy", "loss", "iou"), chunk_size=chunk, device="cpu", progress=False)
    check(res, seg_reference(model, ds))


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, N))
def test_token_metrics_with_ignored_padding_are_exact_under_any_chunking(chunk):
    ids, labels = token_data()
    model = TokenLM()
    res = evaluate(model, (ids, labels), metrics=("accuracy", "loss", "perplexity"), chunk_size=chunk, device="cpu",
                   progress=False)
    check(res, token_reference(model, CompactDataset.from_arrays(ids, labels, device="cpu")))


@settings(max_examples=12, deadline=None)
@given(chunk=st.integers(1, N), shape=st.sampled_from([(), (3,)]))
def test_regression_metrics_are_exact_under_any_chunking(chunk, shape):
    x, y = reg_data(shape)
    model = reg_model(3 if shape else 1)                           # a (N, 1) head meets (N,) targets
    res = evaluate(model, (x, y), chunk_size=chunk, device="cpu", progress=False)
    assert list(res) == ["mse", "mae"]                            # float targets: their default metrics
    check(res, reg_reference(model, CompactDataset.from_arrays(x, y, device="cpu")))


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(1, N - 1), max_size=8, unique=True), last=st.booleans())
def test_metric_sums_are_exact_for_any_partition(cuts, last):
    """Fixed float64 outputs cut into chunks anywhere: every metric equals its whole-set reference."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(N, 4, 3, generator=g, dtype=torch.float64)        # (N, C, T) or, moved, (N, T, C)
    y = torch.randint(0, 4, (N, 3), generator=g)
    y[torch.rand(N, 3, generator=g) < 0.3] = -100
    if last:
        logits = logits.transpose(1, 2).contiguous()                          # classes last
    target, out = torch.randn(2, N, 3, generator=g, dtype=torch.float64)    # a regression's targets and outputs
    made = {name: metrics.make_metric(name) for name in ("accuracy", "loss", "perplexity", "iou", "topk:2")}
    errs = {name: metrics.make_metric(name) for name in ("mse", "mae")}
    bounds = [0, *sorted(cuts), N]
    for a, b in zip(bounds, bounds[1:], strict=False):
        for m in made.values():
            m.commit(m.contribution(logits[a:b], y[a:b]))
        for m in errs.values():
            m.commit(m.contribution(out[a:b], target[a:b]))
    scores = logits.transpose(1, 2) if last else logits                       # (N, C, T)
    keep = y != -100
    ce = F.cross_entropy(scores, y, ignore_index=-100).item()
    assert made["accuracy"].compute() == (scores.argmax(1) == y)[keep].double().mean().item()
    top2 = (scores.topk(2, 1).indices == y[:, None]).any(1)
    assert made["topk:2"].compute() == top2[keep].double().mean().item()
    assert made["loss"].compute() == pytest.approx(ce, rel=1e-13)
    assert made["perplexity"].compute() == pytest.approx(np.exp(ce), rel=1e-13)
    pred = scores.argmax(1)
    ious = [((pred == c) & (y == c) & keep).sum().item() / u for c in range(4)
            if (u := (((pred == c) | (y == c)) & keep).sum().item())]
    assert made["iou"].compute() == pytest.approx(np.mean(ious), rel=1e-15)
    diff = out - target
    assert errs["mse"].compute() == pytest.approx((diff ** 2).mean().item(), rel=1e-13)
    assert errs["mae"].compute() == pytest.approx(diff.abs().mean().item(), rel=1e-13)


def test_the_segmentation_ignore_index_comes_from_the_data():
    x, y = seg_data()
    model = seg_model()
    ds = CompactDataset.from_arrays(x, y, ignore_index=255, device="cpu")
    res = evaluate(model, ds, chunk_size=5, device="cpu", progress=False)        # default metrics, bound to 255
    assert list(res) == ["accuracy", "loss"]
    check(res, {k: v for k, v in seg_reference(model, ds).items() if k != "iou"})
    iou = metrics.IoU()
    evaluate(model, ds, metrics=[iou], chunk_size=4, device="cpu", progress=False)
    per = iou.per_class()
    assert per.shape == (4,) and float(per[~per.isnan()].mean()) == pytest.approx(seg_reference(model, ds)["iou"])


class TwoHeads(torch.nn.Module):
    def __init__(self, as_tuple=False):
        super().__init__()
        torch.manual_seed(0)
        self.cls, self.box, self.as_tuple = torch.nn.Linear(6, 5), torch.nn.Linear(6, 2), as_tuple

    def forward(self, x):
        out = {"label": self.cls(x), "box": self.box(x)}
        return tuple(out.values()) if self.as_tuple else out


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_dict_of_targets_gets_each_its_own_metrics(as_tuple):
    x, box = reg_data((2,))
    label = np.random.default_rng(4).integers(0, 5, N)
    model = TwoHeads(as_tuple)
    ds = CompactDataset.from_arrays(x, {"label": label, "box": box}, device="cpu")
    res = evaluate(model, ds, chunk_size=6, device="cpu", progress=False)
    assert list(res) == ["accuracy@label", "loss@label", "mse@box", "mae@box"]
    xb, yb = decoded(ds)
    with torch.no_grad():
        z, b = model.cls(xb).double(), model.box(xb).double()
    check({k.split("@")[0]: v for k, v in res.items()},
          {"accuracy": (z.argmax(1) == yb["label"]).double().mean().item(),
           "loss": F.cross_entropy(z, yb["label"]).item(), "mse": ((b - yb["box"]) ** 2).mean().item(),
           "mae": (b - yb["box"]).abs().mean().item()})


@pytest.mark.parametrize("data, model, kwargs, match", [
    (reg_data(()), reg_model(1), dict(metrics=("accuracy",)),
     r"accuracy compares class ids, but the targets are float \(torch.float64, shape \(6,\)\): use metrics 'mse' "
     r"and 'mae'"),
    (reg_data(()), reg_model(1), dict(metrics=("loss",)),
     r"loss without loss_fn is cross entropy, which needs class ids; the targets are float"),
    ((seg_data()[0], seg_data()[1][:, :4]), seg_model(), dict(metrics=("accuracy",)),
     r"accuracy: found outputs of shape \(6, 4, 5, 6\) and targets of shape \(6, 4, 6\); .*the shapes other than "
     r"the classes must match"),
    ((np.zeros((N, 6), np.float32), np.zeros((N, 4), np.float32)), reg_model(3), dict(),
     r"mse compares outputs with targets of the same shape; found outputs \(6, 3\) and targets \(6, 4\)"),
    ((np.zeros((N, 6), np.float32), np.zeros((N, 6), np.int64)),
     torch.nn.Sequential(torch.nn.Linear(6, 36), torch.nn.Unflatten(1, (6, 6))), dict(metrics=("accuracy",)),
     r"outputs \(6, 6, 6\) with targets \(6, 6\) fit classes on dimension 1 and on the last one; say which: "
     r"metrics=\[memfit.metrics.Accuracy\(class_dim=1\)\]"),
    ((np.zeros((N, 6), np.float32), np.full(N, 7)), reg_model(3), dict(),
     r"label 7 is out of range for a model with 3 outputs \(labels must be in 0..2, or ignore_index -100"),
    (reg_data(()), reg_model(1), dict(metrics=("mse@box",)), r"metric 'mse' reads target 'box', but the data has "
     r"one target, not a dict"),
    ((np.zeros((N, 6), np.float32), {"box": np.zeros((N, 2))}), reg_model(2), dict(metrics=("mse@box",)),
     r"target 'box': expected the model to return a dict with a tensor 'box'"),
    # integer values to regress, and class ids stored as floats: the error says how to give each (a new user's
    # first try; the messages spoke of labels and shapes only)
    ((np.zeros((N, 6), np.float32), np.arange(N) - 10), reg_model(1), dict(),
     r"holds label -10.*or y_dtype=torch.float32 if y holds values to regress"),
    ((np.zeros((N, 6), np.float32), np.arange(N)), reg_model(1), dict(),
     r"label \d+ is out of range for a model with 1 output .*one output regresses a value.*y.astype\(np.float32\)"),
    ((seg_data()[0], np.where(seg_data()[1] == 255, 255, 0)), seg_model(), dict(),
     r"label 255 is out of range for a model with 4 outputs .*; if 255 marks positions without a label, pass "
     r"ignore_index=255"),
    ((np.zeros((N, 6), np.float32), (np.arange(N) % 3).astype(np.float32)), reg_model(3), dict(),
     r"found outputs \(6, 3\) and targets \(6,\).*class ids stored as floats, give them as integers, "
     r"y.astype\(np.int64\)"),
])
def test_bad_input_says_what_was_expected_and_found(data, model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        evaluate(model, data, chunk_size=6, device="cpu", progress=False, **kwargs)


def test_an_ambiguous_class_dimension_is_said_and_given():
    x = np.random.default_rng(5).normal(size=(N, 6)).astype(np.float32)
    y = np.random.default_rng(6).integers(0, 6, (N, 6))
    model = torch.nn.Sequential(torch.nn.Linear(6, 36), torch.nn.Unflatten(1, (6, 6)))
    res = evaluate(model, (x, y), metrics=[metrics.Accuracy(class_dim=-1)], chunk_size=7, device="cpu",
                   progress=False)
    xb = torch.from_numpy(x)
    with torch.no_grad():
        want = (model(xb).argmax(-1) == torch.from_numpy(y)).double().mean().item()
    assert res["accuracy"] == want


def _dist_rank(rank, world):
    x, y = seg_data()
    ds = CompactDataset.from_arrays(x, y, ignore_index=255, device="cpu")           # the whole set on each rank
    res = evaluate(seg_model(), ds, metrics=("accuracy", "loss", "iou"), chunk_size=4, device="cpu",
                   progress=False, distributed=True)
    ids, labels = token_data()
    tok = evaluate(TokenLM(), (ids, labels), metrics=("loss", "perplexity"), chunk_size=3, device="cpu",
                   progress=False, distributed=True)
    xr, yr = reg_data()
    reg = evaluate(reg_model(), (xr, yr), chunk_size=5, device="cpu", progress=False, distributed=True)
    return dict(res), dict(tok), dict(reg), res.n, _even_per_rank(rank)


def even_per_rank_data():
    """Token labels whose samples count 2 tokens each in the first half (rank 0's part), 4 in the second."""
    ids, labels = token_data()
    labels = np.clip(labels[:12], 0, None)
    labels[:6, 2:], labels[6:, 4:] = -100, -100
    return ids[:12], labels


def _even_per_rank(rank):
    """A loss_fn returning the chunk's mean, each rank's samples even on their own but not together: refused on
    every rank (the sums of the counts and of their squares are state); with terms= the one-batch value."""
    ids, labels = even_per_rank_data()
    part = (ids[rank * 6:(rank + 1) * 6], labels[rank * 6:(rank + 1) * 6])
    mean = lambda out, t: F.cross_entropy(out.transpose(1, 2), t)
    refused = ""
    try:
        evaluate(TokenLM(), part, metrics=("loss",), loss_fn=mean, loss_reduction="mean", distributed=True,
                 sharded=True, progress=False)
    except ValueError as e:
        refused = str(e)
    r = evaluate(TokenLM(), part, metrics=("loss",), loss_fn=mean, loss_reduction="mean",
                 terms=lambda x, t: (t != -100).sum(), distributed=True, sharded=True, progress=False)
    return refused, r["loss"]


def test_two_gloo_ranks_with_shards_of_different_sizes_give_the_single_process_values():
    out = run_ranks(_dist_rank, 2, timeout=120)
    assert sorted(out) == [0, 1], out
    x, y = seg_data()
    seg = seg_reference(seg_model(), CompactDataset.from_arrays(x, y, ignore_index=255, device="cpu"))
    ids, labels = token_data()
    tok = token_reference(TokenLM(), CompactDataset.from_arrays(ids, labels, device="cpu"))
    xr, yr = reg_data()
    reg = reg_reference(reg_model(), CompactDataset.from_arrays(xr, yr, device="cpu"))
    ids, labels = even_per_rank_data()
    with torch.no_grad():
        uneven = F.cross_entropy(TokenLM()(torch.from_numpy(ids)).transpose(1, 2), torch.from_numpy(labels)).item()
    for status, value in out.values():
        assert status == "ok", value
        res, t, r, n, (refused, loss) = value
        assert n == N
        check(res, seg)
        check(t, {k: tok[k] for k in ("loss", "perplexity")})
        check(r, reg)
        # a chunk mean whose samples count 2 tokens on rank 0 and 4 on rank 1: each rank alone could not tell
        assert "counts that differ between ranks" in refused and "terms=lambda x, y: (y != -100).sum()" in refused
        assert loss == pytest.approx(uneven, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_labels_from_batches_give_the_int64_values(dtype):
    """A loader's uint8 masks (void 255) or int32 labels: the default loss, perplexity and the confusion matrix
    equal torch's on int64 labels (old: uint8 labels overflowed y * classes in the confusion matrix, the
    ignored positions were filled with -100 wrapped to 156 and counted as class 156; int16/int32 crashed)."""
    torch.manual_seed(0)
    classes = 200
    model = torch.nn.Linear(3, classes)
    x, y = torch.randn(24, 3), torch.randint(0, classes, (24,))
    y[:5] = 255
    batches = [(x[:10], y[:10].to(dtype)), (x[10:], y[10:].to(dtype))]
    with torch.no_grad():
        logits = model(x)
    keep = y != 255
    ref_loss = F.cross_entropy(logits.double(), y, ignore_index=255)
    ref_conf = torch.bincount(y[keep] * classes + logits.argmax(1)[keep], minlength=classes ** 2).view(classes, -1)
    res = evaluate(model, batches, progress=False,
                   metrics={"loss": metrics.Loss(ignore_index=255), "ppl": metrics.Perplexity(ignore_index=255),
                            "confusion": metrics.Confusion(ignore_index=255)})
    assert res["loss"] == pytest.approx(float(ref_loss), rel=1e-6)
    assert res["ppl"] == pytest.approx(float(ref_loss.exp()), rel=1e-6)
    assert torch.equal(res["confusion"], ref_conf)


@pytest.mark.parametrize("chunk", [1, 4, N])
def test_a_one_channel_output_meets_masks_without_it_value_for_value(chunk):
    """A binary-segmentation head (N, 1, H, W) against float masks (N, H, W), or the other way round: 'mse' and
    'mae' compare pixel for pixel, as torch on matching shapes (old: refused as a shape mismatch)."""
    rng = np.random.default_rng(7)
    x, masks = rng.normal(size=(N, 3, 4, 5)).astype(np.float32), (rng.random((N, 4, 5)) > 0.5).astype(np.float32)
    torch.manual_seed(0)
    head = torch.nn.Conv2d(3, 1, 1)
    with torch.no_grad():
        out = head(torch.from_numpy(x)).double()[:, 0]
    ref = {"mse": ((out - torch.from_numpy(masks)) ** 2).mean().item(),
           "mae": (out - torch.from_numpy(masks)).abs().mean().item()}
    check(evaluate(head, (x, masks), chunk_size=chunk, progress=False).metrics, ref)
    squeezed = torch.nn.Sequential(head, torch.nn.Flatten(1, 2))          # (N, 4, 5) outputs, (N, 1, 4, 5) masks
    check(evaluate(squeezed, (x, masks[:, None]), chunk_size=chunk, progress=False).metrics, ref)

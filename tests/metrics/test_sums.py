"""Metrics for every task (dense accuracy and loss with an ignore index, perplexity, IoU, mse, mae;
memfit.metrics.sums and .stateful) against a plain PyTorch reference computed in float64 on the dataset's own
decoded batches: exact under any chunking (hypothesis draws the chunk size) and across 2 gloo ranks whose shards
differ by one sample."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from metric_cases import N, check, decoded, reg_data, reg_model, seg_data, seg_model, seg_reference

from memfit import CompactDataset, evaluate, metrics
from memfit.testing.ranks import run_ranks


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

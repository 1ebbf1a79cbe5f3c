"""accumulate (memfit.accumulation.run): micro-batched steps against one plain full-batch step (eager PyTorch as
the reference)."""
import functools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from accumulation.cases import (
    C,
    Tagger,
    assert_same_step,
    data,
    make,
    pair,
    plain_step,
    token_loss,
)
from memfit.accumulation.run import accumulate
from memfit.testing.reads import counted_reads


@settings(max_examples=20, deadline=None, derandomize=True)
@given(n=st.integers(1, 13), micro=st.integers(1, 15),
       kind=st.sampled_from(["mlp", "cnn", "tied", "attn", "frozen_cat", "batch_cat", "cls_token"]))
def test_gradient_and_step_equal_the_full_batch(n, micro, kind):
    ref, ref_opt, mod, opt = pair(kind)
    x, y = data(n)
    loss = plain_step(ref, ref_opt, x, y)
    r = accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=micro)
    assert r.micro_batches == -(-n // min(micro, n)) and r.retries == 0 and r.n == n
    assert abs(r.loss - loss) <= 1e-5 * max(1.0, abs(loss))
    assert_same_step(ref, mod)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(n=st.integers(2, 9), micro=st.integers(1, 8), seed=st.integers(0, 100))
def test_padded_tokens_weighted_by_their_count_give_the_full_batch_step(n, micro, seed):
    """Labels ignoring a different number of positions per sample: weighted by samples the step is off (and a
    warning says so); with terms= counting the positions it is the full-batch step, whole-mean loss included."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (n, 6), generator=g)
    y = torch.randint(0, C, (n, 6), generator=g)
    y[torch.arange(6) >= torch.randint(0, 7, (n, 1), generator=g)] = -100      # 0 to 6 positions count
    assume((y != -100).any())
    ref, mod = Tagger(), Tagger()
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    loss = plain_step(ref, ref_opt, ids, y, token_loss)
    r = accumulate(mod, opt, (ids, y), token_loss, micro_batch=micro, terms=lambda x, y: (y != -100).sum())
    assert abs(r.loss - loss) <= 1e-5 * max(1.0, abs(loss))
    assert_same_step(ref, mod)
    uneven = len(set((y != -100).sum(1).tolist())) > 1
    if uneven and micro < n:
        with pytest.warns(UserWarning, match=r"terms=lambda x, y: \(y != -100\)\.sum\(\)"):
            accumulate((t := Tagger()), torch.optim.SGD(t.parameters(), lr=0.1), (ids, y), token_loss,
                       micro_batch=micro, nonfinite="skip")      # a micro-batch of no terms has a NaN mean


def test_several_steps_with_adamw_follow_the_plain_run():
    # not "attn": its key bias has a zero true gradient, so Adam's first steps are +-lr on float noise
    ref, ref_opt, mod, opt = pair("tied", "adamw")
    for step in range(4):
        x, y = data(11, seed=step)
        plain_step(ref, ref_opt, x, y)
        accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4)     # 4 + 4 + 3
    # Adam divides by sqrt(v): a gradient element near 0 turns a 1e-7 reassociation difference into a
    # visible fraction of lr (1e-3) per step, so parameters agree to a few percent of one step's size
    for p, q in zip(ref.parameters(), mod.parameters(), strict=True):
        assert (p - q).abs().max() <= 5e-5


def test_per_sample_losses_are_summed_not_averaged_per_micro_batch():
    ref, ref_opt, mod, opt = pair("mlp")
    x, y = data(10)
    plain_step(ref, ref_opt, x, y)
    r = accumulate(mod, opt, (x, y), lambda out, t: F.cross_entropy(out, t, reduction="none"), micro_batch=3)
    assert r.micro_batches == 4
    assert_same_step(ref, mod)


def test_a_micro_batch_mean_weighted_equally_would_fail_this_test():
    """The uneven last micro-batch: averaging the micro-batch means (equal weights, unequal parts) is wrong."""
    ref, ref_opt, mod, _ = pair("mlp")
    x, y = data(9)
    plain_step(ref, ref_opt, x, y)
    mod.zero_grad()
    for s in range(0, 9, 4):                         # 4 + 4 + 1, each weighted 1/3
        (F.cross_entropy(mod(x[s:s + 4]), y[s:s + 4]) / 3).backward()
    with pytest.raises(AssertionError):
        for p, q in zip(ref.parameters(), mod.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4)


# ---- inputs, precision, loaders -------------------------------------------------------------------------
class KwModel(nn.Module):
    """Takes tokenizer-style keyword inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, C)

    def forward(self, input_ids, attention_mask, scale=1.0):
        m = attention_mask.unsqueeze(-1).float()                          # (N, T, 1)
        return self.head((self.emb(input_ids) * m).sum(1) / m.sum(1) * scale)


def test_dict_inputs_are_split_per_tensor():
    g = torch.Generator().manual_seed(0)
    x = {"input_ids": torch.randint(0, 20, (9, 5), generator=g), "attention_mask": torch.ones(9, 5, dtype=torch.long),
         "scale": 2.0}
    x["attention_mask"][::2, 3:] = 0
    y = torch.randint(0, C, (9,), generator=g)
    ref, mod = KwModel(), KwModel()
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    ref_opt.zero_grad()
    F.cross_entropy(ref(**x), y).backward()
    ref_opt.step()
    accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4)
    assert_same_step(ref, mod)


def test_transformers_bert_from_a_tiny_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=16, num_labels=C,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    ref = transformers.BertForSequenceClassification(cfg)
    mod = transformers.BertForSequenceClassification(cfg)
    mod.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    x = {"input_ids": torch.randint(0, 50, (7, 6), generator=g), "attention_mask": torch.ones(7, 6, dtype=torch.long)}
    y = torch.randint(0, C, (7,), generator=g)
    loss_fn = lambda out, t: F.cross_entropy(out.logits, t)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(mod.parameters(), lr=0.1)
    ref_opt.zero_grad()
    loss_fn(ref(**x), y).backward()
    ref_opt.step()
    accumulate(mod, opt, (x, y), loss_fn, micro_batch=3)
    assert_same_step(ref, mod, rtol=1e-4)


def test_bf16_autocast_on_cpu_matches_the_plain_autocast_step():
    ref, ref_opt, mod, opt = pair("attn")
    x, y = data(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain_step(ref, ref_opt, x, y)
        r = accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=4)
    assert r.micro_batches == 3
    # bf16 keeps 8 bits of mantissa; per-micro-batch rounding of the bf16 products differs from the full batch's
    for p, q in zip(ref.parameters(), mod.parameters(), strict=True):
        assert q.grad.dtype == torch.float32
        assert (p.grad - q.grad).norm() <= 2e-2 * p.grad.norm() + 1e-6


def test_bf16_parameters_without_a_grad_scaler():
    ref, ref_opt, mod, opt = pair("mlp")
    ref.to(torch.bfloat16)
    mod.to(torch.bfloat16)
    x, y = data(12)
    plain_step(ref, ref_opt, x.bfloat16(), y)
    accumulate(mod, opt, (x.bfloat16(), y), F.cross_entropy, micro_batch=5)
    for p, q in zip(ref.parameters(), mod.parameters(), strict=True):
        assert q.grad.dtype == torch.bfloat16
        assert (p.grad.float() - q.grad.float()).norm() <= 2e-2 * p.grad.float().norm() + 1e-6


def test_memfit_loader_batches_train_like_plain_steps():
    from memfit import loader
    rng = np.random.default_rng(0)
    xs, ys = rng.integers(0, 256, (50, 1, 2, 3), dtype=np.uint8), rng.integers(0, C, 50)
    ld = loader((xs, ys), 16, device="cpu", seed=0, budget="64MiB")          # 16, 16, 16, 2
    ref, ref_opt, mod, opt = pair("cnn")
    sizes = []
    for xb, yb in ld:
        plain_step(ref, ref_opt, xb.flatten(1), yb)
        sizes.append(accumulate(mod, opt, (xb.flatten(1), yb), F.cross_entropy, micro_batch=5).micro_batches)
    assert sizes == [4, 4, 4, 1]
    for p, q in zip(ref.parameters(), mod.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_demo_section_trains_under_a_small_budget_on_the_plain_curve():
    from memfit.cli.demo import train_under_budget
    from memfit.compact import CompactDataset
    rng = np.random.default_rng(0)
    ds = CompactDataset.from_arrays(rng.integers(0, 256, (100, 1, 8, 8), dtype=np.uint8), rng.integers(0, 4, 100),
                                    normalize="dataset", device="cpu")
    r = train_under_budget(ds, 4, torch.device("cpu"), seed=0, batch=48, lr=3e-3, quiet=True, steps=3)
    assert r["needs"] > r["budget"] and 1 <= r["micro_batch"] < 48 and r["micro_batches"] >= 2
    assert len(r["plain"]) == len(r["accumulated"]) == 3 and r["plain"][-1] < r["plain"][0]
    assert r["max_difference"] < 1e-5


# ---- losses whose mean is not one term per sample -------------------------------------------------------------
WEIGHTS = torch.tensor([1.0, 5.0, 0.1, 2.0, 0.7])[:C]


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(reduction="sum"),
                                     functools.partial(F.cross_entropy, reduction="sum"),
                                     nn.MSELoss(reduction="sum")], ids=["module", "partial", "mse"])
def test_a_summing_loss_gets_the_gradient_of_the_full_batchs_sum(loss_fn):
    """reduction='sum': each micro-batch's sum was weighted by its share of the samples, 85% off the full-batch
    gradient, silently. The full batch's sum is the sum of the parts' sums; the loss reported is that sum."""
    ref, ref_opt, mod, opt = pair("mlp")
    x, y = data(11)
    if isinstance(loss_fn, nn.MSELoss):
        y = torch.randn(11, C, generator=torch.Generator().manual_seed(2))
    loss = plain_step(ref, ref_opt, x, y, loss_fn)
    r = accumulate(mod, opt, (x, y), loss_fn, micro_batch=4)
    assert r.micro_batches == 3 and r.loss == pytest.approx(loss, rel=1e-5)
    assert_same_step(ref, mod)
    with pytest.raises(ValueError, match="terms= weights a loss_fn's mean.*reduction='sum'"):
        accumulate(mod, opt, (x, y), loss_fn, micro_batch=4, terms=lambda x, y: len(y))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(n=st.integers(2, 12), micro=st.integers(1, 6), ignored=st.integers(0, 4),
       how=st.sampled_from(["module", "partial", "nll"]))
def test_class_weights_and_ignored_targets_weigh_each_micro_batch_as_torchs_mean_does(n, micro, ignored, how):
    """A class-weighted cross entropy divides by the sum of the weights of the targets it counts, which differs
    between micro-batches: weighted by samples the step was 36% off, silently. Weighted by those sums (and by the
    targets not ignored), it is the full-batch step."""
    x, y = data(n, seed=n)
    y[:min(ignored, n - 1)] = 3 if how == "nll" else -100               # the first samples ignored
    loss_fn = {"module": nn.CrossEntropyLoss(weight=WEIGHTS),
               "partial": functools.partial(F.cross_entropy, weight=WEIGHTS),
               "nll": functools.partial(F.nll_loss, weight=WEIGHTS, ignore_index=3)}[how]
    ref, ref_opt, mod, opt = pair("mlp")
    if how == "nll":
        ref, mod = nn.Sequential(ref, nn.LogSoftmax(1)), nn.Sequential(mod, nn.LogSoftmax(1))
    loss = plain_step(ref, ref_opt, x, y, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # exact: nothing to warn about
        r = accumulate(mod, opt, (x, y), loss_fn, micro_batch=micro)
    assert r.loss == pytest.approx(loss, rel=1e-5)
    assert_same_step(ref, mod)


def test_a_class_weighted_mean_inside_a_lambda_is_warned_about_and_exact_with_terms():
    """A lambda (what a transformers model's output needs: out.logits) around a class-weighted cross entropy cannot
    say what its mean is over: warned about (it was silent), and terms= counting the weights gives the full batch."""
    x, y = data(10)
    lam = lambda out, t: F.cross_entropy(out, t, weight=WEIGHTS)
    ref, ref_opt, mod, opt = pair("mlp")
    loss = plain_step(ref, ref_opt, x, y, lam)
    with pytest.warns(UserWarning, match=r"class weights inside.*terms=lambda x, y: w\[y\[y != -100\]\]\.sum\(\)"):
        accumulate((m := make("mlp")), torch.optim.SGD(m.parameters(), lr=0.1), (x, y), lam, micro_batch=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = accumulate(mod, opt, (x, y), lam, micro_batch=3, terms=lambda x, t: WEIGHTS[t].sum())
        accumulate((m := make("mlp")), torch.optim.SGD(m.parameters(), lr=0.1), (x, y), lam, micro_batch=10)
        accumulate((m := make("mlp")), torch.optim.SGD(m.parameters(), lr=0.1), (x, y),
                   lambda out, t: F.cross_entropy(out, t), micro_batch=3)        # unweighted: samples are the terms
    assert r.loss == pytest.approx(loss, rel=1e-5)
    assert_same_step(ref, mod)


def _hand_loop(model, opt, x, y, loss_fn, micro: int, counts=None):
    """The reference: forward, the loss scaled by the micro-batch's share (its samples, or its `counts` of terms,
    over the batch's), backward, then one optimizer step; and the loss as a float64 running sum of each
    micro-batch's loss times its share's count, over the total (what accumulate reports)."""
    n = len(y)
    counts = counts or [1] * n
    total = sum(counts)
    opt.zero_grad(set_to_none=True)
    loss_sum = None
    for s in range(0, n, micro):
        e = min(n, s + micro)
        c = sum(counts[s:e])
        part = loss_fn(model(x[s:e]), y[s:e])
        weight = c / total
        (part if weight == 1 else part * weight).backward()
        share = part.detach().double() * c if c != 1 else part.detach().double()
        loss_sum = share if loss_sum is None else loss_sum + share
    opt.step()
    return float(loss_sum) / total


@pytest.mark.parametrize("micro", [1, 3, 4, 10])
@pytest.mark.parametrize("padded", [False, True])
def test_every_bit_of_the_step_is_the_hand_written_loops(micro, padded):
    """Loss, gradients and parameters exactly equal (not within a tolerance) to a plain micro-batch loop doing the same
    arithmetic, over three AdamW steps: what accumulate adds (the counts, a loss sum read once, checks) changes no
    bit. Padded: labels of ignored positions, weighted by the positions each micro-batch counts."""
    g = torch.Generator().manual_seed(3)
    model, ref = Tagger(), Tagger()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    loss_fn = functools.partial(F.cross_entropy, ignore_index=-100)
    loss = lambda out, y: loss_fn(out.transpose(1, 2), y)
    for _ in range(3):
        ids, y = torch.randint(0, 20, (10, 6), generator=g), torch.randint(0, C, (10, 6), generator=g)
        if padded:
            y[torch.arange(6) >= torch.randint(1, 7, (10, 1), generator=g)] = -100
        counts = (y != -100).sum(1).tolist()
        terms = lambda x, y: (y != -100).sum()
        r = accumulate(model, opt, (ids, y), loss, micro_batch=micro, terms=terms)
        assert r.loss == _hand_loop(ref, ref_opt, ids, y, loss, micro, counts)
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


class _ClassesFirst(nn.Module):
    """A Tagger whose scores are (n, C, T), as F.cross_entropy takes them with (n, T) labels."""

    def __init__(self):
        super().__init__()
        self.tagger = Tagger()

    def forward(self, ids):
        return self.tagger(ids).transpose(1, 2)


@pytest.mark.parametrize("micro", [2, 5])
def test_a_step_reads_the_device_twice_whatever_the_micro_batches(micro):
    """The labels once (which targets the loss ignores: the weighting by terms and the warning about unequal samples
    answer from one read) and the loss sum once (needed before the optimizer's step, which a loss that is not finite
    skips); none per micro-batch. Before: 3 reads a step with class labels or a lambda over token labels, and
    2 + 2 per micro-batch with padded token labels (14 at 5 micro-batches)."""
    g = torch.Generator().manual_seed(0)
    ids, tags = torch.randint(0, 20, (10, 6), generator=g), torch.randint(0, C, (10, 6), generator=g)
    padded = tags.clone()
    padded[:, 4:] = -100
    padded[0, 1:] = -100
    cases = {"class labels": (make("mlp"), data(10), F.cross_entropy),
             "padded token labels, F.cross_entropy": (_ClassesFirst(), (ids, padded), F.cross_entropy),
             "token labels, a lambda": (Tagger(), (ids, tags), token_loss)}
    for what, (model, batch, loss_fn) in cases.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        accumulate(model, opt, batch, loss_fn, micro_batch=micro)          # warm: lazy state made
        with counted_reads() as reads:
            accumulate(model, opt, batch, loss_fn, micro_batch=micro)
        assert len(reads) == 2, (what, reads)


def test_the_models_own_loss_gives_the_full_batch_step():
    """loss_fn=None: a causal LM's own loss (labels inside the batch, -100 where nothing counts, different per
    sample) in micro-batches gives the gradient and loss of one plain step of the model on the whole batch."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    ref, mod, again = tf.LlamaForCausalLM(cfg), tf.LlamaForCausalLM(cfg), tf.LlamaForCausalLM(cfg)
    mod.load_state_dict(ref.state_dict())
    again.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (5, 8), generator=g)
    labels = ids.clone()
    labels[0, 2:] = -100
    labels[3, :5] = -100
    x = {"input_ids": ids, "labels": labels}
    ref_opt, opt, again_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mod, again))
    loss = ref(**x).loss
    loss.backward()
    ref_opt.step()
    r = accumulate(mod, opt, x, micro_batch=2)             # loss_fn=None: the default
    assert r.micro_batches == 3 and r.loss == pytest.approx(loss.item(), rel=1e-6)
    assert_same_step(ref, mod)
    assert accumulate(again, again_opt, (x, None), "model", micro_batch=3).loss == pytest.approx(r.loss, rel=1e-6)
    with pytest.raises(ValueError, match="found targets y beside them"):
        accumulate(mod, opt, (x, labels), None, micro_batch=2)
    with pytest.raises(ValueError, match=r"every label in x\['labels'\] is -100 \(a causal LM's from the second"):
        accumulate(mod, opt, {"input_ids": ids, "labels": torch.where(torch.arange(8) == 0, ids, -100)}, micro_batch=2)
    with pytest.raises(ValueError, match=r"model returned CausalLMOutputWithPast .*without one"):
        accumulate(mod, opt, {"input_ids": ids}, "model", micro_batch=2)

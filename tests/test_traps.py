"""Known traps: each one broke, or nearly broke, a promise of memfit once. A test here reproduces the trap on
the smallest model that shows it and checks the promise still holds. Add a trap here when you find one.

- BatchNorm on one value per channel cannot train at batch 1 (torch refuses): the memory model fits from batch 2.
- transformers' SDPA skips an all-ones attention mask: a fake run cannot read values, so the padded batch counts;
  transformers 4.x reads the mask's values to decide (`torch.all(mask == 1)`): that check, and no other question on
  values, is answered no (the mask counts), with a warning.
- A `functools.lru_cache` or a memo dict that a fake run fills would hand fake tensors to every real forward after.
- float16 autocast needs loss scaling that accumulate cannot do around its own optimizer.step(): refused.
- A view keeps its whole storage alive: a slice is counted at its base's size.
- transformers' causal LMs shift `labels=input_ids` inside their own loss; evaluate scores positions as given:
  labels equal to the input ids of a causal LM are refused unless `shift_labels` says how to score them.
- A plan is for the model it was made on: a parameter unfrozen after `fit` adds a gradient and optimizer
  state `plan.step` never counted: refused.
- A class-weighted cross entropy's mean divides by its micro-batch's sum of weights, a reduction='sum' loss is
  no mean at all: weighted by samples, accumulate's gradient was 36% and 85% off; both are now the full batch's.
- A tuple of outputs meets a dict of targets by position: a 2-class head beside a 2-value box fits either
  order, and a dict written in the other order swapped every metric silently; now refused
  (tests/metrics/test_outputs.py).
"""
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.accumulation.run import accumulate
from memfit.memory.step import measure_step


def test_batch_norm_on_one_value_per_channel_trains_from_batch_2():
    """BatchNorm1d after a Linear cannot train on one sample (torch refuses, as in the real step): the model is
    fit from batch 2 up and says so, instead of failing on a batch of 1 the user never asked about."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    data = lambda n: (torch.randn(n, 16), torch.randint(0, 4, (n,)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # exact, not an estimate
        mm = memfit.memory_model(model, data(8)[0], train=True, optimizer=torch.optim.AdamW(model.parameters()),
                                 loss_fn=F.cross_entropy, target=data(8)[1])
    assert "batch 1 cannot train" in mm.method
    for n in (2, 5, 16):
        m = copy.deepcopy(model)
        real = measure_step(m, data(n)[0], torch.optim.AdamW(m.parameters()), F.cross_entropy, data(n)[1])
        assert 1.0 <= mm.total_bytes(n) / real <= 1.05, (n, mm.total_bytes(n), real)


def test_an_attention_mask_a_fake_run_cannot_read_counts_the_padded_batch():
    """transformers' SDPA attention skips its mask when an attention_mask is all ones; a fake run cannot read the
    values, so the mask a padded batch needs is counted: exact for a padded batch, above an unpadded one."""
    tf = pytest.importorskip("transformers")
    from memfit.memory.prediction_check import check_prediction
    tf.logging.set_verbosity_error()
    cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters())

    def mask(n, padded):
        m = torch.ones(n, 64, dtype=torch.long)
        if padded:
            m[::2, -8:] = 0
        return m
    loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    for padded in (True, False):
        rows = check_prediction(model, lambda n, padded=padded: {"input_ids": torch.randint(0, 256, (n, 64)),
                                                  "attention_mask": mask(n, padded)},
                                (8,), optimizer=opt, loss_fn=loss, target_at=lambda n: torch.randint(0, 256, (n, 64)))
        ratio = rows[0]["ratio"]
        assert (1.0 <= ratio <= 1.001) if padded else (1.02 <= ratio <= 1.1), (padded, ratio)


# transformers 4.57's `_prepare_4d_attention_mask_for_sdpa` (modeling_attn_mask_utils.py), its check verbatim, in a
# module of that name: the environment may have transformers 5, which no longer reads the mask's values
_MASK_UTILS = {"__name__": "transformers.modeling_attn_mask_utils", "torch": torch}
exec(compile("""
def _prepare_4d_attention_mask_for_sdpa(mask, dtype, tgt_len=None):
    _, key_value_length = mask.shape
    tgt_len = tgt_len if tgt_len is not None else key_value_length
    if torch.all(mask == 1):
        return None
    expanded = mask[:, None, None, :].expand(mask.shape[0], 1, tgt_len, key_value_length).to(dtype)
    inverted = 1.0 - expanded
    return inverted.masked_fill(inverted.to(torch.bool), torch.finfo(dtype).min)
""", "modeling_attn_mask_utils.py", "exec"), _MASK_UTILS)


class SdpaWithMask(nn.Module):
    """Attention with a padding mask made as transformers 4.x makes it for SDPA."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 4)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        bias = _MASK_UTILS["_prepare_4d_attention_mask_for_sdpa"](mask, x.dtype)
        att = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=bias)
        return self.out(att[:, 0].mean(1))


class BranchesOnValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x, mask):
        return self.lin(x).mean(1) if torch.all(mask == 1) else x.mean(1)


def test_transformers_4s_all_ones_mask_check_is_answered_no_and_any_other_question_refused():
    """transformers 4.x's SDPA path reads the attention mask's values (`torch.all(mask == 1)`) to skip an all-ones
    one: every memory model with an attention_mask failed on fake tensors (DataDependentOutputException). That
    check is answered no, the mask counted, with a warning naming it: exact for a padded batch, above an unpadded
    one. The same question asked by any other code stays refused: its branches could differ either way."""
    from memfit.memory import storage_log
    from memfit.memory.prediction_check import check_prediction
    torch.manual_seed(0)
    model = SdpaWithMask()
    opt = torch.optim.AdamW(model.parameters())

    def batch(n, padded):
        mask = torch.ones(n, 48, dtype=torch.long)
        if padded:
            mask[::2, -8:] = 0
        return (torch.randn(n, 48, 32), mask)
    for padded in (True, False):
        storage_log._WARNED.clear()                          # warned once per process per line of transformers
        with pytest.warns(UserWarning, match=r"_prepare_4d_attention_mask_for_sdpa asks if the attention mask is "
                                             "all ones; values unknown, answered no"):
            rows = check_prediction(model, lambda n, padded=padded: batch(n, padded), (8,), optimizer=opt,
                                    loss_fn=F.cross_entropy, target_at=lambda n: torch.randint(0, 4, (n,)))
        ratio = rows[0]["ratio"]
        assert (1.0 <= ratio <= 1.001) if padded else ratio > 1.01, (padded, ratio)
    with pytest.raises(memfit.errors.FakeRunError, match="data-dependent Python control flow"):
        memfit.memory_model(BranchesOnValues(), batch(2, True), train=True, loss_fn=F.mse_loss,
                            target=torch.zeros(2, 32))


@functools.lru_cache(maxsize=4)
def position_table(k: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.float32)


class CachedPositions(nn.Module):
    """Adds a table from a function cache, as transformers' BEiT does with its relative position index."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 12)

    def forward(self, x):
        return self.proj(x + position_table(x.shape[-1]))


class Memoised(CachedPositions):
    """The same table from a dict memo and from a cache made per instance."""

    def __init__(self):
        super().__init__()
        self.memo = {}
        self.table = functools.lru_cache(maxsize=4)(lambda k: torch.arange(k, dtype=torch.float32))

    def forward(self, x):
        k = x.shape[-1]
        if k not in self.memo:
            self.memo[k] = torch.arange(k, dtype=torch.float32)
        return self.proj(x + self.memo[k] + self.table(k) - position_table(k))


@pytest.mark.parametrize("make", [CachedPositions, Memoised])
def test_a_fake_run_leaves_no_fake_tensor_in_a_cache_the_model_uses(make):
    position_table.cache_clear()
    model = make()
    memfit.memory_model(model, (12,), train=True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    memfit.memory_model(model, (12,))
    out = model(torch.zeros(2, 12))                    # the real forward after: real tensors throughout
    assert type(out) is torch.Tensor and type(position_table(12)) is torch.Tensor
    torch.testing.assert_close(out, model.proj(torch.arange(12.0).expand(2, 12)))


def test_float16_autocast_is_refused_before_any_gradient():
    """float16 needs loss scaling, which accumulate cannot do around its own optimizer.step(): refuse,
    leaving the model untouched, rather than let small gradients flush to zero."""
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(mod.parameters(), lr=0.1)
    before = [p.detach().clone() for p in mod.parameters()]
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="float16 autocast.*bfloat16"):
        accumulate(mod, opt, (x, y), F.cross_entropy, micro_batch=2)
    assert all(torch.equal(a, p) and p.grad is None for a, p in zip(before, mod.parameters(), strict=True))


def test_held_bytes_of_a_view_counts_its_whole_storage():
    from memfit.device.measure import held_bytes
    m = torch.nn.Module()
    base = torch.zeros(100)
    m.register_buffer("head", base[:10])           # a view holds its whole storage alive
    m.register_buffer("tail", base[90:])
    assert held_bytes(m) == base.nbytes


def test_a_causal_lms_labels_given_the_transformers_way_are_refused_or_shifted_as_its_own_loss_does():
    """GPT-2 (any *ForCausalLM) evaluated the transformers way, labels=input_ids: its own loss shifts them, evaluate
    scored them as given (perplexity 34.4 against the model's 50.2, silently). Refused; shift_labels=True is the
    model's own loss."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=50, n_positions=12, n_embd=16, n_layer=1, n_head=2)).eval()
    ids = torch.randint(0, 50, (6, 12))
    with pytest.raises(ValueError, match="labels equal the input ids"):
        memfit.evaluate(model, ({"input_ids": ids}, ids), metrics=("perplexity",), progress=False)
    res = memfit.evaluate(model, ({"input_ids": ids}, ids), metrics=("loss",), shift_labels=True, progress=False)
    with torch.no_grad():
        assert res["loss"] == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-5)


def test_a_parameter_unfrozen_after_fit_is_refused_by_plan_step():
    """Fine-tuning that unfreezes a layer after memfit.fit: the step ran with the new gradient and optimizer state,
    above the plan's bytes, silently. plan.step now refuses and names the parameter."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters())
    batch = (torch.randn(16, 8), torch.randn(16, 8))
    plan = memfit.fit(model, opt, batch, F.mse_loss, "1GiB")
    plan.step(batch)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="parameter '0.weight' now requires grad.*call memfit.fit again"):
        plan.step(batch)


@pytest.mark.parametrize("loss_fn", [nn.CrossEntropyLoss(weight=torch.tensor([1.0, 5.0, 0.1])),
                                     nn.CrossEntropyLoss(reduction="sum")], ids=["class-weights", "sum"])
def test_accumulate_with_a_loss_that_is_not_a_mean_over_samples_is_the_full_batch_step(loss_fn):
    """CrossEntropyLoss(weight=...) divides by the weights of the targets in its batch and reduction='sum' does not
    divide: micro-batches weighted by their share of the samples gave another gradient (36%, 85% off), silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 4), torch.tensor([0, 1, 1, 2, 0, 2, 1, 1, 1, 0])
    loss_fn(ref(x), y).backward()
    accumulate(model, torch.optim.SGD(model.parameters(), lr=0.0), (x, y), loss_fn, micro_batch=3)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)

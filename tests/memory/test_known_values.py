"""The values a fake run knows (`memfit.memory.known_values`): a question on values the program made from no input
is answered as the real run answers it, one on anything else stays a question; transformers' causal LMs without an
attention mask are predicted as their real steps, against the allocator's bytes (`measure_step`)."""
import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.device.torch_private import DataDependentOutputException
from memfit.memory.known_values import KnownValues
from memfit.memory.step import measure_step
from memfit.memory.storage_log import LoggingFakeMode, StorageLog

NO_VALUES = "memfit's memory model runs on tensors without values"


class PositionsChecked(nn.Module):
    """Checks the positions it makes as transformers 5.x's `find_packed_sequence_indices` does: unpacked (one
    sequence per row), a plain linear layer; packed, a (batch, seq, seq) mask besides, kept for backward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):                                      # x: (batch, seq, 16)
        pos = (torch.arange(x.shape[1]) + 0).unsqueeze(0).expand(x.shape[0], -1)      # (batch, seq)
        first = pos[:, :1] - 1
        packed = (torch.diff(pos, prepend=first, dim=-1) != 1).cumsum(-1)
        h = self.lin(x)
        if not (packed[:, -1] == 0).all():
            h = h * torch.ones(x.shape[0], x.shape[1], x.shape[1]).tril().sum(-1, keepdim=True)
        return h * (pos[0, -1].item() + 1)


def test_a_question_on_values_made_from_no_input_is_answered_as_the_real_run_answers_it():
    """Predicted as the allocator's bytes of the real step (which never builds the packed branch's mask), and no
    question left for `_mask_check_answered_no` (no warning, no error)."""
    torch.manual_seed(0)
    model = PositionsChecked()
    x, y = torch.randn(6, 24, 16), torch.randn(6, 24, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm = memfit.memory_model(model, x[:2], train=True, optimizer=torch.optim.AdamW(model.parameters()),
                                 loss_fn=F.mse_loss, target=y[:2])
    m = copy.deepcopy(model)
    real = measure_step(m, x, torch.optim.AdamW(m.parameters()), F.mse_loss, y)
    assert 0 <= mm.total_bytes(6) - real <= 64, (mm.total_bytes(6), real)      # the packed branch: 13.5 KiB more


def _logged(fn):
    """fn() run under a logging fake mode, as a fake run runs an op, with what it returns."""
    mode = LoggingFakeMode()
    with mode, mode.logging_to(StorageLog(torch.device("cpu"))):
        return fn(mode)


def test_values_from_the_batch_a_random_op_or_a_stale_write_are_not_known():
    """Each of these would be answered wrongly by a shadow kept too widely: a value from the batch, a random draw,
    a position overwritten in place from the batch (the real answer flips: the stale shadow still says all
    positions are 0..5), a tensor beyond the size cap. Reading one stays a question without an answer."""
    def user(mode):                                            # two values of the batch
        return mode.from_tensor(torch.tensor([7, 7]))

    def written(mode, by):                                     # positions 2 and 3 moved by `by` in place
        pos = torch.arange(6)
        pos[2:4].add_(by)
        return bool((pos == torch.arange(6)).all())

    questions = {
        "from the batch": lambda mode: bool(((torch.arange(2) + user(mode)) > 0).all()),
        "random": lambda mode: bool((torch.randint_like(torch.arange(4), 3) < 3).all()),
        "written from the batch": lambda mode: written(mode, user(mode)),
        "over the cap": lambda mode: bool((torch.arange(KnownValues.MAX_ELEMENTS + 1) >= 0).all()),
    }
    for what, question in questions.items():
        with pytest.raises(DataDependentOutputException):
            _logged(question)
            pytest.fail(what)
    # the same questions on values it knows: answered, and as torch answers them on real tensors
    assert _logged(lambda mode: bool((torch.arange(KnownValues.MAX_ELEMENTS) >= 0).all())) is True
    assert _logged(lambda mode: written(mode, torch.full((2,), 7))) is written(None, torch.full((2,), 7)) is False
    assert _logged(lambda mode: (torch.arange(5) * 3).cumsum(0)[-1].item()) == (torch.arange(5) * 3).sum().item()


# transformers: causal LMs and BERT from small configs (random weights, nothing downloaded)
S, V = 32, 128


def _lm(name):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=S, use_cache=False)
        return tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    cfg = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=2, n_positions=S, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False)
    return tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()


def _predicted_and_real(model, batch, target, loss):
    """(predicted bytes of the step at the batch's size, the allocator's bytes of the real step, the warnings)."""
    n = len(target)
    opt = torch.optim.AdamW(model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mm = memfit.memory_model(model, {k: v[:2] for k, v in batch.items()}, train=True, optimizer=opt,
                                 loss_fn=loss, target=target[:2])
    m, o = copy.deepcopy((model, opt))
    return mm.total_bytes(n), measure_step(m, batch, o, loss, target), [str(w.message) for w in caught]


def _lm_loss(out, y):
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_causal_lm_without_an_attention_mask_is_predicted_as_its_real_step(name):
    """transformers 5.x took fake tensors for traced and built the causal mask the real eager step never builds:
    predicted 4*S^2 bytes per sample per layer over (16 KiB here). Its own positions are known: exact now."""
    ids, target = torch.randint(0, V, (8, S)), torch.randint(0, V, (8, S))
    predicted, real, warned = _predicted_and_real(_lm(name), {"input_ids": ids}, target, _lm_loss)
    assert 0 <= predicted - real <= 100, (predicted, real)
    assert not [w for w in warned if NO_VALUES in w]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_padded_batch_or_the_users_position_ids_keep_the_mask(name):
    """The batch's own values are never read: a padded attention mask is exact (the mask is needed); position ids
    the user gives count the mask too, exact where packed, above the real step where not, with a warning."""
    ids, target = torch.randint(0, V, (8, S)), torch.randint(0, V, (8, S))
    mask = torch.ones(8, S, dtype=torch.long)
    mask[::2, -5:] = 0
    predicted, real, warned = _predicted_and_real(_lm(name), {"input_ids": ids, "attention_mask": mask}, target,
                                                  _lm_loss)
    assert 0 <= predicted - real <= 100, (predicted, real)
    assert any("asked whether the attention mask leaves every position in: answered no" in w for w in warned)
    if name != "llama":
        return
    # 5.x reads the positions' values; 4.57 always builds the packed sequences' mask, 4.46 never packs
    reads = hasattr(sys.modules.get("transformers.masking_utils"), "is_tracing")
    for packed in (True, False):
        pos = torch.arange(S).repeat(8, 1)
        if packed:
            pos[:, S // 2:] -= S // 2                            # two sequences in each row
        predicted, real, warned = _predicted_and_real(_lm(name), {"input_ids": ids, "position_ids": pos}, target,
                                                      _lm_loss)
        exact = packed or not reads                              # the real step builds the mask too
        assert (0 <= predicted - real <= 100) if exact else predicted - real >= 4 * S * S * 8, (packed, predicted,
                                                                                                 real)
        assert not reads or any("find_packed_sequence_indices asked whether the position ids hold one sequence "
                                "per row" in w for w in warned)


def test_bert_with_an_all_ones_attention_mask_counts_the_mask():
    """An attention mask is the user's batch: the plan must hold for later padded batches, so even an all-ones one
    counts (above the real step, which skips it), with a warning."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=S, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = tf.BertForSequenceClassification._from_config(cfg, attn_implementation="sdpa").train()
    batch = {"input_ids": torch.randint(0, V, (8, S)), "attention_mask": torch.ones(8, S, dtype=torch.long)}
    predicted, real, warned = _predicted_and_real(model, batch, torch.randint(0, 3, (8,)),
                                                  lambda out, y: F.cross_entropy(out.logits, y))
    assert predicted > real, (predicted, real)
    assert any("asked whether the attention mask leaves every position in: answered no" in w for w in warned)


def test_transformers_takes_fakes_for_untraced_in_the_predicting_thread_only():
    """Inside, masking_utils' is_tracing says no for a fake tensor in this thread; another thread meanwhile, and
    every thread afterwards, gets transformers' own function (which takes a fake tensor for traced)."""
    pytest.importorskip("transformers")
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "is_tracing"):
        pytest.skip("transformers 4.x decides without is_tracing")
    import threading

    from memfit.device.torch_private import FakeTensorMode
    from memfit.memory.known_values import transformers_reads_values
    original = mu.is_tracing
    fake = FakeTensorMode().from_tensor(torch.zeros(2))
    other = []
    with transformers_reads_values():
        inside = mu.is_tracing(fake)
        t = threading.Thread(target=lambda: other.append(mu.is_tracing(fake)))
        t.start()
        t.join()
    assert (inside, other, mu.is_tracing(fake)) == (False, [True], True)
    assert mu.is_tracing is original

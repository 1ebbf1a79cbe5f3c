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
from memfit.errors import FakeRunError
from memfit.memory import storage_log
from memfit.memory.known_values import DataDependentOnBatchSize, KnownValues
from memfit.memory.step import measure_step
from memfit.memory.storage_log import LoggingFakeMode, StorageLog

NO_VALUES = "values unknown, answered no"


@pytest.fixture(autouse=True)
def _warned_afresh(monkeypatch):
    """Each test sees the warnings its own predictions give (they are given once per process per line)."""
    monkeypatch.setattr(storage_log, "_WARNED", set())


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
    question left for `mask_check_answered_no` (no warning, no error)."""
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
    positions are 0..5), a tensor beyond the size cap, one moved onto the batch's storage (`set_`, or `.data =`,
    which dispatches no op), one whose values were never set (`empty_like`). Reading one stays a question without
    an answer."""
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
        "moved onto the batch by set_": lambda mode: moved(mode, lambda pos, u: pos.set_(u)),
        "moved onto the batch by .data =": lambda mode: moved(mode, lambda pos, u: setattr(pos, "data", u)),
        "never set": lambda mode: bool((torch.empty_like(torch.arange(4)) >= 0).all()),
    }

    def moved(mode, move):                                     # positions 0..3 put on the batch's 7, 7, 7, 7
        pos = torch.arange(4)
        move(pos, mode.from_tensor(torch.full((4,), 7)))
        return bool((pos == torch.arange(4)).all())
    for what, question in questions.items():
        with pytest.raises(DataDependentOutputException):
            _logged(question)
            pytest.fail(what)
    # the same questions on values it knows: answered, and as torch answers them on real tensors
    assert _logged(lambda mode: bool((torch.arange(KnownValues.MAX_ELEMENTS) >= 0).all())) is True
    assert _logged(lambda mode: written(mode, torch.full((2,), 7))) is written(None, torch.full((2,), 7)) is False
    assert _logged(lambda mode: (torch.arange(5) * 3).cumsum(0)[-1].item()) == (torch.arange(5) * 3).sum().item()


# transformers: causal LMs and BERT from small configs (random weights, nothing downloaded), one layer each: the
# questions are asked once per forward and the mask's bytes checked here are per layer (4*S^2 per sample), so one
# layer checks all of it in ~half the ops (and fake-run time) of two
S, V = 32, 128


def _lm(name):
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "llama":
        cfg = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=S, use_cache=False)
        return tf.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").train()
    cfg = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2, n_positions=S, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, use_cache=False)
    return tf.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa").train()


def _predicted_and_real(model, batch, target, loss):
    """(predicted bytes of the step at the batch's size, the allocator's bytes of the real step, the warnings)."""
    n = len(target)
    opt = torch.optim.AdamW(model.parameters())
    storage_log._WARNED.clear()                                # this prediction's warnings, each given once
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
    predicted 4*S^2 bytes per sample per layer over (32 KiB at batch 8 here). Its own positions are known: exact now."""
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
    assert any("asks if the attention mask is all ones; values unknown, answered no" in w for w in warned)
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
        assert not reads or any("find_packed_sequence_indices asks if the position ids are packed" in w
                                               for w in warned)


def test_bert_with_an_all_ones_attention_mask_counts_the_mask():
    """An attention mask is the user's batch: the plan must hold for later padded batches, so even an all-ones one
    counts (above the real step, which skips it), with a warning."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=S, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = tf.BertForSequenceClassification._from_config(cfg, attn_implementation="sdpa").train()
    batch = {"input_ids": torch.randint(0, V, (8, S)), "attention_mask": torch.ones(8, S, dtype=torch.long)}
    predicted, real, warned = _predicted_and_real(model, batch, torch.randint(0, 3, (8,)),
                                                  lambda out, y: F.cross_entropy(out.logits, y))
    assert predicted > real, (predicted, real)
    assert any("asks if the attention mask is all ones; values unknown, answered no" in w for w in warned)


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


class BigBatchesDoMore(nn.Module):
    """Asks a question whose answer the batch size decides: True up to batch 4 (every size a memory model runs),
    False above, where the real step keeps twice the activations."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        if (torch.arange(x.shape[0]) < 4).all():
            return self.a(x)
        return self.b(self.a(x).relu()).relu() * 2


def test_a_value_made_from_the_batch_size_is_not_answered():
    """Answered at the sizes run (True) and extrapolated, it predicted 0.81x the real step at 64: refused now,
    saying so. The values a run makes alike at every size (`PositionsChecked`'s positions, expanded to the batch)
    stay answered: the test above."""
    model = BigBatchesDoMore()
    for parallel in ({}, {"parallel": "fsdp", "world_size": 2}):
        with pytest.raises((memfit.errors.FakeRunError, DataDependentOnBatchSize), match="depends on the batch size"):
            memfit.memory_model(model, torch.randn(2, 32), train=True, optimizer=torch.optim.SGD(model.parameters()),
                                loss_fn=F.mse_loss, target=torch.randn(2, 32), **parallel)


class OwnMask(nn.Module):
    """A causal LM behind a wrapper that makes an all-ones attention mask from the batch's shape (as LED and
    ProphetNet do inside transformers): the mask's sum, read by transformers, is made otherwise at each batch size."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, attention_mask=torch.ones(ids.shape, dtype=torch.long))


def test_a_mask_made_from_the_batch_shape_is_predicted_as_before_values_were_read():
    """Its read was refused ("depends on the batch size") where it used to predict: the runs are made again
    without reading any value, and the mask counts, as before (over the real step, never under)."""
    ids, target = torch.randint(0, V, (8, S)), torch.randint(0, V, (8, S))
    predicted, real, _ = _predicted_and_real(OwnMask(_lm("llama")), {"ids": ids}, target, _lm_loss)
    assert real <= predicted <= 1.05 * real, (predicted, real)
    # per FSDP2 rank too: refused before ("depends on the batch size"), its runs made again without reading values
    model = OwnMask(_lm("llama"))
    ranked = memfit.memory_model(model, {"ids": ids[:2]}, train=True, optimizer=torch.optim.AdamW(model.parameters()),
                                 loss_fn=_lm_loss, target=target[:2], parallel="fsdp", world_size=2)
    assert "values not read" in ranked.method and ranked.total_bytes(8) > 0


class CountsExpanded(nn.Module):
    """Its own positions, expanded to the batch (alike in every run), then counted: the count is the batch's, so
    the question's answer turns at batch 3 although the value is made alike at every size."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        if (torch.ones(8, dtype=torch.long).expand(x.shape[0], -1).sum() < 24).item():
            return self.a(x)
        return self.b(self.a(x).relu()).relu() * 2


def test_a_value_made_alike_that_answers_otherwise_at_another_size_is_not_answered():
    """Answered from each run's own values, the run at batch 2 took one branch and the run at 4 the other, and the
    memory model's line through them mixed the two; refused now, as any answer the batch size decides."""
    model = CountsExpanded()
    with pytest.raises((memfit.errors.FakeRunError, DataDependentOnBatchSize), match="depends on the batch size"):
        memfit.memory_model(model, torch.randn(2, 32), train=True, optimizer=torch.optim.SGD(model.parameters()),
                            loss_fn=F.mse_loss, target=torch.randn(2, 32))


class TrimsPadding(nn.Module):
    """Reads the batch: its longest unpadded row decides the shapes."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, x):                                      # x: (batch, 2, seq) int: ids and attention mask
        longest = int(x[:, 1].sum(-1).max().item())
        return self.out(self.emb(x[:, 0, :max(longest, 1)])).mean(1)


def test_the_batch_is_never_known_under_fsdp_either():
    """FSDP's run builds the batch (as zeros) inside its logged step: it was known as zeros, and the longest row
    answered 0 (a prediction made silently from it). Refused as on the plain path."""
    model = TrimsPadding()
    x = torch.stack([torch.randint(1, 16, (2, 8)), torch.ones(2, 8, dtype=torch.long)], 1)
    for parallel in ({}, {"parallel": "fsdp", "world_size": 2}):
        with pytest.raises((memfit.errors.FakeRunError, DataDependentOutputException)):
            memfit.memory_model(model, x, train=True, optimizer=torch.optim.SGD(model.parameters()),
                                loss_fn=F.cross_entropy, target=torch.zeros(2, dtype=torch.long), **parallel)


def test_a_compiled_causal_lm_counts_the_mask_dynamo_builds():
    """Under dynamo transformers 5 takes every tensor for traced and builds the causal mask, so a `torch.compile`d
    model's step holds it (Llama, seq 1024, batch 4: 36.1 MB real, 24.2 MB predicted as the eager module): its
    questions are left unasked, the mask counts, 4*S^2 bytes per sample and layer above the eager prediction."""
    mu = pytest.importorskip("transformers.masking_utils")
    if not hasattr(mu, "is_tracing"):
        pytest.skip("transformers 4.x decides without is_tracing")
    model = _lm("llama")
    ids = torch.randint(0, V, (2, S))
    predicted = {}
    for compiled in (False, True):
        mm = memfit.memory_model(torch.compile(model) if compiled else model, {"input_ids": ids}, train=True,
                                 loss_fn=_lm_loss, target=ids)
        predicted[compiled] = mm.total_bytes(8)
    assert predicted[True] - predicted[False] >= 4 * S * S * 8, predicted


def test_a_mask_question_is_warned_of_once_per_process_per_line():
    """Each run of each prediction asks: the warning was given 4 times per memory model (Llama with an all-ones
    mask), again on every call. Now once per line of transformers: none on the second call."""
    model = _lm("llama")
    batch = {"input_ids": torch.randint(0, V, (2, S)), "attention_mask": torch.ones(2, S, dtype=torch.long)}
    counts = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            memfit.memory_model(model, batch, train=True, loss_fn=_lm_loss, target=batch["input_ids"])
        counts.append([(w.filename, w.lineno) for w in caught if NO_VALUES in str(w.message)])
    assert counts[0] and len(set(counts[0])) == len(counts[0]) and counts[1] == [], counts


class LayerDrop(nn.Module):
    """transformers 4.x's LayerDrop as BART, Whisper and wav2vec2 run it in training: a draw in [0, 1) compared with
    the layerdrop, whatever it is (5.x draws only where it is above 0)."""

    def __init__(self, layerdrop):
        super().__init__()
        self.layers, self.layerdrop = nn.ModuleList(nn.Linear(16, 16) for _ in range(3)), layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:      # skip the layer
                    continue
            x = torch.relu(layer(x))
        return x


def test_a_draw_compared_with_a_bound_outside_its_range_is_answered_as_every_draw_answers_it():
    """At layerdrop 0 no draw in [0, 1) skips a layer: the memory model and fit's op counting answer so (under
    transformers 4.46 both raised FakeRunError on BART, Whisper and wav2vec2 in training), and the prediction is the
    allocator's bytes; at layerdrop 0.5 the draw decides, and stays a question without an answer."""
    torch.manual_seed(0)
    model = LayerDrop(0.0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    mm = memfit.memory_model(model, x[:2], train=True, optimizer=torch.optim.AdamW(model.parameters()),
                             loss_fn=F.mse_loss, target=y[:2])
    m = copy.deepcopy(model)
    real = measure_step(m, x, torch.optim.AdamW(m.parameters()), F.mse_loss, y)
    assert 0 <= mm.total_bytes(8) - real <= 64, (mm.total_bytes(8), real)
    plan = memfit.fit(model, torch.optim.AdamW(model.parameters()), (x, y), F.mse_loss, "1GiB")   # op counting too
    assert plan.micro_batch >= 1
    with pytest.raises(FakeRunError, match="control flow"):
        memfit.memory_model(LayerDrop(0.5), x[:2], train=True, optimizer=None, loss_fn=F.mse_loss, target=y[:2])


class DrawWritten(nn.Module):
    """A draw in [0, 1) written in place before it is compared with 1 (`write`: into [1, 2), or 3): the real run always
    takes the wide branch (64x the activations), which a draw left as drawn never would."""

    def __init__(self, write):
        super().__init__()
        self.lin, self.up, self.down, self.write = nn.Linear(16, 16), nn.Linear(16, 1024), nn.Linear(1024, 16), write

    def forward(self, x):
        r = torch.rand([])
        self.write(r)
        h = self.lin(x)
        if r >= 1:
            h = h + self.down(torch.relu(self.up(h)))
        return h


@pytest.mark.parametrize("write", [lambda r: r.add_(1), lambda r: r.view(1).add_(1), lambda r: r.fill_(3.0),
                                   lambda r: r.copy_(torch.tensor(3.0)), lambda r: setattr(r, "data", r + 1)],
                         ids=["add_", "through a view", "fill_", "copy_", ".data ="])
def test_a_draw_written_since_it_was_drawn_is_not_known_to_be_in_its_range(write):
    """Once written (in place, through a view, or moved by `.data =`), a draw's range is not [0, 1): comparing it with
    1 stays a question (answered 'r >= 1 is False', the prediction left out the branch every real step takes:
    with SGD at batch 8, 0.52x the allocator's bytes of the real step)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    model = DrawWritten(write)
    real = measure_step(copy.deepcopy(model), x, torch.optim.SGD(model.parameters()), F.mse_loss, y)
    plain = measure_step(copy.deepcopy(model).lin, x, torch.optim.SGD(model.lin.parameters()), F.mse_loss, y)
    assert real > plain + 8 * 1024 * 4          # the wide branch runs for real
    with pytest.raises(FakeRunError, match="control flow"):
        memfit.memory_model(model, x[:2], train=True, optimizer=None, loss_fn=F.mse_loss, target=y[:2])

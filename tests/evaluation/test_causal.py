"""evaluate on `transformers` causal LMs against the model's own `outputs.loss`: labels given the transformers way
(labels=input_ids, shifted inside the model's loss) are refused unless shift_labels says how to score them;
shift_labels=True gives the model's own loss and perplexity over any chunking."""
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import memfit
from memfit.evaluation.causal import is_causal_lm, shifted

tf = pytest.importorskip("transformers")
N, T, V = 21, 10, 60


def gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=1, n_head=2))


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=T))


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = (torch.arange(T) < torch.randint(3, T + 1, (N, 1), generator=g)).long()      # right padding
    labels = ids.masked_fill(mask == 0, -100)                                            # the transformers way
    return ids, mask, labels


@pytest.fixture(autouse=True, scope="module")
def quiet():
    from memfit.testing.zoo import quiet_transformers
    quiet_transformers()


@pytest.mark.parametrize("build", [gpt2, llama])
def test_shift_labels_gives_the_models_own_loss_and_perplexity(build):
    torch.manual_seed(0)
    model = build().eval()
    ids, mask, labels = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)        # the whole set as one batch
    logits, target = out.logits[:, :-1], labels[:, 1:]
    counted = target != -100
    accuracy = float((logits.argmax(-1) == target)[counted].double().mean())
    data = ({"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, labels.numpy())
    res = memfit.evaluate(model, data, metrics=("loss", "perplexity", "accuracy"), shift_labels=True, chunk_size=4,
                          progress=False)
    assert res["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(out.loss.item()), rel=1e-5)
    assert res["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    # a loss_fn averaging over the tokens that count, weighted by terms=, sees the shifted labels too
    token_mean = lambda lg, y: F.cross_entropy(lg.transpose(1, 2), y)
    res = memfit.evaluate(model, data, metrics=("loss",), loss_fn=token_mean, loss_reduction="mean",
                          terms=lambda x, y: (y != -100).sum(), shift_labels=True, chunk_size=5, progress=False)
    assert res["loss"] == pytest.approx(out.loss.item(), rel=1e-5)


def test_labels_equal_to_the_input_ids_of_a_causal_lm_are_refused_and_the_options_say_how_to_score():
    torch.manual_seed(0)
    model = gpt2().eval()
    ids, mask, labels = batch()
    with torch.no_grad():
        own = model(input_ids=ids, labels=ids).loss.item()
        logits = model(input_ids=ids).logits
    as_given = F.cross_entropy(logits.transpose(1, 2), ids).item()
    assert abs(math.exp(as_given) - math.exp(own)) > 1      # the silent difference it was: another perplexity
    for data in [({"input_ids": ids.numpy()}, ids.numpy()), (ids.numpy(), ids.numpy()),
                 ({"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, labels.numpy()),
                 memfit.loader((ids.numpy(), ids.numpy()), 8, shuffle=False)]:
        with pytest.raises(ValueError, match="labels equal the input ids.*GPT2LMHeadModel is a causal LM.*"
                                             "shift_labels=True.*shift_labels=False"):
            memfit.evaluate(model, data, metrics=("perplexity",), progress=False)
    data = (ids.numpy(), ids.numpy())
    res = memfit.evaluate(model, data, metrics=("loss",), shift_labels=True, chunk_size=8, progress=False)
    assert res["loss"] == pytest.approx(own, rel=1e-5)
    res = memfit.evaluate(model, data, metrics=("loss",), shift_labels=False, chunk_size=8, progress=False)
    assert res["loss"] == pytest.approx(as_given, rel=1e-5)
    # labels shifted by hand (the README's recipe) pass without the option: the model's own loss on them
    by_hand = shifted(labels, -100)
    res = memfit.evaluate(model, ({"input_ids": ids.numpy(), "attention_mask": mask.numpy()}, by_hand.numpy()),
                          metrics=("loss",), chunk_size=8, progress=False)
    with torch.no_grad():
        assert res["loss"] == pytest.approx(model(input_ids=ids, attention_mask=mask, labels=labels).loss.item(),
                                            rel=1e-5)


def test_only_causal_lms_are_checked():
    assert is_causal_lm(gpt2()) and is_causal_lm(llama())
    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=64, max_position_embeddings=T)).eval()
    plain = torch.nn.Sequential(torch.nn.Embedding(V, 8), torch.nn.Linear(8, V))
    assert not is_causal_lm(bert) and not is_causal_lm(plain)
    ids = np.random.default_rng(0).integers(0, V, (8, T))
    for model in (bert, plain):              # labels at the same position are what their losses score
        memfit.evaluate(model, (ids, ids), metrics=("loss",), progress=False)
    with pytest.raises(TypeError, match="shift_labels must be True, False or None"):
        memfit.evaluate(plain, (ids, ids), shift_labels="yes", progress=False)
    with pytest.raises(ValueError, match="shift_labels=True shifts token labels"):
        memfit.evaluate(plain, (ids, ids[:, 0]), shift_labels=True, progress=False)


@pytest.mark.parametrize("build", [gpt2, llama])
def test_the_models_own_loss_over_chunks_is_its_loss_on_the_whole_set(build):
    """loss_fn="model": labels inside the inputs, the model's own out.loss per chunk weighted by its counted labels
    (shifted) gives the whole set's own loss; the other metrics read the same labels, shifted. loss_fn=None does the
    same on data without targets; a loader of dicts works too."""
    torch.manual_seed(0)
    model = build().eval()
    ids, mask, labels = batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    logits, target = out.logits[:, :-1], labels[:, 1:]
    accuracy = float((logits.argmax(-1) == target)[target != -100].double().mean())
    x = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "labels": labels.numpy()}
    res = memfit.evaluate(model, (x, None), loss_fn="model", metrics=("loss", "perplexity", "accuracy"),
                          chunk_size=4, progress=False)
    assert res["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(out.loss.item()), rel=1e-5)
    assert res["accuracy"] == pytest.approx(accuracy, abs=1e-12)
    by_samples = np.mean([model(input_ids=ids[s:s + 4], attention_mask=mask[s:s + 4], labels=labels[s:s + 4]).loss
                          .item() for s in range(0, N, 4)])
    assert abs(by_samples - out.loss.item()) > 1e-3          # chunks weighted equally would be off
    res = memfit.evaluate(model, (x, None), chunk_size=5, progress=False)       # loss_fn=None, no targets
    assert list(res.metrics) == ["loss"] and res["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    loader = [{"input_ids": ids[s:s + 6], "attention_mask": mask[s:s + 6], "labels": labels[s:s + 6]}
              for s in range(0, N, 6)]
    res = memfit.evaluate(model, loader, loss_fn="model", progress=False)
    assert res["loss"] == pytest.approx(out.loss.item(), rel=1e-5) and res.n == N
    # a loader's dict batches with loss_fn=None: the default metrics have no targets; the fix is named (it said
    # 'accuracy needs targets; the data has none (give y, or use metrics that need none)')
    with pytest.raises(ValueError, match=r"labels inside the inputs \(x\['labels'\].*the metrics accuracy, loss have "
                                         r"none to score against. Fix: loss_fn='model'"):
        memfit.evaluate(model, loader, progress=False)

"""memfit.own_loss: the model's own loss (out.loss) and the labels it is a mean over, against transformers' own
losses computed on the whole batch (a causal LM's shift, -100, an encoder's unshifted labels)."""
import pytest
import torch

from memfit.own_loss import is_causal_lm, is_own, label_terms, model_loss, own_batch

tf = pytest.importorskip("transformers")
V = 64


def llama():
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=16))


def bert_mlm():
    torch.manual_seed(0)
    return tf.BertForMaskedLM(tf.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                            intermediate_size=32, max_position_embeddings=16))


def labels_with_holes():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (4, 8), generator=g)
    labels = ids.clone()
    labels[0, 3:] = -100
    labels[2, :6] = -100
    return {"input_ids": ids, "labels": labels}


@pytest.mark.parametrize("make", [llama, bert_mlm])
def test_label_terms_weigh_parts_to_the_whole_batch_loss(make):
    """Each part's own mean loss times its count of labels, summed over parts and divided by the total, is the model's
    own loss on the whole batch: the count is what transformers' loss divides by (shifted for the causal LM only)."""
    model, x = make().eval(), labels_with_holes()
    terms = label_terms(model, x)
    parts = [(0, 1), (1, 3), (3, 4)]
    with torch.no_grad():
        whole = float(model(**x).loss)
        each = [float(model(**{k: v[s:e] for k, v in x.items()}).loss) for s, e in parts]
    total = sum(loss * sum(terms.per_sample[s:e]) for loss, (s, e) in zip(each, parts, strict=True))
    assert total / sum(terms.per_sample) == pytest.approx(whole, rel=1e-5)
    shift = is_causal_lm(model)
    counted = (x["labels"][:, 1:] if shift else x["labels"]) != -100
    assert terms.per_sample == counted.sum(1).tolist() and int(terms(x)) == int(counted.sum())
    by_samples = sum(loss * (e - s) for loss, (s, e) in zip(each, parts, strict=True)) / 4
    assert abs(by_samples - whole) > 1e-3        # the reason for the count: samples alone weigh parts wrong


def test_shift_labels_given_are_counted_as_they_are():
    x = labels_with_holes()
    x["shift_labels"] = torch.full_like(x["labels"], -100)
    x["shift_labels"][:, :2] = 1
    assert label_terms(llama(), x).per_sample == [2, 2, 2, 2]


def test_no_integer_labels_no_terms():
    assert label_terms(llama(), {"input_ids": torch.zeros(2, 4, dtype=torch.long)}) is None
    assert label_terms(llama(), {"input_ids": torch.zeros(2, 4, dtype=torch.long), "labels": torch.zeros(2, 3)}) is None
    assert label_terms(llama(), torch.zeros(2, 4)) is None


def test_model_loss_and_what_it_refuses():
    with torch.no_grad():
        out = llama()(**labels_with_holes())
    assert model_loss(out) is out.loss and model_loss({"loss": out.loss}) is out.loss
    with pytest.raises(ValueError, match=r"without one.*x\['labels'\]"):
        with torch.no_grad():
            model_loss(llama()(input_ids=torch.zeros(2, 4, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"returned tuple without one \(a transformers model returns a tuple with "
                                         r"return_dict=False: leave that out"):
        with torch.no_grad():
            model_loss(llama()(**labels_with_holes(), return_dict=False))
    assert is_own(None) and is_own("model") and is_own(model_loss) and not is_own(torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match="found the string 'mse'"):
        is_own("mse")
    x = labels_with_holes()
    assert own_batch(x, "here") == (x, None) and own_batch((x, None), "here") == (x, None)
    with pytest.raises(ValueError, match="here: .*found targets y beside them"):
        own_batch((x, x["labels"]), "here")
    with pytest.raises(TypeError, match="here: .*found tuple of length 3"):
        own_batch((x, None, None), "here")


def test_a_tokenizers_batch_encoding_is_the_dict_it_holds():
    """What a tokenizer or data collator returns (`BatchEncoding`, a UserDict, not a dict) is taken as its dict by fit,
    plan.step, accumulate, evaluate and memory_model: the same plan, loss and gradient as the dict gives (each was
    refused: 'the batch is the inputs x, a dict ... found BatchEncoding', or in evaluate a KeyError from
    BatchEncoding's integer indexing)."""
    import copy

    import memfit
    x = labels_with_holes()
    enc = tf.BatchEncoding(x)
    assert not isinstance(enc, dict)
    model = llama()
    results = []
    for batch in (x, enc):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        plan = memfit.fit(m, opt, batch, None, "64MiB")
        step = plan.step(batch)
        grads = [p.grad.clone() for p in m.parameters()]
        acc = memfit.accumulate(m, opt, batch, None, micro_batch=3)
        evaluated = memfit.evaluate(m, [batch], loss_fn="model", progress=False)["loss"]
        results.append(((plan.micro_batch, plan.checkpoint, plan.peak_bytes), step.loss, grads, acc.loss, evaluated,
                        memfit.memory_model(m, batch).total_bytes(4)))
    inputs, labels = {"input_ids": x["input_ids"]}, x["labels"]          # (x, y) with a loss_fn: x a BatchEncoding too
    loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    copies = [copy.deepcopy(model) for _ in range(2)]
    pair = [memfit.accumulate(m, torch.optim.SGD(m.parameters(), lr=0.1), (b, labels), loss_fn, micro_batch=2).loss
            for m, b in zip(copies, (inputs, tf.BatchEncoding(inputs)), strict=True)]
    assert pair[0] == pair[1]
    (plan, loss, grads, acc, ev, mm), want = results[1], results[0]
    assert (plan, loss, acc, ev, mm) == (want[0], want[1], want[3], want[4], want[5])
    assert all(torch.equal(a, b) for a, b in zip(grads, want[2], strict=True))

"""memfit.fit handed to a real transformers Trainer (CPU, tiny models from configs, two steps, nothing downloaded):
the per-device batch and accumulation the plan gives train to the same weights as the plain arguments, the
Trainer's own checkpointing stays off under both of its names (4.x `gradient_checkpointing`, 5.x
`activation_checkpointing`), and a causal LM's own loss keeps the Trainer's weighting by tokens. Runs under
whichever transformers is installed (the project tests 4.57 and 5.24)."""
import dataclasses

import pytest
import torch

import memfit
from memfit.fitting.trainer import per_device_split, remove_checkpointing, weighs_items

transformers = pytest.importorskip("transformers")
MAJOR = int(transformers.__version__.split(".")[0])
N, SEQ, VOCAB = 16, 16, 100


def tiny_bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=SEQ, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  attn_implementation="eager",
                                  # what the first forward with labels sets otherwise: a config changed by a forward
                                  # drops what memfit kept for the model (`ModelCache`), and the second fit of a
                                  # test counted the step's costs and memory models all over again
                                  problem_type="single_label_classification")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).train()      # use_cache=True, its default


def dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * N, SEQ), generator=g)
    labels = torch.randint(0, 3, (2 * N,), generator=g)
    # the attention mask a tokenizer gives, with eager attention: transformers 4.x BERT looks for padding in the ids
    # without one (`pad_token_id in input_ids`), and its sdpa path asks whether the mask is all ones, neither of which
    # fit's fake tensors can answer (docs/fit.md, known limitations)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels[i]}
            for i in range(2 * N)]


def lm_dataset():
    """Token labels with a different number of -100 per row: weighting micro-batches by samples would be off."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * N, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.arange(SEQ) >= torch.randint(2, SEQ + 1, (2 * N, 1), generator=g)] = -100
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(2 * N)]


def stacked(ds):
    return {k: torch.stack([d[k] for d in ds[:N]]) for k in ds[0]}


def args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=N, max_steps=2,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                                          logging_strategy="no", disable_tqdm=True, seed=0, **kw)


def hf_checkpointing(model) -> bool:
    """transformers' own checkpointing switched on in any layer."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def test_split_keeps_the_effective_batch():
    for n in range(1, 40):
        for m in range(1, n + 1):
            b, s = per_device_split(n, m)
            assert b * s == n and b <= m


def test_trainer_gets_the_plan_and_trains_as_the_plain_arguments(tmp_path):
    """BERT's classifier with its own loss, which ignores num_items_in_batch: marked, so the Trainer divides each
    micro-batch's mean by the steps. gradient_checkpointing=True in the user's arguments is turned off (5.x: its
    new name too), so the Trainer checkpoints no layer beside the plan's."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the dev extra installs it)")
    ds = dataset()
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = stacked(ds)
    plain = memfit.fit(model, opt, x, None, "1GiB")
    # a budget the plain step misses: the plan micro-batches or checkpoints some layers
    plan = memfit.fit(model, opt, x, None, plain.peak_bytes - 1)
    assert plan.micro_batch < N or plan.checkpoint
    assert not weighs_items(model, {k: v[:1] for k, v in x.items()})
    planned = plan.trainer_arguments(args(tmp_path / "a", gradient_checkpointing=True))
    batch, steps = per_device_split(N, plan.micro_batch)
    assert (planned.per_device_train_batch_size, planned.gradient_accumulation_steps) == (batch, steps)
    assert not planned.gradient_checkpointing and not getattr(planned, "activation_checkpointing", False)
    layers = dict(model.named_modules())
    assert all("forward" in vars(layers[c]) for c in plan.checkpoint)
    trainer = transformers.Trainer(model=model, args=planned, train_dataset=ds)
    assert not hf_checkpointing(model)
    trainer.train()
    assert model.accepts_loss_kwargs is False           # the Trainer divides each micro-batch's mean by the steps
    remove_checkpointing(plan)
    assert all("forward" not in vars(m) for m in model.modules()) and "accepts_loss_kwargs" not in vars(model)

    ref = tiny_bert()
    transformers.Trainer(model=ref, args=args(tmp_path / "b"), train_dataset=ds).train()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)

    with pytest.raises(ValueError, match="effective per-device batch of 32"):
        plan.trainer_arguments(args(tmp_path / "c", gradient_accumulation_steps=2))


def test_a_causal_lm_with_its_own_loss_keeps_the_trainers_token_weighting(tmp_path):
    """A Llama (use_cache=True) with its own loss, rows of different lengths: its loss divides by the Trainer's
    num_items_in_batch, so it is not marked and each token weighs the same in the accumulated step; the checkpointed
    layers run with the cache off (it is put back after). Trained as the plain arguments train."""
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the dev extra installs it)")
    ds = lm_dataset()
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = stacked(ds)
    # the hand-off of a plan that both accumulates and checkpoints (whichever fit would choose here)
    plan = dataclasses.replace(memfit.fit(model, opt, x, "model", "1GiB"), micro_batch=N // 4,
                               checkpoint=("model.layers.0", "model.layers.2"))
    planned = plan.trainer_arguments(args(tmp_path / "a"))
    assert planned.gradient_accumulation_steps == 4
    assert "accepts_loss_kwargs" not in vars(model) and model.config.use_cache is False
    transformers.Trainer(model=model, args=planned, train_dataset=ds).train()
    remove_checkpointing(plan)
    assert model.config.use_cache is True

    ref = tiny_llama()
    transformers.Trainer(model=ref, args=args(tmp_path / "b"), train_dataset=ds).train()
    # float32 sums in another order, through two AdamW steps (1.2e-5 apart under 4.57); weighted by samples, 3e-2
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@pytest.mark.skipif(MAJOR < 5, reason="activation_checkpointing is transformers 5.x's name for "
                                      f"gradient_checkpointing; installed {transformers.__version__}")
def test_the_new_name_of_the_trainers_checkpointing_is_turned_off_too(tmp_path):
    model = tiny_bert()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = memfit.fit(model, opt, stacked(dataset()), None, "1GiB")
    planned = plan.trainer_arguments(args(tmp_path, activation_checkpointing=True))
    assert planned.activation_checkpointing is False and planned.gradient_checkpointing is False
    remove_checkpointing(plan)

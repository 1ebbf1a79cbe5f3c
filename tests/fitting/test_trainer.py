"""memfit.fit handed to a real transformers Trainer (CPU, a tiny BERT from a config, two steps): the per-device
batch and accumulation the plan gives train to the same weights as the plain arguments."""
import pytest
import torch

import memfit
from memfit.fitting.trainer import per_device_split, remove_checkpointing

transformers = pytest.importorskip("transformers")
N, SEQ, VOCAB = 16, 16, 100


def tiny_bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=SEQ, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(cfg).train()


def dataset():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * N, SEQ), generator=g)
    labels = torch.randint(0, 3, (2 * N,), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(2 * N)]


def args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=N, max_steps=2,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True,
                                          logging_strategy="no", disable_tqdm=True, seed=0, **kw)


def test_split_keeps_the_effective_batch():
    for n in range(1, 40):
        for m in range(1, n + 1):
            b, s = per_device_split(n, m)
            assert b * s == n and b <= m


def test_trainer_gets_the_plan_and_trains_as_the_plain_arguments(tmp_path):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the dev extra installs it)")
    ds = dataset()
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = {k: torch.stack([d[k] for d in ds[:N]]) for k in ("input_ids", "labels")}
    loss = lambda out, y: out.loss
    plain = memfit.fit(model, opt, (x, None), loss, "1GiB")
    # a budget the plain step misses: the plan micro-batches or checkpoints some layers
    plan = memfit.fit(model, opt, (x, None), loss, plain.peak_bytes - 1)
    assert plan.micro_batch < N or plan.checkpoint
    planned = plan.trainer_arguments(args(tmp_path / "a"))
    batch, steps = per_device_split(N, plan.micro_batch)
    assert (planned.per_device_train_batch_size, planned.gradient_accumulation_steps) == (batch, steps)
    assert not planned.gradient_checkpointing
    layers = dict(model.named_modules())
    assert all("forward" in vars(layers[c]) for c in plan.checkpoint)
    transformers.Trainer(model=model, args=planned, train_dataset=ds).train()
    assert model.accepts_loss_kwargs is False           # the Trainer divides each micro-batch's mean by the steps
    remove_checkpointing(plan)
    assert all("forward" not in vars(m) for m in model.modules()) and "accepts_loss_kwargs" not in vars(model)

    ref = tiny_bert()
    transformers.Trainer(model=ref, args=args(tmp_path / "b"), train_dataset=ds).train()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)

    with pytest.raises(ValueError, match="effective per-device batch of 32"):
        plan.trainer_arguments(args(tmp_path / "c", gradient_accumulation_steps=2))

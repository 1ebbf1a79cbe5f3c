"""Real architectures end to end: a BERT-style text classifier on token ids and image classifiers
(ViT, ResNet) from `transformers` configs (tiny, random weights, nothing downloaded), through
`memfit.loader` and `memfit.evaluate`, against the plain PyTorch loop a user would write."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit.compact import CompactDataset

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

N, L, CLASSES = 150, 12, 3


def plain_loop(model, inputs: dict, y: torch.Tensor, batch: int):
    """What a user writes: batches in order, model(**x).logits, correct counts, per-sample losses summed."""
    correct, loss, logits = 0, torch.zeros((), dtype=torch.float64), []
    with torch.inference_mode():
        for s in range(0, len(y), batch):
            z = model(**{k: v[s:s + batch] for k, v in inputs.items()}).logits
            correct += int((z.argmax(1) == y[s:s + batch]).sum())
            loss += F.cross_entropy(z.float(), y[s:s + batch], reduction="none").double().sum()
            logits.append(z)
    return correct / len(y), float(loss) / len(y), torch.cat(logits)


@pytest.fixture(scope="module")
def bert():
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=CLASSES)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg).eval()
    g = np.random.default_rng(0)
    ids = g.integers(1, 1000, (N, L))
    lengths = g.integers(3, L + 1, N)
    mask = (np.arange(L)[None, :] < lengths[:, None]).astype(np.int64)
    ids = ids * mask                                                 # padding token 0 after each sequence
    y = g.integers(0, CLASSES, N)
    return model, {"input_ids": ids, "attention_mask": mask}, y


def tensors(inputs):
    return {k: torch.from_numpy(v) for k, v in inputs.items()}


def test_bert_on_token_ids_equals_the_plain_loop(bert):
    model, inputs, y = bert
    ds = CompactDataset.from_arrays(inputs, y, device="cpu")
    assert ds.dtype == {"input_ids": torch.int64, "attention_mask": torch.int64}      # token ids stay integers
    assert ds.fields["input_ids"].template.codec.name == "int16"
    yt = torch.from_numpy(y)
    for chunk in (32, 7):
        acc, loss, _ = plain_loop(model, tensors(inputs), yt, chunk)
        r = memfit.evaluate(model, ds, chunk_size=chunk, device="cpu", progress=False)
        assert r.metrics["accuracy"] == acc                       # the same chunks: exactly the same counts
        assert r.metrics["loss"] == pytest.approx(loss, rel=1e-12, abs=0)
    r = memfit.evaluate(model, (inputs, y), device="cpu", progress=False)       # auto: one eager chunk
    acc, loss, _ = plain_loop(model, tensors(inputs), yt, N)
    assert r.metrics["accuracy"] == acc and r.metrics["loss"] == pytest.approx(loss, rel=1e-12, abs=0)


def test_bert_batches_from_the_loader_are_what_the_model_takes(bert):
    model, inputs, y = bert
    _, _, ref_logits = plain_loop(model, tensors(inputs), torch.from_numpy(y), 32)
    with memfit.loader((inputs, y), 32, shuffle=False, device="cpu") as ld:
        with torch.inference_mode():
            logits = torch.cat([model(**xb).logits for xb, _ in ld])
        assert ld.strategy == "resident"
    assert torch.equal(logits, ref_logits)


class FakeOOM(torch.nn.Module):
    """The model, except that a chunk larger than `limit` samples raises an out-of-memory error."""

    def __init__(self, model, limit):
        super().__init__()
        self.model, self.limit, self.sizes = model, limit, []

    def forward(self, **x):
        n = next(iter(x.values())).shape[0]
        self.sizes.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} MiB (fake)")
        return self.model(**x)


def test_bert_out_of_memory_back_off_and_torchmetrics(bert):
    torchmetrics = pytest.importorskip("torchmetrics")
    model, inputs, y = bert
    wrapped = FakeOOM(model, 40).eval()         # evaluate restores the mode it found: keep BERT in eval
    acc_metric = torchmetrics.classification.MulticlassAccuracy(num_classes=CLASSES, average="micro")
    r = memfit.evaluate(wrapped, (inputs, y), chunk_size=64, metrics=("accuracy", "loss", acc_metric),
                        device="cpu", progress=False)
    assert r.retries >= 1 and r.oom_sizes[0] == 64 and r.n == N
    assert max(s for s in wrapped.sizes if s <= 40) == 32                    # halved until it fit
    acc, loss, _ = plain_loop(model, tensors(inputs), torch.from_numpy(y), 32)
    assert r.metrics["accuracy"] == acc == pytest.approx(r.metrics["MulticlassAccuracy"], abs=1e-7)
    assert r.metrics["loss"] == pytest.approx(loss, rel=1e-6)


def image_model(kind):
    torch.manual_seed(0)
    if kind == "vit":
        cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, num_labels=5)
        return transformers.ViTForImageClassification(cfg).eval()
    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                    num_labels=5)
    return transformers.ResNetForImageClassification(cfg).eval()


@pytest.mark.parametrize("kind", ["vit", "resnet"])
def test_image_classifier_equals_the_plain_loop(kind):
    model = image_model(kind)
    g = np.random.default_rng(1)
    x = g.standard_normal((90, 3, 16, 16)).astype(np.float32)
    y = g.integers(0, 5, 90)
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    assert ds.codec.name == "float32"                                 # float images are stored exactly
    yt = torch.from_numpy(y)
    for chunk in (25, 90):
        acc, loss, _ = plain_loop(lambda pixel_values: model(pixel_values), {"pixel_values": torch.from_numpy(x)},
                                  yt, chunk)
        r = memfit.evaluate(model, ds, chunk_size=chunk, device="cpu", progress=False)
        assert r.metrics["accuracy"] == acc and r.metrics["loss"] == pytest.approx(loss, rel=1e-12, abs=0)
    with memfit.loader(ds, 30, shuffle=False, device="cpu") as ld, torch.inference_mode():
        got = torch.cat([model(xb).logits for xb, _ in ld])
    _, _, ref = plain_loop(lambda pixel_values: model(pixel_values), {"pixel_values": torch.from_numpy(x)}, yt, 30)
    assert torch.equal(got, ref)


def test_a_model_the_planner_cannot_capture_still_gets_an_auto_chunk():
    """GPT-2 defeats torch.export; evaluate sizes chunks from a fake-tensor run and runs eagerly, saying why."""
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=500, n_positions=32, num_labels=CLASSES,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(cfg).eval()
    g = np.random.default_rng(2)
    ids, y = g.integers(1, 500, (120, 10)), g.integers(0, CLASSES, 120)
    r = memfit.evaluate(model, (ids, y), budget="40MiB", device="cpu", progress=False)
    assert r.runner.startswith("eager") and "estimated peak" in r.reason and r.n == 120
    acc, loss, _ = plain_loop(lambda input_ids: model(input_ids), {"input_ids": torch.from_numpy(ids)},
                              torch.from_numpy(y), r.chunk_size)
    assert r.metrics["accuracy"] == acc and r.metrics["loss"] == pytest.approx(loss, rel=1e-12, abs=0)

"""The models `memfit bench train` trains: memfit's zoo (MLP, LeNet, ResNet-18, MobileNetV2, U-Net, a
transformer block) and `transformers` models from small configs with random weights (BERT, GPT-2, ViT,
ConvNeXt), each a `Case` (a model factory, a batch of n and its mean loss); `cost_cases` gives a typical user's
small CNN and BERT and GPT-2 at the width people train, for the cost table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from memfit.testing.zoo import build, quiet_transformers

__all__ = ["Case", "cost_cases", "hf_cases", "hf_factory", "on_device", "three_block_cnn", "zoo_cases"]


@dataclass
class Case:
    """A model, a batch of n samples (x, y) and its mean loss."""
    name: str
    make: Callable[[], torch.nn.Module]
    batch: Callable[[int], tuple]
    loss: Callable


def on_device(case: Case, device: torch.device) -> Case:
    """The same case with its model and batches on `device` (the batches are made on the CPU, then moved)."""
    if device.type == "cpu":
        return case
    move = lambda b: {k: v.to(device) for k, v in b.items()} if isinstance(b, dict) else b.to(device)
    return Case(case.name, lambda: case.make().to(device), lambda n: tuple(move(b) for b in case.batch(n)),
                case.loss)


def hf_factory(cls, cfg) -> Callable[[], torch.nn.Module]:
    """A factory of `cls(cfg)` (a `transformers` model class and its config) in training mode, its random
    weights seeded: the same model at every call."""
    def build_it():
        torch.manual_seed(0)
        return cls(cfg).train()
    return build_it


def _seeded(n: int, seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 7919 + n)


def _images(shape, classes):
    return lambda n: (torch.randn(n, *shape, generator=_seeded(n)),
                      torch.randint(0, classes, (n,), generator=_seeded(n)))


def _zoo(name: str, image: int | None, classes: int) -> Case:
    model, shape = build(name, image=image)
    return Case(name, lambda: build(name, image=image)[0].train(), _images(shape, classes), F.cross_entropy)


def zoo_cases() -> list[Case]:
    # 64 pixels: at 32 the last feature map is 1x1 and BatchNorm cannot train on one sample of it
    cases = [_zoo("mlp", None, 10), _zoo("lenet", None, 10), _zoo("resnet18", 64, 1000),
             _zoo("mobilenet_v2", 64, 1000)]
    unet_shape = build("unet", image=32)[1]
    cases.append(Case("unet", lambda: build("unet", image=32)[0].train(),
                      lambda n: (torch.randn(n, *unet_shape, generator=_seeded(n)),
                                 torch.randint(0, 2, (n, 32, 32), generator=_seeded(n))), F.cross_entropy))
    tshape = build("transformer")[1]
    cases.append(Case("transformer", lambda: build("transformer")[0].train(),
                      lambda n: (torch.randn(n, *tshape, generator=_seeded(n)), torch.randn(n, *tshape,
                                                                                            generator=_seeded(n, 1))),
                      F.mse_loss))
    return cases


def hf_cases(seq: int = 64) -> list[Case]:
    """transformers models from small configs, random weights, no dropout (nothing is downloaded)."""
    try:
        import transformers as tf
    except ImportError:
        return []
    quiet_transformers()
    vocab, classes = 1000, 10
    tokens = lambda n: {"input_ids": torch.randint(0, vocab, (n, seq), generator=_seeded(n)),
                        "attention_mask": torch.ones(n, seq, dtype=torch.long)}
    pixels = lambda n: {"pixel_values": torch.randn(n, 3, 32, 32, generator=_seeded(n))}
    labels = lambda n: torch.randint(0, classes, (n,), generator=_seeded(n, 1))
    logits_ce = lambda out, y: F.cross_entropy(out.logits, y)
    bert = tf.BertConfig(vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256, max_position_embeddings=seq, num_labels=classes,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gpt2 = tf.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=2, n_head=2, n_positions=seq, resid_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0, embd_pdrop=0.0, attn_pdrop=0.0)
    vit = tf.ViTConfig(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=128, num_labels=classes, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    convnext = tf.ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=classes,
                                 image_size=32)

    make = hf_factory
    # next-token loss: the mean over (sample, position), every sample with `seq` positions, so by samples too
    lm_loss = lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    return [
        Case("bert", make(tf.BertForSequenceClassification, bert), lambda n: (tokens(n), labels(n)), logits_ce),
        Case("gpt2 (no export)", make(tf.GPT2LMHeadModel, gpt2),
             lambda n: ({"input_ids": tokens(n)["input_ids"]},
                        torch.randint(0, vocab, (n, seq), generator=_seeded(n, 2))),
             lm_loss),
        Case("vit", make(tf.ViTForImageClassification, vit), lambda n: (pixels(n), labels(n)), logits_ce),
        Case("convnext", make(tf.ConvNextForImageClassification, convnext), lambda n: (pixels(n), labels(n)),
             logits_ce),
    ]


def three_block_cnn() -> torch.nn.Module:
    """A typical user's small CNN: three conv-BN-ReLU-max-pool blocks (32, 64, 128 channels) and a linear head, for
    64x64 RGB images and 10 classes (the model of issue 35's `memfit plan mymodel.py:make --train`)."""
    def block(cin: int, cout: int) -> list[torch.nn.Module]:
        return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU(),
                torch.nn.MaxPool2d(2)]
    torch.manual_seed(0)
    return torch.nn.Sequential(*block(3, 32), *block(32, 64), *block(64, 128), torch.nn.Flatten(),
                               torch.nn.Linear(128 * 8 * 8, 10)).train()


def cost_cases(quick: bool) -> list[tuple[Case, int, str | None]]:
    """(case, batch, budget) for the cost table: the three-block CNN at batch 32 (max_batch_size in 256 MiB, 1 GiB
    in full), and BERT and GPT-2 at the width people train, 768 (quick: 2 layers and an 8,000-token vocabulary;
    full: the shapes of BERT-base and GPT-2 small, 12 layers), sequence 128, batch 8 (budget None: 1.5x the
    predicted peak at the batch)."""
    cnn = Case("cnn 3 blocks, 64x64", three_block_cnn, _images((3, 64, 64), 10), F.cross_entropy)
    out = [(cnn, 32, "256MiB" if quick else "1GiB")]
    try:
        import transformers as tf
    except ImportError:
        return out
    quiet_transformers()
    seq, width, layers, batch, vocab = (128, 768, 2, 8, 8000) if quick else (128, 768, 12, 8, None)
    heads = width // 64
    bert = tf.BertConfig(vocab_size=vocab or 30522, hidden_size=width, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=4 * width, max_position_embeddings=seq,
                         num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    gpt2 = tf.GPT2Config(vocab_size=vocab or 50257, n_embd=width, n_layer=layers, n_head=heads, n_positions=seq,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)

    make = hf_factory
    ids = lambda n, v: torch.randint(0, v, (n, seq), generator=_seeded(n))
    tag = f"{width}x{layers}, seq {seq}"
    return out + [
        (Case(f"bert {tag}", make(tf.BertForSequenceClassification, bert),
              lambda n: ({"input_ids": ids(n, bert.vocab_size)}, torch.randint(0, 2, (n,), generator=_seeded(n, 1))),
              lambda out, y: F.cross_entropy(out.logits, y)), batch, None),
        (Case(f"gpt2 {tag}", make(tf.GPT2LMHeadModel, gpt2),
              lambda n: ({"input_ids": ids(n, gpt2.vocab_size)}, ids(n, gpt2.vocab_size)),
              lambda out, y: F.cross_entropy(out.logits.flatten(0, 1), y.flatten())), batch, None),
    ]


def _fit_cnn(bn: bool):
    def block(cin, cout):
        norm = (lambda c: [nn.BatchNorm2d(c)]) if bn else (lambda c: [])
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), *norm(cout), nn.ReLU(),
                             nn.Conv2d(cout, cout, 3, padding=1), *norm(cout), nn.ReLU())

    def make():
        torch.manual_seed(0)
        return nn.Sequential(block(3, 16), block(16, 16), block(16, 16), block(16, 16), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(16, 10)).train()
    return make


def fit_cases() -> list[Case]:
    """`memfit bench fit`'s models: small CNNs with and without batch norm, and transformers at width 128-ish,
    sequence 32 (GPT-2 and Llama without a key/value cache)."""
    g = lambda n, k=0: torch.Generator().manual_seed(n * 31 + k)
    images = lambda n: (torch.randn(n, 3, 24, 24, generator=g(n)), torch.randint(0, 10, (n,), generator=g(n, 1)))
    out = [Case("cnn", _fit_cnn(False), images, F.cross_entropy),
           Case("cnn_bn", _fit_cnn(True), images, F.cross_entropy)]
    for c in hf_cases(seq=32):
        name = c.name.split()[0]
        if name == "gpt2":           # a key/value cache would be appended to again by a checkpointed block's rerun
            c = Case(name, (lambda make: lambda: _no_cache(make()))(c.make), c.batch, c.loss)
            out.append(Case(name, c.make, c.batch, c.loss))
            out.append(_llama(c.batch, c.loss))
            continue
        out.append(Case(name, c.make, c.batch, c.loss))
    return out


def _llama(batch, loss) -> Case:
    """A Llama-style causal LM (transformers' LlamaForCausalLM from a config: RMSNorm, rotary positions, SwiGLU),
    on GPT-2's tokens and loss."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, use_cache=False)
    return Case("llama", hf_factory(tf.LlamaForCausalLM, cfg), batch, loss)


def _no_cache(model):
    model.config.use_cache = False
    return model

"""A zoo of models for the planner benchmark and tests, written without torchvision.

Each entry builds an eval-mode model with fixed random weights and names its sample shape (one
sample, no batch dimension). Sizes follow the originals (ResNet-18/50 and MobileNetV2 layer
plans); `image` shrinks the inputs of the image models so a CPU benchmark finishes quickly.

Example:
    >>> import torch
    >>> model, shape = build("mlp")
    >>> model(torch.zeros(2, *shape)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["MODELS", "build", "build_real", "quiet_transformers"]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),     # (N, 6, 14, 14)
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),  # (N, 400)
                         nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: type = nn.ReLU) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout), act()]


class Basic(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(*_cbr(cin, width, 3, stride), nn.Conv2d(width, cout, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(cout))
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return torch.relu(self.body(x) + self.down(x))


class Bottleneck(Basic):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__(cin, width, stride)
        cout = width * self.expansion
        self.body = nn.Sequential(*_cbr(cin, width, 1), *_cbr(width, width, 3, stride),
                                  nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))


def resnet(block: type, layers: tuple[int, ...], classes: int = 1000) -> nn.Module:
    mods, cin = [*_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)], 64
    for i, n in enumerate(layers):
        width = 64 * 2**i
        for j in range(n):
            mods.append(block(cin, width, 2 if j == 0 and i > 0 else 1))
            cin = width * block.expansion
    return nn.Sequential(*mods, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers = _cbr(cin, hidden, 1, act=nn.ReLU6) if expand != 1 else []
        layers += [*_cbr(hidden, hidden, 3, stride, groups=hidden, act=nn.ReLU6),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


def mobilenet_v2(classes: int = 1000) -> nn.Module:
    # (expansion, channels, repeats, stride) as in Sandler et al. 2018
    plan = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    mods, cin = _cbr(3, 32, 3, 2, act=nn.ReLU6), 32
    for t, c, n, s in plan:
        for i in range(n):
            mods.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
            cin = c
    mods += [*_cbr(cin, 1280, 1, act=nn.ReLU6), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(1280, classes)]
    return nn.Sequential(*mods)


class UNet(nn.Module):
    """Three levels down, three up, skip connections concatenated (Ronneberger et al. 2015, small)."""

    def __init__(self, cin: int = 3, base: int = 16, classes: int = 2):
        super().__init__()
        ch = [base, base * 2, base * 4, base * 8]
        self.down = nn.ModuleList()
        c = cin
        for w in ch:
            self.down.append(nn.Sequential(*_cbr(c, w), *_cbr(w, w)))
            c = w
        self.up = nn.ModuleList(nn.ConvTranspose2d(ch[i + 1], ch[i], 2, 2) for i in reversed(range(3)))
        self.merge = nn.ModuleList(nn.Sequential(*_cbr(2 * ch[i], ch[i]), *_cbr(ch[i], ch[i]))
                                   for i in reversed(range(3)))
        self.head = nn.Conv2d(base, classes, 1)

    def forward(self, x):
        skips = []
        for i, d in enumerate(self.down):
            x = d(x if i == 0 else nn.functional.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for up, merge in zip(self.up, self.merge, strict=True):
            x = merge(torch.cat([up(x), skips.pop()], 1))
        return self.head(x)


class EncoderBlock(nn.Module):
    """Pre-norm transformer encoder block; attention written out (B, T, D) -> (B, h, T, D/h)."""

    def __init__(self, dim: int = 256, heads: int = 4, tokens: int = 64):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.attend(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))

    def attend(self, q, k, v):
        """(B, h, T, D/h) from q, k, v of that shape: written out, its (B, h, T, T) weights made."""
        att = torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, dim=-1)     # (B, h, T, T)
        return att @ v


class Inception(nn.Module):
    """Four parallel branches concatenated (Szegedy et al. 2015, block 3a widths)."""

    def __init__(self, cin: int = 192):
        super().__init__()
        self.b1 = nn.Sequential(*_cbr(cin, 64, 1))
        self.b2 = nn.Sequential(*_cbr(cin, 96, 1), *_cbr(96, 128, 3))
        self.b3 = nn.Sequential(*_cbr(cin, 16, 1), *_cbr(16, 32, 5))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), *_cbr(cin, 32, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (mlp, (1, 28, 28)),
    "lenet": (lenet, (1, 28, 28)),
    "resnet18": (lambda: resnet(Basic, (2, 2, 2, 2)), (3, 224, 224)),
    "resnet50": (lambda: resnet(Bottleneck, (3, 4, 6, 3)), (3, 224, 224)),
    "mobilenet_v2": (mobilenet_v2, (3, 224, 224)),
    "unet": (UNet, (3, 128, 128)),
    "transformer": (EncoderBlock, (64, 256)),
    "inception": (Inception, (192, 28, 28)),
}


def build(name: str, image: int | None = None, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    """(eval-mode model, sample shape) of a zoo entry; `image` replaces the height and width.

    Example:
        >>> build("resnet18", image=64)[1]
        (3, 64, 64)
    """
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {sorted(MODELS)}")
    factory, shape = MODELS[name]
    torch.manual_seed(seed)
    model = factory().eval()
    for m in model.modules():        # non-trivial batch-norm statistics, so tests see them
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    if image is not None and len(shape) == 3 and name not in ("mlp", "lenet", "inception"):
        shape = (shape[0], image, image)
    return model, shape


# --- real architectures from `transformers` configs (random weights, never a download) ---------------

class MainOutput(nn.Module):
    """A `transformers` model returning its main tensor: `.logits`, else `.last_hidden_state`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        out = self.model(x)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state


def _text(cls_name: str, cfg_name: str, make_cfg: Callable[[bool], dict], seq: tuple[int, int] = (32, 128)):
    def factory(quick: bool):
        import transformers
        cfg = getattr(transformers, cfg_name)(**make_cfg(quick))
        model = getattr(transformers, cls_name)(cfg)
        length = seq[0] if quick else seq[1]
        return MainOutput(model), lambda b: torch.randint(0, cfg.vocab_size, (b, length))
    return factory


def _image(cls_name: str, cfg_name: str, make_cfg: Callable[[bool], dict], size: tuple[int, int] = (64, 128)):
    def factory(quick: bool):
        import transformers
        side = size[0] if quick else size[1]
        kwargs = make_cfg(quick)
        if "image_size" in kwargs:
            kwargs["image_size"] = side
        cfg = getattr(transformers, cfg_name)(**kwargs)
        model = getattr(transformers, cls_name)(cfg)
        return MainOutput(model), lambda b: torch.randn(b, 3, side, side)
    return factory


def _enc(quick: bool, **extra) -> dict:
    # tiny (quick) or moderate encoder sizes: hidden, layers, heads, MLP width
    d = 64 if quick else 256
    return {"hidden_size": d, "num_hidden_layers": 2 if quick else 4, "num_attention_heads": 4,
            "intermediate_size": 4 * d, "vocab_size": 1000, **extra}


def _stages(quick: bool) -> dict:
    return {"hidden_sizes": [16, 32, 64, 128] if quick else [48, 96, 192, 384], "depths": [1, 1, 2, 1] if quick
            else [2, 2, 4, 2]}


REAL: dict[str, Callable[[bool], tuple[nn.Module, Callable[[int], torch.Tensor]]]] = {
    "bert": _text("BertForSequenceClassification", "BertConfig", _enc),
    "distilbert": _text("DistilBertForSequenceClassification", "DistilBertConfig", lambda q: {
        "dim": 64 if q else 256, "n_layers": 2 if q else 4, "n_heads": 4, "hidden_dim": 256 if q else 1024,
        "vocab_size": 1000}),
    "roberta": _text("RobertaForSequenceClassification", "RobertaConfig", _enc),
    "t5_encoder": _text("T5EncoderModel", "T5Config", lambda q: {
        "d_model": 64 if q else 256, "num_layers": 2 if q else 4, "num_heads": 4, "d_ff": 256 if q else 1024,
        "d_kv": 16 if q else 64, "vocab_size": 1000}),
    "gpt2": _text("GPT2LMHeadModel", "GPT2Config", lambda q: {
        "n_embd": 64 if q else 256, "n_layer": 2 if q else 4, "n_head": 4, "vocab_size": 1000, "n_positions": 256}),
    "vit": _image("ViTForImageClassification", "ViTConfig", lambda q: _enc(q, image_size=0, patch_size=16)),
    "deit": _image("DeiTForImageClassification", "DeiTConfig", lambda q: _enc(q, image_size=0, patch_size=16)),
    "convnext": _image("ConvNextForImageClassification", "ConvNextConfig", _stages),
    "resnet": _image("ResNetForImageClassification", "ResNetConfig", lambda q: {
        "hidden_sizes": [32, 64, 128, 256] if q else [256, 512, 1024, 2048], "depths": [1, 1, 1, 1] if q else
        [3, 4, 6, 3], "embedding_size": 32 if q else 64, "layer_type": "bottleneck"}),
    "efficientnet": _image("EfficientNetForImageClassification", "EfficientNetConfig", lambda q: {
        "image_size": 0, "depth_coefficient": 0.5 if q else 1.0}),
    "mobilenet_v2_hf": _image("MobileNetV2ForImageClassification", "MobileNetV2Config", lambda q: {
        "image_size": 0, "depth_multiplier": 0.5 if q else 1.0}),
    "swin": _image("SwinForImageClassification", "SwinConfig", lambda q: {
        "image_size": 0, "embed_dim": 32 if q else 96, "depths": [1, 1, 2] if q else [2, 2, 6, 2],
        "num_heads": [2, 4, 8] if q else [3, 6, 12, 24], "window_size": 4}),
    "mobilevit": _image("MobileViTForImageClassification", "MobileViTConfig", lambda q: {"image_size": 0}),
    "regnet": _image("RegNetForImageClassification", "RegNetConfig", lambda q: {
        "hidden_sizes": [32, 64, 128, 256] if q else [64, 128, 256, 512], "depths": [1, 1, 2, 1] if q
        else [1, 2, 4, 2]}),
}


def build_real(name: str, quick: bool = False, seed: int = 0):
    """(eval-mode model, make_input(batch)) of a `transformers` architecture from a config with random
    weights (`transformers` is an optional bench dependency; nothing is downloaded)."""
    if name not in REAL:
        raise ValueError(f"unknown real model {name!r}; expected one of {sorted(REAL)}")
    torch.manual_seed(seed)
    quiet_transformers()
    model, make_input = REAL[name](quick)
    return model.eval(), make_input


def quiet_transformers() -> None:
    """Silence transformers' config warnings (e.g. GPT-2's token ids outside a small test vocabulary):
    they are about the random-weight configs built here, not about what a benchmark measures."""
    import transformers
    transformers.logging.set_verbosity_error()

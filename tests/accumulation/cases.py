"""Models, data and a plain full-batch reference step shared by the accumulate tests (tests/accumulation/ and
tests/memory/test_micro_batch.py import them as `accumulation.cases`)."""
import torch
from torch import nn
from torch.nn import functional as F

D, C = 6, 3


class Tied(nn.Module):
    """Embedding-like input projection whose weight is used again, transposed, by the head."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, D) * 0.3)
        self.mid = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(x @ self.w.t())                 # (N, 8)
        return (self.mid(h) @ self.w)[:, :C]           # the same weight again: two uses, one gradient


class PartlyFrozen(nn.Module):
    """A weight of trainable and frozen rows joined per forward (new tokens added to a frozen embedding table):
    backward of torch.cat leaves the trainable rows' gradient as a slice of a buffer of every row."""

    def __init__(self):
        super().__init__()
        self.new = nn.Parameter(torch.randn(4, D) * 0.3)
        self.old = nn.Parameter(torch.randn(400, D) * 0.3, requires_grad=False)
        self.head = nn.Linear(404, C)

    def forward(self, x):
        return self.head(torch.tanh(x @ torch.cat([self.new, self.old]).t()))      # (N, 404) -> (N, C)


class BatchCat(nn.Module):
    """Trainable anchor rows joined with the batch's own embeddings (in-batch keys): the anchors' gradient is a
    slice of a buffer of 4 + N rows, which grows with the micro-batch that made it."""

    def __init__(self):
        super().__init__()
        self.anchors = nn.Parameter(torch.randn(C, 16) * 0.3)
        self.enc = nn.Linear(D, 16)

    def forward(self, x):
        h = self.enc(x)                                 # (N, 16)
        return (h @ torch.cat([self.anchors, h]).t())[:, :C]      # (N, C + N) -> the anchors' scores


class ClsToken(nn.Module):
    """A class token broadcast over the batch (ViT): at batch 1 no sum is made, and its gradient is a slice of
    torch.cat's buffer; at larger batches the sum is a gradient of its own size."""

    def __init__(self):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 8) * 0.3)
        self.inp = nn.Linear(D, 32)
        self.head = nn.Linear(8, C)

    def forward(self, x):
        h = self.inp(x).view(x.shape[0], 4, 8)                                    # (N, 4, 8)
        return self.head(torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1).mean(1))


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, C)

    def forward(self, x):
        return self.head(self.enc(self.inp(x).view(x.shape[0], 1, 16).expand(-1, 3, -1)).mean(1))


def make(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, C))
    if kind == "cnn":
        return nn.Sequential(nn.Unflatten(1, (1, 2, 3)), nn.Conv2d(1, 4, 2, padding=1), nn.GroupNorm(2, 4),
                             nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 4, C))
    if kind == "tied":
        return Tied()
    if kind == "attn":
        return Attn()
    if kind == "frozen_cat":
        return PartlyFrozen()
    if kind == "batch_cat":
        return BatchCat()
    if kind == "cls_token":
        return ClsToken()
    raise ValueError(kind)


def data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=g), torch.randint(0, C, (n,), generator=g)


def plain_step(model, opt, x, y, loss_fn=F.cross_entropy):
    """The reference: one full-batch step."""
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def pair(kind: str, opt="sgd"):
    a, b = make(kind), make(kind)
    b.load_state_dict(a.state_dict())
    mk = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
          "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3)}[opt]
    return a, mk(a.parameters()), b, mk(b.parameters())


def assert_same_step(ref, mod, rtol=1e-5):
    """Gradients and parameters after the step agree within float32 reassociation (relative to each tensor's
    size)."""
    for (name, p), q in zip(ref.named_parameters(), mod.parameters(), strict=True):
        if p.grad is None:                                      # frozen: no gradient in either
            assert q.grad is None and torch.equal(p, q), f"frozen parameter {name}"
            continue
        scale = max(p.grad.abs().max().item(), 1e-6)
        assert (p.grad - q.grad).abs().max().item() <= rtol * scale + 1e-7, f"gradient of {name}"
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), f"parameter {name} after the step"


class Tagger(nn.Module):
    """A token model: (n, T) ids -> (n, T, C) scores."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(20, 8), nn.Linear(8, C)

    def forward(self, ids):
        return self.out(self.emb(ids).tanh())


def token_loss(out, y):
    """The mean over the positions not ignored (-100), as cross_entropy and transformers' losses take it."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


# ---- out of memory ----------------------------------------------------------------------------------
class OOMInBackward(torch.autograd.Function):
    """Identity whose backward raises an out-of-memory error while `budget(n)` says the batch is too big."""
    budget = staticmethod(lambda n: True)

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if not OOMInBackward.budget(ctx.n):
            raise torch.OutOfMemoryError(f"emulated: backward of a micro-batch of {ctx.n} does not fit")
        return g


class Gated(nn.Module):
    """The gate sits between two layers: backward reaches it after `head` already has its gradient."""

    def __init__(self, where="backward"):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.where = nn.Linear(D, 16), nn.Linear(16, C), where

    def forward(self, x):
        h = torch.relu(self.body(x))
        if self.where == "forward" and not OOMInBackward.budget(x.shape[0]):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (emulated)")
        return self.head(OOMInBackward.apply(h))


# ---- a loss that is not finite ------------------------------------------------------------------------------
def nan_on(call: int, value: float = float("nan")):
    """cross_entropy, but `value` (NaN, inf) from the given call on (counted from 1): one micro-batch's loss."""
    calls = {"n": 0}

    def loss_fn(out, t):
        calls["n"] += 1
        loss = F.cross_entropy(out, t)
        return loss * value if calls["n"] == call else loss
    return loss_fn


def state_of(model, opt):
    """Parameters, gradients and optimizer state, copied (None where a gradient is None)."""
    import copy
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            copy.deepcopy(opt.state_dict()))


def assert_bitwise(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for u, v in zip(a, b, strict=True):
            assert_bitwise(u, v)
    else:
        assert a == b, (a, b)


def held_grads(params):
    """Gradients of every kind a caller may hold: None, a zero tensor, values, another dtype's shape kept."""
    for i, p in enumerate(params):
        p.grad = [None, torch.zeros_like(p), torch.full_like(p, 0.25), torch.randn_like(p)][i % 4]
    return [p.grad for p in params]

"""Attention masks kept at their broadcast shape (`planner.masks`): a T5-like mask (a position bias of batch 1 where
an expanded padding mask keeps it) is made with batch 1 and broadcast by flash attention; outputs bit-identical to
eager, fewer bytes by the allocator; masks it cannot prove exact are left as they are."""

import pytest
import torch
from torch import nn

from memfit import plan
from memfit.device.measure import track_memory
from memfit.planner import captured
from memfit.planner.captured import capture_model

flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


class BiasedAttention(nn.Module):
    """T5's pattern: q, k, v from x; a (1, heads, L, L) bias where an `arange` mask (expanded over the batch) keeps
    it, else the float minimum; made contiguous; flash attention; a residual."""

    def __init__(self, heads: int = 4, length: int = 32, dim: int = 16, chain=None):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.length, self.dim = heads, length, dim
        self.qkv = nn.Linear(heads * dim, 3 * heads * dim)
        self.bias = nn.Parameter(torch.randn(length, length, heads))      # T5's embedding, permuted below
        self.chain = chain or (lambda keep, bias: torch.where(keep, bias, torch.finfo(torch.float32).min))

    def forward(self, x):                                                 # (N, L, heads * dim)
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, self.length, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
        keep = (torch.arange(self.length) >= 0)[None, None, :, None].expand(n, -1, self.length, self.length)
        mask = self.chain(keep, self.bias.permute(2, 0, 1)[None]).contiguous()
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + out.transpose(1, 2).reshape(n, self.length, -1)


def _peak(fn, x) -> int:
    with torch.inference_mode(), track_memory("cpu") as mem:
        out = fn(x)
        del out
    return mem.peak


def _total(pm, x) -> int:
    """The planned call's bytes: its arena and, by the allocator, what it allocates beyond it."""
    return pm.report.arena_bytes + _peak(pm, x)


def _mask_shapes(cap) -> list[tuple]:
    return [tuple(n.kwargs["attn_mask"].meta["val"].shape) for n in cap.ep.graph.nodes if n.target is flash]


def test_a_mask_broadcast_over_the_batch_is_made_once_bit_identical_and_fewer_bytes(monkeypatch):
    model, x = BiasedAttention().eval(), torch.randn(8, 32, 64)
    pm = plan(model, (x,))
    assert _mask_shapes(pm.captures[0]) == [(1, 4, 32, 32)]             # batch 1, flash attention broadcasts it
    planned = _total(pm, x)
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= planned     # the report is never below
    assert not [r for r in pm.report.rows if r.shape == (8, 4, 32, 32)]    # no mask of the whole batch exists
    with torch.inference_mode():
        for n in (8, 3):
            xb = torch.randn(n, 32, 64)
            assert torch.equal(pm(xb), model(xb))
    monkeypatch.setattr(captured, "broadcast_masks", lambda ep: [])
    before = plan(model, (x,))
    assert _mask_shapes(before.captures[0]) == [(8, 4, 32, 32)]
    assert planned < _total(before, x)          # 289,024 < 403,712 bytes here


@pytest.mark.parametrize("shape", [(8, 4, 32, 16, 32), (3, 2, 17, 8, 40), (2, 1, 129, 32, 65)])
def test_flash_attention_reads_a_broadcast_mask_as_the_full_one(shape):
    """The kernel property the rewrite rests on: flash attention (CPU) with a mask of size 1 in some dimensions gives
    the bits it gives with that mask repeated to the full shape, at sizes that are and are not multiples of its
    blocks."""
    b, h, lq, d, lk = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (lq, lk, lk))
    for small in [(1, h, lq, lk), (b, 1, lq, lk), (1, 1, lq, 1), (1, 1, 1, lk), (lq, 1), (1, lk)]:
        mask = torch.randn(small, generator=g).masked_fill(torch.rand(small, generator=g) < 0.2, -1e30)
        full = (b, h, lq, lk) if mask.dim() == 4 else (lq, lk)          # the kernel takes masks of 2 or 4 dims
        with torch.inference_mode():
            out = flash(q, k, v, attn_mask=mask, scale=0.3)
            ref = flash(q, k, v, attn_mask=mask.expand(full).contiguous(), scale=0.3)
        assert all(torch.equal(a, r) for a, r in zip(out, ref, strict=True)), small


def test_a_mask_chain_with_an_inexact_op_is_left_as_it_is():
    """exp's vectorised and scalar loops may differ in the last bit: a mask made by it keeps its full shape (an exp of
    the bias alone, an operand, would not matter: it runs at the bias's shape either way)."""
    model = BiasedAttention(chain=lambda keep, bias: torch.where(keep, bias, -1.0).exp()).eval()
    cap = capture_model(model, torch.randn(4, 32, 64))
    assert _mask_shapes(cap) == [(4, 4, 32, 32)]


def test_a_mask_whose_chain_is_read_elsewhere_is_left_as_it_is():
    """A tensor of the chain that another op reads would be made twice: not rewritten."""

    class ReadTwice(BiasedAttention):
        def forward(self, x):
            n = x.shape[0]
            q, k, v = self.qkv(x).view(n, self.length, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
            keep = (torch.arange(self.length) >= 0)[None, None, :, None].expand(n, -1, self.length, self.length)
            full = torch.where(keep, self.bias.permute(2, 0, 1)[None], -1e9)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=full.contiguous())
            return out.sum() + full.sum()

    cap = capture_model(ReadTwice().eval(), torch.randn(4, 32, 64))
    assert _mask_shapes(cap) == [(4, 4, 32, 32)]


def test_a_mask_that_differs_along_the_batch_is_left_as_it_is():
    """A padding mask from the input differs per sample: no dimension is broadcast in every operand."""

    class Padded(BiasedAttention):
        def forward(self, x):
            n = x.shape[0]
            q, k, v = self.qkv(x).view(n, self.length, 3, self.heads, self.dim).permute(2, 0, 3, 1, 4)
            keep = (x[:, :, 0] > 0)[:, None, None, :]                   # (N, 1, 1, L)
            mask = torch.where(keep, self.bias.permute(2, 0, 1)[None], -1e9).contiguous()
            return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    cap = capture_model(Padded().eval(), torch.randn(4, 32, 64))
    assert _mask_shapes(cap) == [(4, 4, 32, 32)]


def test_t5_encoder_masks_are_made_at_batch_1_bit_identical(monkeypatch):
    pytest.importorskip("transformers")
    from memfit.testing.zoo import build_real
    model, make_input = build_real("t5_encoder", quick=True)
    x = make_input(8)
    pm = plan(model, (x,))
    assert _mask_shapes(pm.captures[0]) == [(1, 4, 32, 32)] * 2          # one per layer
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))
    planned = _total(pm, x)
    monkeypatch.setattr(captured, "broadcast_masks", lambda ep: [])
    assert planned < _total(plan(model, (x,)), x)

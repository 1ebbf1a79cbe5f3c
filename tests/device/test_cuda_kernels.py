"""The CUDA kernels' byte formulas against the kernels' own fake implementations on fake CUDA tensors (these run
without autograd on any torch build, the CPU build included)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memfit.device.cuda_kernels import adamw_step, sdpa_backward, sdpa_forward
from memfit.device.fake_cuda import log_fake_cuda


def _nbytes(out) -> int:
    return sum(t.untyped_storage().nbytes() for t in out if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_len, kv_len", [(100, 100), (256, 384)])
def test_flash_forward_and_backward_bytes_are_the_fake_kernels(dtype, q_len, kv_len):
    with FakeTensorMode():
        q = torch.empty(2, 4, q_len, 64, device="cuda", dtype=dtype)
        kv = torch.empty(2, 4, kv_len, 64, device="cuda", dtype=dtype)
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            q, q, kv, kv, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, True, out[6], out[7])
    fwd = sdpa_forward("flash", 2, 4, q_len, kv_len, 64, dtype)
    assert fwd.outputs == _nbytes(out) and fwd.saved == out[1].nbytes == 4 * 2 * 4 * q_len
    bwd = sdpa_backward("flash", 2, 4, q_len, kv_len, 64, dtype)
    assert bwd.outputs == _nbytes(grads)
    # the inside workspaces (not in any fake kernel): softmax_d and dq_accum of flash_api.cpp's mha_bwd
    rows = -(-q_len // 128) * 128
    assert bwd.workspace == 4 * 2 * 4 * rows + 4 * 2 * rows * 4 * 64


@pytest.mark.parametrize("requires_grad", [True, False])
def test_memory_efficient_forward_bytes_are_the_fake_kernels(requires_grad):
    with FakeTensorMode():
        q = torch.empty(2, 4, 100, 64, device="cuda", dtype=torch.float32)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, requires_grad, 0.0, True)
    eff = sdpa_forward("efficient", 2, 4, 100, 100, 64, torch.float32, requires_grad=requires_grad)
    assert eff.outputs == _nbytes(out)
    assert eff.saved == (4 * 2 * 4 * 128 if requires_grad else 0)          # logsumexp rows padded to 32


def test_attention_without_the_t_by_t_matrix():
    flash = sdpa_forward("flash", 8, 16, 4096, 4096, 128, torch.bfloat16)
    math = sdpa_forward("math", 8, 16, 4096, 4096, 128, torch.bfloat16)
    assert math.saved == 4 * 8 * 16 * 4096 * 4096 and flash.saved == 4 * 8 * 16 * 4096
    with pytest.raises(ValueError, match="'flash', 'efficient' or 'math'"):
        sdpa_forward("cudnn", 1, 1, 1, 1, 8, torch.float16)


@pytest.mark.parametrize("impl", ["fused", "foreach", "for-loop"])
def test_adamw_state_and_temporaries_are_what_the_optimizer_allocates(impl):
    shapes = [(256, 256), (256,), (64, 256)]
    box = {}

    def make():
        params = [torch.zeros(s, device="cuda", requires_grad=True) for s in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        box["opt"] = torch.optim.AdamW(params, fused=impl == "fused", foreach=impl == "foreach")
        return params

    def step():
        box["opt"].step()

    run = log_fake_cuda(make, backward=False, after=step)
    before = [n for op, _, n in run.log if op < run.phases["forward"]]
    during = [n for op, _, n in run.log if run.phases["forward"] <= op < run.phases["after"]]
    live, peak = sum(before), sum(before)
    for n in during:
        live += n
        peak = max(peak, live)
    expected = adamw_step([4 * torch.Size(s).numel() for s in shapes], impl)
    assert live - sum(before) == expected.outputs            # the state made at the first step
    assert peak - live == expected.workspace                  # the temporaries at their largest

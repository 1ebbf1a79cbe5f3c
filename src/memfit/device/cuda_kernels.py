"""The CUDA kernels whose bytes differ from the CPU ones, as formulas: for a machine whose torch cannot run a
training step on fake CUDA tensors (a CPU build: `memfit.device.fake_cuda.cuda_fakes`), and for what no fake
kernel shows (the workspaces a kernel allocates and frees inside).

- `scaled_dot_product_attention` on an Ampere-or-newer GPU runs flash attention (fp16/bf16, no mask) or the
  memory-efficient kernel: neither makes the T x T attention matrix; both save a logsumexp (float32) for backward.
  The math kernel (the CPU's fallback shape, and CUDA's for other inputs) saves the softmax probabilities, and on
  CUDA computes half and bfloat16 inputs in float32. Shapes from the kernels' fake implementations (torch 2.13 and
  2.14 agree); flash backward's inside workspaces from aten/src/ATen/native/transformers/cuda/flash_attn/
  flash_api.cpp (`mha_bwd`: `softmax_d`, `dq_accum`, and for grouped heads `dk_expanded`, `dv_expanded`).
- Fused AdamW (`fused=True`) keeps each parameter's `step` as a float32 tensor on the GPU (one 512 B block each in
  the caching allocator) and allocates nothing while it steps; `foreach` (CUDA's default) keeps `step` on the CPU
  and allocates one temporary the size of every parameter at once (`_foreach_sqrt` of exp_avg_sq); the for-loop
  (what `torch.optim` picks under a fake mode) two per parameter, one parameter at a time.

Example:
    >>> flash = sdpa_forward("flash", batch=8, heads=16, q_len=4096, kv_len=4096, head_dim=128, dtype=torch.bfloat16)
    >>> math = sdpa_forward("math", batch=8, heads=16, q_len=4096, kv_len=4096, head_dim=128, dtype=torch.bfloat16)
    >>> flash.saved >> 20, math.saved >> 20         # the logsumexp against the float32 probabilities
    (2, 8192)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KernelBytes", "adamw_step", "flash_backward_workspaces", "sdpa_backward", "sdpa_forward"]

_FLASH_SRC = "aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp"


@dataclass(frozen=True)
class KernelBytes:
    """What one CUDA kernel call allocates, in bytes (tensor bytes: the caching allocator rounds each to 512 B).

    Attributes:
        outputs: the tensors it returns.
        saved: the part of `outputs` (or of its temporaries) autograd keeps for backward, beyond its inputs.
        workspace: what it allocates inside and frees before it returns (live at its call only).
        tensors: how many tensors `outputs` are (for the allocator's rounding).
        source: where the formula comes from.
    """
    kernel: str
    outputs: int
    saved: int
    workspace: int
    tensors: int
    source: str


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def sdpa_forward(kernel: str, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, dtype: torch.dtype,
                 requires_grad: bool = True, v_dim: int | None = None) -> KernelBytes:
    """One `scaled_dot_product_attention` forward on CUDA with `kernel` 'flash', 'efficient' or 'math'
    (inputs (batch, heads, q_len, head_dim); a head dim not a multiple of 8 is padded first, as torch does)."""
    v_dim = head_dim if v_dim is None else v_dim
    item = torch.empty((), dtype=dtype).element_size()
    b, h = batch, heads
    if kernel in ("flash", "efficient"):
        padded = _round(head_dim, 8) != head_dim or _round(v_dim, 8) != v_dim
        # the padded copies of q, k and v the composite makes (then freed with the call's inputs)
        pad = item * b * h * ((q_len + kv_len) * _round(head_dim, 8) + kv_len * _round(v_dim, 8)) if padded else 0
        out = item * b * h * q_len * _round(v_dim, 8)
        if kernel == "flash":
            lse = 4 * b * h * q_len                       # (B, H, T) float32
            extra, tensors = 16 + 8, 4                    # rng_state (2,) and unused () uint64
        else:
            lse = 4 * b * h * _round(q_len, 32) if requires_grad else 0   # padded to 32 rows; none without grad
            extra, tensors = 8 + 8, 4                     # philox seed and offset, int64 scalars
        return KernelBytes(kernel, out + lse + extra + pad, lse if requires_grad else 0, 0, tensors,
                           "the kernel's fake implementation (output, logsumexp, RNG state); padding as torch's "
                           "composite pads the head dim to 8")
    if kernel != "math":
        raise ValueError(f"kernel must be 'flash', 'efficient' or 'math', found {kernel!r}")
    up = 4 if dtype in (torch.float16, torch.bfloat16) else item   # CUDA's math kernel computes in float32
    probs = up * b * h * q_len * kv_len
    out = item * b * h * q_len * v_dim
    return KernelBytes("math", out + probs, probs if requires_grad else 0, up * b * h * q_len * kv_len, 2,
                       "the (B, H, T, S) probabilities kept for backward and the scores before them, in float32 "
                       "for half inputs (torch 2.14's decomposition on CUDA); its float32 copies of q, k and v are "
                       "not in this formula: a fake run counts them")


def flash_backward_workspaces(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, dtype: torch.dtype,
                              kv_heads: int | None = None, deterministic: bool = False, sms: int = 132) -> list[int]:
    """The blocks flash attention's backward allocates inside and frees before it returns, in bytes, one per
    tensor as `mha_bwd` makes them: softmax_d (B, H, Tq rounded to 128) and dq_accum (splits, B, Tq rounded to 128,
    H, D rounded to 32) in float32, then for grouped heads dk_expanded and dv_expanded (B, Tk, H, D).

    Example:
        >>> flash_backward_workspaces(2, 4, 100, 100, 64, torch.bfloat16)      # 128 rows each
        [4096, 262144]
    """
    kv_heads = heads if kv_heads is None else kv_heads
    item = torch.empty((), dtype=dtype).element_size()
    d = _round(head_dim, 8)
    q_r, d_r = _round(q_len, 128), _round(d, 32)
    splits = -(-sms // (batch * heads)) if deterministic else 1
    blocks = [4 * batch * heads * q_r, 4 * splits * batch * q_r * heads * d_r]
    if kv_heads != heads:
        blocks += [item * batch * kv_len * heads * d] * 2
    return blocks


def sdpa_backward(kernel: str, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, dtype: torch.dtype,
                  kv_heads: int | None = None, deterministic: bool = False, sms: int = 132) -> KernelBytes:
    """The flash attention backward on CUDA: dq, dk, dv, and the workspaces `mha_bwd` allocates inside
    (`flash_backward_workspaces`; `sms`: the GPU's multiprocessors, for the deterministic dq accumulator's splits;
    132 on an H100 SXM)."""
    if kernel != "flash":
        raise ValueError(f"only flash attention's backward is written down here, found {kernel!r}")
    kv_heads = heads if kv_heads is None else kv_heads
    item = torch.empty((), dtype=dtype).element_size()
    d = _round(head_dim, 8)
    grads = item * batch * d * (heads * q_len + 2 * kv_heads * kv_len)
    inside = flash_backward_workspaces(batch, heads, q_len, kv_len, head_dim, dtype, kv_heads, deterministic, sms)
    return KernelBytes("flash", grads, 0, sum(inside), 3,
                       f"{_FLASH_SRC} mha_bwd: softmax_d (B, H, Tq rounded to 128) and dq_accum (B, Tq rounded to "
                       "128, H, D rounded to 32) in float32, dk/dv expanded for grouped heads")


def adamw_step(param_bytes: list[int], impl: str) -> KernelBytes:
    """An AdamW step's device bytes on CUDA: its state (made at the first step: exp_avg and exp_avg_sq as each
    parameter, and for `fused` a float32 `step` per parameter on the GPU) and its temporaries at their largest.
    `impl`: 'fused', 'foreach' (CUDA's default) or 'for-loop' (what a fake mode picks); `param_bytes` per
    parameter."""
    total = sum(param_bytes)
    state = 2 * total + (4 * len(param_bytes) if impl == "fused" else 0)
    tensors = 2 * len(param_bytes) + (len(param_bytes) if impl == "fused" else 0)
    if impl == "fused":
        transient = 0
    elif impl == "foreach":
        transient = total                                  # _foreach_sqrt(exp_avg_sq): every parameter at once
    elif impl == "for-loop":
        transient = 2 * max(param_bytes, default=0)        # exp_avg_sq.sqrt() and its division, one parameter
    else:
        raise ValueError(f"impl must be 'fused', 'foreach' or 'for-loop', found {impl!r}")
    return KernelBytes(f"adamw ({impl})", state, 0, transient, tensors,
                       "torch/optim/adamw.py and adam.py: state at the first step, temporaries of the update")

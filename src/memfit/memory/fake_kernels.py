"""Where torch's fake (meta) kernels give an op's outputs other bytes than the real kernels do, and the bytes
the real ones give (`real_bytes`): what a fake run (`memfit.memory.fake_run`) logs instead.

Each entry was found by comparing a fake run with `memfit.memory.measure`'s live bytes of the real step; a test in
tests/memory/test_step_model.py guards each.
"""

from __future__ import annotations

import torch

__all__ = ["REAL_SIZE", "real_bytes"]


def _overloads(*names: str) -> frozenset:
    """The ATen overloads of these names ("aten.mse_loss.default") that this torch has."""
    found = set()
    for name in names:
        _, packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


_REAL_BYTES: dict = {}          # (argument shapes) -> bytes the bound below gives


def _lstm_workspace_bytes(args, kwargs: dict) -> int:
    """An upper bound, at this batch size, of the workspace the CPU (oneDNN) LSTM kernel keeps for backward,
    whose meta kernel says 0 bytes.

    oneDNN sizes it as a sum of parts, each proportional to the batch and rounded up to its alignment, so
    w(n) = sum(round_up(c_i * n)) lies between s * n and s * n + w(1) for the per-sample rate s, and
    w(m) / m >= s at any m. The real kernel is asked once per layer shape, on zeros, for w(1) and for w(m) at
    a batch m as large as about 0.2 GFLOP allows (2 to 256; a large LSTM still costs two real forwards of the
    layer at batch 1 and 2): the bound w(m) / m * n + w(1) is then affine in n (the fit through the probes
    holds at every size) and never below the real workspace."""
    from torch.utils._python_dispatch import _disable_current_modes
    func = torch.ops.aten.mkldnn_rnn_layer.default
    x, hidden = args[0], args[10]
    n, steps, width = x.shape[1], x.shape[0], x.shape[2]         # the input comes sequence first
    key = (steps, width, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                               for i, a in enumerate(args) if i not in (0, 5, 6) and not isinstance(a, list)),
           tuple(sorted(kwargs)))                             # not the batch: the same (rate, w(1)) at every n
    if key not in _REAL_BYTES:
        m = int(min(256, max(2, 2e8 / (8 * steps * hidden * (width + hidden)))))

        def workspace(b: int) -> int:
            def at(a, i):
                if not isinstance(a, torch.Tensor):
                    return a
                shape = list(a.shape)
                if i == 0:
                    shape[1] = b                      # x: (steps, batch, width)
                elif i in (5, 6):
                    shape[0] = b                      # hx, cx: (batch, hidden)
                return torch.zeros(shape, dtype=a.dtype)
            out = func(*(at(a, i) for i, a in enumerate(args)), **kwargs)[3]
            return 0 if out is None else out.untyped_storage().nbytes()
        with _disable_current_modes():
            one, big = workspace(1), workspace(m)
        _REAL_BYTES[key] = (-(-big // m), one)              # a whole byte rate: exactly affine in n
    rate, one = _REAL_BYTES[key]
    return rate * n + one


# batch norm on a half or bfloat16 input: the real kernels keep the saved mean and inverse std in float32
# (the accumulation type); the meta kernels give them the input's dtype
BATCH_NORM = _overloads("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                       "aten._native_batch_norm_legit_functional.default",
                       "aten._native_batch_norm_legit.no_stats")
# these CPU losses return the reduced scalar as a view of an input-sized buffer, which it keeps alive
CPU_LOSS_VIEWS = _overloads("aten.mse_loss.default", "aten.smooth_l1_loss.default",
                            "aten.binary_cross_entropy.default", "aten.soft_margin_loss.default")
# LSTM on the CPU (oneDNN): the meta kernel gives the workspace kept for backward no bytes at all; the real
# one's size is oneDNN's own: bounded from the real kernel's at two batch sizes
REAL_SIZE = {op: (3, _lstm_workspace_bytes) for op in _overloads("aten.mkldnn_rnn_layer.default")}


def real_bytes(func, index: int, t: torch.Tensor, nbytes: int, args, kwargs) -> int:
    """Bytes the real kernel gives output `index` of `func` where the fake kernel's `nbytes` differ from them."""
    if index in (1, 2) and func in BATCH_NORM and t.dtype in (torch.float16, torch.bfloat16):
        return nbytes * 2
    if index == 0 and func in CPU_LOSS_VIEWS and t.device.type == "cpu" and t.dim() == 0 and args:
        return max(nbytes, args[0].numel() * t.element_size())
    real = REAL_SIZE.get(func)
    if real is not None and real[0] == index and t.device.type == "cpu":
        return max(nbytes, real[1](args, kwargs or {}))
    return nbytes

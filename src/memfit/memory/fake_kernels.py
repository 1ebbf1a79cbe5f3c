"""Where torch's fake (meta) kernels give an op's outputs other bytes than the real kernels do, and the bytes
the real ones give (`real_bytes`): what a fake run (`memfit.memory.fake_run`) logs instead; and the bytes real
CPU kernels allocate inside beyond their outputs, freed before they return (`workspace_bytes`): oneDNN's
reordered weights, its result before the copy into the output, a temporary of an input's size; the
tensors made outside any op that the fake mode never sees (`host_tensors_logged`: the RNG states
`torch.utils.checkpoint` keeps); and the ops a composite of torch runs otherwise for a tensor subclass than for a
real tensor (`composites_as_real`: F.linear's bias add, in place for real).

Each entry was found by comparing a fake run with the allocator's bytes of the real step
(`memfit.device.measure.track_memory`); a test in tests/memory/test_step_model.py guards each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from memfit.device.replacements import ScopedReplacement
from memfit.device.torch_private import (
    disable_current_modes,
    op_schema,
    overload_name,
    tree_map,
    unset_fake_temporarily,
)

__all__ = ["BOUNDED_IN_BATCH", "REAL_SIZE", "WORKSPACE", "as_real_kernel_takes", "bias_added_in_place",
           "composites_as_real", "host_tensors_logged", "real_bytes", "workspace_bytes"]


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


def _rnn_rate_batch(steps: int, width: int, hidden: int) -> int:
    """The batch m at which an RNN layer's bytes are measured to bound its per-sample rate by w(m) / m: the larger
    m, the closer that is to the true rate (the parts' rounding spread over more samples), capped at about
    0.2 GFLOP of one forward of the layer (2 to 256)."""
    return int(min(256, max(2, 2e8 / (8 * steps * hidden * (width + hidden)))))


def _lstm_workspace_bytes(args, kwargs: dict) -> int:
    """An upper bound, at this batch size, of the workspace the CPU (oneDNN) LSTM kernel keeps for backward,
    whose meta kernel says 0 bytes.

    oneDNN sizes it as a sum of parts, each proportional to the batch and rounded up to its alignment, so
    w(n) = sum(round_up(c_i * n)) lies between s * n and s * n + w(1) for the per-sample rate s, and
    w(m) / m >= s at any m. The real kernel is asked once per layer shape, on zeros, for w(1) and for w(m) at
    a batch m as large as about 0.2 GFLOP allows (2 to 256; a large LSTM still costs two real forwards of the
    layer at batch 1 and 2): the bound w(m) / m * n + w(1) is then affine in n (the fit through the probes
    holds at every size) and never below the real workspace."""
    func = torch.ops.aten.mkldnn_rnn_layer.default
    x, hidden = args[0], args[10]
    n, steps, width = x.shape[1], x.shape[0], x.shape[2]         # the input comes sequence first
    key = (steps, width, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                               for i, a in enumerate(args) if i not in (0, 5, 6) and not isinstance(a, list)),
           tuple(sorted(kwargs)), torch.get_num_threads())    # not the batch: the same (rate, w(1)) at every n
    if key not in _REAL_BYTES:
        m = _rnn_rate_batch(steps, width, hidden)

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
        with disable_current_modes():
            one, big = workspace(1), workspace(m)
        _REAL_BYTES[key] = (-(-big // m), one)              # a whole byte rate: exactly affine in n
    rate, one = _REAL_BYTES[key]
    return rate * n + one


# batch norm on a half or bfloat16 input: the real kernels keep the saved mean and inverse std in float32
# (the accumulation type); the meta kernels give them the input's dtype
BATCH_NORM = _overloads("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                       "aten._native_batch_norm_legit_functional.default",
                       "aten._native_batch_norm_legit.no_stats")
# layer norm on a half or bfloat16 input with float32 weights (a bf16 activation under autocast, whose layer norm
# keeps its float32 parameters): the real CPU kernel keeps the mean and inverse std in float32, the meta kernel
# in the input's dtype (with half-precision weights both give the input's dtype)
LAYER_NORM = _overloads("aten.native_layer_norm.default")
# these CPU losses return the reduced scalar as a view of an input-sized buffer, which it keeps alive
CPU_LOSS_VIEWS = _overloads("aten.mse_loss.default", "aten.smooth_l1_loss.default",
                            "aten.binary_cross_entropy.default", "aten.soft_margin_loss.default")
# LSTM on the CPU (oneDNN): the meta kernel gives the workspace kept for backward no bytes at all; the real
# one's size is oneDNN's own: bounded from the real kernel's at two batch sizes
REAL_SIZE = {op: (3, _lstm_workspace_bytes) for op in _overloads("aten.mkldnn_rnn_layer.default")}


def real_bytes(func, index: int, t: torch.Tensor, nbytes: int, args, kwargs, cpu_kernels: bool = True) -> int:
    """Bytes the real kernel gives output `index` of `func` where the fake kernel's `nbytes` differ from them;
    `cpu_kernels=False`: for CUDA's kernels (a CUDA step predicted on CPU fakes): the CPU kernels' own differences
    left out."""
    if index in (1, 2) and func in BATCH_NORM and t.dtype in (torch.float16, torch.bfloat16):
        return nbytes * 2
    if not cpu_kernels:
        return nbytes
    if index in (1, 2) and func in LAYER_NORM and t.dtype in (torch.float16, torch.bfloat16) \
            and t.device.type == "cpu" and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32
                                               for a in args[2:4]):
        return nbytes * 2
    if index == 0 and func in CPU_LOSS_VIEWS and t.device.type == "cpu" and t.dim() == 0 and args:
        return max(nbytes, args[0].numel() * t.element_size())
    real = REAL_SIZE.get(func)
    if real is not None and real[0] == index and t.device.type == "cpu":
        return max(nbytes, real[1](args, kwargs or {}))
    return nbytes


# CPU kernels that allocate inside beyond their outputs (found by running every op of training steps of an MLP,
# ResNet-18, ConvNeXt, ViT, GPT-2 and a transformer encoder under the allocator's events): oneDNN convolution
# (weights reordered to its blocked layout; its result copied into the output), its backward (gradients in
# the blocked layout, then reordered), batch and group norm's backward (a temporary of the input's size), flash
# attention on the CPU (per-thread buffers), layer norm on a non-contiguous input (a contiguous copy) and its
# backward, max pooling, oneDNN's LSTM layer, batch norm's forward in eval mode. Each
# with its arguments that carry the batch: {position: dimension, or None for an int that is the batch}.
_BATCH_ARGS = {
    "aten.convolution.default": {0: 0},
    "aten.convolution_backward.default": {0: 0, 1: 0},
    "aten.native_batch_norm_backward.default": {0: 0, 1: 0},
    "aten._native_batch_norm_legit_no_training.default": {0: 0},   # eval: statistics made inside, 0-size outputs
    # an eager forward of BatchNorm in eval mode dispatches here (training=False): two (C,) float tensors made and
    # freed inside (512 B for 64 channels: a small CNN's eager forward peaked 240 B above its prediction there)
    "aten.native_batch_norm.default": {0: 0},
    "aten.native_group_norm_backward.default": {0: 0, 1: 0, 2: 0, 3: 0, 5: None},     # 5: N, the batch
    "aten._scaled_dot_product_flash_attention_for_cpu.default": {0: 0, 1: 0, 2: 0},
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0},
    "aten.native_layer_norm_backward.default": {0: 0, 1: 0, 3: 0, 4: 0},
    "aten.native_layer_norm.default": {0: 0},      # a permuted (non-contiguous) input: copied contiguous inside
    "aten.max_pool2d_with_indices.default": {0: 0},
    "aten.mkldnn_rnn_layer.default": {0: 1, 5: 0, 6: 0},        # the input comes sequence first
    # the fast paths of nn.TransformerEncoderLayer and nn.MultiheadAttention in eval mode without grad (batch first):
    # one kernel each, whose meta kernel gives its output alone; the real one makes the projections, the attention
    # and the feed-forward inside (an encoder layer's eager forward was predicted 0.40-0.54x its real peak)
    "aten._transformer_encoder_layer_fwd.default": {0: 0},
    "aten._native_multi_head_attention.default": {0: 0, 1: 0, 2: 0},
    # its backward: input, hx, cx, output, hy, cy and their gradients (the workspace, 22, is the forward's at that
    # batch: made again by the forward, `_rnn_backward_at`); on an AVX2 CPU 75 KiB + 24 KiB a sample for a 2-layer
    # 48-wide LSTM over 32 steps, uncounted until a step at batch 40 peaked 0.5% above its prediction
    "aten.mkldnn_rnn_layer_backward.default": {0: 1, 5: 0, 6: 0, 7: 1, 8: 0, 9: 0, 10: 1, 11: 0, 12: 0},
}
WORKSPACE = {op: _BATCH_ARGS[f"aten.{op_schema(op).name[6:]}.{overload_name(op)}"]
             for op in _overloads(*_BATCH_ARGS)}
_WORKSPACE_BYTES: dict = {}      # (op, argument shapes, strides, dtypes and values) -> (constant, batch part)
# oneDNN's RNN: workspace parts rounded up, not affine in the batch
_ROUNDED = _overloads("aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default")
_RNN_BACKWARD = _overloads("aten.mkldnn_rnn_layer_backward.default")
# ops of WORKSPACE whose bytes `workspace_bytes` bounds at every batch (w(1) + the rate at a large batch, which the
# rounding keeps above): a fake run logs them as that line. The bytes of every other op of WORKSPACE are oneDNN's
# choice per size (a 1x1 convolution 0 B up to batch 13, 1.4 MiB at 16; a transposed one's grows faster from 8): a
# line through a few batches held below the allocator beyond them (a U-Net's step at batch 37: 0.975), so the
# training memory model measures them at each batch it is asked about (`memfit.memory.kernel_scratch`)
BOUNDED_IN_BATCH = _ROUNDED
_LINE = (2, 4, 8)                # the batches whose workspaces give the line (constant, bytes per sample)
def as_real_kernel_takes(func, args, kwargs: dict) -> tuple[list, dict]:
    """(args, kwargs): real arguments made from a fake run's, as the real kernel gets them where the two differ: the
    real forward of batch norm (and of layer norm with float32 weights) on half-precision inputs saved its
    statistics in float32 (see `real_bytes`), the fake one in the input's dtype."""
    half = (torch.float16, torch.bfloat16)
    args = list(args)
    if func is torch.ops.aten.native_batch_norm_backward.default and args[1].dtype in half \
            and args[2] is not None and args[2].dtype == torch.float32:
        return [a.float() if i in (5, 6) and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)], kwargs
    if func is torch.ops.aten.native_layer_norm_backward.default and args[1].dtype in half \
            and any(isinstance(a, torch.Tensor) and a.dtype == torch.float32 for a in args[5:7]):
        return [a.float() if i in (3, 4) else a for i, a in enumerate(args)], kwargs
    return args, kwargs


def workspace_bytes(func, args, kwargs, exact: bool = True) -> tuple[int, int]:
    """(constant, batch part): bytes a real CPU kernel of `WORKSPACE` allocates beyond its outputs while it
    runs, (0, 0) for other ops. Measured once per argument shapes by running the real kernel on zeros of those
    shapes, strides and dtypes under the allocator's events, and at batches 2, 4 and 8: the least line above
    those with their steepest slope (raised to the bytes at b where they lie above it) splits it into a part the same at
    every batch (reordered weights) and one that grows with it (at batch 1, all of it: a kernel may take
    another path there). Runs at two batch sizes then see sizes constant or proportional, as an exact line
    needs (`memfit.memory.fit.proportional`; where they do not, more sizes run, batch 1 its own exact run).
    Counted at the op beside its inputs and outputs, it errs high by what the kernel frees before its outputs
    are made, never low.

    `exact=False`: above batch 8, the line alone, without running the kernel at this batch (a guide for choices,
    as the planner's slicing rule weighs batches up to 1024: never a figure reported as the bytes)."""
    dims = WORKSPACE.get(func)
    if dims is None:
        return 0, 0
    from memfit.device.kernel_probe import arguments_key, probe_bytes, zeros
    key = (func, arguments_key(args, kwargs), torch.get_num_threads(), exact)
    if key not in _WORKSPACE_BYTES:
        def real(a):            # zeros the system hands out zeroed: nothing written (the planner's probes up to
            if not isinstance(a, torch.Tensor):     # batch 1024 wrote every byte of each argument first)
                return a
            return zeros(tuple(a.shape), a.stride(), a.dtype)

        def grow(a: torch.Tensor, d: int, k: int) -> torch.Tensor:
            """`a` with k along dimension d: its own strides where d is outermost (a slice of a larger buffer
            keeps its layout, which the kernel's bytes may depend on), else k copies of its first entry."""
            if a.dim() and a.stride(d) == max(a.stride()):
                shape = list(a.shape)
                shape[d] = k
                return zeros(tuple(shape), a.stride(), a.dtype)
            return torch.cat([a.narrow(d, 0, 1)] * k, d)

        def at(r_args, r_kwargs, k):             # the batch made k
            b = r_args[0].shape[dims[0]]
            r_args = [a if i not in dims or a is None else k if dims[i] is None else grow(a, dims[i], k)
                      for i, a in enumerate(r_args)]
            if func in _RNN_BACKWARD:
                r_args = _rnn_backward_at(r_args)
            mask = r_kwargs.get("attn_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() and mask.shape[0] == b > 1:
                r_kwargs = {**r_kwargs, "attn_mask": grow(mask, 0, k)}
            return as_real_kernel_takes(func, r_args, r_kwargs)
        with unset_fake_temporarily(), torch.no_grad():
            r_args, r_kwargs = tree_map(real, (args, kwargs))
            b = r_args[0].shape[dims[0]]
            if func in _ROUNDED:
                # oneDNN's RNN sizes its buffers as parts each rounded up to an alignment: w(b) <= s*b + w(1)
                # for the per-sample rate s, and w(m)/m >= s (see `_lstm_workspace_bytes`); m fixed, so the
                # rate is the same in every run
                x = r_args[0]                          # (steps, batch, width); hidden: an int argument
                m = _rnn_rate_batch(x.shape[0], x.shape[2], r_args[15 if func in _RNN_BACKWARD else 10])
                one = probe_bytes(func, *at(r_args, r_kwargs, 1))
                rate = -(-probe_bytes(func, *at(r_args, r_kwargs, m)) // m)
                _WORKSPACE_BYTES[key] = (one, rate * b)
                return _WORKSPACE_BYTES[key]
            w = lambda k: probe_bytes(func, *at(r_args, r_kwargs, k)) if k != b else \
                probe_bytes(func, *as_real_kernel_takes(func, r_args, r_kwargs))
            if b == 1:
                # a kernel may take another path at batch 1 (oneDNN's convolution backward does: 192 bytes there,
                # 22 KiB at 2 for a small layer): its own bytes, which a line through larger batches would not give
                _WORKSPACE_BYTES[key] = (0, w(1))
                return _WORKSPACE_BYTES[key]
            # the least line above the bytes at batches 2, 4 and 8 with the steepest slope between them (whole
            # bytes): the same at every batch size, so runs at two sizes see each part constant or proportional
            # (oneDNN picks its algorithm by size: the bytes need not be affine); raised where batch b lies
            # above it, which makes the runs differ and more sizes run
            ws = {k: w(k) for k in _LINE}
            rate = max(0, *(-(-(ws[q] - ws[p]) // (q - p)) for p, q in zip(_LINE, _LINE[1:], strict=False)))
            at_b = w(b) - rate * b if exact or b <= _LINE[-1] else 0
            constant = max(0, *(ws[k] - rate * k for k in _LINE), at_b)
        _WORKSPACE_BYTES[key] = (constant, rate * b)
    return _WORKSPACE_BYTES[key]


def _rnn_backward_at(args: list) -> list:
    """The arguments of oneDNN's RNN layer backward with what its forward gives at this batch (output, hy, cy and
    the workspace, whose size is oneDNN's own and not a line in the batch) made by running that forward; the
    other arguments as given."""
    (x, w0, w1, w2, w3, hx, cx, _, _, _, _, _, _, reverse, mode, hidden, layers, biases, train, bidirectional,
     batch_sizes, batch_first, _) = args
    with torch.enable_grad():                   # under no_grad the forward keeps no workspace (None)
        out, hy, cy, ws = torch.ops.aten.mkldnn_rnn_layer.default(
            x, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden, layers, biases, bidirectional,
            batch_first, train)
    return [*args[:7], out, hy, cy, *args[10:22], ws]     # the gradients keep their layout (a transposed one is
    #                                                         copied inside the kernel)


# torch.get_rng_state makes a real tensor (the CPU generator's state: 5056 bytes) through no ATen op, so a fake
# mode never sees it; torch.utils.checkpoint takes one per checkpointed call when its forward runs (kept until
# the block's backward is done) and one more around each recomputation (`fork_rng`). On the CPU they are the
# device's bytes: a plan checkpointing 2 blocks of a small MLP peaked 5 KiB (5.4%) above its prediction.
_HOST = threading.local()           # `.record`: where this thread's fake run logs them (None: not logged);
#                                     `.linear_bias`: F.linear with a bias runs in this thread (`composites_as_real`)


def _logged(get_rng_state) -> torch.Tensor:
    state = get_rng_state()
    record = getattr(_HOST, "record", None)
    if record is not None:
        record("<torch.get_rng_state>", state)
    return state


_GET_RNG_STATE = ScopedReplacement(lambda: torch, "get_rng_state", _logged)


@contextmanager
def host_tensors_logged(record: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Inside the block, every `torch.get_rng_state()` on this thread is handed to record(name, state) as it is
    made: a fake run logs it as an op's output (freed when the last reference to it goes, as for real).
    `torch.get_rng_state` is replaced while any thread is inside such a block, for the threads inside only
    (`ScopedReplacement`: other threads' calls are torch's own; put back when the last leaves)."""
    outer, _HOST.record = getattr(_HOST, "record", None), record
    try:
        with _GET_RNG_STATE.active():
            yield
    finally:
        _HOST.record = outer


# ATen's linear (aten/src/ATen/native/Linear.cpp) with a bias, on an input not 2-D that it does not flatten into one
# addmm (torch 2.13/2.14: one not contiguous, as `lin(x.transpose(1, 2))`; or a bias it cannot fuse), runs matmul
# and then adds the bias: in place (`output.add_(bias)`) for a real tensor, out of place (`at::add`) for a tensor
# subclass (`isTensorSubclassLike`: a fake tensor), one more output-sized tensor live beside the matmul's result.
# A small model's step was predicted 1.2-1.6x its real peak. While a fake run logs, F.linear is replaced in the
# logging thread (`ScopedReplacement`) by torch's own inside a note that the bias add it runs is the real one's in
# place: the only `aten.add.Tensor` that linear dispatches (its matmul folds, views, copies and multiplies; autocast
# casts with `_to_copy`), which `memfit.memory.storage_log.StorageLog` then logs into its first argument's storage.
_ADD = torch.ops.aten.add.Tensor


def _linear_noted(linear, *args, **kwargs):
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    x = args[0] if args else kwargs.get("input")
    if bias is None or not isinstance(x, torch.Tensor) or x.dim() == 2:      # 2-D: one addmm, no add
        return linear(*args, **kwargs)
    outer, _HOST.linear_bias = getattr(_HOST, "linear_bias", False), True
    try:
        return linear(*args, **kwargs)
    finally:
        _HOST.linear_bias = outer


_LINEAR = ScopedReplacement(lambda: torch.nn.functional, "linear", _linear_noted)


@contextmanager
def composites_as_real() -> Iterator[None]:
    """Inside the block, this thread's F.linear notes where it adds its bias (`bias_added_in_place`): a real tensor's
    in place, a fake one's out of place (see above). `torch.nn.functional.linear` is replaced while any thread is
    inside such a block, for the threads inside only (`ScopedReplacement`)."""
    with _LINEAR.active():
        yield


def bias_added_in_place(func) -> bool:
    """Whether op `func`, dispatched now in this thread, is the bias add of a F.linear inside `composites_as_real`:
    the real kernel adds in place into its first argument (the matmul's result), which then is the output."""
    return func is _ADD and getattr(_HOST, "linear_bias", False)

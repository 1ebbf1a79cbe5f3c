"""Which ATen ops the planner can run into the arena: views, `out=` kernels, in-place allowlist.

An op's output can live in the arena only when the op has an `out=` variant with a real kernel
for the device (registered under the CPU or CUDA dispatch key). Many `out=` variants are generated
wrappers (`CompositeExplicitAutograd`) that allocate the result and copy it into `out`: on the CPU
that is the case for convolution, layer norm and `_native_batch_norm_legit_no_training`. Those are
either rewritten to an equivalent op that has a real kernel (`REWRITES`) or run normally, their
output reported as unplanned.

Example:
    >>> import torch
    >>> is_view(torch.ops.aten.permute.default), is_view(torch.ops.aten.mm.default)
    (True, False)
    >>> out_variant(torch.ops.aten.mm.default, "cpu").name
    'aten::mm.out'
    >>> out_variant(torch.ops.aten.convolution.default, "cpu") is None    # no real CPU out= kernel
    True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.device.torch_private import OpOverload, has_kernel, nn_binding, op_kernel, op_schema

__all__ = ["INPLACE", "WHEN_UNREAD", "Lowered", "inplace_candidates", "is_view", "lower", "out_variant",
           "why_not_lowered"]

aten = torch.ops.aten

# Ops whose result shares memory with an input although their schema does not say so.
_EXTRA_VIEWS = {"_unsafe_view", "alias", "lift_fresh", "detach"}

# Elementwise ops that may write over their input (same shape, strides and dtype; the input has no
# later reader). Every other op's output gets bytes no live tensor holds.
INPLACE = frozenset({
    "relu", "clamp", "clamp_min", "clamp_max", "hardtanh", "add", "sub", "mul", "div", "sigmoid", "tanh",
    "gelu", "silu", "hardswish", "hardsigmoid", "leaky_relu", "elu", "neg", "exp",
    "_native_batch_norm_legit_no_training",
})

# Python bindings that take the same positional arguments as the ATen op plus `out=`: about 1 us
# faster per call than going through the OpOverload (which matters for batch-1 MLPs).
_FAST = {name: getattr(torch, name) for name in (
    "add", "sub", "mul", "div", "addmm", "mm", "bmm", "baddbmm", "sigmoid", "tanh", "clamp_min", "clamp",
    "clamp_max", "cat", "mean", "sum", "exp", "neg", "rsqrt", "sqrt", "where", "maximum", "minimum",
    "index_select", "pow", "amax")}
_FAST.update({name: nn_binding(name) for name in (
    "hardtanh", "gelu", "silu", "hardswish", "hardsigmoid", "leaky_relu", "avg_pool2d")})


def is_view(op) -> bool:
    """True when the op returns a view of (an alias of) one of its inputs."""
    if not isinstance(op, OpOverload):
        return False
    if op_schema(op).name.split("::")[-1] in _EXTRA_VIEWS:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in op_schema(op).returns)


def _out_args(schema) -> list[str]:
    return [a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]


@dataclass(frozen=True)
class OutVariant:
    """An `out=` overload: `name` for messages, `fn` to call, `outs` the names of its out arguments."""
    name: str
    fn: Callable
    outs: tuple[str, ...]
    fast: bool            # fn is a Python binding: single output passed as out=


_KERNEL_KEYS = {"cpu": "CPU", "cuda": "CUDA"}      # devices whose out= kernels the planner runs into its arena


@functools.cache
def out_variant(op, device_type: str) -> OutVariant | None:
    """The `out=` overload of `op` with a real kernel on `device_type` ('cpu' or 'cuda'), or None.

    Matching is by signature: the overload whose arguments, less its out arguments, are the op's.
    """
    if not isinstance(op, OpOverload) or is_view(op):
        return None
    key = _KERNEL_KEYS.get(device_type)
    if key is None:
        return None
    want = [(a.name, str(a.type)) for a in op_schema(op).arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        ov = getattr(packet, name)
        outs = _out_args(op_schema(ov))
        if not outs or [(a.name, str(a.type)) for a in op_schema(ov).arguments if a.name not in outs] != want:
            continue
        if not has_kernel(ov, key):
            return None        # a generated wrapper that allocates and copies: no memory saved
        short = packet.__name__
        fast = len(outs) == 1 and outs[0] == "out" and short in _FAST
        return OutVariant(ov.name(), _FAST[short] if fast else op_kernel(ov), tuple(outs), fast)
    return None


@dataclass(frozen=True)
class Lowered:
    """How to run one op into preallocated outputs: `fn(*args, **kwargs, <outs[i]>=output i)`."""
    variant: OutVariant
    args: tuple
    kwargs: dict


def _relu(args, kwargs, metas, dev):
    v = out_variant(aten.clamp_min.default, dev)
    return v and Lowered(v, (args[0], 0), {})


def _batch_norm_eval(args, kwargs, metas, dev):
    # native_batch_norm.out has a real CPU kernel; with training=False it only normalises
    v = out_variant(aten.native_batch_norm.default, dev)
    x, w, b, mean, var, momentum, eps = args
    return v and Lowered(v, (x, w, b, mean, var, False, momentum, eps), {})


def _upsample_nearest2d_vec(args, kwargs, metas, dev):
    x, size, scales = (list(args) + [None, None])[:3]
    v = out_variant(aten.upsample_nearest2d.default, dev)
    sh, sw = scales if scales is not None else (None, None)
    return v and Lowered(v, (x, list(metas[0].shape[-2:]), sh, sw), {})


def _copy_into(x, *, out, **_):
    # clone / _to_copy into a preallocated tensor: copy_ converts dtype and keeps out's strides,
    # which are the strides the functional op would give (the planner allocates them from its meta)
    return out.copy_(x)


_COPY = OutVariant("Tensor.copy_", _copy_into, ("out",), True)


def _copy(args, kwargs, metas, dev):
    x = args[0]
    device = kwargs.get("device")
    if (device is not None and torch.device(device).type != dev) or kwargs.get("layout") not in (None, torch.strided):
        return None
    return Lowered(_COPY, (x,), {})


REWRITES: dict[object, Callable] = {
    aten.clone.default: _copy,
    aten._to_copy.default: _copy,
    aten.relu.default: _relu,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval,
    aten.upsample_nearest2d.vec: _upsample_nearest2d_vec,
}


def lower(op, args: tuple, kwargs: dict, metas: list, device_type: str) -> Lowered | None:
    """How to run `op(*args, **kwargs)` writing into preallocated outputs, or None when it cannot."""
    if op in REWRITES:
        return REWRITES[op](args, kwargs, metas, device_type)
    into = getattr(op, "into", None)         # planner.sliced.SlicedSegment: its slices written into a given output
    if into is not None:
        return into(args, kwargs, metas, device_type)
    v = out_variant(op, device_type)
    if v is None or len(v.outs) != len(metas):
        return None
    return Lowered(v, tuple(args), dict(kwargs))


def _max_pool2d_no_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    # eager's max_pool2d on the CPU makes no indices; the decomposed graph asks for int64 indices
    # (twice the bytes of the values) even when nothing reads them
    return torch.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode), None


# ops to run with another function (no out=) when some of their outputs are never read:
# op -> (output positions that must be unread, replacement)
WHEN_UNREAD: dict[object, tuple[tuple[int, ...], Callable]] = {
    aten.max_pool2d_with_indices.default: ((1,), _max_pool2d_no_indices),
}


def why_not_lowered(op, device_type: str) -> str:
    """Why `lower` found no way to run `op` into the arena, in words for the report."""
    if getattr(op, "__name__", "") == "batch_slices":            # planner.sliced.SlicedSegment
        return ("a segment of per-sample ops run in slices of the batch (planner.slicing): its intermediates exist "
                "for one slice at a time, its output is allocated by torch")
    if not isinstance(op, OpOverload):
        return "not an ATen op"
    if device_type not in _KERNEL_KEYS:
        return f"nothing runs into the arena on {device_type} (only on cpu and cuda)"
    want = [(a.name, str(a.type)) for a in op_schema(op).arguments]
    packet = op.overloadpacket
    for name in packet.overloads():
        ov = getattr(packet, name)
        outs = _out_args(op_schema(ov))
        if outs and [(a.name, str(a.type)) for a in op_schema(ov).arguments if a.name not in outs] == want:
            if not has_kernel(ov, _KERNEL_KEYS[device_type]):
                return (f"its out= variant on {device_type} is a wrapper that allocates and copies: "
                        "no memory saved, slower than eager")
            return "its out= variant returns a different number of outputs"
    return "no out= variant"


def inplace_candidates(op, args: tuple) -> list[int]:
    """Positions of the arguments an allowlisted elementwise op may overwrite (the first, and the
    second for the commutative binary ops); a sliced segment's input (each slice reads its own samples of it, all
    of them before its result is written there)."""
    if getattr(op, "__name__", "") == "batch_slices":            # planner.sliced.SlicedSegment: over its input
        return [0]
    if not isinstance(op, OpOverload) or op.overloadpacket.__name__ not in INPLACE:
        return []
    return [0, 1] if op.overloadpacket.__name__ in ("add", "mul") and len(args) > 1 else [0]

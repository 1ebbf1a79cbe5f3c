"""Capture a model as a flat graph of core ATen ops with `torch.export` and `run_decompositions()`.

Example:
    >>> import torch
    >>> ep = capture(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> [n.target.__name__ for n in ep.graph.nodes if n.op == "call_function"]
    ['permute.default', 'addmm.default', 'relu.default']
"""

from __future__ import annotations

import functools
import warnings

import torch

__all__ = ["CaptureError", "as_inputs", "capture", "constants"]


class CaptureError(RuntimeError):
    """`torch.export` could not capture the model as one static graph (the reason is in the message)."""


def as_inputs(example_inputs) -> tuple:
    """`example_inputs` as a tuple of tensors (one tensor is wrapped), or a TypeError saying so."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)) or not all(isinstance(x, torch.Tensor) for x in example_inputs):
        found = [type(x).__name__ for x in example_inputs] if isinstance(example_inputs, (tuple, list)) \
            else type(example_inputs).__name__
        raise TypeError(f"expected example_inputs as a tuple of tensors, e.g. (torch.empty(8, 3, 32, 32),); "
                        f"found {found}")
    return tuple(example_inputs)


@functools.cache
def decompositions(device_type: str) -> dict:
    """Core ATen decompositions, less those of ops with a real kernel on the device.

    Eager PyTorch runs `silu` as one kernel; the default table rewrites it as `sigmoid` then `mul`
    (two passes over memory, one more intermediate, and results that differ from eager in the last
    bit), and `hardswish` as five ops. Keeping every functional op that has its own kernel runs what
    eager runs, so the planned model is never slower for lack of a fused kernel.
    """
    table = torch.export.default_decompositions()
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    if key is None:
        return table
    for op in list(table):
        if (isinstance(op, torch._ops.OpOverload) and not op._schema.is_mutable
                and not any(r.alias_info is not None for r in op._schema.returns)
                and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)):
            del table[op]
    return table


def capture(model: torch.nn.Module, example_inputs: tuple) -> torch.export.ExportedProgram:
    """Export `model` at the shapes of `example_inputs` and decompose to core ATen ops.

    Raises:
        TypeError: `model` is not an `nn.Module` or an input is not a tensor.
        CaptureError: export failed (data-dependent control flow, unsupported Python, ...), or the
            forward mutates its buffers or inputs (a BatchNorm in training mode, say).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module to plan; found {type(model).__name__}")
    example_inputs = as_inputs(example_inputs)
    try:
        with warnings.catch_warnings():
            # torch 2.13's export warns about its own pytree internals (LeafSpec): not the user's concern
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = torch.export.export(model, tuple(example_inputs), strict=False)
            device = example_inputs[0].device.type if example_inputs else "cpu"
            ep = ep.run_decompositions(dict(decompositions(device)))
    except Exception as e:                     # export raises many types; all mean "cannot capture"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CaptureError(f"torch.export could not capture {type(model).__name__}: {type(e).__name__}: {reason}. "
                           "memfit plans models that export as one static graph; run the model eagerly "
                           "instead (or remove data-dependent Python control flow)") from e
    mutated = [s.target for s in ep.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if mutated:
        raise CaptureError(f"{type(model).__name__}.forward writes to {mutated} (a BatchNorm in training mode?); "
                           "the planner runs inference only: call model.eval() before planning")
    return ep


def constants(ep: torch.export.ExportedProgram, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Placeholder name -> the tensor it stands for: the model's own parameters and buffers (so
    in-place weight updates after planning are seen) and the constants export lifted."""
    out = {}
    for spec in ep.graph_signature.input_specs:
        kind, name, target = spec.kind.name, spec.arg.name, spec.target
        if kind == "PARAMETER":
            out[name] = model.get_parameter(target)
        elif kind == "BUFFER":
            out[name] = model.get_buffer(target)
        elif kind == "CONSTANT_TENSOR":
            out[name] = ep.constants[target]
        elif kind != "USER_INPUT":
            raise CaptureError(f"input {name!r} of kind {kind} is not supported by the planner; "
                               "run the model eagerly instead")
    return out

"""Capture a model as a flat graph of core ATen ops with `torch.export` and `run_decompositions()`.

Example:
    >>> import torch
    >>> ep = capture(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), (torch.ones(2, 4),))
    >>> [n.target.__name__ for n in ep.graph.nodes if n.op == "call_function"]
    ['permute.default', 'addmm.default', 'relu.default']
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import warnings

import torch

from memfit.device.torch_private import OpOverload, cia_split_kept, has_kernel, op_schema
from memfit.input_mistakes import input_hint
from memfit.memory.global_caches import function_caches_kept_real
from memfit.memory.isolation import predicting, structural_copy, traced_section, tracer_patches_this_thread_only
from memfit.messages import first_line

__all__ = ["CaptureError", "as_inputs", "capture", "constants", "decompositions", "diagnose", "quiet_torch"]


class CaptureError(RuntimeError):
    """The model could not be captured as one static graph; the message says why in one line.

    Attributes:
        kind: "inputs" (the model fails on the example inputs even eagerly: a shape or dtype
            mistake), "data-dependent" (control flow or output shapes that depend on values),
            "mutation" (the forward writes to its buffers), or "export" (anything else torch.export
            cannot trace).
    """

    def __init__(self, message: str, kind: str = "export"):
        super().__init__(message)
        self.kind = kind


DEBUG_ENV = "MEMFIT_DEBUG"      # set to 1 to see torch's own log lines and tracebacks during capture


@contextlib.contextmanager
def quiet_torch():
    """Silence torch's loggers (fake-tensor error lines) and stderr (graph dumps of failed traces)
    while capturing; both are restored afterwards. `MEMFIT_DEBUG=1` keeps them."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        yield
        return
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    saved = [(lg, lg.level, lg.propagate, lg.disabled) for lg in loggers]
    try:
        for lg in loggers:
            lg.disabled = True
        with contextlib.redirect_stderr(io.StringIO()):     # export prints graph dumps of failed traces
            yield
    finally:
        for lg, level, propagate, disabled in saved:
            if lg.level != level:       # setLevel clears every logger's cache: 0.1 s over torch's ~290 loggers
                lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled


def _fails_eagerly(model: torch.nn.Module, inputs: tuple) -> BaseException | None:
    """Run the model eagerly on the example inputs (only after a failed capture); the error, or None.
    The whole example, not one sample: a model may be written for its batch size."""
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(*inputs)
    except Exception as e:                          # any error here is the model's own reaction to the inputs
        return e
    return None


def diagnose(model: torch.nn.Module, inputs: tuple, error: BaseException) -> CaptureError:
    """The one-line CaptureError for an export failure: an input mistake, data-dependence or other."""
    name = type(model).__name__
    eager = _fails_eagerly(model, inputs)
    if eager is not None:
        return CaptureError(f"{name} fails on the example inputs, before any capture: "
                            f"{first_line(eager, with_type=False)} ({input_hint(str(eager), inputs)})", kind="inputs")
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # with sympy: ~0.9 s to import
    text = first_line(error)
    if isinstance(error, GuardOnDataDependentSymNode) or "data-dependent" in text.lower() \
            or "data dependent" in text.lower():
        return CaptureError(f"{name} has control flow or output shapes that depend on tensor values ({text}); "
                            "the planner needs one static graph: run the model eagerly, or compute the "
                            "value-dependent part (boolean-mask indexing, nonzero, .item()) outside the model",
                            kind="data-dependent")
    return CaptureError(f"torch.export could not capture {name} ({text}); the planner needs a model that exports "
                        f"as one graph: run it eagerly instead (set {DEBUG_ENV}=1 to see torch's own log)")


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
        if (isinstance(op, OpOverload) and not op_schema(op).is_mutable
                and not any(r.alias_info is not None for r in op_schema(op).returns)
                and has_kernel(op, key)):
            del table[op]
    return table


def capture(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes=None,
            explain: bool = True) -> torch.export.ExportedProgram:
    """Export `model` at the shapes of `example_inputs` (sizes symbolic where `dynamic_shapes`, as
    in `torch.export.export`, says so) and decompose to core ATen ops. `explain=False` skips the
    diagnosis of a failure (an eager run): for attempts that have a fallback.

    Raises:
        TypeError: `model` is not an `nn.Module` or an input is not a tensor.
        CaptureError: export failed (data-dependent control flow, unsupported Python, ...), or the
            forward mutates its buffers or inputs (a BatchNorm in training mode, say).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module to plan; found {type(model).__name__}")
    example_inputs = as_inputs(example_inputs)
    try:
        with quiet_torch(), warnings.catch_warnings(), function_caches_kept_real(model):
            # torch 2.13's export warns about its own pytree internals (LeafSpec): not the user's concern
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            # a copy of the module tree: export swaps in fake parameters, which every thread would see on the
            # model; its tracer's patches of Module.__call__ stay in this thread
            with predicting(), tracer_patches_this_thread_only(), traced_section():
                ep = torch.export.export(structural_copy(model), tuple(example_inputs),
                                         dynamic_shapes=dynamic_shapes, strict=False)
                device = example_inputs[0].device.type if example_inputs else "cpu"
                with cia_split_kept():      # torch's split of the table, found once (0.11 s a capture)
                    ep = ep.run_decompositions(dict(decompositions(device)))
    except Exception as e:                     # export raises many types; all mean "cannot capture"
        debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        with predicting():                     # the diagnosis runs the model: its RNG draws are not the user's
            err = diagnose(model, example_inputs, e) if explain else CaptureError(first_line(e))
        raise err from (e if debug else None)
    mutated = [s.target for s in ep.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if mutated:
        raise CaptureError(f"{type(model).__name__}.forward writes to {mutated} (a BatchNorm in training mode?); "
                           "the planner runs inference only: call model.eval() before planning", kind="mutation")
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

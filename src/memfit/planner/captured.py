"""`capture_model(model, example_inputs)`: one `torch.export` capture with the batch dimension symbolic where
the model allows it, from which every batch size is placed (`planner.placement.place_at`) without exporting again.

Example:
    >>> import torch
    >>> cap = capture_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.zeros(2, 8))
    >>> cap.dynamic, cap.batch_range
    (True, (2, None))
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from memfit.memory.isolation import predicting
from memfit.messages import first_line
from memfit.planner.capture import CaptureError, as_inputs, capture, constants
from memfit.planner.graph import Meta
from memfit.planner.masks import broadcast_masks
from memfit.planner.remat import recompute_at_readers
from memfit.planner.slicing import slice_segments

__all__ = ["Captured", "capture_model", "input_key"]

log = logging.getLogger("memfit.planner")


def input_key(inputs) -> tuple:
    """What picks a plan: every input's shape, strides, dtype and device (a dtype or device the example did not
    have misses the cache, so the planned module's checks run only then: 0.5 us less per call than isinstance
    checks plus a dtype check of the first input, 2.0 -> 1.5 us on a batch-1 MLP)."""
    return tuple([(x.shape, x.stride(), x.dtype, x.device) for x in inputs])


@dataclass
class Captured:
    """One `torch.export` capture of a model, with the batch dimension symbolic where it can be:
    placements for any algorithm and any batch size in `batch_range` come from it, no re-export.

    It holds the parameters (by reference) but not the module, so a cache of captures never keeps a
    model alive.

    Attributes:
        batch: the batch size symbol (a sympy Symbol), or None when the capture is static.
        batch_range: (lowest, highest) batch the graph is valid for (highest None: unbounded).
        static_reason: why the batch could not be symbolic ("" when it is).
        example_batch: the batch of the example inputs.
    """
    ep: torch.export.ExportedProgram
    consts: dict[str, torch.Tensor]
    device: torch.device
    batch: object = None
    batch_range: tuple = (None, None)
    static_reason: str = ""
    example_batch: int | None = None
    example_key: tuple = ()
    kernel_layouts: dict = field(default_factory=dict)   # node name -> why it runs eagerly (see _kernel_layouts)
    run_eagerly: dict = field(default_factory=dict)      # node name -> why: run by torch whatever the bytes (tests)
    sliced: dict = field(default_factory=dict)           # node name -> the segment it runs in batch slices (slicing)

    @property
    def dynamic(self) -> bool:
        return self.batch is not None

    def env(self, n: int | None) -> dict:
        return {} if self.batch is None or n is None else {self.batch: n}

    @staticmethod
    def batch_of(inputs: tuple) -> int | None:
        return inputs[0].shape[0] if inputs and inputs[0].dim() else None

    def accepts(self, inputs: tuple) -> bool:
        """Whether these inputs can be planned from this capture; False when they need a new capture
        (another sample shape, dtype or strides; a batch outside the range; any change if static)."""
        if not self.dynamic:
            return input_key(inputs) == self.example_key
        n = self.batch_of(inputs)
        lo, hi = self.batch_range
        if n is None or n < lo or (hi is not None and n > hi):
            return False
        specs = [p.meta["val"] for p in self.ep.graph.nodes if p.op == "placeholder" and p.name not in self.consts]
        if len(specs) != len(inputs):
            return False
        for x, fake in zip(inputs, specs, strict=True):
            meta = Meta.of(fake, self.env(n))
            if x.dtype != meta.dtype or tuple(x.shape) != meta.shape or tuple(x.stride()) != meta.strides:
                return False
        return True


def _batch_dims(example_inputs: tuple):
    """`dynamic_shapes` with dim 0 of every input one shared symbolic batch, or a reason it cannot be."""
    if not example_inputs or any(x.dim() == 0 for x in example_inputs):
        return None, "an input has no batch dimension"
    if len({x.shape[0] for x in example_inputs}) != 1:
        return None, "the inputs' first dimensions differ, so there is no one batch dimension"
    # from 2: with min=1 export may assume the batch is never 1 (size-1 specialisation), so a model that
    # squeezes or branches on a size of 1 would run differently at batch 1; batch 1 gets a capture of its own
    batch = torch.export.Dim("batch", min=2)
    return tuple({0: batch} for _ in example_inputs), ""


def capture_model(model: torch.nn.Module, example_inputs, *, dynamic_batch: bool = True) -> Captured:
    """Export `model` once, with the batch dimension symbolic where the model allows it (else at the
    example's shapes, the reason kept in `static_reason`). Raises CaptureError, TypeError. One capture at a
    time in the process, every RNG left as found (`memfit.memory.isolation.predicting`)."""
    with predicting():
        return _capture_model(model, example_inputs, dynamic_batch)


def _capture_model(model: torch.nn.Module, example_inputs, dynamic_batch: bool) -> Captured:
    example_inputs = as_inputs(example_inputs)
    device = example_inputs[0].device if len(example_inputs) else torch.device("cpu")
    n = example_inputs[0].shape[0] if example_inputs and example_inputs[0].dim() else None
    key = input_key(example_inputs)
    dims, reason = _batch_dims(example_inputs) if dynamic_batch else (None, "a static capture was asked for")
    if dims is not None and n == 1:
        dims, reason = None, "batch 1 is captured on its own (a symbolic batch starts at 2)"
    if dims is not None:
        try:
            ep = capture(model, example_inputs, dims, explain=False)
        except CaptureError as e:                 # the static capture below explains errors of its own
            reason = f"the batch cannot be symbolic ({e})"
        else:
            sym = _batch_symbol(ep)
            if sym is not None:
                vr = ep.range_constraints.get(sym)
                hi = None if vr is None or vr.upper.is_infinite or str(vr.upper) == "int_oo" else int(vr.upper)
                cap = Captured(ep, constants(ep, model), device, sym, (int(vr.lower) if vr else 2, hi), "", n, key)
                if cap.accepts(example_inputs):
                    _rewrite(cap, example_inputs)
                    cap.kernel_layouts = _kernel_layouts(cap, example_inputs)
                    return cap
                reason = (f"the symbolic graph holds for batch sizes in [{cap.batch_range[0]}, "
                          f"{hi or 'inf'}] only, not {n}")
            else:
                reason = "export made the batch size a constant (the model specialises on it)"
    ep = capture(model, example_inputs)
    cap = Captured(ep, constants(ep, model), device, None, (n, n), reason, n, key)
    _rewrite(cap, example_inputs)
    cap.kernel_layouts = _kernel_layouts(cap, example_inputs)
    return cap


def _rewrite(cap: Captured, example_inputs: tuple) -> None:
    """The graph rewritten for fewer bytes, each rewrite exact: masks at their broadcast shape, small input-free
    tensors recomputed at each reader, then per-sample blocks in slices of the batch (which read those masks and
    tensors as they are: each slice reads the same)."""
    broadcast_masks(cap.ep)
    recompute_at_readers(cap.ep, cap.consts, cap.env(cap.example_batch))
    cap.sliced = slice_segments(cap.ep, cap.consts, example_inputs, cap.batch, cap.batch_range)


def _kernel_layouts(cap: Captured, example_inputs: tuple) -> dict[str, str]:
    """Node name -> reason, for the ops whose real kernel gives its output other strides than the graph's
    metadata says (the strides an arena view gets): written into such a view, the kernel would compute in its
    own layout and copy, or write strided against it. One eager run of the graph on the example finds them
    (on the 14 `transformers` architectures of the benchmark and memfit's 8 zoo models: none); they run
    eagerly. The check is at the example's batch; the strides a kernel picks follow the shapes' order, not their
    sizes (dimensions of size 1 aside, which are not compared)."""
    from torch.fx import Interpreter
    env = cap.env(cap.example_batch)
    found: dict[str, str] = {}

    class Layouts(Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node.op != "call_function":
                return out
            vals = node.meta.get("val")
            pairs = zip(out, vals, strict=False) if isinstance(out, (tuple, list)) and isinstance(vals, (tuple, list)) \
                else [(out, vals)]
            for real, meta in pairs:
                if not (isinstance(real, torch.Tensor) and isinstance(meta, torch.Tensor)):
                    continue
                m = Meta.of(meta, env)
                if tuple(real.shape) == m.shape and any(a != b for a, b, d in zip(real.stride(), m.strides, m.shape,
                                                                                    strict=True) if d > 1):
                    found[node.name] = (f"its kernel gives strides {tuple(real.stride())} where the graph says "
                                        f"{m.strides}: written into an arena view it would go through its own layout")
            return out
    # the lifted graph itself, its parameters, buffers and constants passed as the inputs they are: `ep.module()`
    # would first unlift them into a new module (a copy of the graph, recompiled: 2x the run itself on ResNet)
    inputs = iter(example_inputs)
    args = [cap.consts[p.name] if p.name in cap.consts else next(inputs)
            for p in cap.ep.graph.nodes if p.op == "placeholder"]
    try:
        with torch.no_grad():            # no buffer is written: capture refuses a forward that writes one
            Layouts(cap.ep.graph_module).run(*args, enable_io_processing=False)
    except Exception as e:               # only a speed rule: a graph that does not run here runs as planned
        log.info("the check that kernels give the strides of the graph did not run (%s): ops run as planned",
                 first_line(e))
        return {}
    return found


def _batch_symbol(ep):
    for p in ep.graph.nodes:
        if p.op == "placeholder" and p.name in {s.arg.name for s in ep.graph_signature.input_specs
                                                if s.kind.name == "USER_INPUT"}:
            size = p.meta["val"].shape[0]
            if isinstance(size, torch.SymInt) and len(size.node.expr.free_symbols) == 1:
                return next(iter(size.node.expr.free_symbols))
            return None
    return None

"""Generate the straight-line Python function that runs a plan, as torch.fx generates code.

One line per op and no interpreter loop: an op with a real `out=` kernel writes into its arena
view (`f_3(g_x, g_w, out=g_addmm)`), views of the arena and of parameters are made once at plan
time, and only views of the caller's inputs and outputs of ops without an `out=` kernel are made
per call (the latter deleted after their last reader, so torch can reuse their memory).

Objects the code reads (kernels, plan-time tensors, constants) are globals of the function, not
attributes of a module: a global costs one dictionary look-up, an attribute two (this is why the
generator writes Python itself instead of recompiling a `torch.fx.GraphModule`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from memfit.device.torch_private import op_kernel
from memfit.planner.graph import Graph, OpRun
from memfit.planner.workspaces import handed_over

__all__ = ["generate"]

aten = torch.ops.aten

# Tensor methods are cheaper to call than the OpOverload (about 2 us less per view).
_VIEW_FAST = {
    aten.view.default: torch.Tensor.view, aten._unsafe_view.default: torch.Tensor.view,
    aten.permute.default: torch.Tensor.permute, aten.expand.default: torch.Tensor.expand,
    aten.unsqueeze.default: torch.Tensor.unsqueeze, aten.squeeze.dim: torch.Tensor.squeeze,
    aten.transpose.int: torch.Tensor.transpose, aten.select.int: torch.Tensor.select, aten.t.default: torch.Tensor.t,
}
_CALL_FAST = {aten.convolution.default: torch.convolution, aten.native_layer_norm.default: torch.native_layer_norm}


def _callable(op) -> Callable:
    if op in _CALL_FAST:
        return _CALL_FAST[op]
    if op in _VIEW_FAST:
        return _VIEW_FAST[op]
    return op_kernel(op)


_PER_CALL = object()      # marks a value known only when the generated function runs
_HELD = object()          # the local `held`: a sliced segment's input handed over in a list (`_emit_call`)


@dataclass
class _Value:
    """How the generated code reaches one tensor value: a Python expression (a global `g_3` or a
    local `v_add`) and, for values fixed at plan time (parameters, arena views), the tensor itself."""
    expr: str
    tensor: torch.Tensor | None = None


@dataclass
class _Source:
    """The function being written: its globals, its lines and every tensor value it can name."""
    graph: Graph
    values: dict[str, _Value] = field(default_factory=dict)     # value name -> how to reach it
    glb: dict[str, object] = field(default_factory=dict)         # the function's globals
    lines: list[str] = field(default_factory=list)
    locals_of: dict[str, list[str]] = field(default_factory=dict)   # root -> its per-call locals to delete
    node_value: dict[Node, str] = field(default_factory=dict)   # fx node -> its (first) value name

    def stash(self, obj, prefix: str = "k") -> str:
        name = f"{prefix}_{len(self.glb)}"
        self.glb[name] = obj
        return name

    def fix(self, value: str, t: torch.Tensor) -> None:
        self.values[value] = _Value(self.stash(t, "g"), t)

    def value_of(self, node: Node) -> _Value:
        return self.values[node.name if node.op == "placeholder" else self.node_value[node]]

    def render(self, x) -> str:
        """Python source for an argument: a value's expression, a size computed at this batch, a literal,
        or a global for anything else."""
        if x is _HELD:
            return "held"
        if isinstance(x, Node):
            return self.render(self.graph.ints[x]) if x in self.graph.ints else self.value_of(x).expr
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(self.render(i) for i in x) + "]"
        if x is None or isinstance(x, (bool, int, str)) or isinstance(x, float) and math.isfinite(x):
            return repr(x)
        return self.stash(x)

    def call_args(self, args, kwargs) -> str:
        return ", ".join([self.render(a) for a in args] + [f"{k}={self.render(v)}" for k, v in kwargs.items()])

    def plan_time(self, x):
        """The argument's value at plan time, or _PER_CALL when some part of it is known only per call."""
        if isinstance(x, Node):
            if x in self.graph.ints:
                return self.graph.ints[x]
            t = self.value_of(x).tensor
            return _PER_CALL if t is None else t
        if isinstance(x, (list, tuple)):
            parts = [self.plan_time(i) for i in x]
            return _PER_CALL if any(p is _PER_CALL for p in parts) else parts
        return x


def _emit_out(src: _Source, op: OpRun) -> None:
    """`f(args, out=arena view)`: the op writes into its planned place."""
    low = op.lowered
    f = src.stash(low.variant.fn, "f")
    if op.inplace_arg is not None and op.outputs[0] not in src.values:
        # over a tensor torch allocated (a local of this call): the output is that local, written in place
        src.values[op.outputs[0]] = src.value_of(op.node.args[op.inplace_arg])
    outs = ", ".join(f"{k}={src.values[v].expr}" for k, v in zip(low.variant.outs, op.outputs, strict=True))
    note = " (in place)" if op.inplace_arg is not None else ""
    src.lines.append(f"{f}({src.call_args(low.args, low.kwargs)}, {outs})  # {op.node.name}{note}")


def _fix_view(src: _Source, op: OpRun) -> bool:
    """Make a view of plan-time tensors (an arena view, a parameter) now, once; False when an operand
    is known only per call."""
    node = op.node
    args = src.plan_time(list(node.args))
    kwargs = {k: src.plan_time(v) for k, v in node.kwargs.items()}
    if args is _PER_CALL or any(v is _PER_CALL for v in kwargs.values()):
        return False
    with torch.inference_mode(False), torch.no_grad():
        out = (op.replacement or node.target)(*args, **kwargs)
    for v, t in zip(op.outputs, out if isinstance(out, (tuple, list)) else [out], strict=True):
        if v:
            src.fix(v, t)
    return True


def _emit_call(src: _Source, op: OpRun) -> None:
    """`v_x = f(args)`: a view of a per-call tensor, or an op torch allocates for (no `out=` kernel). A sliced
    segment handed its input (`workspaces.handed_over`): `held = [v_in]; del v_in; v_x = f.owned(held, ...)`."""
    node = op.node
    f = src.stash(op.replacement or _callable(node.target), "f")
    args, note, root = node.args, "", handed_over(src.graph, op)
    if root is not None:
        f = src.stash(node.target.owned, "f")
        src.lines.append(f"held = [{src.render(node.args[0])}]")
        src.lines.append("del " + ", ".join(src.locals_of.pop(root)))
        args, note = (_HELD, *node.args[1:]), " (its input handed over)"
    targets = []
    for v in op.outputs:
        if v:
            src.values[v] = _Value(f"v_{v}")
            src.locals_of.setdefault(src.graph.root_of[v], []).append(f"v_{v}")
        targets.append(f"v_{v}" if v else "_")
    many = len(targets) != 1 or isinstance(node.meta.get("val"), (tuple, list))
    lhs = ", ".join(targets) + "," if many else targets[0]
    src.lines.append(f"{lhs} = {f}({src.call_args(args, node.kwargs)})  # {node.name}{note}")


def _emit_op(src: _Source, op: OpRun) -> None:
    src.node_value[op.node] = op.outputs[0] if len(op.outputs) == 1 else ""
    if op.mode == "getitem":
        return                                  # the value was named by its producer
    if op.mode == "out":
        _emit_out(src, op)
    elif not (op.mode == "view" and _fix_view(src, op)):
        _emit_call(src, op)


def generate(graph: Graph, tensors: dict[str, torch.Tensor]) -> tuple[Callable, str]:
    """The function `forward(*inputs) -> tuple of flat outputs` and its source.

    Args:
        graph: the analysed graph.
        tensors: root name -> its preallocated tensor for `const`, `arena` and `empty` roots.
    """
    src = _Source(graph)
    for name, root in graph.roots.items():
        if root.kind in ("const", "arena", "empty"):
            src.fix(name, tensors[name])
            for value in root.members:                  # in-place results: their own shape, the root's memory
                t, m = tensors[name], graph.metas[value]
                with torch.inference_mode(False), torch.no_grad():
                    src.fix(value, t.as_strided(m.shape, m.strides, t.storage_offset() + m.offset))
    for v in graph.inputs:
        src.values[v] = _Value(f"v_{v}")
    dies_after: dict[int, list[str]] = {}               # op index -> torch-allocated roots last read there
    for name, root in graph.roots.items():
        if root.kind == "call":
            dies_after.setdefault(root.last, []).append(name)
    for op in graph.ops:
        _emit_op(src, op)
        for root in dies_after.get(op.index, []):
            if src.locals_of.get(root):
                src.lines.append("del " + ", ".join(src.locals_of.pop(root)))
    outs = [src.values[o].expr if isinstance(o, str) else src.stash(o) for o in graph.outputs]
    args = ", ".join(f"v_{v}" for v in graph.inputs)
    text = f"def forward({args}):\n" + "".join(f"    {ln}\n" for ln in src.lines)
    text += f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})\n"
    ns: dict[str, object] = dict(src.glb)
    exec(compile(text, "<memfit planned forward>", "exec"), ns)   # noqa: S102 - code we generated above
    return ns["forward"], text

"""Generate the straight-line Python function that runs a plan, as torch.fx generates code.

One line per op and no interpreter loop: an op with a real `out=` kernel writes into its arena
view (`f_3(g_x, g_w, out=g_addmm)`), views of the arena and of parameters are made once at plan
time, and only views of the caller's inputs and outputs of ops without an `out=` kernel are made
per call (the latter deleted after their last reader, so torch can reuse their memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.fx import Node

from memfit.planner.graph import Graph

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
    return getattr(op, "_op", op)


def generate(graph: Graph, tensors: dict[str, torch.Tensor]) -> tuple[Callable, str]:
    """The function `forward(*inputs) -> tuple of flat outputs` and its source.

    Args:
        graph: the analysed graph.
        tensors: root name -> its preallocated tensor for `const`, `arena` and `empty` roots.
    """
    glb: dict[str, object] = {}
    expr: dict[str, str] = {}                 # value name -> Python expression holding it
    known: dict[str, torch.Tensor] = {}       # value name -> tensor, for values fixed at plan time
    node_value: dict[Node, str] = {}
    lines: list[str] = []
    local_root: dict[str, list[str]] = {}     # root name -> locals to delete after its last reader

    def stash(obj, prefix: str = "k") -> str:
        name = f"{prefix}_{len(glb)}"
        glb[name] = obj
        return name

    def fixed(value: str, t: torch.Tensor) -> None:
        known[value] = t
        expr[value] = stash(t, "g")

    for name, root in graph.roots.items():
        if root.kind in ("const", "arena", "empty"):
            fixed(name, tensors[name])
            for m in root.members:
                fixed(m, tensors[name])
    for v in graph.inputs:
        expr[v] = f"v_{v}"

    def vname(n: Node) -> str:
        return n.name if n.op == "placeholder" else node_value[n]

    ints = graph.ints          # sizes computed from the batch: plain numbers in this plan

    def render(x) -> str:
        if isinstance(x, Node) and x in ints:
            return render(ints[x])
        if isinstance(x, Node):
            return expr[vname(x)]
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(render(i) for i in x) + "]"
        if x is None or isinstance(x, (bool, int, str)) or isinstance(x, float) and math.isfinite(x):
            return repr(x)
        return stash(x)

    def value(x):
        if isinstance(x, Node) and x in ints:
            return ints[x]
        if isinstance(x, Node):
            return known[vname(x)]
        if isinstance(x, (list, tuple)):
            return [value(i) for i in x]
        return x

    def is_fixed(x) -> bool:
        if isinstance(x, Node):
            return x in ints or vname(x) in known
        if isinstance(x, (list, tuple)):
            return all(is_fixed(i) for i in x)
        return True

    def call_args(args, kwargs) -> str:
        parts = [render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()]
        return ", ".join(parts)

    dels: dict[int, list[str]] = {}
    for name, root in graph.roots.items():
        if root.kind == "call":
            dels.setdefault(root.last, []).append(name)

    def emit(step) -> None:
        node = step.node
        if step.mode == "getitem":
            node_value[node] = step.outputs[0]
            return
        node_value[node] = step.outputs[0] if len(step.outputs) == 1 else ""
        if step.mode == "out":
            low = step.lowered
            f = stash(low.variant.fn, "f")
            outs = ", ".join(f"{k}={expr[v]}" for k, v in zip(low.variant.outs, step.outputs, strict=True))
            args = call_args(low.args, low.kwargs)
            note = " (in place)" if step.inplace_arg is not None else ""
            lines.append(f"{f}({args}, {outs})  # {node.name}{note}")
            return
        if step.mode == "view" and is_fixed((node.args, list(node.kwargs.values()))):
            with torch.inference_mode(False), torch.no_grad():
                out = node.target(*value(list(node.args)), **{k: value(v) for k, v in node.kwargs.items()})
            outs = list(out) if isinstance(out, (tuple, list)) else [out]
            for v, t in zip(step.outputs, outs, strict=True):
                if v:
                    fixed(v, t)
            return
        # a runtime call: a view of an input or of a fresh tensor, or an op without an out= kernel
        f = stash(step.replacement or _callable(node.target), "f")
        targets = []
        for v in step.outputs:
            if v:
                expr[v] = f"v_{v}"
                local_root.setdefault(graph.root_of[v], []).append(expr[v])
            targets.append(expr[v] if v else "_")
        lhs = targets[0] if len(targets) == 1 and not isinstance(node.meta.get("val"), (tuple, list)) \
            else ", ".join(targets) + ","
        lines.append(f"{lhs} = {f}({call_args(node.args, node.kwargs)})  # {node.name}")

    def emit_dels(index: int) -> None:
        for root in dels.get(index, []):
            if local_root.get(root):
                lines.append("del " + ", ".join(local_root.pop(root)))

    for step in graph.steps:
        emit(step)
        emit_dels(step.index)

    outs = [expr[o] if isinstance(o, str) else stash(o) for o in graph.outputs]
    args = ", ".join(f"v_{v}" for v in graph.inputs)
    src = f"def forward({args}):\n" + "".join(f"    {ln}\n" for ln in lines)
    src += f"    return ({', '.join(outs)}{',' if len(outs) == 1 else ''})\n"
    ns: dict[str, object] = dict(glb)
    exec(compile(src, "<memfit planned forward>", "exec"), ns)   # noqa: S102 - code we generated above
    return ns["forward"], src

"""From an exported graph to what the arena needs: tensors, their aliases, lifetimes and op modes.

Every tensor value in the graph belongs to one *root*: the allocation it lives in. A compute op
creates roots; a view (`view`, `permute`, `expand`, `slice`, `getitem` of a multi-output view, ...)
and an in-place op add values to their input's root and keep it alive; so does a `clone` into the
very same layout (export's dropout in eval before torch 2.14), which runs as the tensor itself. A root's lifetime runs
from the op that writes it to the last op that reads any of its values. Root kinds:

- `input`, `const`: the caller's inputs, parameters, buffers; never written.
- `arena`: written by an `out=` kernel into the arena; what the planner places.
- `call`: the output of an op with no real `out=` kernel, or of one run eagerly because its output
  costs less memory outside the arena (`eager`); allocated by torch, freed after its last reader
  (counted as unplanned bytes).
- `output`: returned to the caller, so it must be fresh memory each call (also unplanned bytes).
- `empty`: zero bytes (the unused statistics outputs of batch norm in eval).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from memfit.planner.ops import WHEN_UNREAD, Lowered, inplace_candidates, is_view, lower, why_not_lowered

__all__ = ["Graph", "Meta", "Root", "OpRun", "analyze", "concrete", "meta_value", "span_bytes"]


class DataDependentSize(RuntimeError):
    """A tensor size that is known only when the model runs (boolean-mask indexing, nonzero, .item())."""


def concrete(v, env: dict):
    """An int (or bool) from a size that may be symbolic in the batch: `env` maps the batch symbol
    to its value. Raises DataDependentSize for sizes that depend on tensor values."""
    if isinstance(v, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        expr = v.node.expr
        expr = expr.xreplace(env) if hasattr(expr, "xreplace") else expr
        if getattr(expr, "free_symbols", None):
            raise DataDependentSize(f"size {v.node.expr} depends on tensor values")
        return bool(expr) if isinstance(v, torch.SymBool) else int(expr) if isinstance(v, torch.SymInt) \
            else float(expr)
    return v


@dataclass(frozen=True)
class Meta:
    """Shape, strides, dtype and storage offset of one tensor value at a concrete batch size (the
    methods mirror a tensor's, so code reads `meta.stride()` either way)."""
    shape: tuple
    strides: tuple
    dtype: torch.dtype
    offset: int

    @classmethod
    def of(cls, t, env: dict) -> Meta:
        return cls(tuple(concrete(s, env) for s in t.shape), tuple(concrete(s, env) for s in t.stride()), t.dtype,
                   concrete(t.storage_offset(), env))

    def stride(self) -> tuple:
        return self.strides

    @property
    def nbytes(self) -> int:
        """Bytes of storage it touches (`span_bytes`, from its storage offset)."""
        return span_bytes(self.shape, self.strides, self.dtype, self.offset)

    def storage_offset(self) -> int:
        return self.offset


def meta_value(a, env: dict):
    """An fx argument (a node, or the value a node had) at the batch of `env`: a meta tensor for a tensor, a concrete
    size for a symbolic one, lists and tuples element by element."""
    if isinstance(a, Node):
        a = a.meta.get("val")
    if isinstance(a, torch.Tensor):
        m = Meta.of(a, env)
        return torch.empty_strided(m.shape, m.strides, dtype=m.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(meta_value(x, env) for x in a)
    return concrete(a, env)


def span_bytes(shape, stride, dtype: torch.dtype, storage_offset: int = 0) -> int:
    """Bytes of storage a strided tensor touches (0 when it has no elements)."""
    if any(s == 0 for s in shape):
        return 0
    elems = storage_offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True))
    return elems * dtype.itemsize


@dataclass
class Root:
    """One allocation: the values stored in it, its size and lifetime (op indices, both included)."""
    name: str
    kind: str
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    nbytes: int
    first: int
    last: int
    members: list[str] = field(default_factory=list)     # values written into it by in-place ops


@dataclass
class OpRun:
    """One call_function node: how it runs (`view`, `getitem`, `out`, `call`) and what it writes."""
    index: int
    node: Node
    mode: str
    outputs: list[str]                  # value names of its tensor outputs ("" for non-tensors)
    lowered: Lowered | None = None
    inplace_arg: int | None = None      # position of the argument it overwrites
    replacement: object = None          # run this instead of the op (mode "call", or "view" for a copy as is)
    reason: str = ""                    # why a compute op runs outside the arena (mode "call")


@dataclass
class Graph:
    ops: list[OpRun]
    roots: dict[str, Root]
    root_of: dict[str, str]             # value name -> root name
    metas: dict[str, Meta]              # value name -> shape, stride, dtype at this batch size
    inputs: list[str]
    consts: dict[str, torch.Tensor]
    outputs: list                       # flat outputs: value names (str) or constants
    ints: dict[Node, object] = field(default_factory=dict)   # size arithmetic, evaluated at this batch size


def _metas(node: Node, env: dict) -> list:
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    return [Meta.of(v, env) if isinstance(v, torch.Tensor) else v for v in vals]


def _nodes_in(x) -> list[Node]:
    if isinstance(x, Node):
        return [x]
    if isinstance(x, (tuple, list)):
        return [n for item in x for n in _nodes_in(item)]
    if isinstance(x, dict):
        return [n for item in x.values() for n in _nodes_in(item)]
    return []


def _same_tensor(x, *args, **kwargs):
    return x


def _copy_as_is(node: Node, outs: list, metas: dict, value_of: dict, roots: dict, root_of: dict) -> bool:
    """True for a `clone` that copies an intermediate tensor into the very same layout (what export
    made of dropout in eval before torch 2.14, and of `.contiguous()` on a contiguous tensor, where eager
    copies nothing). Nothing writes over a tensor the planner does not write (the graph is functional; the
    planner's in-place writes check every alias of their root), so the copy can be the tensor itself,
    a view of its allocation: no bytes, no time. Copies of the caller's inputs and of parameters, and
    model outputs, stay copies (an output must not alias another tensor)."""
    if (node.target is not torch.ops.aten.clone.default or not isinstance(node.args[0], Node)
            or any(u.op == "output" for u in node.users)):
        return False
    v = value_of[node.args[0]][0]
    src = metas[v]
    return (len(outs) == 1 and isinstance(outs[0], Meta) and roots[root_of[v]].kind not in ("input", "const")
            and (outs[0].shape, outs[0].strides, outs[0].dtype) == (tuple(src.shape), tuple(src.stride()), src.dtype))


def _out_name(node: Node, k: int, many: bool) -> str:
    return f"{node.name}__out{k}" if many else node.name


def analyze(ep, consts: dict[str, torch.Tensor], device_type: str, inplace: bool = True,
            env: dict | None = None, eager: dict[str, str] | None = None,
            own_layout: frozenset[str] = frozenset(), order: list[Node] | None = None) -> Graph:
    """Lifetimes, aliases and the run mode of every op of an exported, decomposed graph.

    `env` maps the batch symbol of a graph exported with a dynamic batch to the batch size to plan
    for; every size is then exact at that batch (none: the graph's sizes are static). `eager` maps
    node names to the reason they run eagerly although they have an `out=` kernel; those in `own_layout`
    (their kernels give other strides than the graph's) also never write over another tensor. `order`: the
    graph's call_function nodes in the order to run them (a topological order, `planner.order`; none: the
    graph's); lifetimes, in-place writes and everything else follow it.
    """
    walk = _Walk(consts, env or {})
    output_node = None
    for node in _in_order(ep.graph, order):
        if node.op == "placeholder":
            walk.placeholder(node)
        elif node.op == "output":
            output_node = node
        elif node.op == "call_function":
            walk.call(node)
        else:
            raise TypeError(f"unexpected node {node.op} {node.target} in the exported graph")
    graph = Graph(walk.ops, walk.roots, walk.root_of, walk.metas, walk.inputs, consts, walk.outputs(output_node),
                  walk.ints)
    _decide_modes(graph, walk.value_of, device_type, inplace, eager or {}, own_layout)
    return graph


def _in_order(fx_graph, order: list[Node] | None) -> list[Node]:
    """The graph's nodes with its call_function nodes in `order`; ValueError unless that is a topological
    order of all of them."""
    nodes = list(fx_graph.nodes)
    if order is None:
        return nodes
    calls = [n for n in nodes if n.op == "call_function"]
    if len(order) != len(calls) or set(order) != set(calls):
        raise ValueError(f"order must hold each of the {len(calls)} call_function nodes once; found "
                         f"{len(order)} ({len(set(order) ^ set(calls))} differ); a planner bug: please report it")
    done = {n for n in nodes if n.op == "placeholder"}
    for node in order:
        early = [a.name for a in _nodes_in((node.args, node.kwargs)) if a not in done]
        if early:
            raise ValueError(f"order runs {node.name} before its inputs {early}: not a topological order; "
                             "a planner bug, please report it")
        done.add(node)
    return [n for n in nodes if n.op == "placeholder"] + list(order) + [n for n in nodes if n.op == "output"]


class _Walk:
    """One pass over the graph's nodes in order: each tensor value's root (its storage), first write and last
    read, and each op's run mode before lowering ('view', 'getitem' or 'call')."""

    def __init__(self, consts: dict[str, torch.Tensor], env: dict):
        self.consts, self.env = consts, env
        self.roots: dict[str, Root] = {}
        self.root_of: dict[str, str] = {}
        self.metas: dict[str, torch.Tensor] = {}
        self.value_of: dict[Node, list[str]] = {}        # node -> names of its tensor output values
        self.ops: list[OpRun] = []
        self.inputs: list[str] = []
        self.ints: dict[Node, object] = {}

    def new_root(self, name: str, kind: str, meta, index: int) -> None:
        nbytes = span_bytes(meta.shape, meta.stride(), meta.dtype, meta.storage_offset())
        self.roots[name] = Root(name, kind if nbytes else "empty", tuple(meta.shape), tuple(meta.stride()),
                                meta.dtype, nbytes, index, index)
        self.root_of[name] = name
        self.metas[name] = meta

    def placeholder(self, node: Node) -> None:
        meta = node.meta["val"]
        if node.name in self.consts:
            self.new_root(node.name, "const", self.consts[node.name], -1)
        else:
            if not isinstance(meta, torch.Tensor):
                raise TypeError(f"the planner takes tensor inputs only; input {node.name!r} is {meta!r}")
            self.inputs.append(node.name)
            self.new_root(node.name, "input", Meta.of(meta, self.env), -1)
        self.value_of[node] = [node.name]

    def call(self, node: Node) -> None:
        val = node.meta.get("val")
        if val is None or isinstance(val, (int, float, bool, torch.SymInt, torch.SymBool, torch.SymFloat)):
            # size arithmetic (sym_size, mul of sizes) is a number at this batch size; a None value is a
            # runtime assertion on sizes, which holds for every batch in the exported range
            self.ints[node] = concrete(val, self.env)
            return
        index = len(self.ops)
        outs = _metas(node, self.env)
        many = isinstance(val, (tuple, list))
        names = [_out_name(node, k, many) if isinstance(m, Meta) else "" for k, m in enumerate(outs)]
        replacement = None
        if node.target is operator.getitem:
            src, k = node.args
            names = [self.value_of[src][k]]
            mode = "getitem"
        elif is_view(node.target) or _copy_as_is(node, outs, self.metas, self.value_of, self.roots, self.root_of):
            base = self.root_of[self.value_of[node.args[0]][0]]
            for name, m in zip(names, outs, strict=True):
                if name:
                    self.root_of[name], self.metas[name] = base, m
            mode = "view"
            if not is_view(node.target):
                replacement = _same_tensor
        else:
            if node.target in WHEN_UNREAD:
                unread, fn = WHEN_UNREAD[node.target]
                read = {u.args[1] for u in node.users if u.target is operator.getitem}
                if not read & set(unread):
                    names = ["" if k in unread else name for k, name in enumerate(names)]
                    replacement = fn
            for name, m in zip(names, outs, strict=True):
                if name:
                    self.new_root(name, "call", m, index)
            mode = "call"
        self.value_of[node] = names
        for arg in _nodes_in((node.args, node.kwargs)):
            for v in self.value_of.get(arg, ()):
                if v:
                    r = self.roots[self.root_of[v]]
                    r.last = max(r.last, index)
        self.ops.append(OpRun(index, node, mode, names, replacement=replacement))

    def outputs(self, output_node: Node) -> list:
        """The flat outputs: alive to the end, and fresh memory every call."""
        flat_out = []
        for item in output_node.args[0]:
            if isinstance(item, Node):
                name = self.value_of[item][0]
                flat_out.append(name)
                r = self.roots[self.root_of[name]]
                r.last = len(self.ops)
                if r.kind in ("call", "empty"):
                    r.kind = "output"
            else:
                flat_out.append(item)
        return flat_out


_OUTPUT = "a model output: fresh memory every call, so the caller may keep it"
_NOT_TENSORS = "some of its outputs are not tensors"


def _why_eager(op: OpRun, own: list[Root], eager: dict[str, str]) -> str:
    """Why a compute op cannot write into the arena before lowering is tried ("" if nothing stops it)."""
    if op.replacement:
        return "an output nobody reads is skipped by running another kernel (as eager does)"
    if not own or any(r.kind == "output" for r in own):
        return _OUTPUT
    if not all(op.outputs):
        return _NOT_TENSORS
    return eager.get(op.node.name, "")


def _decide_modes(graph: Graph, value_of: dict, device_type: str, inplace: bool, eager: dict[str, str],
                  own_layout: frozenset[str]) -> None:
    """How each compute op runs: an `out=` kernel into the arena (in place where the rules allow) or eagerly,
    with the reason. In-place merges go in execution order."""
    roots, metas = graph.roots, graph.metas
    for op in graph.ops:
        if op.mode != "call":
            continue
        node, names = op.node, op.outputs
        own = [roots[n] for n in names if n]
        op.reason = _why_eager(op, own, eager)
        if op.reason in (_OUTPUT, _NOT_TENSORS) or op.replacement:
            continue
        lowered = lower(node.target, node.args, node.kwargs, [metas[n] for n in names], device_type)
        # over a dead input torch allocated (a convolution's output, an op run eagerly): no new bytes at all
        if (inplace and lowered is not None and node.name not in own_layout and all(r.kind == "empty" for r in own[1:])
                and _try_inplace(op, own[0], roots, graph.root_of, metas, value_of, "call")):
            op.mode, op.lowered, op.reason = "out", lowered, ""
            continue
        if op.reason:
            continue
        if lowered is None:
            op.reason = why_not_lowered(node.target, device_type)
            continue
        op.mode, op.lowered = "out", lowered
        for r in own:
            r.kind = "arena" if r.nbytes else "empty"
        if inplace and own[0].kind == "arena" and all(r.kind == "empty" for r in own[1:]):
            _try_inplace(op, own[0], roots, graph.root_of, metas, value_of)


def _shares_storage(op: OpRun, pos: int, v: str, root_of, value_of) -> bool:
    """True when an operand of the op other than argument `pos` lives in `v`'s allocation (a view,
    slice, transpose, expand or broadcast of the same root, however many views deep). Writing over
    `v` would then change what that operand reads while the kernel still reads it: a broadcast row
    overwritten before the other rows read it gives wrong numbers without any error. The very same
    value at two positions (`y * y`) is safe: each element is read before it is written."""
    root = root_of[v]
    others = [a for i, a in enumerate(op.node.args) if i != pos] + list(op.node.kwargs.values())
    for arg in _nodes_in(others):
        for w in value_of.get(arg, ()):
            if w and root_of[w] == root and w != v:
                return True
    return False


def _try_inplace(op: OpRun, out: Root, roots, root_of, metas, value_of, kind: str = "arena") -> bool:
    """Write `out` over an input when the rules allow: allowlisted elementwise op, input of root kind `kind`
    (`arena`, or `call`: torch allocated it, so the op then writes over it with its `out=` kernel) with no later
    reader, covering all of its allocation, same shape, strides and dtype as `out`, and no other operand of the
    op sharing its memory. True when it does."""
    args = op.node.args
    for pos in inplace_candidates(op.node.target, args):
        arg = args[pos]
        if not isinstance(arg, Node) or arg not in value_of:
            continue
        v = value_of[arg][0]
        if not v:
            continue
        base = roots[root_of[v]]
        meta = metas[v]
        # the whole allocation, or a view of all of it (a linear's 2-D output viewed as 3-D): each element is read
        # and written at the same address, as for the root itself
        whole = span_bytes(meta.shape, meta.stride(), meta.dtype, meta.storage_offset()) == base.nbytes
        if (base.kind != kind or base.last != op.index or not whole
                or _shares_storage(op, pos, v, root_of, value_of)
                or tuple(meta.shape) != out.shape or tuple(meta.stride()) != out.stride or meta.dtype != out.dtype
                or meta.storage_offset() != 0 or base.nbytes != out.nbytes):
            continue
        base.last = max(base.last, out.last)
        base.members.append(out.name)
        for name, r in list(root_of.items()):
            if r == out.name:
                root_of[name] = base.name
        del roots[out.name]
        op.inplace_arg = pos
        return True
    return False

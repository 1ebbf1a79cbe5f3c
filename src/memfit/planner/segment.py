"""A block of graph nodes made into the steps of a `planner.sliced.SlicedSegment`: each node a step (a multi-output
op read through one `getitem` is one step taking that output), run in the order of the least peak bytes
(`planner.order`, on the block's own ops: the order of the graph holds a GELU's `0.5 * x` beside the whole of
`tanh(...)`; run last, it writes over x), and each allowlisted elementwise op (`ops.INPLACE`) written over a value
of the slice that nothing reads after it, by its `out=` kernel, as the planner writes such ops over dead tensors of
the whole graph (`graph._try_inplace`): no new bytes, the same values.

Example:
    >>> import torch
    >>> from memfit.planner.capture import capture
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).eval()
    >>> ep = capture(model, (torch.randn(4, 8),))
    >>> nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
    >>> seg, params = build_segment(next(iter(ep.graph.nodes)), nodes[1:], 2)   # after the first weight's view
    >>> [st.target.__name__ for st in seg.steps]
    ['addmm.default', 'gelu.default', 'permute.default', 'addmm.default']
    >>> [st.over for st in seg.steps]           # the GELU over the first linear's output
    [None, 0, None, None]
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from memfit.planner.ops import inplace_candidates, is_view, lower
from memfit.planner.order import Dag, best
from memfit.planner.sliced import SlicedSegment, _lifetimes, _Ref, _refs, _same, _Step

__all__ = ["build_segment"]

aten = torch.ops.aten


def _alias(node: Node) -> bool:
    """A view of what it reads, or a copy into the very same layout (export's dropout in eval, `.contiguous()` of
    a contiguous tensor), which a slice runs as the value itself: a slice writes only over values it made."""
    if node.target is operator.getitem or is_view(node.target):
        return True
    src = node.args[0] if node.args else None
    val = node.meta.get("val")
    return (node.target is aten.clone.default and isinstance(src, Node) and isinstance(val, torch.Tensor)
            and isinstance(src.meta.get("val"), torch.Tensor)
            and (val.shape, val.stride(), val.dtype) == (src.meta["val"].shape, src.meta["val"].stride(),
                                                         src.meta["val"].dtype))


def build_segment(start: Node, nodes: list[Node], k: int, rule=None, index: int = 0,
                  symbol=None) -> tuple[SlicedSegment, list[Node]]:
    """The segment that runs `nodes` (graph order; the last is its output) on slices of `start`'s value, and the
    nodes it reads besides `start` (parameters, tensors without a batch dimension), passed after it."""
    inside = set(nodes)
    taken = {}                          # multi-output node -> the one output its readers take
    for node in nodes:
        if isinstance(node.meta.get("val"), (tuple, list)):
            items = {u.args[1] for u in node.users if u.target is operator.getitem}
            if len(items) == 1 and all(u.target is operator.getitem for u in node.users):
                taken[node] = items.pop()
    index_of: dict[Node, int] = {}
    params: list[Node] = []
    steps: list[_Step] = []
    origin: list[Node] = []

    def ref(a):
        if isinstance(a, Node):
            if a is start:
                return "x"
            if a in inside:
                return _Ref("step", index_of[a])
            val = a.meta.get("val")
            if isinstance(val, torch.SymInt):
                return _Ref("size", val) if symbol is not None else int(val)
            if isinstance(val, (int, float, bool)):
                return val
            if a not in params:
                params.append(a)
            return _Ref("const", params.index(a))
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        if isinstance(a, torch.SymInt):
            return _Ref("size", a) if symbol is not None else int(a)
        return a
    for node in nodes:
        if node.target is operator.getitem and node.args[0] in taken:
            index_of[node] = index_of[node.args[0]]          # the producer's step took this output
            continue
        val = node.meta["val"]
        vals = tuple(val) if isinstance(val, (tuple, list)) else (val,)
        item = taken.get(node)
        alias = _alias(node)
        steps.append(_Step(_same if alias and node.target is aten.clone.default else node.target,
                           ref(tuple(node.args)), {k: ref(v) for k, v in node.kwargs.items()}, item,
                           vals[item] if item is not None else val,
                           tuple(v for v in vals if isinstance(v, torch.Tensor) and v.dim()), alias))
        origin.append(node)
        index_of[node] = len(steps) - 1
    steps = _in_place(*_least_peak(steps, origin, symbol), symbol)
    seg = SlicedSegment(tuple(steps), k, start.meta["val"], tuple(p.meta["val"] for p in params), rule, index, symbol)
    return seg, params


def _bytes(val, symbol, s: int = 1) -> int:
    """Bytes of a value at a slice of s samples (a static graph: its first dimension replaced)."""
    return _meta(val, symbol, s).nbytes


def _remap(a, new: dict[int, int]):
    if isinstance(a, _Ref) and a.kind == "step":
        return _Ref("step", new[a.index])
    if isinstance(a, (list, tuple)):
        return type(a)(_remap(x, new) for x in a)
    if isinstance(a, dict):
        return {k: _remap(v, new) for k, v in a.items()}
    return a


def _least_peak(steps: list[_Step], origin: list[Node], symbol) -> tuple[list[_Step], list[Node]]:
    """The steps in the topological order of the least peak bytes of a slice (`planner.order.best`, the graph's
    order on a tie), with what each may write over (`Dag.inplace`) weighed as the slice will run it."""
    if len(steps) < 3:
        return steps, origin
    roots, _ = _lifetimes(steps)
    alloc = [i for i, st in enumerate(steps) if not st.alias]
    bid = {step: b for b, step in enumerate(alloc)}
    sizes = tuple(sum(_bytes(v, symbol) for v in steps[i].outputs) for i in alloc)
    preds, writes, reads, inplace = [], [], [], []
    for i, st in enumerate(steps):
        read = [r.index for r in _refs((st.args, st.kwargs)) if r != "x"]
        preds.append(tuple(sorted(set(read))))
        writes.append((bid[i],) if i in bid else ())
        reads.append(tuple(sorted({bid[roots[j]] for j in read if roots[j] is not None})))
        cand = [roots[st.args[p].index] for p in inplace_candidates(st.target, st.args)
                if isinstance(st.args[p], _Ref) and st.args[p].kind == "step"
                and _whole(steps, roots, st.args[p].index, symbol)]
        inplace.append(tuple(bid[j] for j in cand if j in bid) if not st.alias else ())
    pinned = frozenset({bid[roots[-1]]} if roots[-1] is not None else set())
    dag = Dag(tuple(preds), sizes, tuple(writes), tuple(reads), pinned, (), tuple(inplace))
    order = best(dag).order
    new = {old: pos for pos, old in enumerate(order)}
    out = []
    for old in order:
        st = steps[old]
        out.append(_Step(st.target, _remap(st.args, new), _remap(st.kwargs, new), st.item, st.val, st.outputs,
                         st.alias))
    return out, [origin[old] for old in order]


def _in_place(steps: list[_Step], origin: list[Node], symbol) -> list[_Step]:
    """Each allowlisted elementwise step written over an argument of its size, shape, strides and dtype that is a
    value this slice made (not its input, not a view), read by no later step and by no other argument of it."""
    out = list(steps)
    lives = None                            # `_lifetimes(out)`, worked out again only after a step is changed
    for i, st in enumerate(out):
        if st.alias or st.item is not None and len(st.outputs) > 1 and not _empties(st, symbol):
            continue
        roots, last = lives = lives or _lifetimes(out)
        for pos in inplace_candidates(st.target, st.args):
            a = st.args[pos] if pos < len(st.args) else None
            if not isinstance(a, _Ref) or a.kind != "step":
                continue
            root = roots[a.index]           # all of its root: the value, a view of all of it, or written over it
            if root is None or not _whole(out, roots, a.index, symbol) or last[root] != i:
                continue
            others = [r for j, arg in enumerate(st.args) if j != pos for r in _refs(arg)] + _refs(st.kwargs)
            if any(r != "x" and roots[r.index] == root for r in others):
                continue
            if not _same_layout(out[a.index].val, st.val, symbol):
                continue
            node = origin[i]
            low = lower(node.target, st.args, st.kwargs, [st.val], "cpu")
            if low is None or len(low.variant.outs) != len(node.meta["val"] if isinstance(node.meta["val"],
                                                                                          (tuple, list)) else [1]):
                continue
            out[i] = _Step(st.target, st.args, st.kwargs, st.item, st.val, st.outputs, False, pos, low)
            lives = None
            break
    return out


def _whole(steps: list[_Step], roots: list, j: int, symbol) -> bool:
    """Whether step j's value covers all of its root's bytes from its start (the root itself, a value written over
    it, or a view of all of it: a linear's 2-D output viewed as 3-D), so writing over it writes over nothing else."""
    root = roots[j]
    if root is None:
        return False
    if root == j or steps[j].over is not None:
        return True
    m = _meta(steps[j].val, symbol, 1)
    return m.offset == 0 and m.nbytes == _bytes(steps[root].val, symbol)


def _meta(val, symbol, s: int):
    return SlicedSegment((), 1, None, (), symbol=symbol)._meta(val, {}, s)


def _empties(st: _Step, symbol) -> bool:
    """Whether every output but the one taken is empty (batch norm's statistics in eval)."""
    return all(_bytes(v, symbol) == 0 for v in st.outputs if v is not st.val)


def _same_layout(a, b, symbol) -> bool:
    """The same shape, strides and dtype at every batch (compared at two)."""
    return all((m := _meta(a, symbol, s), w := _meta(b, symbol, s)) and (m.shape, m.strides, m.dtype, m.offset)
               == (w.shape, w.strides, w.dtype, w.offset) for s in (1, 2))

"""Attention masks kept at their broadcast shape: a mask that holds the same values along a dimension (the batch,
the heads) is computed with size 1 there and handed to the attention kernel as it is, which broadcasts it.

T5 adds its relative position bias, (1, heads, L, L), to a padding mask expanded over the batch: `where(expand(ge,
[N, -1, L, L]), bias, min)` makes (N, heads, L, L), a `clone` makes that contiguous, and flash attention reads it;
two tensors of N x the bias's bytes (128 KiB each at batch 8 of the tiny config), and the call's peak. Rewritten,
the `expand` keeps size 1 where every operand of the mask's chain is broadcast, so the chain makes (1, heads, L, L)
and flash attention reads it with batch stride 0 (what inductor passes too).

Exact: the chain's ops are elementwise and give every element from the operands' elements at its index alone, the
same IEEE operation on the same values whichever loop runs it (`EXACT`: selections, comparisons, correctly rounded
add/sub/mul/div without a scale, copies); each element of the smaller mask equals the full mask's at every index it
stands for. The CPU flash attention kernel (the only one rewritten) reads the mask per (batch, head, row) through
its strides, a size-1 dimension at stride 0: the same values, the same arithmetic (tests compare with `torch.equal`).

Example:
    >>> import torch
    >>> from memfit.planner.captured import capture_model
    >>> class Attn(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.bias = torch.nn.Parameter(torch.randn(1, 2, 8, 8))
    ...     def forward(self, q):                       # (N, 2, 8, 4)
    ...         keep = (torch.arange(8) >= 2).view(1, 1, 8, 1).expand(q.shape[0], -1, 8, 8)
    ...         mask = torch.where(keep, self.bias, -1e9).contiguous()
    ...         return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    >>> cap = capture_model(Attn().eval(), torch.randn(4, 2, 8, 4))
    >>> [tuple(n.meta["val"].shape) for n in cap.ep.graph.nodes if n.name.startswith("where")]
    [(1, 2, 8, 8)]
"""

from __future__ import annotations

import torch
from torch.fx import Node

__all__ = ["EXACT", "ATTENTION", "broadcast_masks"]

aten = torch.ops.aten

# elementwise ops whose every output element is one IEEE operation (or a selection, a comparison, a copy) on the
# operands' elements at its index: the same bits whether the loop is vectorised, strided or broadcast. Left out:
# transcendental functions (vectorised and scalar implementations differ in the last bit) and add/sub with a scale
# (the vectorised loop fuses the multiply-add).
EXACT = frozenset({
    aten.where.self, aten.clone.default, aten.neg.default, aten.abs.default,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar, aten.sub.Scalar,
    aten.mul.Scalar, aten.div.Scalar, aten.maximum.default, aten.minimum.default,
    aten.eq.Scalar, aten.ne.Scalar, aten.ge.Scalar, aten.gt.Scalar, aten.le.Scalar, aten.lt.Scalar,
    aten.eq.Tensor, aten.ne.Tensor, aten.ge.Tensor, aten.gt.Tensor, aten.le.Tensor, aten.lt.Tensor,
    aten.logical_not.default, aten.logical_and.default, aten.logical_or.default, aten.bitwise_not.default,
    aten.masked_fill.Scalar,
})

# attention kernels that broadcast a mask of size 1 in any dimension, and the name of their mask argument
ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask"}


def _tensor(n) -> bool:
    return isinstance(n, Node) and isinstance(n.meta.get("val"), torch.Tensor)


def _sizes(n: Node) -> tuple:
    return tuple(n.meta["val"].shape)


def _chain(mask: Node) -> tuple[list[Node], list[Node]] | None:
    """(the chain's ops in graph order, its tensor operands from outside it): the `EXACT` ops the mask is made by,
    each read only inside the chain (or, the mask itself, by the attention alone); None where it is not such."""
    ops, leaves, todo = [], [], [mask]
    while todo:
        n = todo.pop()
        if n in ops or n in leaves:
            continue
        exact = (n.op == "call_function" and n.target in EXACT and not n.kwargs.keys() - {"memory_format"}
                 and (n.target not in (aten.add.Tensor, aten.sub.Tensor) or len(n.args) == 2))
        if exact and (n is mask or all(u in ops for u in n.users)):
            ops.append(n)
            todo += [a for a in n.args if _tensor(a)]
        elif n is mask:
            return None
        else:
            leaves.append(n)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    ops.sort(key=order.__getitem__)
    return ops, leaves               # each op was taken only once every reader of it was


def _broadcast_dims(mask: Node, leaves: list[Node]) -> list[int]:
    """The mask's dimensions (counted from the last, -1, -2, ...) of size above 1 where every operand is of size 1
    or absent, or is an `expand` of a tensor of size 1 or absent there."""
    out = []
    sizes = _sizes(mask)
    for d in range(-1, -len(sizes) - 1, -1):
        if isinstance(sizes[d], int) and sizes[d] <= 1:
            continue
        if all(_one_at(leaf, d) for leaf in leaves):
            out.append(d)
    return out


def _one_at(leaf: Node, d: int) -> bool:
    src = leaf.args[0] if leaf.target is aten.expand.default and _tensor(leaf.args[0]) else leaf
    shape = _sizes(src)
    return len(shape) < -d or (isinstance(shape[d], int) and shape[d] == 1)


def _fake_run(node: Node, target, args, kwargs):
    """The meta value `target` gives on the fake values of `args` (the graph's own fake tensors)."""
    from memfit.device.torch_private import detect_fake_mode

    def val(a):
        if isinstance(a, Node):
            return a.meta["val"]
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a
    vals, kvals = val(args), {k: val(v) for k, v in kwargs.items()}
    with detect_fake_mode([node.meta["val"]]):
        return target(*vals, **kvals)


def _rewrite(attention: Node, arg: str, ops: list[Node], leaves: list[Node], dims: list[int]) -> None:
    """Copy the chain before the attention with each `expand` operand of size 1 in `dims`, and hand the copy's
    mask to the attention."""
    graph = attention.graph
    new: dict[Node, Node] = {}
    with graph.inserting_before(attention):
        for leaf in leaves:
            if leaf.target is aten.expand.default and _tensor(leaf.args[0]):
                sizes = list(leaf.args[1])
                for d in dims:
                    if len(sizes) >= -d:
                        sizes[d] = 1
                n = graph.call_function(aten.expand.default, (leaf.args[0], sizes))
                n.meta["val"] = _fake_run(leaf, aten.expand.default, (leaf.args[0], sizes), {})
                new[leaf] = n
        for op in ops:
            args = tuple(new.get(a, a) if isinstance(a, Node) else a for a in op.args)
            n = graph.call_function(op.target, args, dict(op.kwargs))
            n.meta["val"] = _fake_run(op, op.target, args, op.kwargs)
            n.meta["stack_trace"] = op.meta.get("stack_trace")
            new[op] = n
    attention.update_kwarg(arg, new[ops[-1]])


def broadcast_masks(ep) -> list[str]:
    """Rewrite `ep`'s graph: each attention mask (`ATTENTION`) made by `EXACT` ops from operands that are all
    broadcast along some dimension is made with size 1 there. Returns the names of the masks rewritten."""
    graph = ep.graph
    done = []
    for node in list(graph.nodes):
        arg = ATTENTION.get(node.target) if node.op == "call_function" else None
        mask = node.kwargs.get(arg) if arg else None
        if not _tensor(mask) or len(mask.users) != 1:
            continue
        found = _chain(mask)
        if found is None:
            continue
        dims = _broadcast_dims(mask, found[1])
        if dims:
            _rewrite(node, arg, *found, dims)
            done.append(mask.name)
    if done:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return done

"""Where a graph can run in slices of the batch: the ops that compute each sample from that sample alone, and the
blocks of them between two values every path from the model's inputs to its outputs goes through (a residual
block between its input and its output, a transformer's attention or MLP between two values of its residual
stream, each op of a chain).

A value carries the batch in its first dimension, as `c * batch` (a linear's 2-D view of a (batch, tokens, width)
tensor: `tokens * batch` rows, sample-major). An op is per-sample (`per_sample`) where it never mixes that dimension:
elementwise ops, views and reductions that keep it first and whole, matrix products whose rows are samples,
normalisations over the other dimensions, convolutions, pooling, attention. Everything else (a sum over the batch,
a flip of it, an index along it) is not, and a block holding one is never sliced. The exactness of the kernels on
slices is not decided here: `planner.slicing` checks it on the example, bit for bit.

`blocks(graph, consts, symbol)` cuts the graph at the values that dominate its output (every path from an input
to the output goes through them) into blocks: each reads one such value and makes the next, and nothing outside it
reads what it makes in between. Tensors made without the inputs (an attention mask, rotary tables) are read as
they are where they have no batch dimension, and made inside the block where they have one (a mask expanded over
the batch); a block that reads any other value from outside is not sliceable.

Example:
    >>> import torch
    >>> from memfit.planner.capture import capture, constants
    >>> class Residual(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         return torch.relu(x + self.lin(x))
    >>> model = Residual()
    >>> ep = capture(model, (torch.randn(4, 8),))
    >>> [(b.entry.name, b.exit.name, b.sliceable) for b in blocks(ep.graph, constants(ep, model), None, 4)]
    [('x', 'add', False), ('add', 'relu', True)]
    >>> blocks(ep.graph, constants(ep, model), None, 4)[0].why
    'addmm reads permute from outside the block'

A static capture (`symbol` None) cannot tell a tensor made from the weights from one made with the batch, so a block
reads only placeholders from outside: the Linear's transposed weight (`permute`) keeps the residual block whole;
with a symbolic batch the same block is sliceable.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from memfit.device.torch_private import OpOverload

__all__ = ["Block", "blocks", "elementwise", "made_without_inputs", "per_sample"]

aten = torch.ops.aten


@dataclass
class Block:
    """The nodes from one dominating value (`entry`, outside it) to the next (`exit`, its last node), graph order;
    `sliceable` where every op is per-sample and entry and exit carry the batch as their whole first dimension."""
    entry: Node
    nodes: list[Node]
    sliceable: bool
    why: str = ""

    @property
    def exit(self) -> Node:
        return self.nodes[-1]


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, Node) else node


def _rows(val, symbol, n: int | None) -> int | None:
    """c where `val`'s first dimension is c * batch and no other dimension depends on the batch; else None.
    `symbol` None: a static graph, whose first dimension n is the batch (c = 1)."""
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    if symbol is None:
        return 1 if val.shape[0] == n else None
    for d in val.shape[1:]:
        if isinstance(d, torch.SymInt) and symbol in d.node.expr.free_symbols:
            return None
    first = val.shape[0]
    if not isinstance(first, torch.SymInt) or first.node.expr.free_symbols != {symbol}:
        return None
    c = first.node.expr / symbol
    return int(c) if c.is_Integer and int(c) > 0 else None


def _free(val, symbol) -> bool:
    """A tensor whose sizes do not depend on the batch (a static graph: any; its readers' dimensions decide)."""
    if not isinstance(val, torch.Tensor):
        return False
    if symbol is None:
        return True
    return not any(isinstance(d, torch.SymInt) and symbol in d.node.expr.free_symbols for d in val.shape)


def _dims(d, ndim: int) -> list[int]:
    ds = d if isinstance(d, (list, tuple)) else [d]
    return [x % ndim if ndim else 0 for x in ds]


# ops whose output element depends on one element of each operand (broadcast): `torch.Tag.pointwise`, and these
_ELEMENTWISE = {aten._to_copy.default, aten.hardswish.default, aten.alias.default, aten.detach.default}


def elementwise(target) -> bool:
    """An op whose output element depends on one element of each operand, or a batch norm in eval (an affine map
    per channel): what inductor fuses into its neighbours, so that its intermediates never exist, and what the
    planner writes over its input."""
    return isinstance(target, OpOverload) and (torch.Tag.pointwise in target.tags
                                                or target in _ELEMENTWISE or target in _AFFINE)


_AFFINE = {aten._native_batch_norm_legit_no_training.default}


# ops on (N, C, ...) tensors that treat each sample apart, their batch in dimension 0 (parameters beside it)
_SAMPLEWISE = {
    aten.convolution.default, aten._native_batch_norm_legit_no_training.default, aten.native_group_norm.default,
    aten.max_pool2d_with_indices.default, aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest2d.vec, aten.upsample_bilinear2d.default,
    aten.upsample_bilinear2d.vec, aten._scaled_dot_product_flash_attention_for_cpu.default, aten.embedding.default,
}
# reductions and scans along dimension arguments (position 1): per-sample where none of them is 0
_ALONG = {
    aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default, aten._softmax.default,
    aten._log_softmax.default, aten.softmax.int, aten.log_softmax.int, aten.var.correction, aten.std.correction,
    aten.cumsum.default, aten.argmax.default, aten.any.dim, aten.prod.dim_int, aten.flip.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.select.int, aten.narrow.default,
    aten.unbind.int, aten.squeeze.dim, aten.squeeze.dims, aten.index_select.default,
}
# views that give sizes: the first dimension stays c * batch in their output
_RESHAPE = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default}
# ops that make a tensor from sizes alone: per-sample where each element is the same constant
_CONSTANT = {aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default}


def per_sample(node: Node, symbol, n: int | None) -> bool:
    """Whether the op of `node` makes each sample of its output (the first dimension, c * batch) from that sample of
    its batched operands alone, the others (no batch dimension) read whole. `symbol`: the graph's batch (None: a
    static graph of batch n, where only ops without size arguments qualify: sizes there are plain numbers)."""
    t = node.target
    ins = [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]
    batched = [a for a in ins if _rows(_val(a), symbol, n) is not None]
    if any(a not in batched and not _free(_val(a), symbol) for a in ins):
        return False                    # an operand with the batch elsewhere than whole in its first dimension
    val = node.meta.get("val")
    outs = list(val) if isinstance(val, (tuple, list)) else [val]
    if t is operator.getitem:
        return True
    if not batched:
        return t in _CONSTANT and (symbol is not None or not node.args)
    if not all(isinstance(o, torch.Tensor) and (_rows(o, symbol, n) is not None or o.numel() == 0
                                                or (symbol is not None and _free(o, symbol)))
               for o in outs if o is not None):
        return False                    # (batch norm's statistics in eval: empty)
    if not isinstance(t, OpOverload) or (symbol is None and _sized(node)) or _draws(node):
        return False                    # (a random op in slices would draw in another order than eager's)
    x = _val(batched[0])
    if elementwise(t) and t not in _AFFINE:
        # broadcast operands without a batch dimension must not stretch along the first one
        return all(a in batched or _val(a).dim() < x.dim() or _val(a).shape[0] == 1 for a in ins) and \
            (t is not aten._to_copy.default or node.kwargs.get("device") is None)
    if t in _SAMPLEWISE:
        if t is aten.embedding.default:
            return node.args[1] in batched and node.args[0] not in batched
        if t is aten._scaled_dot_product_flash_attention_for_cpu.default:
            return all(a in batched for a in node.args[:3])
        return node.args[0] in batched and all(a is node.args[0] or a not in batched for a in ins)
    if t is aten.slice.Tensor and _dims(node.args[1] if len(node.args) > 1 else 0, x.dim())[0] == 0:
        # all of the first dimension (export's `x[:, ...]`): the value itself
        start, end, step = [*node.args[2:], *(None, None, 1)[len(node.args) - 2:]][:3]
        return start in (None, 0) and step == 1 and (end is None or isinstance(end, int) and end >= 2**62)
    if t in _ALONG:
        if len(node.args) < 2:
            return False
        return 0 not in _dims(node.args[1], x.dim()) and all(a is node.args[0] for a in batched)
    if t in _RESHAPE:
        return all(_rows(o, symbol, n) is not None for o in outs)
    if t is aten.permute.default:
        return _dims(node.args[1], x.dim())[0] == 0
    if t is aten.transpose.int:
        return 0 not in _dims(node.args[1:3], x.dim())
    if t is aten.unsqueeze.default:
        return node.args[1] % (x.dim() + 1) != 0
    if t is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        return _dims(dim, x.dim())[0] != 0 and all(a in batched or _val(a).numel() == 0 for a in ins)
    if t in (aten.mm.default, aten.addmm.default):
        rows, other = node.args[-2:]
        return rows in batched and other not in batched and (t is aten.mm.default or node.args[0] not in batched)
    if t in (aten.bmm.default, aten.baddbmm.default):
        return all(a in batched for a in node.args[-2:])
    if t is aten.native_layer_norm.default:
        return len(node.args[1]) < x.dim() and node.args[0] in batched
    if t is aten.constant_pad_nd.default:
        return len(node.args[1]) // 2 < x.dim()
    return False


def _draws(node: Node) -> bool:
    """An op that draws random numbers here (attention draws only with a dropout probability above 0)."""
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        p = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
        return p != 0
    return True


def _sized(node: Node) -> bool:
    """An op whose arguments give sizes (a static graph cannot tell the batch in them from other numbers)."""
    return node.target in _RESHAPE or node.target in _CONSTANT or node.target is aten.native_group_norm.default


def _tensors(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list))
                                             and any(isinstance(v, torch.Tensor) for v in val))


def _depends(graph, consts: dict) -> set[Node]:
    """The tensors computed from the model's inputs (not from parameters and literals alone; sizes are not
    tensors, and checks that return nothing are left out: `planner.slicing` drops those of a sliced block)."""
    out: set[Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name not in consts and isinstance(node.meta.get("val"), torch.Tensor):
                out.add(node)
        elif node.op == "call_function" and _tensors(node) and any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def made_without_inputs(graph, consts: dict) -> set[str]:
    """Names of the tensors the graph makes from parameters and literals alone (masks, rotary tables, position
    embeddings): the same at every call, whatever the inputs."""
    dep = _depends(graph, consts)
    return {node.name for node in graph.nodes if node.op == "call_function" and _tensors(node) and node not in dep}


def blocks(graph, consts: dict, symbol, n: int | None = None) -> list[Block]:
    """The graph cut into `Block`s at the values that dominate its output (see the module docstring), in order."""
    nodes = list(graph.nodes)
    dep = _depends(graph, consts)
    order = {node: i for i, node in enumerate(nodes)}
    dom: dict[Node, int] = {}               # node -> its dominators (and itself) as a bit set of graph positions
    full = (1 << len(nodes)) - 1
    for node in nodes:
        if node not in dep and node.op != "output":
            continue
        preds = [a for a in node.all_input_nodes if a in dep]
        mask = full
        for a in preds:
            mask &= dom[a]
        dom[node] = (0 if not preds else mask) | (1 << order[node])
    out = next(node for node in nodes if node.op == "output")
    cuts = [node for node in nodes if dom[out] >> order[node] & 1 and node is not out
            and isinstance(node.meta.get("val"), torch.Tensor)]
    if not cuts:
        return []
    cut_set = set(cuts)
    owner: dict[Node, Node] = {}            # node -> the last cut value it follows (its block's entry)
    for node in nodes:
        if node in dep and node not in cut_set and node.op == "call_function":
            ds = [c for c in cuts if dom[node] >> order[c] & 1]
            if ds:
                owner[node] = ds[-1]
    members: dict[Node, list[Node]] = {c: [] for c in cuts}
    for node, entry in owner.items():
        members[entry].append(node)
    out_blocks = []
    for entry, exit_ in zip(cuts, cuts[1:], strict=False):
        inner = sorted([*members[entry], exit_], key=order.__getitem__)
        out_blocks.append(_block(entry, inner, dep, symbol, n, order))
    return out_blocks


def _block(entry: Node, inner: list[Node], dep: set[Node], symbol, n, order: dict) -> Block:
    """The block from `entry` over `inner`, with the batch-sized tensors it reads that no input made (made inside
    it), and whether it is sliceable."""
    inside = set(inner)
    todo = [a for node in inner for a in node.all_input_nodes]
    while todo:                             # absorb batch-sized tensors made without the inputs, read only here
        a = todo.pop()
        if a in inside or a is entry or a in dep or a.op != "call_function":
            continue
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor) or (_free(val, symbol) if symbol is not None
                                                 else _rows(val, symbol, n) is None):
            continue
        if all(u in inside for u in a.users):
            inside.add(a)
            todo += a.all_input_nodes
    nodes = sorted(inside, key=order.__getitem__)
    block = Block(entry, nodes, False)
    if _rows(_val(entry), symbol, n) is None or _rows(_val(nodes[-1]), symbol, n) is None:
        block.why = "its input or output does not carry the batch in its first dimension alone"
        return block
    for node in nodes:
        for a in node.all_input_nodes:
            if a not in inside and a is not entry and (a in dep or not _outside_ok(a, symbol)):
                block.why = f"{node.name} reads {a.name} from outside the block"
                return block
        if not per_sample(node, symbol, n):
            block.why = f"{node.name} ({getattr(node.target, '__name__', node.target)}) is not a per-sample op"
            return block
    block.sliceable = True
    return block


def _outside_ok(a: Node, symbol) -> bool:
    """What a block may read from outside besides its entry: parameters and tensors without a batch dimension
    (read whole by every slice), sizes."""
    val = a.meta.get("val")
    if isinstance(val, (torch.SymInt, int, float, bool)):
        return True
    return _free(val, symbol) and (symbol is not None or a.op == "placeholder")

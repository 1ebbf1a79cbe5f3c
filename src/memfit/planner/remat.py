"""Recomputing at each reader: a small tensor that depends on none of the model's inputs or parameters (an
attention mask made from `arange` and a comparison) and is read by several layers is computed again just before
each reader, so it lives for one op instead of from the first layer to the last.

BERT's `ge` (the mask comparison, read by every layer's `where` through an `expand` view) otherwise sits on every
later peak; inductor computes it inside its readers, so there it never exists. The ops recomputed are
deterministic functions of constants (the same values every time, bit for bit), and only closures of at most
`MAX_BYTES` are recomputed (at a reader they cost their own bytes for one op).

Example:
    >>> import torch
    >>> from memfit.planner.captured import capture_model
    >>> class Masked(torch.nn.Module):
    ...     def forward(self, x):
    ...         mask = torch.arange(4) >= 2
    ...         return torch.where(mask, x, 0.0).exp(), torch.where(mask, x.exp(), 1.0)
    >>> cap = capture_model(Masked(), torch.randn(2, 4))
    >>> sum(n.target is torch.ops.aten.ge.Scalar for n in cap.ep.graph.nodes)
    2
"""

from __future__ import annotations

import torch
from torch.fx import Node

from memfit.device.torch_private import OpOverload
from memfit.planner.graph import Meta
from memfit.planner.ops import is_view

__all__ = ["MAX_BYTES", "recompute_at_readers"]

MAX_BYTES = 4096        # the most bytes of one recomputed closure (tensors made, all of them)


def _deterministic(target) -> bool:
    """An ATen op that gives the same values every time: not a random draw (`rand`, `bernoulli`, ...) and not
    uninitialised memory (`empty`)."""
    return (isinstance(target, OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags
            and not target.overloadpacket.__name__.startswith(("empty", "new_empty")))


def _free(node: Node, consts: dict, memo: dict) -> bool:
    """True when `node` is computed from no placeholder (input, parameter or buffer), only from literals, by
    deterministic ops."""
    if node not in memo:
        memo[node] = (node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
                      and _deterministic(node.target) and all(_free(a, consts, memo) for a in node.all_input_nodes))
    return memo[node]


def _closure(node: Node, memo: dict) -> list[Node]:
    """`node` and every node it is computed from, in graph order."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return [n for n in node.graph.nodes if n in seen]


def recompute_at_readers(ep, consts: dict, env: dict) -> list[str]:
    """Rewrite `ep`'s graph: each input-free tensor read (directly or through views) by several ops is computed
    again before each reader after the first. Returns the names of the tensors recomputed."""
    graph = ep.graph
    memo: dict = {}
    done = []
    for node in list(graph.nodes):
        if not _free(node, consts, memo) or is_view(node.target) or any(_free(u, consts, memo) for u in node.users):
            continue
        closure = _closure(node, memo)
        made = [n for n in closure if n.op == "call_function" and not is_view(n.target)]
        size = sum(Meta.of(n.meta["val"], env).nbytes for n in made)
        if size > MAX_BYTES:
            continue
        readers = _readers(node)                 # (reader, the views between node and it)
        if len(readers) < 2:
            continue
        for reader, views in readers[1:]:
            copies: dict[Node, Node] = {}
            with graph.inserting_before(reader):
                for n in [*closure, *views]:
                    new = graph.node_copy(n, lambda a, c=copies: c.get(a, a))
                    new.meta = dict(n.meta)
                    copies[n] = new
            reader.replace_input_with((views or closure)[-1], copies[(views or closure)[-1]])
        done.append(node.name)
    if done:
        graph.eliminate_dead_code()
        ep.graph_module.recompile()
    return done


def _readers(node: Node) -> list[tuple[Node, list[Node]]]:
    """The ops that read `node` or a view of it, each with the chain of views it reads through (in graph order)."""
    out = []
    for u in node.users:
        if is_view(u.target) and len(u.all_input_nodes) >= 1 and u.all_input_nodes[0] is node:
            out += [(r, [u, *views]) for r, views in _readers(u)]
        else:
            out.append((u, []))
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(out, key=lambda rv: order[rv[0]])

"""Where every intermediate tensor of one batch size goes: `place_at(capture, n)` analyses the captured graph at
that batch, chooses which ops run eagerly (their outputs cost less outside the arena), gives each arena tensor its
offset and writes the report; nothing is allocated or run.

Example:
    >>> import torch
    >>> from memfit.planner.captured import capture_model
    >>> cap = capture_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.zeros(2, 8))
    >>> place_at(cap, 4).report.unplanned_bytes        # the output, (4, 16) float32
    256
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from memfit.device.allocators import CPU_ALIGNMENT
from memfit.device.measure import unique_bytes
from memfit.messages import first_line
from memfit.planner.arena import (
    ALGORITHMS,
    Buffer,
    align,
    assign_offsets,
    cheaper_outside,
    live_profile,
    lower_bound,
    verify,
)
from memfit.planner.capture import CaptureError, as_inputs
from memfit.planner.captured import Captured, capture_model
from memfit.planner.graph import DataDependentSize, Graph, analyze
from memfit.planner.order import candidates, dag_of, fixed_reason, nodes_in_order
from memfit.planner.report import Report, Row
from memfit.planner.workspaces import workspaces

__all__ = ["ALIGNMENT", "EAGER_CHEAPER", "EAGER_ONE_POOL", "Placement", "check_args", "place", "place_at",
           "place_captured"]

ALIGNMENT = CPU_ALIGNMENT     # between the arena's tensors: the CPU allocator's alignment


@dataclass
class Placement:
    """Where every intermediate tensor of one batch size goes: the analysed graph and each arena
    tensor's offset (everything but the memory itself; `_ArenaForward` makes it real)."""
    graph: Graph
    buffers: list[Buffer]
    offsets: dict[str, int]
    report: Report
    out_spec: object
    batch: int | None = None
    workspaces: list[Buffer] = field(default_factory=list)   # what kernels allocate inside (`planner.workspaces`)


def check_args(algorithm: str, inplace: bool, eager_where_cheaper: bool = True, reorder: bool = True) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; found {algorithm!r}")
    for name, flag in (("inplace", inplace), ("eager_where_cheaper", eager_where_cheaper), ("reorder", reorder)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False; found {flag!r}")


def place(model: torch.nn.Module, example_inputs: tuple, *, algorithm: str = "greedy_by_size",
          inplace: bool = True, eager_where_cheaper: bool = True, reorder: bool = True) -> Placement:
    """Capture `model` and place its intermediates, without allocating the arena or running anything
    (so it is cheap at any batch size; `memory_model` calls it)."""
    check_args(algorithm, inplace, eager_where_cheaper, reorder)
    return place_captured(capture_model(model, example_inputs), example_inputs, algorithm=algorithm,
                          inplace=inplace, eager_where_cheaper=eager_where_cheaper, reorder=reorder)


def place_captured(cap: Captured, example_inputs: tuple, *, algorithm: str = "greedy_by_size",
                   inplace: bool = True, eager_where_cheaper: bool = True, reorder: bool = True) -> Placement:
    """`place` from a capture made before (no export) for inputs like `example_inputs`."""
    inputs = as_inputs(example_inputs)
    if not cap.accepts(inputs):
        raise ValueError(f"inputs {[tuple(x.shape) for x in inputs]} cannot be planned from this capture "
                         f"(made for {[tuple(s[0]) for s in cap.example_key]}); capture again")
    return place_at(cap, cap.batch_of(inputs), algorithm=algorithm, inplace=inplace,
                    eager_where_cheaper=eager_where_cheaper, reorder=reorder)


def place_at(cap: Captured, batch: int | None, *, algorithm: str = "greedy_by_size", inplace: bool = True,
             eager_where_cheaper: bool = True, reorder: bool = True, _below_range: bool = False) -> Placement:
    """The placement at batch size `batch` from one capture: exact sizes of every tensor, offsets, the
    report; nothing is exported, allocated or run (milliseconds per batch size).

    Args:
        cap: from `capture_model(model, example_inputs)`.
        batch: any size in `cap.batch_range` when `cap.dynamic`; else the example's batch.
        algorithm, inplace, eager_where_cheaper, reorder: as for `plan`.

    Raises:
        ValueError: a static capture and another batch size (`cap.static_reason` says why it is static),
            or a batch outside the range.

    Example:
        >>> import torch
        >>> cap = capture_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.zeros(2, 8))
        >>> [place_at(cap, n).report.unplanned_bytes for n in (2, 100)]      # the output, (n, 16) float32
        [128, 6400]
    """
    check_args(algorithm, inplace, eager_where_cheaper, reorder)
    lo, hi = cap.batch_range
    # _below_range (sizing only): the symbolic graph's sizes at a batch below its range (batch 1), an
    # estimate of batch 1's own capture, which runs the same ops unless the model branches on a size of 1
    if cap.dynamic and (isinstance(batch, bool) or not isinstance(batch, int) or (batch < lo and not
                        (_below_range and batch >= 1)) or (hi is not None and batch > hi)):
        raise ValueError(f"batch must be an int in [{lo}, {hi or 'inf'}] for this capture (batch 1 is captured on "
                         f"its own); found {batch!r}")
    if not cap.dynamic and batch != cap.example_batch:
        raise ValueError(f"this capture is static at batch {cap.example_batch} ({cap.static_reason}); "
                         f"found batch {batch!r}: capture again with inputs of that batch")
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode  # with sympy: ~0.9 s to import
    try:
        placed = _placed(cap, batch, _graph_at(cap, batch, inplace, eager_where_cheaper), algorithm)
        placed.report.graph_order_bytes = placed.report.arena_bytes + placed.report.unplanned_bytes
        if reorder:
            placed = _reordered(cap, batch, placed, inplace, eager_where_cheaper, algorithm)
        else:
            placed.report.order = "graph (reorder=False)"
    except (GuardOnDataDependentSymNode, DataDependentSize) as e:       # a size known only when the model runs
        why = first_line(e, with_type=False)
        raise CaptureError(f"the model's graph has tensor sizes that depend on values ({why}): "
                           "boolean-mask indexing, nonzero or .item(); the planner needs static sizes: run the "
                           "model eagerly, or do the value-dependent part outside the model",
                           kind="data-dependent") from None
    return placed


def _placed(cap: Captured, batch: int | None, graph: Graph, algorithm: str) -> Placement:
    """Offsets and the report of an analysed graph."""
    lo, hi = cap.batch_range
    arena_roots = [r for r in graph.roots.values() if r.kind == "arena"]
    buffers = [Buffer(r.name, r.nbytes, r.first, r.last) for r in arena_roots]
    offs, size = assign_offsets(buffers, algorithm, ALIGNMENT)
    verify(buffers, offs, ALIGNMENT)
    offsets = dict(zip((b.name for b in buffers), offs, strict=True))
    n_ops = len(graph.ops)
    inside = workspaces(graph, cap.env(batch), cap.device.type)
    outside = _outside(graph) + inside
    params = unique_bytes(graph.consts[r.name] for r in graph.roots.values() if r.kind == "const")
    rows = sorted((Row(r.name, r.shape, str(r.dtype).removeprefix("torch."), r.nbytes, (max(r.first, 0), r.last),
                       offsets.get(r.name), r.kind, tuple(r.members))
                   for r in graph.roots.values() if r.kind not in ("const", "input", "empty")),
                  key=lambda row: row.lifetime)
    unplanned_steps = [s for s in graph.ops if s.mode == "call" and any(graph.roots[graph.root_of[v]].kind == "call"
                                                                          for v in s.outputs if v)]
    unplanned = Counter(s.node.target.__name__.split(".")[0] for s in unplanned_steps)
    reasons = {s.node.target.__name__.split(".")[0]: s.reason for s in unplanned_steps}
    report = Report(
        # an in-place member has its root's size (graph._try_inplace checks it): one region each
        naive_bytes=sum(align(r.nbytes, ALIGNMENT) * (1 + len(r.members)) for r in arena_roots),
        arena_bytes=size, lower_bound=lower_bound(buffers, ALIGNMENT),
        unplanned_bytes=max(live_profile(outside, 1), default=0), param_bytes=params,
        input_bytes=sum(graph.roots[v].nbytes for v in graph.inputs), rows=rows, algorithm=algorithm, n_ops=n_ops,
        unplanned_ops=dict(unplanned), unplanned_reasons=reasons)
    report.capture = (f"one capture, batch symbolic in [{lo}, {hi or 'inf'}]" if cap.dynamic
                      else f"static capture at batch {cap.example_batch} ({cap.static_reason})")
    if not size:
        reasons = {s.reason for s in graph.ops if s.mode == "call"}
        report.no_arena = (NO_ARENA_ONE_POOL if EAGER_ONE_POOL in reasons else
                           NO_ARENA_CHEAPER if EAGER_CHEAPER in reasons else
                           "no op here writes into one: model outputs are fresh memory every call, and ops without "
                           "a real out= kernel allocate their own (reasons below)")
    return Placement(graph, buffers, offsets, report, cap.ep.call_spec.out_spec, batch, inside)


CHEAPER_ROUNDS = 4      # analyses with more ops run eagerly, at most: each moves ops out of the arena, none back


REORDER_TRIES = 2      # candidate orders planned for real besides the graph's, least peak by `planner.order` first


def _reordered(cap: Captured, batch: int | None, placed: Placement, inplace: bool, eager_where_cheaper: bool,
               algorithm: str) -> Placement:
    """The placement of the least arena + unplanned bytes among the graph's order and the best `REORDER_TRIES`
    orders of `planner.order` that its byte model finds lower, each planned in full as any plan is; the graph's
    order wins ties. The report says which order runs and the bytes of the graph's order."""
    why = fixed_reason(placed.graph)
    if why:
        placed.report.order = f"graph (kept: {why})"
        return placed
    env = cap.env(batch)
    layouts = {**cap.kernel_layouts, **cap.run_eagerly}
    # one allocation per op output (no in-place merges, no op moved out): the byte model of the candidates
    plain = analyze(cap.ep, cap.consts, cap.device.type, inplace=False, env=env, eager=layouts,
                    own_layout=frozenset(cap.kernel_layouts))
    found = candidates(dag_of(plain, workspaces(plain, env, cap.device.type)))
    graph_peak = next(c.peak for c in found if c.name == "graph")
    best, total = placed, placed.report.graph_order_bytes
    # only orders the byte model finds strictly lower are planned in full: where it finds none (most graphs), the
    # choice costs one analysis and the candidates' list schedules (efficientnet, 190 ops: 0.54 -> 1.38 s when
    # two orders of equal bytes were planned too, on a loaded machine)
    for c in [c for c in found if c.name != "graph" and c.peak < graph_peak][:REORDER_TRIES]:
        p = _placed(cap, batch, _graph_at(cap, batch, inplace, eager_where_cheaper, nodes_in_order(plain, c.order)),
                    algorithm)
        if p.report.arena_bytes + p.report.unplanned_bytes < total:
            best, total = p, p.report.arena_bytes + p.report.unplanned_bytes
            best.report.order = c.name
    best.report.graph_order_bytes = placed.report.graph_order_bytes
    return best


def _graph_at(cap: Captured, batch: int | None, inplace: bool, eager_where_cheaper: bool,
              order: list | None = None) -> Graph:
    """The analysed graph at `batch`, with the ops whose outputs cost less outside the arena run eagerly.
    Moving ops out changes which ops can write in place (over a tensor torch allocated, now), so the choice is
    made again on the new graph, up to `CHEAPER_ROUNDS` times; every op run eagerly is one more candidate; the
    graph of the fewest peak bytes (arena bound + outside peak, kernels' own allocations included) wins.
    `order`: the call_function nodes in the order to run them (`planner.order`; none: the graph's)."""
    env = cap.env(batch)
    layouts = {**cap.kernel_layouts, **cap.run_eagerly}
    keep = frozenset(cap.kernel_layouts)

    def analyzed(eager: dict[str, str]) -> Graph:
        return analyze(cap.ep, cap.consts, cap.device.type, inplace=inplace, env=env, eager={**layouts, **eager},
                       own_layout=keep, order=order)
    graph = analyzed({})
    if not eager_where_cheaper:
        return graph
    inside = workspaces(graph, env, cap.device.type)        # per op: the same whichever way it runs
    best, best_cost, eager = graph, _peak_cost(graph, inside), {}
    # every op eagerly, writing in place over torch's tensors where the rules allow: one pool, torch's; where the
    # outside peak comes early (a stem of convolutions and layer norms) and the arena's later, their sum is above
    # the one pool's peak, and no single move out of the arena lowers it (the greedy's local minimum)
    everything = {op.node.name: EAGER_ONE_POOL for op in graph.ops if op.mode == "out"}
    for _ in range(CHEAPER_ROUNDS):
        more = _eager_where_cheaper(graph, inside, inplace)
        if not more.keys() - eager.keys():
            break
        eager.update(more)
        graph = analyzed(eager)
        cost = _peak_cost(graph, inside)
        if cost < best_cost:
            best, best_cost = graph, cost
    if everything and everything.keys() != eager.keys():
        graph = analyzed(everything)
        if _peak_cost(graph, inside) < best_cost:
            best = graph
    return best


def _peak_cost(graph: Graph, inside: list[Buffer]) -> int:
    """The arena's lower bound + the peak of what torch allocates outside it (the planned call's peak bytes, as
    the report counts them, with the arena at its bound)."""
    arena = [Buffer(r.name, r.nbytes, r.first, r.last) for r in graph.roots.values() if r.kind == "arena"]
    return lower_bound(arena, ALIGNMENT) + max(live_profile(_outside(graph) + inside, 1), default=0)


def _outside(graph: Graph) -> list[Buffer]:
    """The tensors torch allocates (op outputs without an arena place, the model's outputs), alive to the last op."""
    n_ops = len(graph.ops)
    return [Buffer(r.name, r.nbytes, r.first, min(r.last, n_ops)) for r in graph.roots.values()
            if r.kind in ("call", "output")]


EAGER_CHEAPER = ("runs eagerly: the arena is held at its peak for the whole call, and this output fits under "
                 "the peak of the tensors outside it, so arena + unplanned bytes are lower with it outside")


EAGER_ONE_POOL = ("runs eagerly: with every op run by torch (in place where the rules allow) the call peaks lower "
                  "than with an arena beside the tensors torch allocates")
NO_ARENA_CHEAPER = ("every op that could write into an arena costs less outside it: an arena is held at its peak "
                    "for the whole call, and these outputs fit under the peak of the tensors torch allocates")
NO_ARENA_ONE_POOL = ("with every op run by torch (in place where the rules allow) the call peaks lower than with an "
                     "arena beside the tensors torch allocates (`plan(..., eager_where_cheaper=False)` forces one)")


def _eager_where_cheaper(graph: Graph, inside: list[Buffer], inplace: bool = True) -> dict[str, str]:
    """Node name -> reason for the ops whose outputs cost less memory outside the arena than in it
    (`arena.cheaper_outside`): an arena tensor moves out with the ops that write over it in place
    (with `inplace`, over the tensor torch allocated: `graph._try_inplace` allows it there as in the arena;
    else they write a copy), where each of those ops has one output to place. `inside`: what kernels
    allocate inside (`planner.workspaces`), outside the arena at their ops: a convolution's copy of its
    result lifts the outside peak, under which arena tensors then fit for free."""
    writer = {v: s for s in graph.ops if s.mode == "out" for v in s.outputs if v}   # value -> the op writing it
    arena = [r for r in graph.roots.values() if r.kind == "arena"]

    def single(step) -> bool:
        return all(not v or v == step.outputs[0] or graph.roots[graph.root_of[v]].kind == "empty"
                   for v in step.outputs)

    movable = {r.name: () if inplace else tuple(writer[m].index for m in r.members) for r in arena
               if single(writer[r.name]) and all(single(writer[m]) for m in r.members)}
    moved = cheaper_outside([Buffer(r.name, r.nbytes, r.first, r.last) for r in arena], _outside(graph) + inside,
                            movable, ALIGNMENT)
    return {writer[v].node.name: EAGER_CHEAPER for name in moved for v in (name, *graph.roots[name].members)}

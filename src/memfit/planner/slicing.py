"""Batch slicing: a memory-heavy chain of per-sample ops (a convolution stem: convolution, batch norm, ReLU,
max pooling) run in slices of the batch, so that its large intermediates exist for a few samples at a time and
only its (smaller) output for the whole batch.

A CPU convolution on an NCHW input computes in oneDNN's blocked layout and copies the result into its output:
the output is held twice at that op. A stem whose convolution output is the largest tensor of the model peaks
there (ResNet: 2x the stem's output; torch.compile's channels-last convolution holds it once, but a channels-last
convolution is not bit-identical to eager's). Sliced, the stem holds its input, its whole output and one slice's
intermediates.

What may be sliced: a chain whose peak run whole is above every op in no chain at some batch probed (`_floor`),
cut where `_segment` says at `REFERENCE_BATCH`, falling by `MIN_SAVING` sliced, each step exact at the slice size,
its slices holding at least `MIN_SLICE_BYTES` in their largest tensor (a convolution call costs a fixed time beyond
its work: slices of a few small samples cost more time than they save). Whether and in what slices it runs is
chosen per batch size by `planner.slice_rule.SliceRule` (the stems, then the others weighed together, the slices
widened where their kernel calls cost more than `MAX_SLICING_TIME` of the call's estimated time); a chain that rule
slices at no batch in `slice_rule.PROBES` stays as ops of the graph, the others become one `SlicedSegment` each,
which asks the rule at each batch (None: it runs whole, the ops as eager runs them).

The choice does not depend on the example's batch: one capture with a symbolic batch plans every batch size
(`memfit.memory_model` captures at 2 and predicts any n from that capture), so the rule is a function of the batch
n alone, the same in a plan made at 37 and in a memory model made at 2 (chosen once per capture at that capture's
batch, ResNet-18 at 64x64 was sliced at 37 and not at 2: `memory_model` at 37 was 1.82x the allocator's peak of the
plan a user got; chosen at batch 8 for every batch, it ran whole at 37: 19.4 MB against 10.6 MB sliced).

Exactness is checked, never assumed (`planner.slice_check`: every segment run whole and sliced on stand-ins
for the example, kept only where bit-identical).

Example:
    >>> import torch
    >>> stem = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 7, 2, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
    >>> from memfit.planner.captured import capture_model
    >>> cap = capture_model(stem.eval(), torch.randn(4, 3, 64, 64))    # 128 KiB a sample out of the convolution
    >>> [n.target.__name__ for n in cap.ep.graph.nodes if n.op == "call_function"]
    ['batch_slices']
    >>> seg = next(n.target for n in cap.ep.graph.nodes if n.op == "call_function")
    >>> # samples a slice at batch 2 and at 8; None: whole (at 2, one sample a slice is under `MIN_SLICE_BYTES`)
    >>> [seg.size(n) for n in (2, 8)]
    [None, 4]
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.fx import Node

from memfit.planner import slice_check
from memfit.planner.graph import DataDependentSize, Meta
from memfit.planner.op_cost import OpCost
from memfit.planner.ops import is_view
from memfit.planner.per_sample import blocks, elementwise
from memfit.planner.segment import build_segment
from memfit.planner.slice_rule import PROBES, Live, Option, SliceRule, peak_outside
from memfit.planner.sliced import SlicedSegment
from memfit.planner.workspaces import node_inside_parts, workspaces

__all__ = ["slice_segments"]

aten = torch.ops.aten

# the batch every choice is weighed at, whatever the example's: the batch `memfit bench planner` measures
REFERENCE_BATCH = 8
SLICE_SIZES = (1, 2, 4, 8)      # tried in turn; the last slice takes the rest (k .. 2k-1 samples)
# wider slices, for chains of small samples only (`_wide_sizes`): a CIFAR-sized CNN's 16 KiB a sample fills
# `MIN_SLICE_BYTES` at 16 samples a slice, so slices of 1-8 never paid and it ran whole at every batch (the demo's
# CNN at batch 1024: 50.5 MB as eager). Each is checked at 2k+1 besides the batches every size is checked at.
WIDE_SLICE_SIZES = (16, 32, 64, 128, 256)
WIDE_ROOM = 4                   # wide sizes up to this many times the narrowest that fills MIN_SLICE_BYTES
MIN_SAVING = 0.25               # a run is a candidate where its peak falls by at least this fraction sliced
# the fewest bytes a slice's largest tensor holds: a CPU convolution costs a fixed 15-90 us a call beyond its work
# (oneDNN on 1 thread, 32 channels at 32x32: 49-152 us a sample at batch 1, 26-79 at batch 8), so slices of a few
# small samples cost more time than they save bytes (ResNet's stem, 128 KiB a sample, in slices of 1: 1.22x the
# unsliced plan's time, 1.03x eager's; LeNet's 19 KiB: 2.7x eager's)
MIN_SLICE_BYTES = 256 * 1024


def _runs(graph: torch.fx.Graph, consts: dict, symbol, n: int) -> list[tuple[Node, list[list[Node]]]]:
    """(input node, [block's nodes, its output last]) for every maximal run of consecutive sliceable blocks
    (`planner.per_sample.blocks`: each from one value that every path to the output goes through to the next)."""
    runs: list[tuple[Node, list]] = []
    prev = None
    for block in blocks(graph, consts, symbol, n):
        if not block.sliceable:
            prev = None
            continue
        if prev is not None and runs and prev is block.entry:
            runs[-1][1].append(block.nodes)
        else:
            runs.append((block.entry, [block.nodes]))
        prev = block.exit
    return runs


# blocks of one op each (a chain: convolution, batch norm, ReLU, pooling) a segment reaches beyond the block where
# its run peaks, for an input or an output of fewer bytes: a stem ends at its pooling, not its convolution
CHAIN_REACH = 4


def _segment(start: Node, units: list[list[Node]], env: dict, symbol,
             held: list[int] | None = None) -> tuple[int, int, int, float]:
    """(first block to slice, one past the last, the segment's peak run whole, the fraction of it slicing saves):
    the block where the run peaks, reaching over up to `CHAIN_REACH` blocks of one op on either side where that
    holds fewer bytes whole (its input and output, one tensor where the output can be written over the input; a
    stem to its pooling), of equal ones the fewest blocks: the fewest kernel calls slicing repeats (a residual
    block, a transformer's MLP, not every block of the model with it; each of the others is a segment of its own).
    Each block holds its input, its output and what it makes in between (each op's kernel's own bytes too: a
    convolution on NCHW holds its result in oneDNN's layout, maybe its input reordered too). `held`: each block's
    peak run whole (`_held`), where the caller has them."""
    firsts = [start, *(u[-1] for u in units[:-1])]
    outs = [Meta.of(u[-1].meta["val"], env).nbytes for u in units]
    ins = [0 if f.op == "placeholder" else Meta.of(f.meta["val"], env).nbytes for f in firsts]   # (the caller's)
    if held is None:
        held = [_held(firsts[i], u, env, symbol) for i, u in enumerate(units)]
    top = max(range(len(outs)), key=lambda i: ins[i] + held[i])
    lo = hi = top
    while lo > 0 and top - lo < CHAIN_REACH and _one_op(units[lo - 1]):
        lo -= 1
    while hi + 1 < len(units) and hi - top < CHAIN_REACH and _one_op(units[hi + 1]):
        hi += 1

    def ends(i: int, j: int) -> int:          # its input and output whole: one tensor where one goes over the other
        return max(ins[i], outs[j]) if _over_input(firsts[i], units[j][-1]) else ins[i] + outs[j]
    first, end = min(((i, j) for i in range(lo, top + 1) for j in range(top, hi + 1)),
                     key=lambda ij: (ends(*ij), ij[1] - ij[0], -ij[0]))
    whole = max(ins[i] + held[i] for i in range(first, end + 1))
    # sliced: the input and the output whole, a slice's bytes beside them (left out: they shrink as the batch grows,
    # and the choice must not depend on the example's batch, since one capture plans every batch size)
    # what a kernel allocates whatever the batch (weights reordered) stays, in every slice
    constant = max((node_inside_parts(node, env)[0] for u in units[first:end + 1] for node in u), default=0)
    return first, end + 1, whole, 1 - (ends(first, end) + constant) / whole if whole else 0.0


def _held(first: Node, unit: list[Node], env: dict, symbol) -> int:
    """The bytes one block holds at its peak run whole at the batch of `env` (a static capture: its own), beside
    its input."""
    batch = next(iter(env.values())) if env else Meta.of(first.meta["val"], env).shape[0]
    return build_segment(first, unit, 1, symbol=symbol)[0]._slice_peak(env, batch)


def _over_input(first: Node, last: Node) -> bool:
    """Whether a segment's output can be written over its input (`graph._try_inplace` decides it for the plan): an
    op's own output (not the caller's input, a parameter or a view), of the output's shape, strides and dtype."""
    a, b = first.meta["val"], last.meta["val"]
    return (first.op == "call_function" and not is_view(first.target) and first.target is not operator.getitem
            and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype))


def _in_place_only(units: list[list[Node]]) -> bool:
    """Blocks of elementwise ops and views only, which the plan writes over their inputs whole (nothing to save)."""
    return all(node.target is operator.getitem or is_view(node.target) or elementwise(node.target)
               for u in units for node in u)


def _one_op(unit: list[Node]) -> bool:
    """A block of one op (and the `getitem` taking its output, views of it)."""
    return sum(node.target is not operator.getitem and not is_view(node.target) for node in unit) <= 1


def _param(node: Node, consts: dict) -> bool:
    """A parameter or a view of one (a linear's transposed weight): held whatever the batch, not an activation."""
    from memfit.planner.ops import is_view
    while node.op == "call_function" and is_view(node.target) and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node.op == "placeholder" and node.name in consts


def slice_segments(ep, consts: dict, example_inputs: tuple, symbol=None,
                   batch_range: tuple = (None, None)) -> dict[str, str]:
    """Replace, in `ep`'s graph, each run of per-sample ops that `planner.slice_rule.SliceRule` slices at some batch
    size (`slice_rule.PROBES` in `batch_range`; a static capture: its own batch) with one `SlicedSegment` node,
    which asks the rule at each batch whether and in what slices it runs. Only runs that stand-ins of the example
    show bit-identical sliced, op by op, are weighed (an op exact on slices of exact inputs gives exact slices, so the
    run is). `symbol`: the graph's symbolic batch (None: a static capture), valid in `batch_range`; the runs are cut
    with it set to `REFERENCE_BATCH`. Returns segment node name -> what it replaced and when it slices (the report)."""
    graph = ep.graph
    n = example_inputs[0].shape[0] if example_inputs and example_inputs[0].dim() else 0
    if n < 2 or example_inputs[0].device.type != "cpu":      # oneDNN's copy, the reason to slice, is the CPU's
        return {}
    lo, hi = batch_range
    if symbol is None:                # static: the graph's sizes are the example's, and it plans that batch only
        batch, env, sizes, probes = n, {}, (n, 2 * n + 1), (n,)
    else:
        batch = max(lo or 2, min(REFERENCE_BATCH, hi or REFERENCE_BATCH))
        env, sizes = {symbol: batch}, tuple(sorted({n, 2 * n + 1, batch, 2 * batch + 1}))
        probes = tuple(p for p in PROBES if p >= (lo or 2) and (hi is None or p <= hi))
    scored = [(start, units) for start, units in _runs(graph, consts, symbol, n)]
    if not scored:
        return {}
    # ops in no run are never sliced: a run that peaks no higher than one of them at every batch probed is not
    # worth checking
    try:
        costs = _op_costs(graph, consts)
        live = functools.partial(_liveness, _Unsliced(graph), consts)
        weigh = SliceRule(costs, [], symbol, batch, live=live)
        runs = []
        for start, units in scored:
            inside = {node.name for u in units for node in u}
            if any(max(peaks.get(name, 0) for name in inside) > floor
                   for peaks, floor in ((c, _floor(c, scored)) for c, _ in map(weigh.costs, probes))):
                runs.append((start, units))
    except DataDependentSize:         # sizes known only when the model runs: where it peaks is unknown, no slicing
        return {}
    if not runs:
        return {}
    inputs = slice_check.values_of(ep, consts, tuple(slice_check.stand_in(t) for t in example_inputs),
                        {s for s, _ in runs} | {p for s, units in runs for p in _reads(s, units, symbol)})
    options = []
    for start, units in runs:
        if start in inputs:
            wide = _wide_sizes(start, units, env, n if symbol is None else hi, symbol)
            ok = slice_check.exact_steps(start, units, inputs, consts, sizes, symbol, SLICE_SIZES, wide)
            options += _options(env, start, units, ok, symbol)
    if not options:
        return {}
    weighed = [Option(build_segment(first, [nd for u in units for nd in u], ks[0], symbol=symbol)[0],
                      frozenset(nd.name for u in units for nd in u), ks, _over_input(first, units[-1][-1]),
                      first.op != "placeholder")
               for first, units, ks in options]
    # the rule weighs only the options that run sliced where it chooses them (an option it slices at no probe is
    # not installed, and at a batch between the probes it must not count as sliced): narrowed until that holds
    chosen = frozenset(range(len(options)))
    while True:
        rule = SliceRule(costs, weighed, symbol, batch, chosen, live, _costs=weigh._costs, _lives=weigh._lives)
        installed = frozenset(i for p in probes for i in chosen if rule.size(i, p) is not None)
        if installed == chosen:
            break
        chosen = installed
    done, replaced = {}, {}
    order = _order(graph)
    for i in sorted(chosen, key=lambda i: order[options[i][1][0][-1]]):
        start, units, ks = options[i]
        start = replaced.get(start, start)        # the output of a segment sliced before it
        nodes = [nd for u in units for nd in u]
        seg, params = build_segment(start, nodes, ks[0], rule, i, symbol)
        last = nodes[-1]
        with graph.inserting_before(last):
            new = graph.call_function(seg, (start, *params))
        new.meta["val"] = last.meta["val"]
        last.replace_all_uses_with(new)
        replaced[last] = new
        inside = set(nodes)
        for node in reversed(nodes):
            for u in list(node.users):
                if u not in inside:             # a check that returns nothing (`per_sample._depends`): dropped
                    graph.erase_node(u)
            graph.erase_node(node)
        checked = sorted({*sizes, *(2 * k + 1 for k in ks if k not in SLICE_SIZES)})
        names = [nd.name for nd in nodes if nd.target is not operator.getitem]
        done[new.name] = (f"runs in slices of the batch ({', '.join(names)}; checked bit-identical "
                          f"at batch {', '.join(map(str, checked))}): {_when(seg, probes)}")
    if done:
        ep.graph_module.recompile()
    return done


def _when(seg: SlicedSegment, probes: tuple) -> str:
    """Which slices at which batch sizes, in words: "batch 2-3 whole, 4-6 in slices of 1, 8-1024 of 2"."""
    runs: list[list] = []
    for p in probes:
        k = seg.size(p)
        if runs and runs[-1][2] == k:
            runs[-1][1] = p
        else:
            runs.append([p, p, k])
    return "batch " + ", ".join(f"{a}{'' if a == b else f'-{b}'} " + ("whole" if k is None else f"in slices of {k}")
                                for a, b, k in runs)


def _floor(peaks: dict[str, int], scored: list) -> int:
    """The most bytes any op in no chain holds at once."""
    return peak_outside(peaks, {node.name for _, units in scored for u in units for node in u})


class _Unsliced:
    """A copy of the graph before any segment replaced its nodes: what `_liveness` weighs at any batch later (the
    rule is asked at new batch sizes after the segments are in the graph)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = torch.fx.Graph()
        self.graph.output(self.graph.graph_copy(graph, {}))


def _liveness(ep, consts: dict, env: dict) -> Live:
    """The bytes alive at each op of the (unsliced) graph at the batch of `env`, as the planner runs it eagerly:
    `graph.analyze`'s lifetimes (in-place writes merged), what kernels allocate inside (`workspaces`; above batch 8
    from each kernel's line through batches 2, 4 and 8: the rule weighs batches up to 1024, and running every
    convolution at each was most of a capture's time; the plan's own figures run them at the batch asked)."""
    from memfit.planner.arena import Buffer, live_profile
    from memfit.planner.graph import analyze
    from memfit.planner.per_sample import made_without_inputs
    graph = analyze(ep, consts, "cpu", inplace=True, env=env)
    last = len(graph.ops) - 1
    roots = [r for r in graph.roots.values() if r.kind in ("arena", "call", "output")]
    spans = tuple((r.nbytes, max(r.first, 0), min(r.last, last)) for r in roots)
    profile = live_profile([Buffer(r.name, size, a, b) for r, (size, a, b) in zip(roots, spans, strict=True)]
                           + workspaces(graph, env, "cpu", exact=False), 1) if roots else []
    free_roots = made_without_inputs(ep.graph, consts)
    free = [Buffer(r.name, size, a, b) for r, (size, a, b) in zip(roots, spans, strict=True) if r.name in free_roots]
    free_profile = live_profile(free, 1) if free else []
    at = {op.node.name: profile[op.index] if op.index < len(profile) else 0 for op in graph.ops}
    free_at = {op.node.name: free_profile[op.index] if op.index < len(free_profile) else 0 for op in graph.ops}
    return Live(at, free_at, {op.node.name: op.index for op in graph.ops}, spans)


def _op_costs(graph, consts: dict) -> list[OpCost]:
    """Each op of the graph as `SliceRule` weighs it (its bytes counted where it holds activations)."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        # a view holds no bytes of its own (what it reads is counted by the ops that make and read it)
        val = node.meta.get("val")
        made = isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list))       # (attention: output, statistics)
                                                 and any(isinstance(v, torch.Tensor) for v in val))
        held = made and not _param(node, consts) and node.target is not operator.getitem and not is_view(node.target)
        ins = tuple(a.meta["val"] for a in node.all_input_nodes
                    if not _param(a, consts) and isinstance(a.meta.get("val"), torch.Tensor)) if held else ()
        out.append(OpCost.of(node, held, ins))
    return out


def _order(graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _reads(start: Node, units: list[list[Node]], symbol) -> list[Node]:
    """The nodes a run's blocks read besides their inputs (parameters, tensors without a batch dimension)."""
    out = []
    for i, u in enumerate(units):
        out += build_segment(start if i == 0 else units[i - 1][-1], u, 1, symbol=symbol)[1]
    return out


def _options(env: dict, start: Node, units: list, ok: dict[int, list[bool]],
             symbol=None) -> list[tuple[Node, list, tuple]]:
    """(input, blocks, the slice sizes every block is exact at and whose slices hold `MIN_SLICE_BYTES` or more in
    their largest tensor, ascending) of the segments that could be sliced: each run of blocks exact at some size
    cut where `_segment` says (around its peak), kept where it saves `MIN_SAVING` of its peak; the blocks left on
    either side cut again. Cut on the run's shape first, then the sizes all its blocks are exact at (cut per size,
    narrowest first, a U-Net's merge convolution, exact in slices of 1, was taken alone at 1 and the block before it,
    exact from 2, ended at the 4 MiB concatenation the convolution reads). A segment whose blocks share no exact
    size is cut into runs that do."""
    exact = [frozenset(k for k in ok if ok[k][i]) for i in range(len(units))]
    todo, out = [], []
    i = 0
    while i < len(units):                   # the runs of blocks exact at some size
        j = i
        while j < len(units) and exact[j]:
            j += 1
        if j > i:
            todo.append((i, j))
        i = max(j, i + 1)
    peaks: dict[int, int] = {}              # each block's peak whole, weighed once (a cut weighs what is left again)

    def held(i: int, j: int) -> list[int]:
        for k in range(i, j):
            if k not in peaks:
                peaks[k] = _held(start if k == 0 else units[k - 1][-1], units[k], env, symbol)
        return [peaks[k] for k in range(i, j)]

    while todo:                             # each cut around its peak, the blocks left on either side cut again
        i, j = todo.pop()
        first = start if i == 0 else units[i - 1][-1]
        a, b, _, saving = _segment(first, units[i:j], env, symbol, held(i, j))
        a, b = i + a, i + b
        sizes = sorted(frozenset.intersection(*exact[a:b]))
        if not sizes:                       # no size every block is exact at: runs that share one, cut again
            todo += _sharing(exact, i, j)
            continue
        first = start if a == 0 else units[a - 1][-1]
        ks = tuple(k for k in sizes if _largest(first, units[a:b], env, k, symbol) >= MIN_SLICE_BYTES)
        if saving >= MIN_SAVING and not _in_place_only(units[a:b]) and ks:
            out.append((first, units[a:b], ks))
        todo += [(p, q) for p, q in ((i, a), (b, j)) if q > p]
    return sorted(out, key=lambda o: units.index(o[1][0]))


def _sharing(exact: list[frozenset], i: int, j: int) -> list[tuple[int, int]]:
    """Blocks i..j-1 as maximal runs (left to right) whose blocks are all exact at one size at least."""
    runs, p = [], i
    while p < j:
        q, common = p + 1, exact[p]
        while q < j and common & exact[q]:
            common &= exact[q]
            q += 1
        runs.append((p, q))
        p = q
    return runs


def _wide_sizes(start: Node, units: list, env: dict, most: int | None, symbol=None) -> tuple[int, ...]:
    """The `WIDE_SLICE_SIZES` worth checking for a run: where slices of `SLICE_SIZES[-1]` hold less than
    `MIN_SLICE_BYTES` in the run's largest tensor, from the narrowest that holds it up to `WIDE_ROOM` times that
    (room for the rule to widen them for time), two of them at most `most` samples (the largest batch planned).
    A large sample gets none: no extra check (ResNet-18 at 224x224: 3.2 MB a sample out of its stem)."""
    if _largest(start, units, env, SLICE_SIZES[-1], symbol) >= MIN_SLICE_BYTES:
        return ()
    fill = next((k for k in WIDE_SLICE_SIZES if _largest(start, units, env, k, symbol) >= MIN_SLICE_BYTES), None)
    if fill is None:
        return ()
    return tuple(k for k in WIDE_SLICE_SIZES if fill <= k <= WIDE_ROOM * fill and (most is None or 2 * k <= most))


def _largest(first: Node, units: list, env: dict, k: int, symbol=None) -> int:
    """Bytes of the largest tensor a slice of k samples reads or makes (its input, any op's output)."""
    seg = SlicedSegment((), k, None, (), symbol=symbol)
    vals = [first.meta["val"]] + [v for u in units for node in u
                                  for v in (node.meta["val"] if isinstance(node.meta.get("val"), (tuple, list))
                                            else [node.meta.get("val")])
                                  if isinstance(v, torch.Tensor) and v.dim() and _batched(v, first, symbol)]
    return max(seg._meta(v, env, k).nbytes for v in vals)


def _batched(v: torch.Tensor, first: Node, symbol) -> bool:
    """Whether a value carries the batch (grows with it), as the run's input does."""
    if symbol is not None:
        return isinstance(v.shape[0], torch.SymInt) and symbol in v.shape[0].node.expr.free_symbols
    return v.shape[0] == first.meta["val"].shape[0]

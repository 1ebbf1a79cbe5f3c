"""Whether a sliced segment computes what its ops compute whole, bit for bit (`planner.slicing` keeps only the
segments and slice sizes this check passes).

Exactness is checked, never assumed: oneDNN may pick another algorithm for another batch size (a 3x3
convolution at batch 1 differs from the same samples at batch 8 in the last bits), so every segment is run
whole and sliced on stand-ins for the capture's example (normal draws of its shape and dtype from a seeded
generator of our own, so that the choice never depends on the example's values: zeros would pass any check) at
the example's batch n, at 2n+1, at `slicing.REFERENCE_BATCH` and at twice that plus one (the samples repeated),
and kept only where every output is bit-identical (`torch.equal`) with the same strides, at each slice size in
`slicing.SLICE_SIZES` (the last slice of a batch takes the rest: k to 2k-1 samples; checked at the sizes those
batches give it only). A chain of small samples, whose slices of `SLICE_SIZES[-1]` hold less than
`slicing.MIN_SLICE_BYTES`, is also checked at the `slicing.WIDE_SLICE_SIZES` from the narrowest that holds it up
to `slicing.WIDE_ROOM` times that, each wide size k at 2k+1 besides those batches (cheap: a few MB on stand-ins);
a chain of large samples checks none of them, so big models capture no slower.

Known limitations: the check runs at those batch sizes and the process's intra-op thread count; a batch size or
thread count at which oneDNN picks yet another algorithm for the whole batch is not checked (slices of 8, for
batches of 16 and more, are checked at 2 * `slicing.REFERENCE_BATCH` + 1 only, and at 2n+1 where the example's
n is 8 or more; a wide slice of k at 2k+1). So of the last slice's sizes, k to 2k-1, only those the checked
batches give it run checked: a capture at batch 2 runs a last slice of 13 at batch 37 that no check ran (no such
size was seen to differ: the convolutions tried differ at batch 1 against every other size, or at every size).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from memfit.memory.isolation import drawless_section
from memfit.planner.segment import build_segment
from memfit.planner.sliced import SlicedSegment

__all__ = ["exact", "exact_steps", "same", "stand_in", "value", "values_of"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and torch.equal(a, b)


def exact(seg: SlicedSegment, x: torch.Tensor, params: tuple, sizes: tuple[int, ...] = (),
           wholes: dict | None = None) -> bool:
    """The segment sliced equals it run whole, bit for bit with the same strides, on x's samples repeated to each
    batch size in `sizes` (default: x's own batch n and 2n+1, an odd one: the last slice takes the rest).
    `wholes`: batch -> (input, the whole run's result), kept for the next slice size of the same steps."""
    n, wholes = x.shape[0] // seg.rows, {} if wholes is None else wholes
    checked = [b for b in sizes or (n, 2 * n + 1) if seg.size(b) is not None]   # below two slices it runs whole
    for b in checked:
        if b not in wholes:             # (a sample's rows stay together: a linear's view has `rows` a sample)
            xb = x if b == n else x.unflatten(0, (n, seg.rows))[torch.arange(b, device=x.device) % n].flatten(0, 1)
            wholes[b] = xb, seg.run_slice(xb, params)
        xb, whole = wholes[b]
        if not same(seg(xb, *params), whole):
            return False
    return bool(checked)              # a size no batch checked is not exact


def exact_steps(start: Node, units: list, values: dict, consts: dict, sizes: tuple[int, ...], symbol=None,
                narrow: tuple[int, ...] = (1,), wide: tuple[int, ...] = ()) -> dict[int, list[bool]]:
    """Slice size -> whether each block, run on the example's values (repeated to each batch in `sizes`; for each of
    the `wide` sizes k at 2k+1 too: two slices, the last of k+1) whole and in slices of that size (each of the
    `narrow` and `wide` sizes), is bit-identical (one block's input held at a time). `values`: the example's
    value of the run's input and of every tensor its blocks read from outside."""
    ok: dict[int, list[bool]] = {k: [] for k in (*narrow, *wide)}
    v = values[start]
    with torch.no_grad(), drawless_section():          # (a block with a random op is never sliceable)
        for i, unit in enumerate(units):
            node_in = start if i == 0 else units[i - 1][-1]
            wholes: dict = {}           # each batch's whole run, once for all slice sizes
            seg, params = build_segment(node_in, unit, 1, symbol=symbol)      # its steps, whatever the slice size
            args = tuple(value(p, consts, values) for p in params)
            for k in ok:
                at = sizes if k in narrow else tuple(sorted({*sizes, 2 * k + 1}))
                ok[k].append(exact(seg.with_size(k), v, args, at, wholes))
            n = v.shape[0] // seg.rows  # the next block's input: the whole batch, as eager (run above where checked)
            v = wholes[n][1] if n in wholes else seg.run_slice(v, args)
            del wholes
    return ok


def value(node: Node, consts: dict, values: dict):
    """A node's value: a constant's, or the example's."""
    return consts[node.name] if node.name in consts else values[node]


def stand_in(t):
    """The values the exactness check runs on: for a floating example, normal draws of its shape, dtype and
    strides from a generator of our own (seeded: the same choice for every example of that shape, whatever its
    values; an example of zeros would pass any check, one of uninitialised memory may hold NaN, which never
    compares equal); other inputs (indices, masks) as they are."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return t
    g = torch.Generator(device=t.device).manual_seed(0)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_(generator=g)


def values_of(ep, consts: dict, example_inputs: tuple, wanted: set[Node]) -> dict[Node, torch.Tensor]:
    """The real values of the `wanted` nodes when the graph runs on the example (one eager run)."""
    from torch.fx import Interpreter
    got: dict[Node, torch.Tensor] = {}

    class Keep(Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node in wanted:
                got[node] = out
            return out
    users = iter(example_inputs)
    args = [consts[n.name] if n.name in consts else next(users) for n in ep.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        Keep(ep.graph_module).run(*args)
    return got

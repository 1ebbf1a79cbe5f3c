"""The callable a sliced segment of the graph runs (`planner.slicing` chooses where): `SlicedSegment` runs a chain
of per-sample ops (`SLICEABLE`) on slices of k samples of the batch, writes each slice's result into the whole
output, and says how many bytes one slice holds (the planner counts them as the segment's workspace).

Example:
    >>> import torch
    >>> relu = _Step(torch.ops.aten.relu.default, ("x",), {}, None, None)
    >>> seg = SlicedSegment((relu,), 2, None, ())
    >>> seg.slices(5)                 # slices of 2, the last one takes the rest
    [(0, 2), (2, 5)]
    >>> seg.slices(3)                 # below two slices: whole
    [(0, 3)]
    >>> x = torch.randn(5, 3)
    >>> torch.equal(seg(x), x.relu())
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from memfit.planner.graph import Meta, meta_value

__all__ = ["SLICEABLE", "SlicedSegment", "build_segment"]

aten = torch.ops.aten

# ops that compute each sample from that sample alone (argument 0 and output 0 carry the batch in dimension 0; the
# other tensor arguments are parameters): -> the output positions read after it (getitem), None: one output
SLICEABLE = {
    aten.convolution.default: None,
    aten._native_batch_norm_legit_no_training.default: 0,
    aten.relu.default: None,
    aten.hardtanh.default: None,
    aten.clamp_min.default: None,
    aten.silu.default: None,
    aten.gelu.default: None,
    aten.max_pool2d_with_indices.default: 0,
    aten.avg_pool2d.default: None,
    aten._adaptive_avg_pool2d.default: None,
}


@dataclass(frozen=True)
class _Step:
    target: object
    args: tuple               # "x" for the running value, ("const", i) for the i-th parameter, else literals
    kwargs: dict
    item: int | None          # the output taken (multi-output ops)
    val: object               # the graph's value of its (taken) output, for sizes at any batch
    outputs: tuple = ()       # the graph's values of all its tensor outputs


class SlicedSegment:
    """The callable that replaces a segment's nodes: `segment(x, *params)` runs the steps on slices of the batch
    (`size(n)` samples each, the last slice takes the rest) and writes each slice's result into the whole output,
    or runs them on the whole batch where `size(n)` is None. With a `rule` (`planner.slice_rule.SliceRule`, the
    segment its option `index`), the size is the rule's at each batch; without one, `k` at every batch that makes
    two slices of it."""

    __name__ = "batch_slices"

    def __init__(self, steps: tuple[_Step, ...], k: int, input_val, param_vals: tuple, rule=None, index: int = 0):
        self.steps, self.k, self.input_val, self.param_vals = steps, k, input_val, param_vals
        self.rule, self.index = rule, index

    def with_size(self, k: int) -> SlicedSegment:
        """The same steps in slices of k at every batch that makes two of them (the rule weighs sizes with it)."""
        return SlicedSegment(self.steps, k, self.input_val, self.param_vals)

    def size(self, n: int) -> int | None:
        """Samples a slice at a batch of n (the last slice takes the rest: k to 2k-1), None: the whole batch."""
        if self.rule is not None:
            return self.rule.size(self.index, n)
        return self.k if n >= 2 * self.k else None

    def slices(self, n: int) -> list[tuple[int, int]]:
        """(start, stop) of each slice of a batch of n; [(0, n)] where it runs whole."""
        k = self.size(n)
        if k is None:
            return [(0, n)]
        cuts = list(range(0, n - k + 1, k))
        return [(a, cuts[i + 1] if i + 1 < len(cuts) else n) for i, a in enumerate(cuts)]

    def run_slice(self, x: torch.Tensor, params: tuple) -> torch.Tensor:
        v = x
        for st in self.steps:
            v = st.target(*[v if a == "x" else params[a[1]] if _is_param(a) else a for a in st.args], **st.kwargs)
            if st.item is not None:
                v = v[st.item]
        return v

    def __call__(self, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        cuts = self.slices(x.shape[0])
        if len(cuts) == 1:                 # whole: the ops as eager runs them, no copy
            return self.run_slice(x, params)
        out = None
        for a, b in cuts:
            part = self.run_slice(x[a:b], params)
            if out is None:      # the slice's strides hold for the whole batch (batch outermost; checked at capture)
                out = part.new_empty_strided((x.shape[0], *part.shape[1:]), part.stride())
            out[a:b].copy_(part)
            del part
        return out

    def slice_bytes(self, env: dict, n: int) -> int:
        """The most bytes the segment holds at once beyond its input and its whole output (both counted beside
        this), for a batch of n. Run whole, its steps' peak less the output (the last step's output is it). In
        slices, the whole output is allocated after the first slice (`__call__`: from that slice's strides), so the
        first slice's peak holds it in none of its bytes: counting the output beside the first slice put a CNN's
        prediction at 1.11x its allocator peak at batch 3. Each later slice runs beside the output; the copy of a
        later slice's result into it is in that slice's peak (its last step's output), the copy of the first
        slice's result is beside the output."""
        cuts = self.slices(n)
        whole_out = _at(self.steps[-1].val, env, n).nbytes
        if len(cuts) == 1:
            return max(0, self._slice_peak(env, n) - whole_out)
        k = cuts[0][1] - cuts[0][0]
        first, part = self._slice_peak(env, k), _at(self.steps[-1].val, env, k).nbytes
        later = max((self._slice_peak(env, size) for size in {b - a for a, b in cuts[1:]}), default=0)
        return max(first - whole_out, part, later)

    def _slice_peak(self, env: dict, s: int) -> int:
        """The most bytes one slice of s samples holds at once: a step's input and output at the slice's size and
        what its kernel allocates inside."""
        from memfit.memory.kernel_scratch import inside_parts
        prev, most = _at(self.input_val, env, s), 0
        for i, st in enumerate(self.steps):
            m = _at(st.val, env, s)
            # every output the op makes at the slice's size (max pooling's indices too, which nothing reads)
            out = sum(o.nbytes for o in (_at(v, env, s) if Meta.of(v, env).shape[:1] == Meta.of(st.val, env).shape[:1]
                                         else Meta.of(v, env) for v in st.outputs))
            args = [_meta(prev) if a == "x" else meta_value(self.param_vals[a[1]], env) if _is_param(a)
                    else a for a in st.args]
            inside = sum(inside_parts(st.target, tuple(args), st.kwargs))
            held = out + (0 if i == 0 else prev.nbytes)   # step 0: x's view
            most = max(most, held + inside)
            prev = m
        return most


def _is_param(a) -> bool:
    return isinstance(a, tuple) and len(a) == 2 and a[0] == "const"


def _at(val, env: dict, s: int) -> Meta:
    """A batch-outermost value's meta at a batch of s (dimension 0 replaced; the strides do not depend on it)."""
    m = Meta.of(val, env)
    return Meta((s, *m.shape[1:]), m.strides, m.dtype, 0)


def _meta(m: Meta) -> torch.Tensor:
    return torch.empty_strided(m.shape, m.strides, dtype=m.dtype, device="meta")


def build_segment(start: Node, steps: list, k: int, rule=None, index: int = 0) -> tuple[SlicedSegment, list[Node]]:
    params: list[Node] = []
    out = []
    for node, value in steps:
        args = []
        for j, a in enumerate(node.args):
            if j == 0:
                args.append("x")
            elif isinstance(a, Node):
                if a not in params:
                    params.append(a)
                args.append(("const", params.index(a)))
            else:
                args.append(a)
        vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
        out.append(_Step(node.target, tuple(args), dict(node.kwargs), SLICEABLE[node.target], value.meta["val"],
                         tuple(v for v in vals if isinstance(v, torch.Tensor) and v.dim())))  # (0-dim: no batch)
    seg = SlicedSegment(tuple(out), k, start.meta["val"], tuple(p.meta["val"] for p in params), rule, index)
    return seg, params

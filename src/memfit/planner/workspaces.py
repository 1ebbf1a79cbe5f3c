"""What the planned forward's kernels allocate inside, beyond their outputs: oneDNN convolution's reordered
weights and the result it copies into its output, max pooling's indices, flash attention's buffers
(`memfit.memory.fake_kernels.WORKSPACE`, measured from the real kernels), and the scratch of kernels on
half-precision arguments (`memfit.memory.kernel_scratch`: `mean` of a bfloat16 tensor sums a float32 copy of it,
twice the input's bytes; oneDNN's bf16 matmuls pack their operands). Live at their op only: the planner
counts them with the tensors outside the arena, so its report, and the memory model built on it, are never
below what the allocator serves.

Example:
    >>> import torch
    >>> from memfit.planner.placement import capture_model, place_at
    >>> conv = torch.nn.Conv2d(3, 8, 3).eval()
    >>> cap = capture_model(conv, torch.zeros(2, 3, 16, 16))
    >>> len(workspaces(place_at(cap, 4).graph, cap.env(4), "cpu")) > 0
    True
"""

from __future__ import annotations

import torch
from torch.fx import Node

from memfit.device.torch_private import OpOverload
from memfit.planner.arena import Buffer
from memfit.planner.graph import Graph, meta_value

__all__ = ["handed_over", "node_inside_parts", "workspaces"]


def _replacement_bytes(fn, args: tuple, kwargs: dict) -> int:
    """Bytes `fn` (a kernel run instead of the graph's op, `ops.WHEN_UNREAD`) allocates beyond its outputs, measured
    on zeros of the arguments' shapes under inference mode (`memfit.device.kernel_probe`: once per shapes): on the CPU
    `torch.max_pool2d` under inference mode still goes through `max_pool2d_with_indices` and makes the int64 indices
    (twice the values' bytes) inside."""
    from memfit.device.kernel_probe import probe_bytes, zeros

    def real(a):
        return zeros(tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
    with torch.inference_mode():
        return probe_bytes(fn, tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()})


def _replacement_at(op, env: dict, exact: bool) -> int:
    """`_replacement_bytes` of a graph op run by another kernel, at the batch of `env`; with `exact=False` above batch
    8, from the line through its bytes at batches 4 and 8 (rounded up), not run at this batch."""
    def at(e: dict) -> int:
        return _replacement_bytes(op.replacement, tuple(meta_value(a, e) for a in op.node.args),
                                  {k: meta_value(v, e) for k, v in op.node.kwargs.items()})
    n = next(iter(env.values()), None)
    if exact or n is None or n <= 8:
        return at(env)
    w4, w8 = at(dict.fromkeys(env, 4)), at(dict.fromkeys(env, 8))
    rate = max(0, -(-(w8 - w4) // 4))
    return max(0, w8 - 8 * rate) + rate * n


def node_inside_parts(node: Node, env: dict, exact: bool = True) -> tuple[int, int]:
    """`inside_parts` of a graph node's op at the batch of `env` ((0, 0) where it is no ATen op: a getitem)."""
    from memfit.memory.kernel_scratch import inside_parts
    if not isinstance(node.target, OpOverload):
        return 0, 0
    return inside_parts(node.target, tuple(meta_value(a, env) for a in node.args),
                        {k: meta_value(v, env) for k, v in node.kwargs.items()}, exact)


def handed_over(graph: Graph, op) -> str | None:
    """The root a sliced segment's call is handed (`SlicedSegment.owned`: the planned forward keeps no reference to
    it, so a whole run frees it after its last step that reads it): its input's, where torch allocated it and this
    call reads it last; else None. `planner.codegen` writes the call so, and `workspaces` counts it so."""
    from memfit.planner.sliced import SlicedSegment
    x = op.node.args[0] if op.node.args else None
    if op.mode != "call" or not isinstance(op.node.target, SlicedSegment) or not isinstance(x, Node):
        return None
    names = [v for o in graph.ops if o.node is x for v in o.outputs]
    root = graph.roots.get(graph.root_of.get(names[0], "")) if len(names) == 1 and names[0] else None
    return root.name if root is not None and root.kind == "call" and root.last == op.index else None


def workspaces(graph: Graph, env: dict, device_type: str, exact: bool = True) -> list[Buffer]:
    """One buffer per op of `graph` whose real kernel allocates inside (on the CPU), alive at that op only.
    `exact=False`: workspaces above batch 8 from their lines, not run at this batch (the slicing rule's guide)."""
    if device_type != "cpu":
        return []                           # CUDA library workspaces: a known limitation (memory.allocator)
    out = []
    from memfit.planner.sliced import SlicedSegment
    for op in graph.ops:
        target = op.node.target
        if isinstance(target, SlicedSegment):        # one slice's intermediates, beside the segment's input and output
            n = meta_value(op.node.args[0], env).shape[0] // target.rows
            root = handed_over(graph, op)
            dies = graph.roots[root].nbytes if root else 0
            out.append(Buffer(f"slices of {op.node.name}",
                              target.slice_bytes(env, n, into=op.mode == "out", input_dies=dies), op.index, op.index))
            continue
        if op.replacement is not None and op.mode == "call":
            # another kernel runs it (max pooling without indices): what that one allocates inside
            size = _replacement_at(op, env, exact)
            if size:
                out.append(Buffer(f"workspace of {op.node.name}", size, op.index, op.index))
            continue
        if op.mode not in ("call", "out") or not isinstance(target, OpOverload):
            continue                        # views and getitem allocate nothing
        size = sum(node_inside_parts(op.node, env, exact))
        if size:
            out.append(Buffer(f"workspace of {op.node.name}", size, op.index, op.index))
    return out

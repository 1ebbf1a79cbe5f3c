"""The scratch real CPU kernels allocate inside on half-precision arguments, and the copies matmul kernels make of
arguments BLAS cannot read, beyond their outputs, freed before they return: measured from the real kernels, sized
along the batch from two fake runs.

Found by running every op of bf16-autocast training steps (an MLP, CNNs with BatchNorm, a ConvNeXt-style block,
a transformer encoder, BERT, GPT-2, ViT) under the allocator's events (`memfit.device.measure.track_memory`):
oneDNN's bf16 matrix multiplications (mm, addmm, bmm, baddbmm) pack their operands into its blocked layout
(7-52 KiB on layers of 32-128 features, growing with the rows when the batch is the reduced dimension, as in
a weight's gradient), and ops on bfloat16 or float16 inputs that compute in float32 keep a float32 copy of an
input (layer norm, `mean`, an add of a bfloat16 and a float32 tensor: a residual under autocast). No op output
shows these bytes, so a fake run, which logs outputs, never sees them: a bf16-autocast step peaked up to 22% above
the prediction without them. The same ops on float32 arguments allocate nothing inside (or are in
`memfit.memory.fake_kernels.WORKSPACE`), but for the matmuls' copies below.

The ops of `WORKSPACE` (oneDNN's convolution and its backward, the norms' backward, flash attention, max pooling;
not the LSTM's, which `fake_kernels` bounds at every batch) are measured here too, at any dtype, for the
training memory model: their bytes are oneDNN's choice per size as well (a 1x1 convolution to 2 channels: 0 B
inside up to batch 13, 1.4 MiB at 16, on an AMD
EPYC), and a line through them at a few batches put a step at 0.85x the allocator beyond them. Their arguments
are made as the real kernel gets them (`fake_kernels.as_real_kernel_takes`: float32 statistics of half-precision
norms).

The CPU matmul kernels (mm, addmm, bmm, baddbmm, addbmm, mv, addmv) hand BLAS a matrix argument only in row- or
column-major order (a unit stride, the other stride at least the size); any other they copy to a contiguous tensor
inside (`addmm_impl_cpu_`'s `clone`, bmm's per batch item where MKL's batched gemm cannot read it), at any dtype.
The gradient `sum(-1)`'s backward gives a Linear is one: expanded along the features (strides (1, 0)), so its
weight's and input's gradients each copy the whole (rows, features) gradient: a Linear(1024, 1024) summed over
its outputs, batch 8 of 512 positions, peaked 8.4% above the prediction without them.

So every op with a float16 or bfloat16 tensor among its arguments (or floating tensors of two dtypes), other
than views, in-place ops and the ops of `WORKSPACE`, and every matmul on a matrix BLAS cannot read as it is
(`measured_here`), is noted by the fake run with its arguments' shapes, strides
and dtypes (`spec_of`), and run for real on zeros of those at this intra-op thread count (`scratch_bytes`, once
per shapes). The bytes are not a line in the batch (oneDNN picks its algorithm and pads by size: a weight
gradient's packing takes 17.1 KiB at every even batch up to 32 rows, 25.2 KiB at odd ones, then grows with the
rows), so the memory model measures them at each batch size it is asked about (`ScratchOp.bytes_at`), on
arguments of that batch's shapes: which dimensions carry the batch differs per call (a matmul's rows in
forward, its reduced dimension in a weight's gradient) and is read off two fake runs at different batch sizes,
as the sizes that differ between the same op of both (`batch_sizes`).

Known limitations: all of this is the CPU kernels' and is measured for a CPU step only (`StorageLog.scratch`): a
prediction for CUDA (on a GPU, or from the CPU with `device="cuda"`) counts none of it, so cuBLAS's copy of a matrix it
cannot read (`prepare_matrix_for_cublas` clones it, by the same rule) is not counted there; zeros stand in for values (a
kernel whose scratch depends on values, an index, is measured on zeros); a seeded random op (dropout) runs the real
kernel under a saved and restored RNG (`memfit.memory.isolation.kept_rng`: another thread's draw in that instant would
be rewound); the first question about a batch size runs each measured kernel once at that size (twice the first time the
process runs it: `memfit.device.kernel_probe.inside_bytes`), on zeros of that size's shapes (about 0.1 s for a two-layer
BERT; for a CNN, whose layers differ in shape, 0.6-0.7x the CPU time of a real step at that size); where the two fake
runs do not show an op's sizes as affine in the batch, its bytes at batch 4 are scaled with the batch and the model's
`method` says APPROXIMATE.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from memfit.device.kernel_probe import probe_bytes, zeros
from memfit.device.torch_private import OpOverload, disable_current_modes, op_schema, tree_flatten, tree_unflatten

__all__ = ["ArgSpec", "Ones", "ScratchOp", "batch_sizes", "forget_measured", "inside_parts", "measured_here",
           "real_arguments", "scratch_bytes", "scratch_ops", "sizes_at", "spec_of"]

_HALF = (torch.float16, torch.bfloat16)
_CHOSEN: dict = {}              # op -> whether its outputs are new storages (not a view, not in place)


@dataclass(frozen=True)
class ArgSpec:
    """An op's arguments without their values: each tensor as (shape, strides, dtype), other leaves as they are."""
    tree: object                      # the pytree spec of (args, kwargs)
    leaves: tuple                     # ("t", shape, stride, dtype) or the value


def spec_of(args, kwargs) -> ArgSpec:
    leaves, tree = tree_flatten((args, kwargs))
    return ArgSpec(tree, tuple(("t", tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                               for a in leaves))


_A = torch.ops.aten
# the matrix arguments (positions) of the CPU matmul kernels that copy one BLAS cannot read: addmm_impl_cpu_ (mm,
# addmm; bmm, baddbmm and addbmm per batch item past MKL's batched gemm) and addmv (mv) clone it to a contiguous
# tensor inside (ATen's LinearAlgebra.cpp, Blas.cpp). dot, vdot and addr pass any stride (measured: 0 B inside on
# stride-0 and strided vectors), so they are not here; nor is the fused addmm + activation only compilers emit.
_MATRICES = {_A.mm.default: (0, 1), _A.addmm.default: (1, 2), _A.bmm.default: (0, 1), _A.baddbmm.default: (1, 2),
             _A.addbmm.default: (1, 2), _A.mv.default: (0,), _A.addmv.default: (1,)}


def _copied_by_blas_kernel(func, args) -> bool:
    """Whether a matrix argument of a matmul kernel (`_MATRICES`) is one BLAS cannot read as it is, so the CPU
    kernel copies it: of its last two dimensions (rows, cols) at strides (sr, sc), neither row-major (sc == 1 and
    sr >= max(1, cols)) nor column-major (sr == 1 and sc >= max(1, rows)), as `addmm_impl_cpu_` tests. A gradient
    broadcast by `sum(-1)`'s backward (stride 0 along the features: (1, 0)) is neither."""
    for i in _MATRICES[func]:
        t = args[i] if i < len(args) else None
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            rows, cols = t.shape[-2:]
            sr, sc = t.stride()[-2:]
            if not (sc == 1 and sr >= max(1, cols) or sr == 1 and sc >= max(1, rows)):
                return True
    return False


def measured_here(func, args, kwargs) -> bool:
    """Whether `func` on these arguments is one whose scratch is measured: a half-precision floating tensor among
    them, or floating tensors of more than one dtype, and outputs that are new storages (a view or an in-place
    op of the optimizer allocates nothing); or a matmul kernel with a matrix argument BLAS cannot read as it is
    (`_copied_by_blas_kernel`), at any dtype."""
    if not isinstance(func, OpOverload):
        return False
    if func in _MATRICES and _copied_by_blas_kernel(func, args):
        return True
    dtypes = set()
    for a in (*args, *(kwargs or {}).values()):   # flat: every op of every fake run passes here
        for t in (a if isinstance(a, (list, tuple)) else (a,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                dtypes.add(t.dtype)
    if not dtypes or (dtypes.isdisjoint(_HALF) and len(dtypes) < 2):
        return False
    if func not in _CHOSEN:
        schema = op_schema(func)
        _CHOSEN[func] = not schema.is_mutable and all(r.alias_info is None for r in schema.returns) \
            and any("Tensor" in str(r.type) for r in schema.returns)
    return _CHOSEN[func]


def _is_tensor(leaf) -> bool:
    return isinstance(leaf, tuple) and len(leaf) == 4 and leaf[0] == "t"


class Ones:
    """Floating arguments of ones cut from one buffer per dtype and device, for kernels that read them and write none
    (`real_arguments(..., ones=Ones())`): each kernel's arguments lie apart in it, 64-byte aligned as c10's
    allocator aligns, and the next kernel's lie over them. The buffer is written once; a tensor of ones made per
    argument writes every byte and page-faults every page of it (GPT-2 768x2's 286 kernels timed at four batch
    sizes: 2.1 s of a 12 s `memfit.fit`). A kernel that writes an argument (in place, `out=`) gets its own (from a
    second `Ones`, `real_arguments(..., own=)`, refilled with ones, where the caller gives one)."""

    def __init__(self):
        self.buffers: dict = {}          # (dtype, device) -> a 1-D tensor of ones
        self.used: dict = {}             # (dtype, device) -> elements taken by the current kernel's arguments

    def next_kernel(self) -> None:
        """The arguments taken from here on are another kernel's: they may lie over the last one's."""
        self.used.clear()

    def take(self, shape: tuple, stride: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        device = torch.device(device or "cpu")
        key, item = (dtype, device), torch.empty((), dtype=dtype).element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
        align = max(1, 64 // item)
        start = -(-self.used.get(key, 0) // align) * align
        self.used[key] = start + extent
        have = self.buffers.get(key)
        if have is None or have.numel() < start + extent:      # grown (views of the old one keep it alive)
            least = max((1 << 20) // item, 2 * (0 if have is None else have.numel()))     # 1 MiB, then doubled
            self.buffers[key] = have = torch.ones(max(start + extent, least), dtype=dtype, device=device)
        return have.as_strided(shape, stride, start)


def _real(leaf: tuple, shape: tuple | None = None, device=None, ones: bool | Ones = False) -> torch.Tensor:
    """A real tensor of zeros (ones for a floating tensor with `ones`; cut from `ones` where it is an `Ones`) for a
    ("t", shape, stride, dtype) leaf: at its own strides, or at `shape` (another batch) with the same layout (the
    order of the strides, and the gaps between dimensions where the tensor is a slice of a larger one, as q, k and v
    of one projection are)."""
    _, old, stride, dtype = leaf
    shape = tuple(old if shape is None else shape)
    new = list(stride)
    if shape != old:
        new = [0] * len(shape)
        step, prev = 1, None
        for d in sorted((d for d in range(len(shape)) if stride[d]), key=lambda d: (stride[d], old[d])):
            gap = stride[d] // (stride[prev] * old[prev]) if prev is not None and stride[prev] * old[prev] else 1
            new[d] = step * max(gap, 1) if prev is not None else stride[d]
            step, prev = new[d] * shape[d], d
    value = 1 if ones is not False and dtype.is_floating_point else 0
    if value and isinstance(ones, Ones):
        return ones.take(shape, tuple(new), dtype, device)
    if value or torch.device(device or "cpu").type != "cpu":
        return torch.empty_strided(shape, new, dtype=dtype, device=device).fill_(value)
    return zeros(shape, tuple(new), dtype)


def real_arguments(spec: ArgSpec, shapes: dict | None = None, device=None, ones: bool | Ones = False,
                   func=None, own: Ones | None = None) -> tuple[tuple, dict]:
    """(args, kwargs) of `spec` made real: zeros for each tensor (ones for floating tensors with `ones`; where it is an
    `Ones`, cut from it, but for the arguments `func`, the op they are for, writes: ones of their own, cut from `own`
    where given and filled with ones again; at `shapes[i]` where given: leaf index -> another shape, or another int,
    for another batch), the other leaves as they are. `own`: a second `Ones` whose regions the caller hands out
    apart until it calls `own.next_kernel()` (every kernel that may still run on them taken since): its pages
    mapped once, where a tensor made per written argument page-faults every page of it (BERT 768x2's AdamW
    kernels, in place: 0.28 s of the ones made for the 76 kernels timed)."""
    shapes = shapes or {}
    written: set[int] = set()
    if isinstance(ones, Ones):
        ones.next_kernel()
        written = _written_leaves(func, spec)

    def make(i: int, lf: tuple) -> torch.Tensor:
        if i not in written:
            return _real(lf, shapes.get(i), device, ones)
        if own is not None and lf[3].is_floating_point:
            return _real(lf, shapes.get(i), device, own).fill_(1)
        return _real(lf, shapes.get(i), device, True)
    real = [make(i, lf) if _is_tensor(lf) else shapes.get(i, lf) for i, lf in enumerate(spec.leaves)]
    return tree_unflatten(real, spec.tree)


# arguments kernels write that their schemas do not mark: batch norm's running statistics, updated in training by
# native_batch_norm (and cudnn_batch_norm, miopen_batch_norm), whose schemas say nothing is written
UNMARKED_WRITES = ("running_mean", "running_var")


def _written_leaves(func, spec: ArgSpec) -> set[int]:
    """The leaves of `spec` that `func` writes (an in-place op's self, an `out=`, an optimizer's foreach lists, batch
    norm's running statistics): by its schema's aliasing, and `UNMARKED_WRITES` by name; every leaf where it has no
    schema (not an op)."""
    schema = op_schema(func)
    if schema is None:
        return set(range(len(spec.leaves)))
    unmarked = any(a.name in UNMARKED_WRITES for a in schema.arguments)
    if not schema.is_mutable and not unmarked:
        return set()
    args, kwargs = tree_unflatten(list(range(len(spec.leaves))), spec.tree)     # each argument's leaf indices
    written = set()
    for i, a in enumerate(schema.arguments):
        if (a.alias_info is not None and a.alias_info.is_write) or a.name in UNMARKED_WRITES:
            where = args[i] if i < len(args) else kwargs.get(a.name)
            written.update(tree_flatten(where)[0] if where is not None else ())
    return written


def scratch_bytes(func, spec: ArgSpec, shapes: dict | None = None) -> int:
    """Bytes the real kernel of `func` allocates beyond its outputs' storages, run on zeros of `spec`'s arguments
    (`shapes`: leaf index -> another shape, or another int, for another batch), once per arguments and thread
    count."""

    from memfit.memory.fake_kernels import WORKSPACE, as_real_kernel_takes
    from memfit.memory.isolation import kept_rng
    seeded = torch.Tag.nondeterministic_seeded in func.tags
    # every dispatch mode off (the fake one, own_rng's generators): the real kernel, whoever asks
    with disable_current_modes(), torch.no_grad(), torch.autocast("cpu", enabled=False), \
            kept_rng() if seeded else nullcontext():
        args, kwargs = real_arguments(spec, shapes)
        if func in WORKSPACE:
            args, kwargs = as_real_kernel_takes(func, args, kwargs)
        return probe_bytes(func, args, kwargs)       # measured once per arguments and thread count


def forget_measured() -> None:
    """Drop the bytes of every real kernel measured so far (here and in `memfit.memory.fake_kernels`), so that the
    next prediction measures them again and can be timed as a first one (`memfit bench train`). What a kernel set up
    on its first call in this process is not undone."""
    from memfit.device import kernel_probe
    from memfit.memory import fake_kernels
    kernel_probe.forget()
    for derived in (fake_kernels._WORKSPACE_BYTES, fake_kernels._REAL_BYTES):     # lines and bounds made from them
        derived.clear()


def batch_sizes(spec: ArgSpec, n: int, other: ArgSpec, m: int) -> dict | None:
    """The leaves of `spec` (at batch n) that carry the batch, read off the same op at batch m: leaf index ->
    (base, per sample) per dimension (a tensor) or for the int; None where the two are not the same op on
    affine sizes (then `ScratchOp.bytes_at` scales the bytes at n up with the batch)."""
    if spec.tree != other.tree or len(spec.leaves) != len(other.leaves):
        return None
    found = {}
    for i, (a, b) in enumerate(zip(spec.leaves, other.leaves, strict=True)):
        if a == b:
            continue
        if _is_tensor(a) and _is_tensor(b):
            if a[3] != b[3] or len(a[1]) != len(b[1]):
                return None
            pairs = list(zip(a[1], b[1], strict=True))
        elif isinstance(a, int) and isinstance(b, int) and not isinstance(a, bool):
            pairs = [(a, b)]
        else:
            return None
        lines = []
        for sa, sb in pairs:
            slope, rest = divmod(sa - sb, n - m)
            if rest or sa - slope * n + slope < 1:           # >= 1 at batch 1
                return None
            lines.append((sa - slope * n, slope))
        if any(slope for _, slope in lines):
            found[i] = lines
    return found


def sizes_at(spec: ArgSpec, lines: dict, k: int) -> dict:
    """leaf index -> its shape (or int) at batch k."""
    return {i: (tuple(b + s * k for b, s in ls) if _is_tensor(spec.leaves[i]) else ls[0][0] + ls[0][1] * k)
            for i, ls in lines.items()}


@dataclass(frozen=True, eq=False)
class ScratchOp:
    """One op of a step whose scratch is measured: where it sits in the memory model, and its arguments."""
    row: int                          # the op's row in the memory model (its index in the run at batch `n`)
    column: int                       # the kind of memory it counts as (activations in forward, else transient)
    func: object
    spec: ArgSpec                     # its arguments at batch n
    n: int
    lines: dict | None                # `batch_sizes`; None: not affine in the batch (sized from batch n up)

    def bytes_at(self, k: int) -> int:
        """The scratch at batch k, measured by the real kernel on arguments of that batch's shapes."""
        if self.lines is None:                   # not affine: the bytes at n, scaled up with the batch
            return -(-scratch_bytes(self.func, self.spec) * max(k, self.n) // self.n)
        return scratch_bytes(self.func, self.spec, sizes_at(self.spec, self.lines, k) if k != self.n else None)


def scratch_ops(run, n: int, other, m: int, column: callable) -> list[ScratchOp]:
    """The measured ops of `run` (a fake run at batch n, `memfit.memory.fake_run._Run`), which dimensions carry the
    batch read off the same ops of `other` (at batch m). Ops past the end of backward (the optimizer step, which
    does not depend on the batch) are constant; where the runs differ, every op is sized from batch n up.
    `column(row)` gives the kind of memory of an op's row."""
    def ends(r):
        return r.phase_ends.get("backward", r.phase_ends.get("forward", len(r.ops)))
    e = ends(run)
    same = other is not None and ends(other) == e and run.ops[:e] == other.ops[:e]
    theirs = {op: spec for op, _, spec in other.scratch} if same else {}
    return [ScratchOp(op, column(op), func, spec, n,
                      {} if op >= e else batch_sizes(spec, n, theirs[op], m) if op in theirs else None)
            for op, func, spec in run.scratch]


def inside_parts(target, args: tuple, kwargs: dict, exact: bool = True) -> tuple[int, int]:
    """(the same at every batch, the part that grows with it): bytes the real CPU kernel of `target` allocates beyond
    its outputs on arguments of these shapes (meta tensors at one batch). The ops of `fake_kernels.WORKSPACE` split the
    two (`workspace_bytes`); any other op on half-precision arguments (or floating ones of two dtypes), or matmul on a
    matrix BLAS cannot read (`measured_here`), is run for real on zeros of these shapes and strides
    (`kernel_scratch.scratch_bytes`, once per shapes and thread count), all of it counted as growing with the batch. The
    functional kernel is measured: on the planner's `out=` variants the bytes were the same (bf16 `mean`, `add` of bf16
    and float32, `addmm`, `mm`, `bmm`, `gelu`, `sum`). `exact=False`: a workspace above batch 8 from its line
    (`workspace_bytes`), for choices only."""
    from memfit.memory.fake_kernels import WORKSPACE, workspace_bytes
    if target in WORKSPACE:
        return workspace_bytes(target, args, kwargs, exact)
    if measured_here(target, args, kwargs):
        return 0, scratch_bytes(target, spec_of(args, kwargs))
    return 0, 0

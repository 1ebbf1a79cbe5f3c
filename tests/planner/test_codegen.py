"""memfit.planner.codegen on its own: the generated straight-line function, run in an arena made here (not by
`PlannedModule`), equals eager PyTorch bit for bit on small models with views, in-place ops, multi-output
ops and ops without an `out=` kernel; its source has one line per op, views of plan-time tensors made once,
torch-allocated tensors deleted after their last reader, and outputs that are fresh memory every call.

Run: python -m pytest -q tests/planner/test_codegen.py
"""
import functools

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from memfit.planner.codegen import generate
from memfit.planner.planned import capture_model, place_captured


@functools.cache
def captured(model, shape):
    """One export per model and shape for the whole file (placements are made from it without export)."""
    return capture_model(model, torch.randn(shape))


def generated(model, x, **options):
    """(the placement, the arena, the generated function, its source) for `model` at `x`'s shape."""
    p = place_captured(captured(model, tuple(x.shape)), (x,), **options)
    arena = torch.full((max(p.report.arena_bytes, 1),), 255, dtype=torch.uint8)      # not zeros: stale bytes show
    tensors = dict(p.graph.consts)
    for r in p.graph.roots.values():
        if r.kind == "arena":
            off = p.offsets[r.name]
            tensors[r.name] = arena[off:off + r.nbytes].view(r.dtype).as_strided(r.shape, r.stride)
        elif r.kind == "empty":
            tensors[r.name] = torch.empty_strided(r.shape, r.stride, dtype=r.dtype)
    fn, source = generate(p.graph, tensors)
    return p, arena, fn, source


class Views(nn.Module):
    """A GEMM, in-place elementwise ops, a broadcast view, a transpose, a chunk (one op, two outputs) and an
    output computed from the caller's input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        a = torch.relu(self.lin(x) + 1)
        b = torch.sigmoid(a * a[:1].expand_as(a)).t()
        h1, h2 = b.chunk(2, dim=0)
        return (h1.contiguous() * 2, h2 - 1), x.relu()


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(8 * 7 * 7, 5))


def norm_mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


MODELS = {"views": (Views, (4, 8)), "cnn": (cnn, (2, 3, 16, 16)), "norm-mlp": (norm_mlp, (3, 5, 16))}


@functools.cache
def built(name):
    """The model (seeded weights, eval mode) and its input shape: one of each for the whole file."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    return make().eval(), shape


@pytest.mark.parametrize("eager_where_cheaper", [True, False], ids=["cheapest", "all-in-arena"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_generated_function_equals_eager_bit_for_bit(name, eager_where_cheaper):
    model, shape = built(name)
    torch.manual_seed(1)
    x = torch.randn(*shape)
    _, arena, fn, _ = generated(model, x, eager_where_cheaper=eager_where_cheaper)
    for inputs in (x, x + 1, x):                       # the arena reused; no value left from the call before
        with torch.no_grad():
            want = pytree.tree_leaves(model(inputs))
            got = fn(inputs)
        assert len(got) == len(want)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_one_line_per_op_in_place_marked_and_views_of_plan_time_tensors_made_once():
    p, _, _, source = generated(built("views")[0], torch.randn(4, 8), eager_where_cheaper=False)
    lines = source.splitlines()
    assert lines[0] == "def forward(v_x):" and lines[-1].lstrip().startswith("return (")
    assert not any(w in source for w in ("for ", "while ", "if "))             # straight-line code
    ops = {op.node.name: op for op in p.graph.ops}
    by_op = {ln.split("# ")[1].split(" ")[0]: ln for ln in lines if "# " in ln}
    written = [name for name, op in ops.items() if op.mode == "out"]
    assert written and all("out=" in by_op[name] for name in written)
    inplace = [name for name, op in ops.items() if op.inplace_arg is not None]
    assert inplace and sorted(n for n, ln in by_op.items() if ln.endswith("(in place)")) == sorted(inplace)
    # views of the weight, of arena tensors (the transpose, the chunk) were made at plan time: no line of theirs
    fixed = [name for name, op in ops.items() if op.mode == "view"]
    assert fixed and not set(fixed) & set(by_op)
    assert all(op.mode != "getitem" or op.node.name not in by_op for op in ops.values())


def test_torch_allocated_tensors_are_deleted_after_their_last_reader(monkeypatch):
    monkeypatch.setattr("memfit.planner.slicing.MIN_SAVING", 2.0)     # no batch slicing: the ops themselves
    monkeypatch.setitem(globals(), "captured", captured.__wrapped__)    # a capture of its own, made without it
    p, _, _, source = generated(built("cnn")[0], torch.randn(2, 3, 16, 16))
    lines = [ln.strip() for ln in source.splitlines()]
    ops = {op.node.name: op for op in p.graph.ops}
    assert ops["convolution"].mode == "call"                    # no real CPU out= kernel for a convolution
    made = next(i for i, ln in enumerate(lines) if ln.startswith("v_convolution = "))
    freed = next(i for i, ln in enumerate(lines) if ln.startswith("del ") and "v_convolution" in ln.split())
    reader = next(i for i, ln in enumerate(lines) if "v_convolution" in ln.split("=", 1)[-1] and i > made)
    assert made < reader < freed
    assert not any("v_convolution" in ln for ln in lines[freed + 1:])


def test_outputs_are_fresh_memory_every_call_and_never_in_the_arena():
    model = built("views")[0]
    x = torch.randn(4, 8)
    _, arena, fn, _ = generated(model, x, eager_where_cheaper=False)
    with torch.no_grad():
        first = fn(x)
        keep = [t.clone() for t in first]
        second = fn(x + 1)
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
    for a, b in zip(first, second, strict=True):
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert not lo <= a.data_ptr() < hi
    assert all(torch.equal(a, k) for a, k in zip(first, keep, strict=True))     # the second call changed none

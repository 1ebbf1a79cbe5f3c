"""memfit.planner.graph on its own: which values are views of which allocation, which ops write into the arena
and which over an input in place, each allocation's lifetime, and the rule that an op may not write over an
input it still reads through any view (the planner's classic silent-wrong-result bug).

Run: python -m pytest -q tests/planner/test_graph.py
"""
import functools

import pytest
import torch
from torch import nn

from memfit.planner.capture import capture, constants
from memfit.planner.graph import DataDependentSize, analyze, concrete, span_bytes
from memfit.planner.planned import capture_model


def analysed(model, *inputs, **options):
    """The analysed graph of `model` at the inputs' shapes, and its ops by node name."""
    ep, consts = _exported(model, tuple(x.shape for x in inputs)) if isinstance(model, type) \
        else _export(model.eval(), inputs)
    graph = analyze(ep, consts, "cpu", **options)
    return graph, {op.node.name: op for op in graph.ops}


def _export(model, inputs):
    ep = capture(model, inputs)
    return ep, constants(ep, model)


@functools.cache
def _exported(model_class, shapes):
    """One export per model class and shapes for the whole file (analyze only reads the program)."""
    return _export(model_class().eval(), tuple(torch.randn(s) for s in shapes))


class Mixed(nn.Module):
    """A GEMM, elementwise ops that may run in place, a broadcast view read beside its base, a transpose, and
    two model outputs (one computed from the caller's input)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x) + 1              # addmm, then add over it in place
        a = torch.relu(y)                # in place again: y is read by nobody else
        b = a * a[:1].expand_as(a)       # may not write over a: a row of a is read beside it
        c = torch.sigmoid(b).t()         # in place over b; t is a view
        return c.contiguous() * 2, x.relu()


def test_views_and_in_place_results_belong_to_their_inputs_allocation():
    graph, ops = analysed(Mixed, torch.randn(4, 8))
    modes = {name: op.mode for name, op in ops.items()}
    assert [modes[n] for n in ("permute", "slice_1", "expand", "permute_1")] == ["view"] * 4
    assert [modes[n] for n in ("addmm", "add", "relu", "mul", "sigmoid", "clone")] == ["out"] * 6
    root = graph.root_of
    assert root["permute"] == "p_lin_weight"                         # a view of a parameter
    assert root["add"] == root["relu"] == root["slice_1"] == root["expand"] == "addmm"
    assert root["sigmoid"] == root["permute_1"] == "mul"
    assert [ops[n].inplace_arg for n in ("add", "relu", "mul", "sigmoid")] == [0, 0, None, 0]
    assert graph.roots["addmm"].members == ["add", "relu"] and graph.roots["mul"].members == ["sigmoid"]
    assert not {"add", "relu", "sigmoid"} & set(graph.roots)        # no allocation of their own
    kinds = {name: r.kind for name, r in graph.roots.items()}
    assert kinds == {"p_lin_weight": "const", "p_lin_bias": "const", "x": "input", "addmm": "arena",
                     "mul": "arena", "clone": "arena", "mul_1": "output", "relu_1": "output"}


def test_an_allocation_lives_from_its_writer_to_its_last_reader_through_any_view():
    graph, ops = analysed(Mixed, torch.randn(4, 8))
    roots, n_ops = graph.roots, len(graph.ops)
    # addmm's memory is last read by mul, through the expand view of its first row (not by relu, its last
    # direct reader); mul's by the copy of its transpose
    assert (roots["addmm"].first, roots["addmm"].last) == (ops["addmm"].index, ops["mul"].index)
    assert (roots["mul"].first, roots["mul"].last) == (ops["mul"].index, ops["clone"].index)
    assert (roots["clone"].first, roots["clone"].last) == (ops["clone"].index, ops["mul_1"].index)
    assert roots["x"].first == -1 and roots["x"].last == ops["relu_1"].index
    assert roots["mul_1"].last == roots["relu_1"].last == n_ops      # outputs: alive to the end
    assert graph.outputs == ["mul_1", "relu_1"] and graph.inputs == ["x"]
    assert roots["addmm"].nbytes == 4 * 8 * 4 and roots["x"].nbytes == 4 * 8 * 4


def _dies_into(op):
    """y = x + 1 (an arena tensor), `op(y)`, then a relu as the output: y dies at op."""
    class M(nn.Module):
        def forward(self, x):
            y = x + 1
            return op(y).relu()
    return M()


@pytest.mark.parametrize("op, inplace", [
    (lambda y: y * y[:1].expand_as(y), False),        # a broadcast row of y, overwritten before other rows read it
    (lambda y: y + y.t(), False),                     # the transpose reads what the op writes
    (lambda y: y + y[0], False),                      # a row broadcast
    (lambda y: y - y[:, :1], False),                  # a column broadcast
    (lambda y: y * y, True),                          # the same value twice: each element read before written
    (lambda y: y * (y * 2), True),                    # another allocation: y may be written over
], ids=["row-expand", "transpose", "row", "column", "same", "other"])
def test_an_op_never_writes_over_an_input_it_still_reads_through_a_view(op, inplace):
    graph, ops = analysed(_dies_into(op), torch.randn(6, 6))
    y = graph.root_of["add"]
    assert graph.roots[y].kind == "arena"
    last = max((o for o in graph.ops if o.mode == "out" and o.index > ops["add"].index), key=lambda o: o.index)
    assert (last.inplace_arg is not None) == inplace, last.node.name
    if inplace:                                               # the op's result lives in y's allocation
        assert graph.roots[y].members == [last.outputs[0]] and graph.root_of[last.outputs[0]] == y
    else:                                                     # y keeps its values until the op has read them
        assert graph.roots[y].members == [] and graph.roots[y].last == last.index


class ReadsLater(nn.Module):
    def forward(self, x):
        a = x * 2
        b = torch.relu(a)          # a is read again below: relu may not overwrite it
        c = torch.relu(x)          # x is the caller's input: never written
        return (b + a + c).relu()


def test_no_op_writes_over_a_tensor_read_later_or_over_the_callers_input():
    graph, ops = analysed(ReadsLater, torch.randn(3, 5))
    assert ops["relu"].mode == ops["relu_1"].mode == "out"
    assert ops["relu"].inplace_arg is None and ops["relu_1"].inplace_arg is None
    assert ops["add"].inplace_arg == 0                    # b + a: b dies there, a too
    assert graph.root_of["add"] == "relu"
    off, _ = analysed(ReadsLater, torch.randn(3, 5), inplace=False)
    assert all(op.inplace_arg is None for op in off.ops)
    assert all(not r.members for r in off.roots.values())


def test_an_output_reached_through_a_view_is_fresh_memory():
    """y.t() is returned: y's allocation is the caller's, so its op runs outside the arena, and says why."""
    class ReturnsAView(nn.Module):
        def forward(self, x):
            return (x + 1).t()

    graph, ops = analysed(ReturnsAView(), torch.randn(3, 4))
    assert ops["permute"].mode == "view" and graph.root_of["permute"] == "add"
    assert graph.roots["add"].kind == "output" and ops["add"].mode == "call"
    assert ops["add"].reason.startswith("a model output")


def test_ops_named_eager_run_outside_the_arena_with_the_reason():
    graph, ops = analysed(Mixed, torch.randn(4, 8), eager={"addmm": "measured: cheaper outside"})
    assert ops["addmm"].mode == "call" and ops["addmm"].reason == "measured: cheaper outside"
    assert graph.roots["addmm"].kind == "call"
    # add writes over addmm's output (dead after it) although torch allocated it: the chain stays outside the arena
    assert ops["add"].mode == "out" and ops["add"].inplace_arg == 0 and ops["add"].reason == ""
    assert graph.root_of["add"] == "addmm" and graph.roots["addmm"].kind == "call"
    assert graph.root_of["relu"] == "addmm"


def test_a_copy_in_the_same_layout_is_a_view_unless_it_is_an_output():
    class Clones(nn.Module):
        # explicit clones: eval dropout was exported as one before torch 2.14, which drops it from the graph
        def forward(self, x):
            h = (x * 2).clone()          # a clone into the same layout
            return (h + 1).clone()       # a clone that is a model output

    graph, ops = analysed(Clones(), torch.randn(4, 8))
    clones = sorted((op for name, op in ops.items() if name.startswith("clone")), key=lambda op: op.index)
    assert [op.mode for op in clones] == ["view", "call"]
    assert clones[0].replacement is not None and graph.root_of[clones[0].outputs[0]] == "mul"
    assert graph.roots[graph.root_of[clones[1].outputs[0]]].kind == "output"


def test_sizes_are_exact_at_the_batch_planned_for():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    cap = capture_model(model, torch.randn(3, 8))
    assert cap.dynamic
    for n in (2, 7, 100):
        graph = analyze(cap.ep, cap.consts, "cpu", env=cap.env(n))
        assert graph.roots["addmm"].nbytes == n * 16 * 4 and graph.roots["addmm"].shape == (n, 16)
        assert graph.metas[graph.inputs[0]].shape == (n, 8)
    size = next(p.meta["val"].shape[0] for p in cap.ep.graph.nodes if p.op == "placeholder" and p.name == "input")
    assert isinstance(size, torch.SymInt) and concrete(size, cap.env(5)) == 5
    with pytest.raises(DataDependentSize, match="depends on tensor values"):
        concrete(size, {})                                    # no value for the symbol
    assert concrete(7, {}) == 7


@pytest.mark.parametrize("shape, stride, offset", [
    ((3, 4), (4, 1), 0), ((4, 3), (1, 4), 0), ((5, 3), (0, 1), 2), ((2, 3), (12, 2), 1), ((2, 0, 3), (3, 3, 1), 0),
    ((), (), 3),
], ids=["contiguous", "transposed", "expanded", "strided", "empty", "scalar"])
def test_span_bytes_is_the_storage_a_strided_view_touches(shape, stride, offset):
    index = torch.arange(64).as_strided(shape, stride, offset)        # each element's index in storage
    want = 0 if index.numel() == 0 else (int(index.max()) + 1) * 8
    assert span_bytes(shape, stride, torch.float64, offset) == want

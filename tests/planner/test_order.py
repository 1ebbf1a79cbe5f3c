"""The op order chosen for peak memory (`memfit.planner.order`): valid orders only, never more bytes than
the graph's order, outputs bit-identical to eager, the optimum of the dynamic programme checked against
every topological order of small graphs."""
import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from memfit.device.measure import track_memory
from memfit.planner import order as O
from memfit.planner.graph import analyze
from memfit.planner.placement import check_args
from memfit.planner.planned import capture_model, plan_captured
from memfit.testing.fuzz import FuzzModel, programs


class TwoBranches(nn.Module):
    """Both branches' (B, 2048) intermediates are made before either is reduced, in the graph's order."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(64, 2048, generator=g))
        self.w2 = nn.Parameter(torch.randn(64, 2048, generator=g))

    def forward(self, x):                      # x (B, 64)
        a = torch.tanh(x @ self.w1)            # (B, 2048)
        b = torch.sigmoid(x @ self.w2)         # (B, 2048)
        return a.sum(1, keepdim=True) * b.amax(1, keepdim=True)    # (B, 1)


def _total(pm) -> int:
    return pm.report.arena_bytes + pm.report.unplanned_bytes


@pytest.fixture(scope="module")
def two_branches():
    model, x = TwoBranches().eval(), torch.randn(16, 64)
    # no batch slicing: the graph's own ops reordered (sliced, the whole model is one segment, which runs its ops in
    # the least-peak order itself: `planner.segment`)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("memfit.planner.slicing.MIN_SAVING", 2.0)
        return model, x, capture_model(model, (x,))          # one export for every plan below


@pytest.mark.parametrize("eager_where_cheaper", [True, False])
def test_two_branches_need_strictly_fewer_bytes_and_equal_eager(two_branches, eager_where_cheaper):
    model, x, cap = two_branches
    kept = plan_captured(cap, (x,), reorder=False, eager_where_cheaper=eager_where_cheaper)
    chosen = plan_captured(cap, (x,), eager_where_cheaper=eager_where_cheaper)
    assert kept.report.order == "graph (reorder=False)"
    assert chosen.report.order != "graph"
    assert chosen.report.graph_order_bytes == _total(kept)
    # one (16, 2048) float32 intermediate less at the peak: 128 KiB of the graph order's 256 KiB (an arena's
    # 64-byte padding aside)
    assert _total(kept) - _total(chosen) >= 16 * 2048 * 4 - 64
    with torch.no_grad():
        ref = model(x)
        for pm in (chosen, kept):
            assert torch.equal(pm(x), ref)
            assert torch.equal(pm(x * 2), model(x * 2))
        # the allocator agrees: the reordered call's own allocations peak lower too
        with torch.inference_mode(), track_memory(x.device) as kept_mem:
            kept(x)
        with torch.inference_mode(), track_memory(x.device) as chosen_mem:
            chosen(x)
    assert chosen.report.arena_bytes + chosen_mem.peak < kept.report.arena_bytes + kept_mem.peak
    assert "op order:" in chosen.report.summary() and "op order:" not in kept.report.summary()


def test_reorder_must_be_a_bool():
    with pytest.raises(TypeError, match="reorder must be True or False; found 'yes'"):
        check_args("greedy_by_size", True, True, "yes")


# ---- random DAGs: the pure byte model


@st.composite
def dags(draw, max_ops: int = 9):
    n = draw(st.integers(1, max_ops))
    preds, writes, reads, inplace, sizes = [], [], [], [], []
    for v in range(n):
        ps = sorted(draw(st.sets(st.integers(0, v - 1), max_size=3))) if v else []
        avail = sorted({b for p in ps for b in writes[p]})
        rd = sorted(draw(st.sets(st.sampled_from(avail), max_size=3))) if avail else []
        ws = []
        for _ in range(draw(st.integers(0, 2))):
            sizes.append(draw(st.integers(0, 100)))
            ws.append(len(sizes) - 1)
        preds.append(tuple(ps))
        reads.append(tuple(rd))
        writes.append(tuple(ws))
        inplace.append(tuple(draw(st.sets(st.sampled_from(rd), max_size=2))) if rd else ())
    pinned = frozenset(draw(st.sets(st.integers(0, max(len(sizes) - 1, 0)), max_size=2))) if sizes else frozenset()
    temp = tuple(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)))
    return O.Dag(tuple(preds), tuple(sizes), tuple(writes), tuple(reads), pinned, temp, tuple(inplace))


@settings(max_examples=100, deadline=None, derandomize=True)
@given(dag=dags())
def test_every_candidate_is_a_valid_order_and_the_best_is_not_above_the_graph_order(dag):
    found = O.candidates(dag)
    assert found[0] == O.best(dag)
    for c in found:
        assert O.is_valid(dag, c.order), c
        assert c.peak == O.peak(dag, c.order)
    assert found[0].peak <= O.peak(dag, range(dag.n))
    assert any(c.name == "graph" for c in found)


def _all_orders(dag):
    return (p for p in itertools.permutations(range(dag.n)) if O.is_valid(dag, p))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(dag=dags(max_ops=7))
def test_the_optimum_is_the_least_peak_of_every_topological_order(dag):
    dp = O.optimal(dag)
    assert dp is not None and O.is_valid(dag, dp.order) and dp.peak == O.peak(dag, dp.order)
    assert dp.peak == min(O.peak(dag, p) for p in _all_orders(dag))       # exhaustive reference
    for name, heuristic in O.HEURISTICS.items():
        assert dp.peak <= O.peak(dag, heuristic(dag)), name


def test_heuristics_beat_the_graph_order_on_two_branches_and_the_optimum_can_beat_them():
    # graph order: a (100), c (100), b = f(a), d = g(c), e = h(b, d): both 100s live together
    two = O.Dag(((), (), (0,), (1,), (2, 3)), (100, 100, 1, 1, 1), ((0,), (1,), (2,), (3,), (4,)),
                ((), (), (0,), (1,), (2, 3)), frozenset({4}))
    assert O.peak(two, range(5)) == 201
    assert {O.peak(two, h(two)) for h in (O.lpmf, O.dfs)} == {102}
    assert O.optimal(two).peak == 102


def test_the_programme_gives_up_past_its_state_budget():
    wide = O.Dag(tuple(() for _ in range(16)), tuple(range(1, 17)), tuple((v,) for v in range(16)),
                 tuple(() for _ in range(16)))
    assert O.optimal(wide, states=100) is None              # 2^16 sets of ops can have run
    assert O.best(wide, states=100).peak == 16              # the heuristics still answer


# ---- the planner's graphs


def _meta(*shape):
    return torch.empty(shape)


def test_random_draws_keep_their_relative_order():
    """Depth first from the outputs would draw `r2` before `r1` here (out1 reads r2, and comes first);
    ops with random draws or side effects are chained in the graph's order, so no candidate swaps them."""
    g = torch.fx.Graph()
    aten = torch.ops.aten
    x = g.placeholder("x")
    x.meta["val"] = _meta(4, 4)
    nodes = {}
    for name, target, args in [("a", aten.mm.default, (x, x)), ("b", aten.mm.default, (x, x)),
                               ("r1", aten.rand_like.default, (x,)), ("r2", aten.rand_like.default, (x,)),
                               ("out1", aten.add.Tensor, ("a", "r2")), ("out2", aten.add.Tensor, ("b", "r1"))]:
        node = g.call_function(target, tuple(nodes.get(a, a) if isinstance(a, str) else a for a in args))
        node.name = name
        node.meta["val"] = _meta(4, 4)
        nodes[name] = node
    g.output((nodes["out1"], nodes["out2"]))
    graph = analyze(SimpleNamespace(graph=g), {}, "cpu", inplace=False)
    dag = O.dag_of(graph)
    index = {op.node.name: op.index for op in graph.ops}
    assert index["r1"] in dag.preds[index["r2"]]
    for c in O.candidates(dag):
        names = [graph.ops[v].node.name for v in c.order]
        assert names.index("r1") < names.index("r2"), c
    unchained = O.Dag(tuple(tuple(p for p in ps if not (v == index["r2"] and p == index["r1"]))
                            for v, ps in enumerate(dag.preds)), dag.sizes, dag.writes, dag.reads, dag.pinned)
    names = [graph.ops[v].node.name for v in O.dfs(unchained)]
    assert names.index("r2") < names.index("r1")          # what the chain prevents


def _check_aliasing(graph) -> None:
    """Independent of `graph._try_inplace`: an op that writes over an input is, in the order that runs, the last
    reader of every value of that allocation made before it (the input and all its views)."""
    born = {}
    for op in graph.ops:
        for v in op.outputs:
            if v:
                born.setdefault(v, op.index)
    value_of = {op.node: op.outputs for op in graph.ops}
    for op in graph.ops:
        if op.inplace_arg is None:
            continue
        root = graph.root_of[op.outputs[0]]
        for later in graph.ops[op.index + 1:]:
            for a in later.node.all_input_nodes:
                for v in value_of.get(a, ()):
                    if v and graph.root_of[v] == root:
                        assert born.get(v, -1) >= op.index, (op.node.name, later.node.name, v)


@settings(max_examples=3, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(progs=programs(max_steps=8, max_programs=6), n=st.integers(2, 6))
def test_random_graphs_run_a_valid_order_that_equals_eager(progs, n):
    model = FuzzModel(progs, n).eval()
    x = torch.randn(n, n)
    with torch.no_grad():
        ref = model(x)
    cap = capture_model(model, (x,))                   # one export (about 1 s) for both plans
    kept = plan_captured(cap, (x,), reorder=False)
    pm = plan_captured(cap, (x,))
    placement = pm.placements[pm._last_key]
    ran = [op.node for op in placement.graph.ops]
    done = {node for node in pm.captures[0].ep.graph.nodes if node.op == "placeholder"} | set(placement.graph.ints)
    for node in ran:                                    # a topological order of the exported graph
        assert all(a in done for a in node.all_input_nodes), node.name
        done.add(node)
    _check_aliasing(placement.graph)
    assert _total(pm) <= _total(kept) == pm.report.graph_order_bytes
    with torch.no_grad():
        got = pm(x)
    for g_, r in zip(got, ref, strict=True):
        assert torch.equal(torch.nan_to_num(g_), torch.nan_to_num(r)) and torch.equal(g_.isnan(), r.isnan())

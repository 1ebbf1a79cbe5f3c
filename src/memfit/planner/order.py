"""An op order chosen for peak memory: several topological orders of the graph, the best kept.

The exported graph's order is one valid order among many: two branches whose large intermediates are
made one after the other, then both reduced, hold both at once; run branch by branch, they never
meet. As inductor does (`torch/_inductor/memory.py`, `reorder_for_peak_memory`), a few list
schedules are tried, and on small graphs the optimum by dynamic programming over the sets of ops
already run (Serenity, Ahn et al., MLSys 2020):

- `lpmf` (least peak memory first): of the ops ready to run, the one whose outputs lift the peak
  so far least; ties: the one that frees most, then graph order.
- `bfs`: by depth (longest path from the inputs), then graph order.
- `dfs`: each op just before its first reader, depth first from the graph's last ops (a branch is
  finished before the next one starts).
- `optimal`: the order of the least peak, exact for this byte model, when the graph has at most
  `DP_STATES` sets of ops that can have run (the states of the dynamic programme; pruned by the
  best heuristic's peak).

Everything here is pure and works on a `Dag`: ops, the allocations each writes and reads, their
bytes. `dag_of` builds one from the planner's analysed graph; `placement.place_at` plans the best
few candidates for real (arena + unplanned bytes, counted as for any plan) and keeps the graph's
order unless one is strictly lower. Which orders are valid: every data dependency, and ops with
side effects or random draws keep their relative order; a graph with an op that writes its inputs
keeps the graph's order (`fixed_reason`). What may be written over is decided afresh on the chosen
order (`graph._try_inplace`: an op writes over an input only when no later op reads any view of
it), so every order gives the eager results bit for bit.

Known limitations: the byte model of the heuristics and the programme is one pool of every op
output (views free, in-place writes of allowlisted ops counted as the planner does them in most
cases); the plan itself then decides arena or not. `optimal` is optimal for that model only.

Example:
    >>> # two branches, in graph order a (100 bytes), c (100), b = f(a) (1), d = g(c) (1), e = h(b, d) (1)
    >>> dag = Dag(preds=((), (), (0,), (1,), (2, 3)), sizes=(100, 100, 1, 1, 1), writes=((0,), (1,), (2,), (3,), (4,)),
    ...           reads=((), (), (0,), (1,), (2, 3)), pinned=frozenset({4}))
    >>> peak(dag, range(5)), peak(dag, [0, 2, 1, 3, 4])
    (201, 102)
    >>> best(dag)
    Candidate(name='lpmf', order=(0, 2, 1, 3, 4), peak=102)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from memfit.device.torch_private import op_schema

__all__ = ["DP_STATES", "Candidate", "Dag", "best", "candidates", "dag_of", "fixed_reason", "is_valid", "optimal",
           "peak"]

DP_STATES = 4_000       # sets of ops run that the dynamic programme may visit (about 50 ms for 128 ops in Python)


@dataclass(frozen=True)
class Dag:
    """Ops 0..n-1 (graph order) and the allocations they write and read. All sizes in bytes.

    Attributes:
        preds: per op, the ops that must run before it (data, and the order of ops with side effects).
        sizes: per allocation, its bytes.
        writes: per op, the allocations it writes (new memory, unless written in place).
        reads: per op, the allocations it reads, through any view (each keeps them alive up to it).
        pinned: allocations alive to the end (the model's outputs).
        temp: per op, bytes its kernel allocates inside, alive at that op only (empty: none).
        inplace: per op, allocations it may write its one output over when it is their last reader
            and they have its size (the planner's allowlisted elementwise ops; empty: none).
    """
    preds: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]
    writes: tuple[tuple[int, ...], ...]
    reads: tuple[tuple[int, ...], ...]
    pinned: frozenset[int] = frozenset()
    temp: tuple[int, ...] = ()
    inplace: tuple[tuple[int, ...], ...] = ()
    readers: tuple[frozenset[int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        readers: list[set[int]] = [set() for _ in self.sizes]
        for v, bs in enumerate(self.reads):
            for b in bs:
                readers[b].add(v)
        object.__setattr__(self, "readers", tuple(frozenset(r) for r in readers))

    @property
    def n(self) -> int:
        return len(self.preds)

    def temp_of(self, v: int) -> int:
        return self.temp[v] if self.temp else 0

    def alloc(self, v: int, reuse: int | None) -> int:
        return sum(self.sizes[b] for b in self.writes[v]) - (self.sizes[reuse] if reuse is not None else 0)

    def reuse(self, v: int, left: Callable[[int], int]) -> int | None:
        """The allocation op `v` writes its output over, or None; `left(b)`: readers of b not run yet."""
        if not self.inplace or len(self.writes[v]) != 1 or self.writes[v][0] in self.pinned:
            return None
        size = self.sizes[self.writes[v][0]]
        return next((b for b in self.inplace[v] if b not in self.pinned and self.sizes[b] == size and left(b) == 1
                     and v in self.readers[b]), None)

    def freed(self, v: int, reuse: int | None, left: Callable[[int], int]) -> int:
        """Bytes freed after op `v` runs (`left(b)`: readers of b not run yet, v counted as run)."""
        return sum(self.sizes[b] for b in {*self.reads[v], *self.writes[v]}
                   if b not in self.pinned and b != reuse and left(b) == 0)


@dataclass(frozen=True)
class Candidate:
    """One topological order (`order[k]` = the op run k-th), how it was found, and its peak (`peak`)."""
    name: str
    order: tuple[int, ...]
    peak: int


def is_valid(dag: Dag, order: Sequence[int]) -> bool:
    """True when `order` runs every op once, each after all of its `preds`."""
    if sorted(order) != list(range(dag.n)):
        return False
    pos = {v: k for k, v in enumerate(order)}
    return all(pos[p] < pos[v] for v in range(dag.n) for p in dag.preds[v])


def peak(dag: Dag, order: Sequence[int]) -> int:
    """The most bytes live at one op when ops run in `order`: an allocation lives from its writer to its
    last reader, both included (as the planner's lifetimes), an output to the end, `temp` at its op."""
    left = [len(r) for r in dag.readers]
    live = top = 0
    for v in order:
        live, top = _run(dag, v, left, live, top)
    return top


def _run(dag: Dag, v: int, left: list[int], live: int, top: int) -> tuple[int, int]:
    """(live bytes, peak so far) after op v runs; `left` (readers left of each allocation) updated in place."""
    reuse = dag.reuse(v, left.__getitem__)
    alloc = dag.alloc(v, reuse)
    top = max(top, live + alloc + dag.temp_of(v))
    for b in dag.reads[v]:
        left[b] -= 1
    return live + alloc - dag.freed(v, reuse, left.__getitem__), top


def _succs(dag: Dag) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(dag.n)]
    for v, ps in enumerate(dag.preds):
        for p in set(ps):
            out[p].append(v)
    return out


def _list_schedule(dag: Dag, key: Callable[[int, Callable[[int], int], int, int], tuple]) -> tuple[int, ...]:
    """Kahn's algorithm: of the ready ops, the least `key(op, readers left of an allocation, live bytes,
    peak so far)` runs next."""
    succs = _succs(dag)
    waiting = [len(set(ps)) for ps in dag.preds]
    ready = [v for v in range(dag.n) if not waiting[v]]
    left = [len(r) for r in dag.readers]
    live = top = 0
    order = []
    while ready:
        v = min(ready, key=lambda u: key(u, left.__getitem__, live, top))
        ready.remove(v)
        order.append(v)
        live, top = _run(dag, v, left, live, top)
        for s in succs[v]:
            waiting[s] -= 1
            if not waiting[s]:
                ready.append(s)
    return tuple(order)


def lpmf(dag: Dag) -> tuple[int, ...]:
    """Least peak memory first (inductor's `topological_sort_lpmf`, after Liu 1987): the op that lifts the
    peak so far least; ties: the one that frees most, then graph order."""
    def key(v, left, live, top):
        reuse = dag.reuse(v, left)
        alloc = dag.alloc(v, reuse)
        freed = dag.freed(v, reuse, lambda b: left(b) - (v in dag.readers[b]))
        return max(top, live + alloc + dag.temp_of(v)), alloc - freed, v
    return _list_schedule(dag, key)


def bfs(dag: Dag) -> tuple[int, ...]:
    """By depth (the longest path from an op without preds), then graph order."""
    depth = [0] * dag.n
    for v in range(dag.n):       # preds come first in graph order
        depth[v] = max((depth[p] + 1 for p in dag.preds[v]), default=0)
    return _list_schedule(dag, lambda v, left, live, top: (depth[v], v))


def dfs(dag: Dag) -> tuple[int, ...]:
    """Each op as late as its first reader allows: depth first from the ops nobody waits for (graph order),
    preds in graph order; a branch is done before the next starts."""
    succs = _succs(dag)
    done = [False] * dag.n
    order: list[int] = []
    for sink in [v for v in range(dag.n) if not succs[v]]:
        stack = [(sink, iter(sorted(set(dag.preds[sink]))))]
        while stack:
            v, it = stack[-1]
            p = next((p for p in it if not done[p]), None)
            if p is None:
                stack.pop()
                if not done[v]:
                    done[v] = True
                    order.append(v)
            else:                  # a DAG: p is not on the stack
                stack.append((p, iter(sorted(set(dag.preds[p])))))
    return tuple(order)


def optimal(dag: Dag, bound: int | None = None, states: int = DP_STATES) -> Candidate | None:
    """The order of the least `peak` by dynamic programming over the sets of ops run (Serenity): a set's
    live bytes do not depend on the order it ran in, so each set keeps only its least peak. Sets whose
    peak is above `bound` are dropped. None when more than `states` sets would be visited (or when no
    order stays within `bound`)."""
    n = dag.n
    pred_mask = [sum(1 << p for p in set(ps)) for ps in dag.preds]
    reader_mask = [sum(1 << r for r in rs) for rs in dag.readers]
    limit = float("inf") if bound is None else bound
    level: dict[int, tuple[int, int]] = {0: (0, 0)}      # set of ops run -> (its least peak, its live bytes)
    parent: list[dict[int, tuple[int, int]]] = []        # per level: set -> (previous set, op added)
    seen = 1
    for _ in range(n):
        nxt: dict[int, tuple[int, int]] = {}
        back: dict[int, tuple[int, int]] = {}
        for s, (pk, live) in level.items():
            for v in range(n):
                if s >> v & 1 or pred_mask[v] & ~s:
                    continue
                t = s | 1 << v
                reuse = dag.reuse(v, lambda b, s=s: (reader_mask[b] & ~s).bit_count())
                alloc = dag.alloc(v, reuse)
                step = max(pk, live + alloc + dag.temp_of(v))
                if step > limit or (t in nxt and nxt[t][0] <= step):
                    continue
                new_live = live + alloc - dag.freed(v, reuse, lambda b, t=t: (reader_mask[b] & ~t).bit_count())
                if t not in nxt:
                    seen += 1
                    if seen > states:
                        return None
                nxt[t], back[t] = (step, new_live), (s, v)
        if not nxt:
            return None
        level = nxt
        parent.append(back)
    (full, (pk, _)), = level.items()
    order, s = [], full
    for back in reversed(parent):
        s, v = back[s]
        order.append(v)
    return Candidate("optimal", tuple(reversed(order)), pk)


HEURISTICS: dict[str, Callable[[Dag], tuple[int, ...]]] = {"lpmf": lpmf, "bfs": bfs, "dfs": dfs}


def candidates(dag: Dag, states: int = DP_STATES) -> list[Candidate]:
    """The graph's order, each heuristic's and (small graphs) the optimum, distinct orders only, least peak
    first (ties: in that order, so the graph's order wins a tie)."""
    found = [Candidate("graph", tuple(range(dag.n)), peak(dag, range(dag.n)))]
    found += [Candidate(name, order, peak(dag, order)) for name, order in ((k, f(dag)) for k, f in HEURISTICS.items())]
    dp = optimal(dag, bound=min(c.peak for c in found), states=states)
    if dp is not None:
        found.append(dp)
    distinct: dict[tuple[int, ...], Candidate] = {}
    for c in found:
        distinct.setdefault(c.order, c)
    return sorted(distinct.values(), key=lambda c: c.peak)        # stable: graph order first among equals


def best(dag: Dag, states: int = DP_STATES) -> Candidate:
    """The candidate of the least peak (the graph's order on a tie)."""
    return candidates(dag, states)[0]


# ---- from the planner's analysed graph


def fixed_reason(graph) -> str:
    """Why the graph's order must be kept ("" when any valid order may run): an op that writes its inputs."""
    for op in graph.ops:
        schema = op_schema(op.node.target)
        if schema is not None and schema.is_mutable:
            return f"{op.node.name} ({op.node.target}) writes its inputs"
    return ""


def _ordered(node) -> bool:
    """An op whose relative order with other such ops must stay: side effects or random draws."""
    target = node.target
    tags = getattr(target, "tags", ())
    return node.is_impure() or torch.Tag.nondeterministic_seeded in tags


def dag_of(graph, temp: Sequence | None = None) -> Dag:
    """The `Dag` of an analysed graph (`graph.analyze`, best with `inplace=False`: one allocation per op
    output); `temp`: `planner.workspaces` buffers of that graph (op index in `first`)."""
    from torch.fx import Node

    from memfit.planner.graph import _nodes_in
    from memfit.planner.ops import inplace_candidates

    index = {op.node: op.index for op in graph.ops}
    through: dict = {}                   # a size computed from tensors (sym_size) -> the ops it depends on

    def deps(a) -> set[int]:
        if a in index:
            return {index[a]}
        if a not in through:
            through[a] = set().union(*(deps(b) for b in _nodes_in((a.args, a.kwargs))))
        return through[a]
    kept = [name for name, r in graph.roots.items() if r.kind not in ("input", "const", "empty") and r.nbytes]
    bid = {name: k for k, name in enumerate(kept)}
    values = {op.node: op.outputs for op in graph.ops}
    preds, writes, reads, inplace = [], [], [], []
    last_ordered = None
    for op in graph.ops:
        args = _nodes_in((op.node.args, op.node.kwargs))
        ps = set().union(*(deps(a) for a in args))
        if _ordered(op.node):
            if last_ordered is not None:
                ps.add(last_ordered)
            last_ordered = op.index
        preds.append(tuple(sorted(ps)))
        writes.append(tuple(bid[r] for r in kept if graph.roots[r].first == op.index))
        read = {bid[graph.root_of[v]] for a in args for v in values.get(a, ()) if v and graph.root_of[v] in bid}
        reads.append(tuple(sorted(read)))
        cand = []
        for pos in inplace_candidates(op.node.target, op.node.args):
            a = op.node.args[pos]
            if isinstance(a, Node) and values.get(a) and values[a][0] and graph.root_of[values[a][0]] in bid:
                cand.append(bid[graph.root_of[values[a][0]]])
        inplace.append(tuple(cand))
    pinned = frozenset(bid[graph.root_of[o]] for o in graph.outputs if isinstance(o, str) and graph.root_of[o] in bid)
    per_op = [0] * len(graph.ops)
    for b in temp or ():
        per_op[b.first] += b.size
    return Dag(tuple(preds), tuple(graph.roots[r].nbytes for r in kept), tuple(writes), tuple(reads), pinned,
               tuple(per_op), tuple(inplace))


def nodes_in_order(graph, order: Sequence[int]) -> list:
    """The call_function nodes of the exported graph for `analyze(order=...)`: the ops in `order`, each size
    computed from tensors (evaluated when the plan is made, not run) as soon as what it reads is there."""
    from memfit.planner.graph import _nodes_in
    pending = [n for n in graph.ints]
    done: set = set()
    out: list = []

    def flush() -> None:
        while True:
            ready = [n for n in pending if all(a in done or a.op == "placeholder"
                                               for a in _nodes_in((n.args, n.kwargs)))]
            if not ready:
                return
            for n in ready:
                pending.remove(n)
                out.append(n)
                done.add(n)
    flush()
    for v in order:
        out.append(graph.ops[v].node)
        done.add(graph.ops[v].node)
        flush()
    return out + pending

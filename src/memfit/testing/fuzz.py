"""Random programs for differential fuzzing of the planner (tests and `memfit bench planner --fuzz N`).

A program is a list of steps `(op, i, j, form_a, form_b)`: take pool tensors `i` and `j` (modulo
the pool size, so -1 is the latest; `j < 0` means the same tensor as `i`), view each through a
*form* (transpose, a row, a broadcast column, a diagonal, ...), apply `op`, append the result to
the pool. Every pool tensor broadcasts to the square `(n, n)` shape, so
any step is valid. Forms that view the same tensor twice are what an in-place planner must get
right: `y * y[:1].expand_as(y)` overwrites row 0 before the other rows read it if run in place.

Example:
    >>> import torch
    >>> model = FuzzModel([[("add1", 0, 0, "same", "same"), ("mul", 1, 1, "same", "row_expand")]], n=4)
    >>> [tuple(t.shape) for t in model(torch.ones(4, 4))]
    [(4, 4), (4, 4)]
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

__all__ = ["FORMS", "OPS", "FuzzModel", "check_programs", "fuzz", "programs"]

# views of an (n, n) tensor; each result broadcasts back to (n, n)
FORMS = {
    "same": lambda t: t,
    "t": lambda t: t.t(),
    "row": lambda t: t[:1],
    "row_expand": lambda t: t[:1].expand_as(t),
    "row0": lambda t: t[0],
    "col": lambda t: t[:, :1],
    "last_col_expand": lambda t: t[:, -1:].expand_as(t),
    "diag": lambda t: t.diagonal(),
    "flat_head": lambda t: t.reshape(-1)[: t.shape[1]],
    "reshaped": lambda t: t.reshape(-1).view(t.shape),       # a view of the whole allocation
}

UNARY = {
    "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "neg": torch.neg,
    "gelu": nn.functional.gelu, "silu": nn.functional.silu, "add1": lambda a: a + 1, "mul2": lambda a: a * 2,
    "clamp": lambda a: a.clamp(-0.5, 0.5), "softmax": lambda a: torch.softmax(a, -1),
    "sum0": lambda a: a.sum(0, keepdim=True),
    "copy_t": lambda a: a.t().reshape(-1).reshape(a.shape),         # reshape of a transpose: a copy
    "dropout": lambda a: nn.functional.dropout(a, 0.5, training=False),   # export: a copy in the same layout
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": lambda a, b: a / (b.abs() + 1),
    "maximum": torch.maximum,
}
OPS = (*UNARY, *BINARY, "mm", "linear", "cat0", "cat1", "attn")


class FuzzModel(nn.Module):
    """Several programs side by side on one input (one export checks them all); returns, for each,
    its last pool tensor and one from the middle of its pool."""

    def __init__(self, programs: list[list[tuple]], n: int):
        super().__init__()
        for op, *_ in (s for prog in programs for s in prog):
            if op not in OPS:
                raise ValueError(f"unknown fuzz op {op!r}; expected one of {OPS}")
        self.programs, self.n = [[tuple(s) for s in prog] for prog in programs], n
        self.weight = nn.Parameter(torch.randn(n, n, generator=torch.Generator().manual_seed(n)))

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        n = self.n
        return t if tuple(t.shape) == (n, n) else t.expand(n, n)

    def _step(self, op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        n = self.n
        if op in UNARY:
            return UNARY[op](a)
        if op in BINARY:
            return BINARY[op](a, b)
        if op == "mm":
            return self._full(a) @ self._full(b)
        if op == "linear":
            return self._full(a) @ self.weight
        if op == "attn":        # flash attention, its mask made from b (`planner.masks` makes a broadcast one smaller)
            # the query contiguous: export picks the kernel when it traces, eager when it runs, and on a query of stride
            # 0 they pick differently (export the math decomposition, eager flash attention: other bits)
            q, m = self._full(a).contiguous()[None, None], self._full(b)
            return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.where(m > 0, m, -1e4))[0, 0]
        if op == "cat0":
            return torch.cat([self._full(a)[: n // 2], self._full(b)[n // 2:]], 0)
        return torch.cat([self._full(a)[:, ::2], self._full(b)[:, 1::2]], 1)   # cat1: even cols of a, odd of b

    def forward(self, x):
        outs = []
        for prog in self.programs:
            pool = [x]
            for op, i, j, fa, fb in prog:
                a = FORMS[fa](self._full(pool[i % len(pool)]))
                b = FORMS[fb](self._full(pool[(i if j < 0 else j) % len(pool)]))
                pool.append(self._step(op, a, b))
            outs += [pool[-1], pool[(len(pool) + 1) // 2]]
        return tuple(outs)


def programs(max_steps: int = 10, max_programs: int = 6):
    """A hypothesis strategy of lists of programs (hypothesis is a dev dependency: imported lazily).
    Half the steps read the latest tensor (often dead afterwards: a candidate to write over), half
    read one tensor twice, mostly whole on the left: the cases in-place planning must
    refuse (`y * y[:1]`) or may allow (`y * y`)."""
    from hypothesis import strategies as st
    index = st.one_of(st.just(-1), st.integers(0, 63))
    step = st.tuples(st.sampled_from(OPS), index, index, st.sampled_from(_LEFT_FORMS), st.sampled_from(list(FORMS)))
    return st.lists(st.lists(step, min_size=1, max_size=max_steps), min_size=1, max_size=max_programs)


_LEFT_FORMS = ["same"] * 4 + list(FORMS)[1:]      # the whole tensor, the one an op may write over, often


def random_program(rng, max_steps: int = 10) -> list[tuple]:
    """The strategy of `programs` drawn with `random.Random` (for long runs without hypothesis)."""
    pick = lambda: rng.choice([-1, rng.randrange(64)])     # noqa: E731
    return [(rng.choice(OPS), pick(), pick(), rng.choice(_LEFT_FORMS), rng.choice(list(FORMS)))
            for _ in range(rng.randint(1, max_steps))]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal values, NaN where the other has NaN (0 / 0 is drawn now and then)."""
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.isnan(), b.isnan()):
        return False
    return torch.equal(torch.where(a.isnan(), 0.0, a), torch.where(b.isnan(), 0.0, b))


def check_programs(programs: list[list[tuple]], n: int, algorithms=None) -> None:
    """Plan the programs' model with every algorithm, every op in the arena where it has an `out=`
    kernel, once more with the default of running ops eagerly where that costs less memory, and once
    with every op run by torch (in-place writes then go over tensors torch allocated), all from one
    capture; outputs must equal eager bit for bit on two inputs, called twice each, and the inputs
    must be left untouched. Raises AssertionError."""
    from memfit.planner.arena import ALGORITHMS
    from memfit.planner.planned import capture_model, plan_captured

    model = FuzzModel(programs, n).eval()
    gen = torch.Generator().manual_seed(sum(map(len, programs)) * 31 + n)
    xs = [torch.randn(n, n, generator=gen) for _ in range(2)]
    with torch.no_grad():
        refs = [model(x) for x in xs]
    # static: every step compares its operands' shape with (n, n) (`_full`), which fixes the batch, so export's attempt
    # at a symbolic one failed every time ("Constraints violated (batch)") before the static export (twice the time)
    cap = capture_model(model, (xs[0],), dynamic_batch=False)
    # every op run by torch: in-place writes go over torch's tensors
    outside = dataclasses.replace(cap, run_eagerly={n.name: "fuzz: every op outside the arena"
                                                    for n in cap.ep.graph.nodes if n.op == "call_function"})
    settings = [(cap, a, False) for a in algorithms or ALGORITHMS] + [(cap, "greedy_by_size", True),
                                                                        (outside, "greedy_by_size", False)]
    for c, algorithm, eager_where_cheaper in settings:
        pm = plan_captured(c, (xs[0],), algorithm=algorithm, eager_where_cheaper=eager_where_cheaper)
        for x, ref in [*zip(xs, refs, strict=True), (xs[0], refs[0])]:
            before = x.clone()
            with torch.no_grad():
                got = pm(x)
            for k, (g, r) in enumerate(zip(got, ref, strict=True)):
                if not _same(g, r):
                    raise AssertionError(f"planned ({algorithm}) differs from eager: program {programs[k // 2]} "
                                         f"(n={n}), {(g != r).sum().item()} of {r.numel()} elements differ\n"
                                         f"{pm.source}")
            if not torch.equal(x, before):
                raise AssertionError(f"the planned run ({algorithm}) wrote over its input: programs {programs}")


def fuzz(examples: int, seed: int = 0, n_max: int = 6) -> int:
    """Check `examples` random models (each of up to 6 programs) without hypothesis; returns how many
    passed, raises AssertionError on the first difference (the benchmark's long run)."""
    import random
    rng = random.Random(seed)
    for _ in range(examples):
        progs = [random_program(rng) for _ in range(rng.randint(1, 6))]
        check_programs(progs, rng.randint(2, 6))
    return examples

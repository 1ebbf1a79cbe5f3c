"""`plan(model, example_inputs)`: capture, place every intermediate tensor in one arena, run it there.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    >>> x = torch.randn(4, 8)
    >>> pm = plan(model, (x,))
    >>> torch.testing.assert_close(pm(x), model(x))
    >>> pm.report.lower_bound <= pm.report.arena_bytes <= pm.report.naive_bytes
    True
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from memfit.budget import format_bytes
from memfit.memory.allocator import CPU_ALIGNMENT
from memfit.memory.isolation import predicting
from memfit.memory.measure import unique_bytes
from memfit.messages import first_line
from memfit.planner.arena import (
    ALGORITHMS,
    Buffer,
    align,
    assign_offsets,
    cheaper_outside,
    live_profile,
    lower_bound,
    verify,
)
from memfit.planner.capture import CaptureError, as_inputs, capture, constants
from memfit.planner.codegen import generate
from memfit.planner.graph import DataDependentSize, Graph, Meta, analyze
from memfit.planner.report import Report, Row
from memfit.planner.workspaces import workspaces

__all__ = ["ALIGNMENT", "Captured", "Placement", "PlannedModule", "capture_model", "place", "place_at",
           "place_captured", "plan", "plan_captured"]

log = logging.getLogger("memfit.planner")

ALIGNMENT = CPU_ALIGNMENT     # between the arena's tensors: the CPU allocator's alignment


@dataclass
class Placement:
    """Where every intermediate tensor of one batch size goes: the analysed graph and each arena
    tensor's offset (everything but the memory itself; `_ArenaForward` makes it real)."""
    graph: Graph
    buffers: list[Buffer]
    offsets: dict[str, int]
    report: Report
    out_spec: object
    batch: int | None = None
    workspaces: list[Buffer] = field(default_factory=list)   # what kernels allocate inside (`planner.workspaces`)


def _check_args(algorithm: str, inplace: bool, eager_where_cheaper: bool = True) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}; found {algorithm!r}")
    for name, flag in (("inplace", inplace), ("eager_where_cheaper", eager_where_cheaper)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False; found {flag!r}")


@dataclass
class Captured:
    """One `torch.export` capture of a model, with the batch dimension symbolic where it can be:
    placements for any algorithm and any batch size in `batch_range` come from it, no re-export.

    It holds the parameters (by reference) but not the module, so a cache of captures never keeps a
    model alive.

    Attributes:
        batch: the batch size symbol (a sympy Symbol), or None when the capture is static.
        batch_range: (lowest, highest) batch the graph is valid for (highest None: unbounded).
        static_reason: why the batch could not be symbolic ("" when it is).
        example_batch: the batch of the example inputs.
    """
    ep: torch.export.ExportedProgram
    consts: dict[str, torch.Tensor]
    device: torch.device
    batch: object = None
    batch_range: tuple = (None, None)
    static_reason: str = ""
    example_batch: int | None = None
    example_key: tuple = ()
    kernel_layouts: dict = field(default_factory=dict)   # node name -> why it runs eagerly (see _kernel_layouts)

    @property
    def dynamic(self) -> bool:
        return self.batch is not None

    def env(self, n: int | None) -> dict:
        return {} if self.batch is None or n is None else {self.batch: n}

    @staticmethod
    def batch_of(inputs: tuple) -> int | None:
        return inputs[0].shape[0] if inputs and inputs[0].dim() else None

    def accepts(self, inputs: tuple) -> bool:
        """Whether these inputs can be planned from this capture; False when they need a new capture
        (another sample shape, dtype or strides; a batch outside the range; any change if static)."""
        if not self.dynamic:
            return PlannedModule._key(inputs) == self.example_key
        n = self.batch_of(inputs)
        lo, hi = self.batch_range
        if n is None or n < lo or (hi is not None and n > hi):
            return False
        specs = [p.meta["val"] for p in self.ep.graph.nodes if p.op == "placeholder" and p.name not in self.consts]
        if len(specs) != len(inputs):
            return False
        for x, fake in zip(inputs, specs, strict=True):
            meta = Meta.of(fake, self.env(n))
            if x.dtype != meta.dtype or tuple(x.shape) != meta.shape or tuple(x.stride()) != meta.strides:
                return False
        return True


def _batch_dims(example_inputs: tuple):
    """`dynamic_shapes` with dim 0 of every input one shared symbolic batch, or a reason it cannot be."""
    if not example_inputs or any(x.dim() == 0 for x in example_inputs):
        return None, "an input has no batch dimension"
    if len({x.shape[0] for x in example_inputs}) != 1:
        return None, "the inputs' first dimensions differ, so there is no one batch dimension"
    # from 2: with min=1 export may assume the batch is never 1 (size-1 specialisation), so a model that
    # squeezes or branches on a size of 1 would run differently at batch 1; batch 1 gets a capture of its own
    batch = torch.export.Dim("batch", min=2)
    return tuple({0: batch} for _ in example_inputs), ""


def capture_model(model: torch.nn.Module, example_inputs, *, dynamic_batch: bool = True) -> Captured:
    """Export `model` once, with the batch dimension symbolic where the model allows it (else at the
    example's shapes, the reason kept in `static_reason`). Raises CaptureError, TypeError. One capture at a
    time in the process, every RNG left as found (`memfit.memory.isolation.predicting`)."""
    with predicting():
        return _capture_model(model, example_inputs, dynamic_batch)


def _capture_model(model: torch.nn.Module, example_inputs, dynamic_batch: bool) -> Captured:
    example_inputs = as_inputs(example_inputs)
    device = example_inputs[0].device if len(example_inputs) else torch.device("cpu")
    n = example_inputs[0].shape[0] if example_inputs and example_inputs[0].dim() else None
    key = PlannedModule._key(example_inputs)
    dims, reason = _batch_dims(example_inputs) if dynamic_batch else (None, "a static capture was asked for")
    if dims is not None and n == 1:
        dims, reason = None, "batch 1 is captured on its own (a symbolic batch starts at 2)"
    if dims is not None:
        try:
            ep = capture(model, example_inputs, dims, explain=False)
        except CaptureError as e:                 # the static capture below explains errors of its own
            reason = f"the batch cannot be symbolic ({e})"
        else:
            sym = _batch_symbol(ep)
            if sym is not None:
                vr = ep.range_constraints.get(sym)
                hi = None if vr is None or vr.upper.is_infinite or str(vr.upper) == "int_oo" else int(vr.upper)
                cap = Captured(ep, constants(ep, model), device, sym, (int(vr.lower) if vr else 2, hi), "", n, key)
                if cap.accepts(example_inputs):
                    cap.kernel_layouts = _kernel_layouts(cap, example_inputs)
                    return cap
                reason = (f"the symbolic graph holds for batch sizes in [{cap.batch_range[0]}, "
                          f"{hi or 'inf'}] only, not {n}")
            else:
                reason = "export made the batch size a constant (the model specialises on it)"
    ep = capture(model, example_inputs)
    cap = Captured(ep, constants(ep, model), device, None, (n, n), reason, n, key)
    cap.kernel_layouts = _kernel_layouts(cap, example_inputs)
    return cap


def _kernel_layouts(cap: Captured, example_inputs: tuple) -> dict[str, str]:
    """Node name -> reason, for the ops whose real kernel gives its output other strides than the graph's
    metadata says (the strides an arena view gets): written into such a view, the kernel would compute in its
    own layout and copy, or write strided against it. One eager run of the graph on the example finds them
    (on the 14 `transformers` architectures of the benchmark and memfit's 8 zoo models: none); they run
    eagerly. The check is at the example's batch; the strides a kernel picks follow the shapes' order, not their
    sizes (dimensions of size 1 aside, which are not compared)."""
    from torch.fx import Interpreter
    env = cap.env(cap.example_batch)
    found: dict[str, str] = {}

    class Layouts(Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node.op != "call_function":
                return out
            vals = node.meta.get("val")
            pairs = zip(out, vals, strict=False) if isinstance(out, (tuple, list)) and isinstance(vals, (tuple, list)) \
                else [(out, vals)]
            for real, meta in pairs:
                if not (isinstance(real, torch.Tensor) and isinstance(meta, torch.Tensor)):
                    continue
                m = Meta.of(meta, env)
                if tuple(real.shape) == m.shape and any(a != b for a, b, d in zip(real.stride(), m.strides, m.shape,
                                                                                    strict=True) if d > 1):
                    found[node.name] = (f"its kernel gives strides {tuple(real.stride())} where the graph says "
                                        f"{m.strides}: written into an arena view it would go through its own layout")
            return out
    try:
        with torch.no_grad():            # no buffer is written: capture refuses a forward that writes one
            Layouts(cap.ep.module()).run(*example_inputs)
    except Exception as e:               # only a speed rule: a graph that does not run here runs as planned
        log.info("the check that kernels give the strides of the graph did not run (%s): ops run as planned",
                 first_line(e))
        return {}
    return found


def _batch_symbol(ep):
    for p in ep.graph.nodes:
        if p.op == "placeholder" and p.name in {s.arg.name for s in ep.graph_signature.input_specs
                                                if s.kind.name == "USER_INPUT"}:
            size = p.meta["val"].shape[0]
            if isinstance(size, torch.SymInt) and len(size.node.expr.free_symbols) == 1:
                return next(iter(size.node.expr.free_symbols))
            return None
    return None


def place(model: torch.nn.Module, example_inputs: tuple, *, algorithm: str = "greedy_by_size",
          inplace: bool = True, eager_where_cheaper: bool = True) -> Placement:
    """Capture `model` and place its intermediates, without allocating the arena or running anything
    (so it is cheap at any batch size; `memory_model` calls it)."""
    _check_args(algorithm, inplace, eager_where_cheaper)
    return place_captured(capture_model(model, example_inputs), example_inputs, algorithm=algorithm,
                          inplace=inplace, eager_where_cheaper=eager_where_cheaper)


def place_captured(cap: Captured, example_inputs: tuple, *, algorithm: str = "greedy_by_size",
                   inplace: bool = True, eager_where_cheaper: bool = True) -> Placement:
    """`place` from a capture made before (no export) for inputs like `example_inputs`."""
    inputs = as_inputs(example_inputs)
    if not cap.accepts(inputs):
        raise ValueError(f"inputs {[tuple(x.shape) for x in inputs]} cannot be planned from this capture "
                         f"(made for {[tuple(s[0]) for s in cap.example_key]}); capture again")
    return place_at(cap, cap.batch_of(inputs), algorithm=algorithm, inplace=inplace,
                    eager_where_cheaper=eager_where_cheaper)


def place_at(cap: Captured, batch: int | None, *, algorithm: str = "greedy_by_size", inplace: bool = True,
             eager_where_cheaper: bool = True, _below_range: bool = False) -> Placement:
    """The placement at batch size `batch` from one capture: exact sizes of every tensor, offsets, the
    report; nothing is exported, allocated or run (milliseconds per batch size).

    Args:
        cap: from `capture_model(model, example_inputs)`.
        batch: any size in `cap.batch_range` when `cap.dynamic`; else the example's batch.
        algorithm, inplace, eager_where_cheaper: as for `plan`.

    Raises:
        ValueError: a static capture and another batch size (`cap.static_reason` says why it is static),
            or a batch outside the range.

    Example:
        >>> import torch
        >>> cap = capture_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()), torch.zeros(2, 8))
        >>> [place_at(cap, n).report.unplanned_bytes for n in (2, 100)]      # the output, (n, 16) float32
        [128, 6400]
    """
    _check_args(algorithm, inplace, eager_where_cheaper)
    lo, hi = cap.batch_range
    # _below_range (sizing only): the symbolic graph's sizes at a batch below its range (batch 1), an
    # estimate of batch 1's own capture, which runs the same ops unless the model branches on a size of 1
    if cap.dynamic and (isinstance(batch, bool) or not isinstance(batch, int) or (batch < lo and not
                        (_below_range and batch >= 1)) or (hi is not None and batch > hi)):
        raise ValueError(f"batch must be an int in [{lo}, {hi or 'inf'}] for this capture (batch 1 is captured on "
                         f"its own); found {batch!r}")
    if not cap.dynamic and batch != cap.example_batch:
        raise ValueError(f"this capture is static at batch {cap.example_batch} ({cap.static_reason}); "
                         f"found batch {batch!r}: capture again with inputs of that batch")
    try:
        graph = _graph_at(cap, batch, inplace, eager_where_cheaper)
    except (GuardOnDataDependentSymNode, DataDependentSize) as e:       # a size known only when the model runs
        why = first_line(e, with_type=False)
        raise CaptureError(f"the model's graph has tensor sizes that depend on values ({why}): "
                           "boolean-mask indexing, nonzero or .item(); the planner needs static sizes: run the "
                           "model eagerly, or do the value-dependent part outside the model",
                           kind="data-dependent") from None
    arena_roots = [r for r in graph.roots.values() if r.kind == "arena"]
    buffers = [Buffer(r.name, r.nbytes, r.first, r.last) for r in arena_roots]
    offs, size = assign_offsets(buffers, algorithm, ALIGNMENT)
    verify(buffers, offs, ALIGNMENT)
    offsets = dict(zip((b.name for b in buffers), offs, strict=True))
    n_ops = len(graph.ops)
    inside = workspaces(graph, cap.env(batch), cap.device.type)
    outside = _outside(graph) + inside
    params = unique_bytes(graph.consts[r.name] for r in graph.roots.values() if r.kind == "const")
    rows = sorted((Row(r.name, r.shape, str(r.dtype).removeprefix("torch."), r.nbytes, (max(r.first, 0), r.last),
                       offsets.get(r.name), r.kind, tuple(r.members))
                   for r in graph.roots.values() if r.kind not in ("const", "input", "empty")),
                  key=lambda row: row.lifetime)
    unplanned_steps = [s for s in graph.ops if s.mode == "call" and any(graph.roots[graph.root_of[v]].kind == "call"
                                                                          for v in s.outputs if v)]
    unplanned = Counter(s.node.target.__name__.split(".")[0] for s in unplanned_steps)
    reasons = {s.node.target.__name__.split(".")[0]: s.reason for s in unplanned_steps}
    report = Report(
        # an in-place member has its root's size (graph._try_inplace checks it): one region each
        naive_bytes=sum(align(r.nbytes, ALIGNMENT) * (1 + len(r.members)) for r in arena_roots),
        arena_bytes=size, lower_bound=lower_bound(buffers, ALIGNMENT),
        unplanned_bytes=max(live_profile(outside, 1), default=0), param_bytes=params,
        input_bytes=sum(graph.roots[v].nbytes for v in graph.inputs), rows=rows, algorithm=algorithm, n_ops=n_ops,
        unplanned_ops=dict(unplanned), unplanned_reasons=reasons)
    report.capture = (f"one capture, batch symbolic in [{lo}, {hi or 'inf'}]" if cap.dynamic
                      else f"static capture at batch {cap.example_batch} ({cap.static_reason})")
    return Placement(graph, buffers, offsets, report, cap.ep.call_spec.out_spec, batch, inside)


CHEAPER_ROUNDS = 4      # analyses with more ops run eagerly, at most: each moves ops out of the arena, none back


def _graph_at(cap: Captured, batch: int | None, inplace: bool, eager_where_cheaper: bool) -> Graph:
    """The analysed graph at `batch`, with the ops whose outputs cost less outside the arena run eagerly.
    Moving ops out changes which ops can write in place (over a tensor torch allocated, now), so the choice is
    made again on the new graph, up to `CHEAPER_ROUNDS` times; the graph of the fewest peak bytes (arena bound +
    outside peak, kernels' own allocations included) wins."""
    env = cap.env(batch)
    layouts = dict(cap.kernel_layouts)
    graph = analyze(cap.ep, cap.consts, cap.device.type, inplace=inplace, env=env, eager=layouts)
    if not eager_where_cheaper:
        return graph
    inside = workspaces(graph, env, cap.device.type)        # per op: the same whichever way it runs
    best, best_cost, eager = graph, _peak_cost(graph, inside), {}
    for _ in range(CHEAPER_ROUNDS):
        more = _eager_where_cheaper(graph, inside, inplace)
        if not more.keys() - eager.keys():
            break
        eager.update(more)
        graph = analyze(cap.ep, cap.consts, cap.device.type, inplace=inplace, env=env, eager={**layouts, **eager})
        cost = _peak_cost(graph, inside)
        if cost < best_cost:
            best, best_cost = graph, cost
    return best


def _peak_cost(graph: Graph, inside: list[Buffer]) -> int:
    """The arena's lower bound + the peak of what torch allocates outside it (the planned call's peak bytes, as
    the report counts them, with the arena at its bound)."""
    arena = [Buffer(r.name, r.nbytes, r.first, r.last) for r in graph.roots.values() if r.kind == "arena"]
    return lower_bound(arena, ALIGNMENT) + max(live_profile(_outside(graph) + inside, 1), default=0)


def _outside(graph: Graph) -> list[Buffer]:
    """The tensors torch allocates (op outputs without an arena place, the model's outputs), alive to the last op."""
    n_ops = len(graph.ops)
    return [Buffer(r.name, r.nbytes, r.first, min(r.last, n_ops)) for r in graph.roots.values()
            if r.kind in ("call", "output")]


EAGER_CHEAPER = ("runs eagerly: the arena is held at its peak for the whole call, and this output fits under "
                 "the peak of the tensors outside it, so arena + unplanned bytes are lower with it outside")


def _eager_where_cheaper(graph: Graph, inside: list[Buffer], inplace: bool = True) -> dict[str, str]:
    """Node name -> reason for the ops whose outputs cost less memory outside the arena than in it
    (`arena.cheaper_outside`): an arena tensor moves out with the ops that write over it in place
    (with `inplace`, over the tensor torch allocated: `graph._try_inplace` allows it there as in the arena;
    else they write a copy), where each of those ops has one output to place. `inside`: what kernels
    allocate inside (`planner.workspaces`), outside the arena at their ops: a convolution's copy of its
    result lifts the outside peak, under which arena tensors then fit for free."""
    writer = {v: s for s in graph.ops if s.mode == "out" for v in s.outputs if v}   # value -> the op writing it
    arena = [r for r in graph.roots.values() if r.kind == "arena"]

    def single(step) -> bool:
        return all(not v or v == step.outputs[0] or graph.roots[graph.root_of[v]].kind == "empty"
                   for v in step.outputs)

    movable = {r.name: () if inplace else tuple(writer[m].index for m in r.members) for r in arena
               if single(writer[r.name]) and all(single(writer[m]) for m in r.members)}
    moved = cheaper_outside([Buffer(r.name, r.nbytes, r.first, r.last) for r in arena], _outside(graph) + inside,
                            movable, ALIGNMENT)
    return {writer[v].node.name: EAGER_CHEAPER for name in moved for v in (name, *graph.roots[name].members)}


class _ArenaForward:
    """One placement made real: views of the arena at its offsets and the generated forward that
    runs the model in them (`run(inputs)`)."""

    def __init__(self, placement: Placement, arena: torch.Tensor):
        self.placement, self.report, self.arena = placement, placement.report, arena
        device = arena.device
        with torch.inference_mode(False), torch.no_grad():
            # views of the one block are handed to the out= kernels
            tensors = dict(placement.graph.consts)
            for r in placement.graph.roots.values():
                if r.kind == "arena":
                    off = placement.offsets[r.name]
                    tensors[r.name] = self.arena[off:off + r.nbytes].view(r.dtype).as_strided(r.shape, r.stride)
                elif r.kind == "empty":
                    tensors[r.name] = torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device=device)
        self.fn, self.source = generate(placement.graph, tensors)
        spec = placement.out_spec
        self.unflatten = (lambda flat: flat[0]) if spec.is_leaf() else (lambda flat: pytree.tree_unflatten(flat, spec))
        self.checked = False

    def run(self, inputs):
        if self.checked:
            return self.unflatten(self.fn(*inputs))
        # first call: a resize of an arena view would write outside its region; make it an error
        storage = (self.arena.untyped_storage().data_ptr(), self.arena.untyped_storage().nbytes())
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*was resized.*")
            out = self.fn(*inputs)
        if (self.arena.untyped_storage().data_ptr(), self.arena.untyped_storage().nbytes()) != storage:
            raise RuntimeError("an op resized its arena view out of the plan; a planner bug: please report it")
        self.checked = True
        return self.unflatten(out)


class _NoBackward(torch.autograd.Function):
    """Marks planned outputs so that `backward` through them says why it cannot work."""

    @staticmethod
    def forward(ctx, x, _anchor):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward through a PlannedModule: planned modules run inference only (their arena is "
                           "reused by the next call and no autograd graph is kept); train the model itself, with "
                           "memfit.accumulate to fit a large batch, and size it with "
                           "memfit.memory_model(model, ..., train=True)")


class PlannedModule:
    """A model run inside one preallocated arena. Call it like the model (positional tensors).

    Inputs of a new shape (or strides) get their own placement and generated forward, made on first
    use and cached (`pm.placements`, `pm.forwards`); a different dtype or device is an error. The
    model is captured once with the batch dimension symbolic, so a new batch size is planned from
    that capture in milliseconds, without exporting again (`pm.captures`; a model that specialises
    on its batch size is captured per shape, and `pm.report.capture` says why). The planned module
    runs inference only: no autograd graph is recorded, and `backward` through its outputs raises
    an error saying so.
    `pm.report` describes the plan of the latest inputs.

    All placements share one arena, as large as the largest of them (`pm.arena_bytes`): a smaller
    last chunk or a halved batch costs no extra memory. `pm.release()` frees the arena between uses;
    the next call allocates it again (the placements are kept, nothing is captured again).

    Threads: calls are serialised by a lock (one arena, one call at a time), so two threads may
    share a PlannedModule and each gets its own correct outputs (outputs are fresh memory, never
    the arena). For parallel inference give each thread its own `plan(...)`.
    """

    def __init__(self, model: torch.nn.Module, example_inputs: tuple, algorithm: str, inplace: bool,
                 captured: Captured | None = None, eager_where_cheaper: bool = True):
        self.model, self.algorithm, self.inplace = model, algorithm, inplace
        self.eager_where_cheaper = eager_where_cheaper
        self.dtypes = [x.dtype for x in example_inputs]
        self.device = example_inputs[0].device if example_inputs else torch.device("cpu")
        self.placements: dict[tuple, Placement] = {}
        self.forwards: dict[tuple, _ArenaForward] = {}
        self._arena: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._last_key = self._key(example_inputs)
        _check_args(algorithm, inplace, eager_where_cheaper)
        # one capture, batch symbolic where the model allows: new batch sizes are planned from it
        self.captures = [captured if captured is not None else capture_model(model, example_inputs)]
        self._forward_for(tuple(example_inputs), self._last_key)

    @staticmethod
    def _key(inputs) -> tuple:
        # every input's shape, strides, dtype and device pick the plan (a dtype or device the example
        # did not have misses the cache, so `_check` runs only then): 0.5 us less per call than
        # isinstance checks plus a dtype check of the first input (2.0 -> 1.5 us, batch-1 MLP)
        return tuple([(x.shape, x.stride(), x.dtype, x.device) for x in inputs])

    @property
    def arena_bytes(self) -> int:
        """Bytes of the shared arena: the largest plan's arena (0 after `release()`)."""
        return 0 if self._arena is None else self._arena.nbytes

    def release(self) -> None:
        """Free the arena and its views (`pm.forwards`); the placements stay, the next call allocates it again."""
        self._arena = None
        self.forwards.clear()

    def _forward_for(self, inputs: tuple, key: tuple) -> _ArenaForward:
        if key not in self.placements:
            with predicting():                    # captures are shared by the plans `borrow_plan` lends out
                self._place(inputs, key)
        placement = self.placements[key]
        need = max(pl.report.arena_bytes for pl in self.placements.values())     # placement is one of them
        if self._arena is None or self._arena.nbytes < need:
            self.forwards.clear()                    # views of the old arena: dropped, so it is freed first
            self._arena = None
            with torch.inference_mode(False):
                self._arena = torch.empty(need, dtype=torch.uint8, device=self.device)
        p = _ArenaForward(placement, self._arena)
        self.forwards[key] = p
        return p

    def _place(self, inputs: tuple, key: tuple) -> None:
        cap = next((c for c in self.captures if c.accepts(inputs)), None)
        if cap is None:                           # another sample shape or strides, or a static capture
            if self.model is None:
                raise RuntimeError("this PlannedModule was given back (its model released); borrow it again "
                                   "to plan new input shapes")
            cap = capture_model(self.model, inputs)
            self.captures.append(cap)
        self.placements[key] = place_captured(cap, inputs, algorithm=self.algorithm, inplace=self.inplace,
                                              eager_where_cheaper=self.eager_where_cheaper)

    @property
    def report(self) -> Report:
        return self.placements[self._last_key].report

    @property
    def source(self) -> str:
        """The generated Python function of the latest plan."""
        p = self.forwards.get(self._last_key)
        if p is None:           # released: generate again on a meta arena (the code, not the bytes, is wanted)
            placement = self.placements[self._last_key]
            p = _ArenaForward(placement, torch.empty(placement.report.arena_bytes, dtype=torch.uint8, device="meta"))
        return p.source

    def _check(self, inputs) -> None:
        if len(inputs) != len(self.dtypes):
            raise TypeError(f"expected {len(self.dtypes)} input tensor(s) as planned; found {len(inputs)}; "
                            "call it with the same positional tensors as the example inputs of plan()")
        for i, (x, dt) in enumerate(zip(inputs, self.dtypes, strict=True)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"input {i}: expected a tensor; found {type(x).__name__}")
            if x.dtype != dt:
                raise TypeError(f"input {i}: expected dtype {dt} as planned; found {x.dtype}; convert with "
                                f"x.to({dt}) or plan again with an example of dtype {x.dtype}")
            if x.device != self.device:
                raise ValueError(f"input {i}: expected device {self.device} as planned; found {x.device}; "
                                 f"move it with x.to('{self.device}')")

    def __call__(self, *inputs):
        try:
            key = self._key(inputs)
        except AttributeError:                    # not a tensor: `_check` says which
            key = None
        with self._lock:
            p = self.forwards.get(key)
            if p is None:
                self._check(inputs)
                p = self._forward_for(inputs, key)
            self._last_key = key
            # plain outputs unless eager's would require grad (grad mode and a trainable parameter): then
            # they are marked so that backward says why it cannot work
            if not (torch.is_grad_enabled() and self._trainable()):
                with torch.no_grad():             # out= kernels refuse to record autograd
                    return p.run(inputs)
            with torch.no_grad():
                out = p.run(inputs)
        anchor = torch.zeros((), requires_grad=True)
        return pytree.tree_map_only(torch.Tensor, lambda t: _NoBackward.apply(t, anchor)
                                    if t.is_floating_point() else t, out)

    forward = __call__

    def _trainable(self) -> bool:
        """Whether a parameter the plans read requires grad (read now: requires_grad_ after planning is seen)."""
        return any(t.requires_grad for cap in self.captures for t in cap.consts.values())

    def __repr__(self) -> str:
        r = self.report
        return (f"PlannedModule({type(self.model).__name__}, {self.algorithm}, arena {format_bytes(r.arena_bytes)}, "
                f"lower bound {format_bytes(r.lower_bound)}, {len(self.placements)} plan(s))")


def plan(model: torch.nn.Module, example_inputs, *, algorithm: str = "greedy_by_size",
         inplace: bool = True, eager_where_cheaper: bool = True) -> PlannedModule:
    """Plan the activation memory of `model` for inputs shaped like `example_inputs` and return a
    module that runs inside that plan.

    Args:
        model: an `nn.Module` in eval mode that `torch.export` can capture.
        example_inputs: a tuple of tensors (or one tensor); their shapes, dtypes and device are planned.
        algorithm: "naive", "greedy_by_size" (default) or "best" (several orders, smallest arena).
        inplace: let allowlisted elementwise ops (relu, add, batch norm in eval, ...) write over an
            input that has no later reader.
        eager_where_cheaper: run an op eagerly (its output allocated by torch, outside the arena) where
            that lowers arena + unplanned peak bytes: the arena is held at its peak for the whole
            call, so tensors that fit under the peak of those outside it (a large model output, a
            stem of ops without `out=` kernels) cost nothing there. False: every op with an `out=`
            kernel writes into the arena. `pm.report.unplanned_reasons` says which ran eagerly.

    Returns:
        A `PlannedModule`: `pm(*inputs)` equals `model(*inputs)`; `pm.report` has the bytes.

    Raises:
        CaptureError: torch.export cannot capture the model (the export error's reason is included).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
        >>> pm = plan(model, torch.zeros(2, 8), algorithm="best")
        >>> pm(torch.ones(2, 8)).shape
        torch.Size([2, 8])
    """
    # the model, algorithm and inplace are checked by `place_at`, which the first call plans with
    return PlannedModule(model, as_inputs(example_inputs), algorithm, inplace,
                         eager_where_cheaper=eager_where_cheaper)


def plan_captured(cap: Captured, example_inputs, *, model: torch.nn.Module | None = None,
                  algorithm: str = "greedy_by_size", inplace: bool = True,
                  eager_where_cheaper: bool = True) -> PlannedModule:
    """`plan` from a capture made before: several algorithms or settings, one export."""
    return PlannedModule(model, as_inputs(example_inputs), algorithm, inplace, captured=cap,
                         eager_where_cheaper=eager_where_cheaper)

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

import threading
import warnings

import torch

from memfit.budget import format_bytes
from memfit.device.torch_private import tree_map_only, tree_unflatten
from memfit.memory.isolation import predicting
from memfit.planner.capture import as_inputs
from memfit.planner.captured import Captured, capture_model, input_key
from memfit.planner.codegen import generate
from memfit.planner.placement import ALIGNMENT, EAGER_CHEAPER, Placement, check_args, place, place_at, place_captured
from memfit.planner.report import Report

# capture_model, place, place_at, Captured, ALIGNMENT and EAGER_CHEAPER are re-exported: callers import them here
__all__ = ["ALIGNMENT", "EAGER_CHEAPER", "Captured", "Placement", "PlannedModule", "capture_model", "place",
           "place_at", "place_captured", "plan", "plan_captured"]


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
        self.unflatten = (lambda flat: flat[0]) if spec.is_leaf() else (lambda flat: tree_unflatten(flat, spec))
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
                 captured: Captured | None = None, eager_where_cheaper: bool = True, reorder: bool = True):
        self.model, self.algorithm, self.inplace = model, algorithm, inplace
        self.eager_where_cheaper, self.reorder = eager_where_cheaper, reorder
        self.dtypes = [x.dtype for x in example_inputs]
        self.device = example_inputs[0].device if example_inputs else torch.device("cpu")
        self.placements: dict[tuple, Placement] = {}
        self.forwards: dict[tuple, _ArenaForward] = {}
        self._arena: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._last_key = self._key(example_inputs)
        check_args(algorithm, inplace, eager_where_cheaper, reorder)
        # one capture, batch symbolic where the model allows: new batch sizes are planned from it
        self.captures = [captured if captured is not None else capture_model(model, example_inputs)]
        self._forward_for(tuple(example_inputs), self._last_key)

    _key = staticmethod(input_key)

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
                                              eager_where_cheaper=self.eager_where_cheaper, reorder=self.reorder)

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
        return tree_map_only(torch.Tensor, lambda t: _NoBackward.apply(t, anchor)
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
         inplace: bool = True, eager_where_cheaper: bool = True, reorder: bool = True) -> PlannedModule:
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
        reorder: run the ops in the topological order of the fewest arena + unplanned bytes among the
            graph's and a few others (`memfit.planner.order`: least peak memory first, breadth and depth
            first, and the optimum on small graphs); every order computes the same values with the
            same kernels, so outputs stay bit-identical to eager. `pm.report.order` says which order
            runs, `pm.report.graph_order_bytes` the bytes in the graph's order. False: the graph's order.

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
                         eager_where_cheaper=eager_where_cheaper, reorder=reorder)


def plan_captured(cap: Captured, example_inputs, *, model: torch.nn.Module | None = None,
                  algorithm: str = "greedy_by_size", inplace: bool = True,
                  eager_where_cheaper: bool = True, reorder: bool = True) -> PlannedModule:
    """`plan` from a capture made before: several algorithms or settings, one export."""
    return PlannedModule(model, as_inputs(example_inputs), algorithm, inplace, captured=cap,
                         eager_where_cheaper=eager_where_cheaper, reorder=reorder)

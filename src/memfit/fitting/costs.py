"""The inputs of `memfit.fit`'s time model: what a step's ops are, counted on fake tensors, and what they cost
here, measured (the model does not run for real).

`step_costs` runs one step (forward, loss, backward, the optimizer step on a copy holding fake state; an optimizer
without state yet steps twice, the first step, which makes the state, not counted) on fake tensors (the parameters
swapped for fake copies as the memory model does, `memfit.memory.fake_run`) at two micro-batch sizes and notes every
op (those a real step dispatches, in the same order: tested): its arguments' shapes
(`memfit.memory.kernel_scratch.spec_of`), whether it is a view (no kernel), its phase (forward, backward,
optimizer), whether it ran inside a candidate block's forward, and per block the tensors its forward saves for
backward; and the adds a micro-batch after the first runs (AccumulateGrad adds each parameter's gradient into the
one held: one `add_` per trainable parameter, which a trial's micro-step, holding no gradient, does not run). Which
dimensions carry the batch is read off the two runs (`kernel_scratch.batch_sizes`), so each op's arguments are known
at every micro-batch size; each distinct kernel is then run for real on ones of those shapes and timed
(`memfit.fitting.timing.kernel_seconds`). The result: a `Cost` for the step, for each block's forward (its
recomputation), for the optimizer step and for the gradients' adds, each with its ops by phase (host work) and its
kernels' seconds at every micro-batch size asked for.

What the host pays besides kernels is `memfit.fitting.host.machine`'s.

Known limitations: kernels are timed warm and alone (in a step their data is not always in cache: 7-35% slower for
the larger ones measured; the gradients' adds, each timed alone, run in a step back to back over every gradient:
0.6-0.9x their real time over BERT 768x12's 440 MB); a kernel whose arguments at a micro-batch size exceed
`CAP` is timed at the largest halving of that size within it and scaled up in proportion (one with no batch
dimension, or over `CAP` at one sample, and one that fails on ones, is priced by the larger of its FLOPs at a large
matmul's rate and its bytes at a copy's); accumulate's own bookkeeping per micro-batch (about 0.1 ms) is left out.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
    ...                             torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    >>> step, blocks, once, later = step_costs(model, torch.randn(4, 8), torch.randn(4, 8),
    ...                                        torch.nn.functional.mse_loss, ["1"], sizes=[1, 4])
    >>> blocks["1"].ops, blocks["1"].saved    # t, addmm, relu; the input, the weight and relu's output saved
    (3, 3)
    >>> [m for m, _ in step.kernels]
    [1, 4]
    >>> later.backward_ops      # a later micro-batch adds each of the 4 gradients into the one held
    4
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace

import torch
from torch.utils.flop_counter import flop_registry

from memfit.batches import forward
from memfit.device.torch_private import (
    READ_VALUE,
    DataDependentOutputException,
    DropoutBase,
    FakeTensorMode,
    TorchDispatchMode,
    disable_current_modes,
    in_backward,
    tree_flatten,
)
from memfit.fitting.search import Cost
from memfit.fitting.timing import copy_rate, kernel_seconds, matmul_rate, spec_bytes, timing_device, unsteady
from memfit.memory.fake_failure import explain_fake_failure
from memfit.memory.fake_run import FakeRunError
from memfit.memory.kernel_scratch import batch_sizes, sizes_at, spec_of
from memfit.memory.known_values import KnownValues, reads_stood_in, stand_in
from memfit.memory.step import ExampleBatch, forward_autocast
from memfit.memory.storage_log import device_asked, mask_check_answered_no, refuse_sparse

__all__ = ["CAP", "step_costs"]

CAP = 64 << 20           # bytes of one kernel's arguments above which it is timed at a smaller batch (or priced)


@dataclass(frozen=True, eq=False)
class _Op:
    """One op of a counted run: its arguments (`ArgSpec`), whether it is a view (no kernel runs), the blocks whose
    forward it ran in, the phase ('forward', 'backward', 'optimizer'), its FLOPs and the bytes it writes."""
    func: object
    spec: object
    view: bool
    blocks: frozenset
    phase: str
    flops: float
    written: float
    dropout: bool = False       # run inside a Dropout module's forward (a trial runs them at p = 0: none of it)


class _Counter(TorchDispatchMode):
    """Notes every op (`_Op`; `prim` ops, which fake tensors dispatch for attributes such as `.device`, are not
    ops of a real run) and, per block, the tensors its forward saves for backward (`pack`)."""

    def __init__(self, blocks: Iterable[str] = ()):
        super().__init__()
        self.open: list[str] = []
        self.phase = "step"
        self.ops: list[_Op] = []
        self.saved = {b: 0 for b in blocks}
        self.unpacked = None
        self.dropping = 0           # Dropout modules whose forward is running
        self.known = KnownValues()  # values the run knows (positions it makes, LayerDrop's decided draws), as the
        #                             memory model's: a question on them answered as it answers it
        self.stands_in = None       # the answer the optimizer's value reads get, as its memory model's
        #                             (`reads_stood_in`; None: not stood in)

    def close(self) -> None:          # a forward hook: returns None, so the output stays the module's
        self.open.pop()

    def drop(self, step: int) -> None:   # a Dropout module's forward begins (1) or ends (-1)
        self.dropping += step

    def pack(self, t):               # saved_tensors_hooks: counts what each open block's forward saves
        for b in set(self.open):
            self.saved[b] += 1
        return t

    def unpack(self, t):             # autograd detaches what an unpack hook gives back: not an op of a real step
        self.unpacked = t
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (device := device_asked(func, args)) is not None:      # a fake tensor's .device: no op
            return device
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except DataDependentOutputException:
            if func is READ_VALUE and (known := self.known.value(args[0])) is not None:
                with disable_current_modes():           # a real tensor's value: not through the fake mode below
                    out = known.item()
            elif func is READ_VALUE and self.phase in ("first optimizer step", "optimizer") \
                    and self.stands_in is not None:
                out = stand_in(args[0], self.stands_in)     # a scalar of the optimizer's update (as the memory
                #                                             model answers it)
            elif func is READ_VALUE and args[0].dtype == torch.bool and mask_check_answered_no():
                out = False     # transformers 4.x's "is the attention mask all ones?": no, as the memory model says
            else:
                raise
        if func.namespace == "prim":
            return out
        self.known.note(func, args, kwargs, out)
        if func is torch.ops.aten.detach.default and args and args[0] is self.unpacked:
            self.unpacked = None
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        refuse_sparse(func, [*outs, *tree_flatten((args, kwargs))[0]], "memfit.fit's time model")
        formula = flop_registry.get(func.overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        written = float(sum(t.nbytes for t in outs))
        backward = in_backward()
        inside = frozenset(self.open) if self.open and not backward else frozenset()
        view = func.is_view or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten._unsafe_view)
        phase = ("backward" if backward else "forward") if self.phase == "step" else self.phase
        self.ops.append(_Op(func, spec_of(args, kwargs), view, inside, phase, flops, written,
                            self.dropping > 0 and not backward))
        return out


def _count(model, x, y, loss_fn, blocks, autocast, device, optimizer=None, adds: bool = False) -> _Counter:
    from memfit.memory.fake_model import FakeModel
    from memfit.memory.fake_run import _fake_optimizer
    from memfit.memory.isolation import predicting
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter = _Counter(blocks)
    counter.stands_in = reads_stood_in(optimizer)
    with ExitStack() as stack:
        stack.enter_context(predicting())      # any draw goes to generators of its own, none to torch's
        fm = FakeModel(model, mode, device)    # hooks and fake parameters go on its copy: no other thread sees them
        modules = dict(fm.copy.named_modules())
        for b in blocks:          # which blocks' forwards are running (a block called twice is counted twice)
            stack.enter_context(modules[b].register_forward_pre_hook(lambda m, a, _b=b: counter.open.append(_b)))
            stack.enter_context(modules[b].register_forward_hook(lambda m, a, o: counter.close(), always_call=True))
        for m in modules.values():    # which ops a Dropout module runs (`Cost.dropped`)
            if isinstance(m, DropoutBase):
                stack.enter_context(m.register_forward_pre_hook(lambda m, a: counter.drop(1)))
                stack.enter_context(m.register_forward_hook(lambda m, a, o: counter.drop(-1), always_call=True))
        # made outside the fake mode: its copy of a real one-element state tensor (Adam's step) must be real
        opt = _fake_optimizer(optimizer, fm.fake, mode) if optimizer is not None else None
        model = stack.enter_context(fm.running())  # own_rng's mode steps aside: nothing draws on fake tensors
        xs = ExampleBatch(x).at(_len(x), device)
        ys = ExampleBatch(y).at(_len(y), device) if y is not None else None
        with counter:
            with forward_autocast(device.type, autocast), \
                    torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                loss = loss_fn(forward(model, xs), ys)
                loss = loss.sum() if loss.dim() else loss
            with torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type) \
                    else ExitStack():
                loss.backward()
                if adds:                # a later micro-batch: AccumulateGrad adds each gradient into the one held
                    counter.phase = "accumulate"
                    for p in fm.copy.parameters():
                        if p.grad is not None:
                            p.grad.add_(p.grad)
                if opt is not None:     # a step as in a running loop: state not made yet is made by a first
                    if not optimizer.state:                         # step, not counted
                        counter.phase = "first optimizer step"
                        _first_step(opt)
                    counter.phase = "optimizer"
                    type(opt).step(opt)
                    type(opt).zero_grad(opt)
        del loss, xs, ys
    return counter


def _counted(model, x, y, loss_fn, blocks, autocast, device, optimizer, adds: bool, m: int) -> _Counter:
    """`_count`, a failure of the fake run explained as the memory model's are (`FakeRunError`: an optimizer that
    reads values, Adafactor's `.item()`, said as such instead of torch's bare DataDependentOutputException)."""
    try:
        return _count(model, x, y, loss_fn, blocks, autocast, device, optimizer, adds)
    except (ValueError, TypeError):        # our own refusals (sparse tensors) and the user's argument errors
        raise
    except Exception as e:
        raise FakeRunError(explain_fake_failure(
            e, model, optimizer, True, m, instead="memfit.fit plans only a step that runs on fake tensors: measure "
            "real steps at a few micro-batch sizes with memfit.measure_step and pass the one that fits to "
            "memfit.accumulate(micro_batch=...)")) from e


def _first_step(opt) -> None:
    """The step that makes the fake optimizer's state: on the multi-tensor kernels (`_multi_tensor`), or, where
    those refuse the groups (an optimizer of another library whose `foreach` path has conditions of its own), on its
    own kernels from no state."""
    try:
        with _multi_tensor(opt):
            type(opt).step(opt)
    except Exception:
        opt.state.clear()
        type(opt).step(opt)


@contextmanager
def _multi_tensor(opt):
    """The fake optimizer's groups on torch's multi-tensor kernels (foreach) for a step that only makes the state:
    its ops are not counted, and the state is the same either way (compared for Adam, AdamW, NAdam, RAdam, Adamax,
    Adagrad, Adadelta, Rprop, RMSprop and SGD with momentum: keys, shapes, dtypes, step values), in one op per kind of
    update for the whole group instead of one per parameter (AdamW on BERT 768x12: 2,615 ops,
    40% of a counted run's). Groups without the choice (fused, or an optimizer without `foreach`) as they are, and
    those with a tensor option (an `lr` or `betas` tensor: torch's multi-tensor Adam refuses them without
    `capturable`, and the default then picks the single-tensor kernels)."""
    def options(g):
        return tree_flatten([v for k, v in g.items() if k != "params"])[0]
    groups = [g for g in opt.param_groups if "foreach" in g and not g.get("fused") and not g.get("differentiable")
              and not any(isinstance(v, torch.Tensor) for v in options(g))]
    was = [g["foreach"] for g in groups]
    for g in groups:
        g["foreach"] = True
    try:
        yield
    finally:
        for g, f in zip(groups, was, strict=True):
            g["foreach"] = f


def _len(x) -> int:
    return next(t.shape[0] for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


@dataclass(frozen=True, eq=False)
class _Sized:
    """An op of the run at batch `n`, with which of its arguments' dimensions carry the batch (`batch_sizes`'
    lines; {} for none, None where the two runs did not show it affine: its time is scaled from batch n)."""
    op: _Op
    n: int
    lines: dict | None

    def kernel(self, m: int) -> tuple[tuple | None, float]:
        """(the kernel to time for batch m: (func, spec, shapes), the factor its seconds are scaled by); None for a
        view (no kernel), or for a kernel too large to time (`roofline` prices it)."""
        spec, lines = self.op.spec, self.lines
        if self.op.view:
            return None, 0.0
        if lines is None:              # not affine in the batch: its kernel at batch n, scaled
            key, scale = (self.op.func, spec, ()), m / self.n
        else:                          # too large to time at m: at the largest halving of m within CAP, scaled up
            k = m
            while lines and k > 1 and spec_bytes(spec, sizes_at(spec, lines, k)) > CAP:
                k = (k + 1) // 2
            shapes = tuple(sorted(sizes_at(spec, lines, k).items())) if lines and k != self.n else ()
            key, scale = (self.op.func, spec, shapes), (m / k if lines else 1.0)
        return (key, scale) if spec_bytes(spec, dict(key[2])) <= CAP else (None, 1.0)

    def roofline(self, m: int, device: torch.device) -> float:
        """Seconds at batch m of a kernel not timed: the larger of its FLOPs at a large matmul's rate and its bytes
        (arguments and outputs) at a copy's."""
        dtype = next((lf[3] for lf in self.op.spec.leaves if isinstance(lf, tuple) and len(lf) == 4 and lf[0] == "t"
                      and lf[3].is_floating_point), torch.float32)
        grow = m / self.n if self.lines != {} else 1.0
        moved = (spec_bytes(self.op.spec, {}) + self.op.written) * grow
        return max(self.op.flops * grow / matmul_rate(device, dtype), moved / copy_rate(device))


def _seconds(ops: list[_Sized], sizes: list[int], device: torch.device) -> tuple[list[dict[int, float]], tuple]:
    """(each op's kernel seconds at each size: the kernels timed together (`timing.kernel_seconds`), the rest priced;
    `timing.unsteady` of the kernels timed)."""
    plans = [{m: o.kernel(m) for m in sizes} for o in ops]
    # size by size: a short kernel timed right after a long one ran up to 1.5x its time (caches it left cold)
    keys = [p[m][0] for m in sizes for p in plans if p[m][0] is not None]
    timed = kernel_seconds(keys, device=device)
    out = []
    for o, p in zip(ops, plans, strict=True):
        row = {}
        for m, (key, scale) in p.items():
            seconds = timed[key] if key is not None else None
            row[m] = seconds * scale if seconds is not None else 0.0 if o.op.view else o.roofline(m, device)
        out.append(row)
    return out, unsteady(keys, device)


def _sized(a: _Counter, m1: int, b: _Counter, m2: int) -> list[_Sized]:
    """The ops of run b (at batch m2) with their batch dimensions read off run a (at m1), the gradients' adds and the
    optimizer's (run b's only) without; where the two runs did not run the same ops, every op's time is scaled from
    batch m2. The first optimizer step's (the one that makes the state) are left out: no cost counts them, so none
    is timed (AdamW's state made for BERT 768x2: 9 kernels more)."""
    step = [q for q in b.ops if q.phase in ("forward", "backward")]
    rest = [_Sized(q, m2, {}) for q in b.ops if q.phase in ("accumulate", "optimizer")]
    theirs = [p for p in a.ops if p.phase in ("forward", "backward")]
    if len(theirs) != len(step) or any(p.func != q.func for p, q in zip(theirs, step, strict=True)):
        return [_Sized(q, m2, None) for q in step] + rest
    return [_Sized(q, m2, batch_sizes(q.spec, m2, p.spec, m1)) for p, q in zip(theirs, step, strict=True)] + rest


def _cost(rows: list[dict[int, float]], phases: list[str], saved: int = 0,
          runs: tuple[int, float, int, float] | None = None) -> Cost:
    """A `Cost` of ops in these `phases` whose kernels take rows[i][m] seconds at m; `runs`: bytes written at two
    sizes."""
    sizes = sorted(rows[0]) if rows else []
    kernels = tuple((m, sum(r[m] for r in rows)) for m in sizes)
    written = (0.0, 0.0)
    if runs is not None:           # bytes written at the two runs' sizes: a line in the batch
        m1, w1, m2, w2 = runs
        slope = max(0.0, (w2 - w1) / (m2 - m1))
        written = (max(0.0, w1 - slope * m1), slope)
    return Cost(phases.count("forward"), kernels, saved, written,
                backward_ops=phases.count("backward") + phases.count("accumulate"),   # autograd's engine runs both
                optimizer_ops=phases.count("optimizer"))


def step_costs(model: torch.nn.Module, x, y, loss_fn, blocks, autocast: torch.dtype | None = None,
               sizes: Iterable[int] = (1, 2, 4), optimizer: torch.optim.Optimizer | None = None,
               runs: tuple[int, int] = (2, 4)) -> tuple[Cost, dict[str, Cost], Cost, Cost]:
    """(the step's cost, each block's forward cost, the optimizer step's cost, the cost of adding each gradient into the
    one held in a micro-batch after the first) with kernel seconds at each of `sizes`, from fake runs at the two
    sizes of `runs` (2 and 4 by default: BatchNorm cannot train on one sample). `x`, `y`: an example batch (any
    size: only its layout is used); `loss_fn(output, y)` -> a scalar or one loss per sample; `optimizer`: its step
    counted once (None: an empty cost)."""
    from memfit.budget import model_device
    device = model_device(model)
    m1, m2 = runs
    # the gradients' adds and the optimizer step are counted in the second run only: their ops do not depend on
    # the batch
    a, b = (_counted(model, _at(x, m), _at(y, m), loss_fn, blocks, autocast, device, opt, adds, m)
            for m, opt, adds in ((m1, None, False), (m2, optimizer, True)))
    ops = _sized(a, m1, b, m2)
    sizes = sorted(set(sizes))
    seconds, steadiness = _seconds(ops, sizes, timing_device(device))
    written = lambda run, pick: sum(o.written for o in run.ops if pick(o))

    def cost(pick, saved=0, line=True) -> Cost:
        chosen = [(o.op.phase, r) for o, r in zip(ops, seconds, strict=True) if pick(o.op)]
        runs = (m1, written(a, pick), m2, written(b, pick)) if line else None
        rows = [r for _, r in chosen] or [dict.fromkeys(sizes, 0.0)]
        return _cost(rows, [p for p, _ in chosen], saved, runs)
    step = replace(cost(lambda o: o.phase in ("forward", "backward")), unsteady=steadiness)
    blocks_cost = {k: replace(cost(lambda o, k=k: k in o.blocks, b.saved[k]),
                              dropped=cost(lambda o, k=k: k in o.blocks and o.dropout, line=False))
                   for k in blocks}
    once = cost(lambda o: o.phase == "optimizer", line=False)
    later = cost(lambda o: o.phase == "accumulate", line=False)
    return step, blocks_cost, once, later


def _at(v, m: int):
    """The example batch `v` (tensors with a batch dimension; None passes) at m samples, as meta tensors."""
    if v is None:
        return None
    return ExampleBatch(v).at(m, torch.device("meta")) if not isinstance(v, torch.Tensor) or v.dim() else v

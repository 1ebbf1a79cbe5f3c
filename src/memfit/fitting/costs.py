"""The inputs of `memfit.fit`'s time model: what a step's ops are, counted on fake tensors, and what they cost
here, measured (the model does not run for real).

`step_costs` runs one step (forward, loss, backward, the optimizer step on a copy holding fake state; an optimizer
without state yet steps twice, the first step, which makes the state, not counted) on fake tensors (the
parameters swapped for fake copies as the memory model does, `memfit.memory.fake_run`) at two micro-batch sizes
and notes every op (those a real step dispatches, in the same order: tested): its arguments' shapes
(`memfit.memory.kernel_scratch.spec_of`), whether it is a view (no kernel), its phase (forward, backward,
optimizer), whether it ran inside a candidate block's forward, and per block the tensors its forward saves for
backward. Which dimensions carry the batch is read off the two runs (`kernel_scratch.batch_sizes`), so each op's
arguments are known at every micro-batch size; each distinct kernel is then run for real on ones of those shapes
and timed (`memfit.fitting.timing.kernel_seconds`). The result: a `Cost` for the step, for each block's forward
(its recomputation) and for the optimizer step, each with its ops by phase (host work) and its kernels' seconds at
every micro-batch size asked for.

`machine` measures once per device what the host pays besides kernels, on a chain of four small blocks (Linear +
GELU, one or six per block) run forward and backward, plain and with every block checkpointed, and an SGD step
on its parameters, by the same clock (the least of 15 rounds that run them all in turn, and each phase's kernels
replayed warm on ones): per op of each phase (that phase's time less its kernels replayed, over its
ops: Python, module calls, the dispatcher and autograd in forward; autograd's engine in backward; the optimizer's
Python calling kernels), and per checkpointed call and per tensor it saves (the extra of the checkpointed chain
less the blocks' forwards again, from the two block sizes). torch's generators are neither drawn from nor reset.

Known limitations: the chain's host work per forward op is about a floor: the forwards of the six models of
`memfit bench fit` (transformers' and plain torch.nn code) cost 12.7-19.9 us an op against its 12.4-13.2, so
splitting a batch is predicted a little cheaper than it is (mean -7% over that bench's grid); kernels are timed
warm and alone (in a step their data is not always in cache: 7-35% slower for the larger ones measured); the
chain's figures move with the machine's load (8.7-13.2 us a forward op in separate processes on the busy VM); a
kernel whose arguments at a micro-batch size exceed `CAP` is timed at
the largest halving of that size within it and scaled up in proportion (one with no batch dimension, or over
`CAP` at one sample, and one that fails on ones, is priced by the larger of its FLOPs at a large matmul's rate
and its bytes at a copy's); accumulate's own bookkeeping per micro-batch (about 0.1 ms) is left out.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
    ...                             torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    >>> step, blocks, once = step_costs(model, torch.randn(4, 8), torch.randn(4, 8), torch.nn.functional.mse_loss,
    ...                                 ["1"], sizes=[1, 4])
    >>> blocks["1"].ops, blocks["1"].saved    # t, addmm, relu; the input, the weight and relu's output saved
    (3, 3)
    >>> [m for m, _ in step.kernels]
    [1, 4]
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from memfit.batches import forward
from memfit.fitting.search import Cost, Machine
from memfit.fitting.timing import clock, copy_rate, kernel_seconds, matmul_rate
from memfit.memory.kernel_scratch import batch_sizes, sizes_at, spec_of
from memfit.memory.step import ExampleBatch, forward_autocast

__all__ = ["CAP", "machine", "step_costs"]

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

    def close(self) -> None:          # a forward hook: returns None, so the output stays the module's
        self.open.pop()

    def pack(self, t):               # saved_tensors_hooks: counts what each open block's forward saves
        for b in set(self.open):
            self.saved[b] += 1
        return t

    def unpack(self, t):             # autograd detaches what an unpack hook gives back: not an op of a real step
        self.unpacked = t
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        if func is torch.ops.aten.detach.default and args and args[0] is self.unpacked:
            self.unpacked = None
            return out
        formula = flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        written = float(sum(t.nbytes for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        backward = torch._C._current_graph_task_id() != -1
        inside = frozenset(self.open) if self.open and not backward else frozenset()
        view = func.is_view or func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten._unsafe_view)
        phase = ("backward" if backward else "forward") if self.phase == "step" else self.phase
        self.ops.append(_Op(func, spec_of(args, kwargs), view, inside, phase, flops, written))
        return out


def _count(model, x, y, loss_fn, blocks, autocast, device, optimizer=None) -> _Counter:
    from torch.nn.utils.stateless import _reparametrize_module

    from memfit.memory.fake_run import _fake_optimizer
    from memfit.memory.isolation import fake_section, predicting, structural_copy
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter = _Counter(blocks)
    model = structural_copy(model)      # hooks and fake parameters go on the copy: no other thread sees them
    modules = dict(model.named_modules())
    with ExitStack() as stack:
        stack.enter_context(predicting())      # any draw goes to generators of its own, none to torch's
        for b in blocks:          # which blocks' forwards are running (a block called twice is counted twice)
            stack.enter_context(modules[b].register_forward_pre_hook(lambda m, a, _b=b: counter.open.append(_b)))
            stack.enter_context(modules[b].register_forward_hook(lambda m, a, o: counter.close(), always_call=True))
        named = {**dict(model.named_parameters(remove_duplicate=False)),
                 **dict(model.named_buffers(remove_duplicate=False))}
        made: dict[int, torch.Tensor] = {}            # one fake per tensor: tied weights stay tied

        def fake_of(v):
            if id(v) not in made:
                f = mode.from_tensor(v)
                made[id(v)] = torch.nn.Parameter(f, v.requires_grad) if isinstance(v, torch.nn.Parameter) else f
            return made[id(v)]
        fake = {k: fake_of(v) for k, v in named.items()}
        # made outside the fake mode: its copy of a real one-element state tensor (Adam's step) must be real
        opt = _fake_optimizer(optimizer, fake_of, mode) if optimizer is not None else None
        stack.enter_context(fake_section(mode))    # own_rng's mode steps aside: nothing draws on fake tensors
        stack.enter_context(_reparametrize_module(model, fake, tie_weights=True, strict=False))
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
                if opt is not None:     # a step as in a running loop: state not made yet is made by a first
                    if not optimizer.state:                         # step, not counted
                        counter.phase = "first optimizer step"
                        type(opt).step(opt)
                    counter.phase = "optimizer"
                    type(opt).step(opt)
                    type(opt).zero_grad(opt)
        del loss, xs, ys
    return counter


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
            while lines and k > 1 and _bytes(spec, sizes_at(spec, lines, k)) > CAP:
                k = (k + 1) // 2
            shapes = tuple(sorted(sizes_at(spec, lines, k).items())) if lines and k != self.n else ()
            key, scale = (self.op.func, spec, shapes), (m / k if lines else 1.0)
        return (key, scale) if _bytes(spec, dict(key[2])) <= CAP else (None, 1.0)

    def roofline(self, m: int, device: torch.device) -> float:
        """Seconds at batch m of a kernel not timed: the larger of its FLOPs at a large matmul's rate and its bytes
        (arguments and outputs) at a copy's."""
        dtype = next((lf[3] for lf in self.op.spec.leaves if isinstance(lf, tuple) and len(lf) == 4 and lf[0] == "t"
                      and lf[3].is_floating_point), torch.float32)
        grow = m / self.n if self.lines != {} else 1.0
        moved = (_bytes(self.op.spec, {}) + self.op.written) * grow
        return max(self.op.flops * grow / matmul_rate(device, dtype), moved / copy_rate(device))


def _seconds(ops: list[_Sized], sizes: list[int], device: torch.device) -> list[dict[int, float]]:
    """Each op's kernel seconds at each size: the kernels timed together (`timing.kernel_seconds`), the rest priced."""
    plans = [{m: o.kernel(m) for m in sizes} for o in ops]
    # size by size: a short kernel timed right after a long one ran up to 1.5x its time (caches it left cold)
    timed = kernel_seconds([p[m][0] for m in sizes for p in plans if p[m][0] is not None], device=device)
    out = []
    for o, p in zip(ops, plans, strict=True):
        row = {}
        for m, (key, scale) in p.items():
            seconds = timed[key] if key is not None else None
            row[m] = seconds * scale if seconds is not None else 0.0 if o.op.view else o.roofline(m, device)
        out.append(row)
    return out


def _bytes(spec, shapes: dict) -> int:
    """Bytes of the tensors among `spec`'s arguments (at `shapes` where given)."""
    total = 0
    for i, lf in enumerate(spec.leaves):
        if isinstance(lf, tuple) and len(lf) == 4 and lf[0] == "t":
            total += math.prod(shapes.get(i, lf[1])) * lf[3].itemsize
    return total


def _sized(a: _Counter, m1: int, b: _Counter, m2: int) -> list[_Sized]:
    """The ops of run b (at batch m2) with their batch dimensions read off run a (at m1), the optimizer's (run b's
    only) without; where the two runs did not run the same ops, every op's time is scaled from batch m2."""
    step = [q for q in b.ops if q.phase in ("forward", "backward")]
    rest = [_Sized(q, m2, {}) for q in b.ops if q.phase not in ("forward", "backward")]
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
    return Cost(phases.count("forward"), kernels, saved, written, backward_ops=phases.count("backward"),
                optimizer_ops=phases.count("optimizer"))


def step_costs(model: torch.nn.Module, x, y, loss_fn, blocks, autocast: torch.dtype | None = None,
               sizes: Iterable[int] = (1, 2, 4), optimizer: torch.optim.Optimizer | None = None,
               runs: tuple[int, int] = (2, 4)) -> tuple[Cost, dict[str, Cost], Cost]:
    """(the step's cost, each block's forward cost, the optimizer step's cost) with kernel seconds at each of
    `sizes`, from fake runs at the two sizes of `runs` (2 and 4 by default: BatchNorm cannot train on one
    sample). `x`, `y`: an example batch (any size: only its layout is used); `loss_fn(output, y)` -> a scalar or
    one loss per sample; `optimizer`: its step counted once (None: an empty cost)."""
    from memfit.budget import model_device
    device = model_device(model)
    m1, m2 = runs
    # the optimizer step is counted in the second run only: its ops do not depend on the batch
    a, b = (_count(model, _at(x, m), _at(y, m), loss_fn, blocks, autocast, device, opt)
            for m, opt in ((m1, None), (m2, optimizer)))
    ops = _sized(a, m1, b, m2)
    sizes = sorted(set(sizes))
    seconds = _seconds(ops, sizes, device)
    written = lambda run, pick: sum(o.written for o in run.ops if pick(o))

    def cost(pick, saved=0, line=True) -> Cost:
        chosen = [(o.op.phase, r) for o, r in zip(ops, seconds, strict=True) if pick(o.op)]
        runs = (m1, written(a, pick), m2, written(b, pick)) if line else None
        rows = [r for _, r in chosen] or [dict.fromkeys(sizes, 0.0)]
        return _cost(rows, [p for p, _ in chosen], saved, runs)
    step = cost(lambda o: o.phase in ("forward", "backward"))
    blocks_cost = {k: cost(lambda o, k=k: k in o.blocks, b.saved[k]) for k in blocks}
    once = cost(lambda o: o.phase == "optimizer", line=False)
    return step, blocks_cost, once


def _at(v, m: int):
    """The example batch `v` (tensors with a batch dimension; None passes) at m samples, as meta tensors."""
    if v is None:
        return None
    return ExampleBatch(v).at(m, torch.device("meta")) if not isinstance(v, torch.Tensor) or v.dim() else v


# device -> Machine: measured once per process
_MACHINES: dict[torch.device, Machine] = {}


class _Checkpointed(torch.nn.Module):
    """A block whose forward runs under non-reentrant torch.utils.checkpoint, as `memfit.fitting.checkpointing`
    runs it, without preserving the RNG state (that would set torch's generator back; nothing here draws)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False, preserve_rng_state=False)


def machine(device: torch.device) -> Machine:
    """What the host pays on `device` besides kernels (seconds per op of a forward, of backward and of an
    optimizer's step, per checkpointed call and per tensor a checkpointed forward saves), from a chain of four
    blocks of one or six Linear(8, 8) + GELU pairs forward and backward, plain and checkpointed, and an SGD step
    with momentum on its parameters, measured once and kept. See the module's docstring."""
    dev = torch.device(device)
    if dev not in _MACHINES:
        chains = {depth: _chain(depth, dev) for depth in (1, 6)}
        op = {p: statistics.mean(c["host"][p] for c in chains.values()) for p in ("forward", "backward")}
        # an optimizer's step has its own Python per call (its groups, its checks) that a model's many parameters
        # spread thin: its figure from the chain with the most (48), where it came out at 1.4-1.9 us an op (8
        # parameters: 6.6-7.5; the six bench models' AdamW steps came within -30% to +8% of their real ones)
        op["optimizer"] = chains[6]["host"]["optimizer"]
        # checkpointing every block adds their forwards again (their ops at the forward's rate, their kernels) and
        # checkpoint's own work: four calls, and each tensor the blocks' forwards save; two depths give both
        extra = {d: c["extra"] - c["inside"] * op["forward"] for d, c in chains.items()}
        saved = {d: c["saved"] for d, c in chains.items()}
        per_saved = max(0.0, (extra[6] - extra[1]) / max(saved[6] - saved[1], 1))
        per_call = max(0.0, (extra[1] - per_saved * saved[1]) / 4)
        _MACHINES[dev] = Machine(op["forward"], op["backward"], op["optimizer"], per_call, per_saved,
                                 overlap=dev.type == "cuda")
    return _MACHINES[dev]


def _chain(depth: int, dev: torch.device) -> dict:
    """One chain's figures: host seconds per op by phase (its time less its kernels', over its ops), the seconds
    checkpointing its four blocks adds beyond their kernels, their forward ops and the tensors they save."""
    from memfit.memory.isolation import own_rng
    with own_rng():       # Linear's initialisation draws from a generator of its own: torch's is neither used nor reset
        blocks = [torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(8, 8), torch.nn.GELU())])
                  for _ in range(4)]
    plain = torch.nn.Sequential(*blocks).to(dev)
    ckpt = torch.nn.Sequential(*[_Checkpointed(b) for b in blocks]).to(dev)
    sgd = torch.optim.SGD(plain.parameters(), lr=1e-9, momentum=0.9)
    tiny = torch.ones(2, 8, device=dev)
    names = [str(i) for i in range(4)]
    counter = _Counter(names)
    with ExitStack() as stack:
        for name, b in zip(names, blocks, strict=True):
            stack.enter_context(b.register_forward_pre_hook(lambda m, a, _n=name: counter.open.append(_n)))
            stack.enter_context(b.register_forward_hook(lambda m, a, o: counter.close()))
        with counter, torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            plain(tiny).sum().backward()
            counter.phase = "first optimizer step"        # momentum buffers made: not counted
            sgd.step()
            counter.phase = "optimizer"
            sgd.step()
    phases = {p: [o for o in counter.ops if o.phase == p and not o.view] for p in ("forward", "backward", "optimizer")}
    phases["inside"] = [o for o in phases["forward"] if o.blocks]
    replays = {p: _replay(ops, dev) for p, ops in phases.items()}
    seconds = _least(plain, ckpt, sgd, tiny, dev, replays)
    host = {p: max(0.0, seconds[p] - seconds[f"{p} kernels"]) / max(sum(o.phase == p for o in counter.ops), 1)
            for p in ("forward", "backward", "optimizer")}
    inside = [o for o in counter.ops if o.blocks]
    return {"host": host, "extra": seconds["checkpointed"] - seconds["forward"] - seconds["backward"]
            - seconds["inside kernels"], "inside": len(inside), "saved": sum(counter.saved.values())}


def _replay(ops: list[_Op], dev: torch.device, repeat: int = 8):
    """A call that runs these ops' kernels on ones of their arguments, each `repeat` times in a row (warm, as
    `timing.kernel_seconds` times a model's kernels: the host's share is what the chain takes beyond that), and
    gives back how many times: its seconds over that are the kernels' once."""
    from memfit.memory.kernel_scratch import real_arguments
    calls = [(o.func, *real_arguments(o.spec, {}, dev, ones=True)) for o in ops]

    def run() -> int:
        for func, args, kwargs in calls:
            for _ in range(repeat):
                func(*args, **kwargs)
        return repeat
    return run


def _least(plain, ckpt, sgd, x, device: torch.device, replays: dict, rounds: int = 15) -> dict[str, float]:
    """Seconds of the plain chain's forward, its backward, the checkpointed chain's forward and backward, an
    optimizer step, and each phase's kernels replayed alone (`replays`: phase -> call): each the least over `rounds`
    rounds that run all of them in turn, by `timing.clock` (the least: what another process's turn on the core
    added to a call is not the chain's; in turn: a busy stretch falls on all of them, the chain and its kernels)."""
    from torch.utils._python_dispatch import _disable_current_modes
    now = clock(device)
    parts = ["forward", "backward", "checkpointed", "optimizer", *(f"{p} kernels" for p in replays)]
    best = dict.fromkeys(parts, float("inf"))
    for r in range(rounds + 2):                 # two rounds to warm up
        times = [now()]
        loss = plain(x).sum()
        times.append(now())
        loss.backward()
        times.append(now())
        ckpt(x).sum().backward()
        times.append(now())
        sgd.step()
        times.append(now())
        per = [1, 1, 1, 1]                      # calls per part: the replays run each kernel several times
        with _disable_current_modes(), torch.no_grad():
            for run in replays.values():
                per.append(run())
                times.append(now())
        if r >= 2:
            for k, a, b, n in zip(parts, times, times[1:], per, strict=False):     # len(times) == len(parts) + 1
                best[k] = min(best[k], (b - a) / n)
    return best

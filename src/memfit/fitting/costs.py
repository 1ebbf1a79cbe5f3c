"""The inputs of `memfit.fit`'s time model, counted on fake tensors: nothing of the model runs for real.

`step_costs` runs one step's forward, loss and backward on fake tensors (the parameters swapped for fake
copies as the memory model does, `memfit.memory.fake_run`) at two micro-batch sizes and counts, for the whole
step and for the forward of each candidate block, the kernels launched, the FLOPs (`torch.utils.flop_counter`'s
formulas: matmuls, convolutions, attention) and the bytes the kernels write: a `Cost` line a + b * m each.
`machine` measures once per device and precision what a launch, a FLOP and a byte cost there (a launch as
a training step pays it: a small stack of Linear + GELU modules forward and backward, over the kernels it ran;
a square matmul; a copy), a few milliseconds of kernels on freshly made tensors (torch's generators neither
drawn from nor reset).

Known limitations: FLOPs of ops without a formula (elementwise, normalisation) count only as bytes written;
the optimizer step is left out (the same in every alternative, so it only dilutes the ratios).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()),
    ...                             torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
    >>> step, blocks = step_costs(model, torch.randn(4, 8), torch.randn(4, 8), torch.nn.functional.mse_loss, ["1"])
    >>> blocks["1"].flops                     # one (m, 8) x (8, 8) matmul: 2 * 8 * 8 per sample
    (0.0, 128.0)
"""

from __future__ import annotations

import statistics
import time
from contextlib import ExitStack

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from memfit.batches import forward
from memfit.fitting.search import Cost, Machine
from memfit.memory.step import ExampleBatch, forward_autocast

__all__ = ["machine", "step_costs"]


class _Counter(TorchDispatchMode):
    """Counts launches, FLOPs and output bytes of every op: for the step, and for each block whose forward is
    running (not its backward: the recomputation is a forward)."""

    def __init__(self):
        super().__init__()
        self.open: list[str] = []
        self.step = [0, 0.0, 0.0]
        self.blocks: dict[str, list] = {}

    def close(self) -> None:          # a forward hook: returns None, so the output stays the module's
        self.open.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        flops = float(formula(*args, **kwargs, out_val=out)) if formula is not None else 0.0
        written = float(sum(t.nbytes for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)))
        for row in [self.step] + ([self.blocks[b] for b in set(self.open)]
                                  if self.open and torch._C._current_graph_task_id() == -1 else []):
            row[0] += 1
            row[1] += flops
            row[2] += written
        return out


def _count(model, x, y, loss_fn, blocks, autocast, device) -> _Counter:
    from torch.nn.utils.stateless import _reparametrize_module

    from memfit.memory.isolation import fake_section, predicting, structural_copy
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counter = _Counter()
    counter.blocks = {b: [0, 0.0, 0.0] for b in blocks}
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
        stack.enter_context(fake_section(mode))    # own_rng's mode steps aside: nothing draws on fake tensors
        stack.enter_context(_reparametrize_module(model, fake, tie_weights=True, strict=False))
        xs = ExampleBatch(x).at(_len(x), device)
        ys = ExampleBatch(y).at(_len(y), device) if y is not None else None
        with counter:
            with forward_autocast(device.type, autocast):
                loss = loss_fn(forward(model, xs), ys)
                loss = loss.sum() if loss.dim() else loss
            with torch.autocast(device.type, enabled=False) if torch.amp.is_autocast_available(device.type) \
                    else ExitStack():
                loss.backward()
        del loss, xs, ys
    return counter


def _len(x) -> int:
    return next(t.shape[0] for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


def step_costs(model: torch.nn.Module, x, y, loss_fn, blocks, autocast: torch.dtype | None = None,
               sizes: tuple[int, int] = (2, 4)) -> tuple[Cost, dict[str, Cost]]:
    """(the step's cost, each block's forward cost) as lines in the micro-batch size, from fake runs at `sizes`
    (2 and 4 by default: BatchNorm cannot train on one sample). `x`, `y`: an example batch (any size: only its
    layout is used); `loss_fn(output, y)` -> a scalar or one loss per sample."""
    from memfit.budget import model_device
    device = model_device(model)
    m1, m2 = sizes
    runs = [_count(model, _at(x, m), _at(y, m), loss_fn, blocks, autocast, device) for m in (m1, m2)]

    def line(a, b) -> Cost:
        slope = [(b[i] - a[i]) / (m2 - m1) for i in (1, 2)]
        return Cost(max(a[0], b[0]), (max(0.0, a[1] - slope[0] * m1), max(0.0, slope[0])),
                    (max(0.0, a[2] - slope[1] * m1), max(0.0, slope[1])))
    return line(runs[0].step, runs[1].step), {k: line(runs[0].blocks[k], runs[1].blocks[k]) for k in blocks}


def _at(v, m: int):
    """The example batch `v` (tensors with a batch dimension; None passes) at m samples, as meta tensors."""
    if v is None:
        return None
    return ExampleBatch(v).at(m, torch.device("meta")) if not isinstance(v, torch.Tensor) or v.dim() else v


# (device, dtype) -> Machine: measured once per process
_MACHINES: dict[tuple, Machine] = {}


def machine(device: torch.device, dtype: torch.dtype = torch.float32) -> Machine:
    """What a kernel launch, a FLOP and a byte written cost on `device` (at `dtype` for the matmul): medians of
    a chain of tiny ops with its backward (per kernel), a 256 x 256 matmul (1024 on CUDA) and a 4 MiB copy,
    measured once and kept."""
    key = (torch.device(device), dtype)
    if key in _MACHINES:
        return _MACHINES[key]
    dev = key[0]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def per_call(fn, calls: int) -> float:
        fn()
        times = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)

    # a launch as a training step pays it: module calls, autograd recording, the backward, over the kernels
    # that ran (a bare add in a loop costs a fraction of that: 0.8 against 2.3 to 5 us here)
    from memfit.memory.isolation import own_rng
    with own_rng():       # Linear's initialisation draws from a generator of its own: torch's is neither used nor reset
        stack = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
                                      for _ in range(4)]).to(dev)
    tiny = torch.ones(2, 8, device=dev)

    def chain():
        stack(tiny).sum().backward()
    counter = _Counter()
    with counter:
        chain()
    op = per_call(chain, 5) / counter.step[0]
    with torch.no_grad():
        k = 1024 if dev.type == "cuda" else 256
        a = torch.full((k, k), 0.5, device=dev, dtype=dtype)
        mm = per_call(lambda: a @ a, 10)
        big = torch.ones(1 << 20, device=dev)            # 4 MiB of float32
        copy = per_call(lambda: big.clone(), 10)
    m = _MACHINES[key] = Machine(op, 2 * k ** 3 / max(mm - op, op), big.nbytes / max(copy - op, op))
    return m

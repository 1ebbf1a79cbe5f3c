"""What the host pays on a device besides kernels, for `memfit.fit`'s time model (`machine`): seconds per op of a
forward (Python, module calls, the dispatcher, autograd), of backward (autograd's engine) and of an optimizer's step
(its Python calling kernels), and what `torch.utils.checkpoint` adds per checkpointed call and per tensor a
checkpointed forward saves (its hooks).

`machine` measures it once per device on a chain of four small blocks (Linear + Tanh, one or six per block) run
forward and backward, plain and with every block checkpointed, and an SGD step on its parameters, by the clock
kernels are timed by (`memfit.fitting.timing.clock`; the least of 15 rounds that run them all in turn, and each
phase's kernels replayed warm on ones): per op of each phase, that phase's time less its kernels replayed, over
its ops (counted as `memfit.fitting.costs` counts a step's); per checkpointed call and per tensor it saves, the
extra of the checkpointed chain less the blocks' forwards again, from the two block sizes. torch's generators are
neither drawn from nor reset.

Known limitations: the chain's host work per forward op is about a floor: the forwards of the six models of
`memfit bench fit` (transformers' and plain torch.nn code) cost 12.7-19.9 us an op against its 12.4-13.2, so
splitting a batch is predicted a little cheaper than it is (mean -7% over that bench's grid); the chain's figures
move with the machine's load (8.7-13.2 us a forward op in separate processes on the busy VM).

Example:
    >>> import torch
    >>> m = machine(torch.device("cpu"))
    >>> 0 < m.op_seconds < 1e-3 and m.checkpoint_seconds >= 0 and not m.overlap
    True
"""

from __future__ import annotations

import statistics
from contextlib import ExitStack

import torch

from memfit.fitting.costs import _Counter, _Op
from memfit.fitting.search import Machine
from memfit.fitting.timing import clock

__all__ = ["machine"]

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
    blocks of one or six Linear(8, 8) + Tanh pairs forward and backward, plain and checkpointed, and an SGD step
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
        # Tanh, not GELU: torch's GELU kernel opens a parallel region whatever its size, which at two threads on a
        # busy 2-core VM cost 13 ms a call (Tanh 1.7 us), and the chain 230 s (9.5 s at one thread); a model's own
        # kernels, GELU's too, are timed by `timing.kernel_seconds`: the chain is for the host's share alone
        blocks = [torch.nn.Sequential(*[m for _ in range(depth) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())])
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


def _replay(ops: list[_Op], dev: torch.device, repeat: int = 16):
    """A call that gives the seconds these ops' kernels take once each, run warm on ones of their arguments (as
    `timing.kernel_seconds` times a model's kernels: the host's share is what the chain takes beyond that): each
    distinct kernel (op and arguments) `repeat` times in a row, its seconds a call times the ops that run it. (The
    six-deep chain's 796 ops are 76 kernels: each op replayed instead, 8 times, was half of `machine`'s 0.7 s.)"""
    from collections import Counter

    from memfit.memory.kernel_scratch import real_arguments
    counts = Counter((o.func, o.spec) for o in ops)
    calls = [(func, *real_arguments(spec, {}, dev, ones=True), n) for (func, spec), n in counts.items()]
    now = clock(dev)

    def run() -> float:
        total = 0.0
        for func, args, kwargs, n in calls:
            t0 = now()
            for _ in range(repeat):
                func(*args, **kwargs)
            total += (now() - t0) / repeat * n
        return total
    return run


def _least(plain, ckpt, sgd, x, device: torch.device, replays: dict, rounds: int = 15) -> dict[str, float]:
    """Seconds of the plain chain's forward, its backward, the checkpointed chain's forward and backward, an
    optimizer step, and each phase's kernels replayed alone (`replays`: phase -> call): each the least over `rounds`
    rounds that run all of them in turn, by `timing.clock` (the least: what another process's turn on the core
    added to a call is not the chain's; in turn: a busy stretch falls on all of them, the chain and its kernels)."""
    from memfit.device.torch_private import disable_current_modes
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
        with disable_current_modes(), torch.no_grad():
            kernels = [run() for run in replays.values()]          # each phase's kernels' seconds, once each
        if r >= 2:
            for k, a, b in zip(parts, times, times[1:], strict=False):     # the chain's parts: len(times) - 1
                best[k] = min(best[k], b - a)
            for k, seconds in zip(parts[len(times) - 1:], kernels, strict=True):
                best[k] = min(best[k], seconds)
    return best

"""The measured side of `memfit.fit`'s time model: the seconds one real kernel takes at the argument shapes a fake
run recorded (`kernel_seconds`: run on ones of those shapes, zeros for integer tensors (an index in range), timed
once per shapes and kept; ones, not zeros: a square root of 128K zeros took 6x as long as of ones or of 1e-3, and
an optimizer's never sees zeros), the clock it is timed by (`clock`), and the bytes per second of a plain copy
(`copy_rate`: the price of a kernel that is not timed).

Why kernels are timed rather than priced from FLOPs at one matmul's rate: the kernels of a training step at the
sizes people split batches into are far from any one rate. On a 2-core VM, one thread: a 512-square matmul ran at
87 GFLOP/s, a 32-square one at 24, an 8-square one at under 1; ConvNeXt's convolutions' backward took 4.4 of its
6.8 ms of kernels at batch 8; GPT-2's tanh cost over 10x what its bytes at copy speed say. Timed kernels plus
the host's work per op (`memfit.fitting.host.machine`) came 2-18% below a real forward and backward at
micro-batch 2 of the six models of `memfit bench fit` (their forwards' Python costs 1.2-2x the measuring chain's
per op, and kernels run slower in a step than alone: their data is not in cache).

The clock: on the CPU with one intra-op thread, the calling thread's CPU time (`time.thread_time`): the kernel
and the host work run on that thread, and CPU time leaves out the time other processes hold the core (on a VM
at load 13, a chain of layers took 4x its CPU time in wall time, while its CPU time stayed within 5%). With more
threads, the wall clock; on CUDA the wall clock around a synchronize. A figure is the least of two samples
after a warm-up (the first call, where it spans 0.2 ms), each sample enough calls of a short kernel to span about
0.2 ms (a call over 10 ms: the first call alone); where the first sample comes within 10% of the warm-up, the
warm-up is the second (`STEADY`). On the Llama of the issue (hidden 256, 4 layers, seq 256) that
is 1.5 s of the thread's CPU time for 400 kernels at 5 sizes (2.1 s with three samples and a second warm-up).

Nothing here touches torch's generators: a random op (dropout) draws from generators of its own
(`memfit.memory.isolation.own_draw`).

Example:
    >>> import torch
    >>> from memfit.memory.kernel_scratch import spec_of
    >>> a = torch.zeros(64, 64)
    >>> mm = (torch.ops.aten.mm.default, spec_of((a, a), {}), ())
    >>> kernel_seconds([mm], device=torch.device("cpu"))[mm] > 0
    True
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import torch

__all__ = ["clock", "copy_rate", "kernel_seconds", "matmul_rate", "timed", "timing_device", "unsteady"]

_SECONDS: dict = {}        # (func, spec, shapes, threads, device) -> seconds, or None where it failed on ones
_RATES: dict = {}          # (what, device, dtype) -> bytes per second of a copy, FLOP/s of a large matmul
_SPREAD: dict = {}         # the keys of _SECONDS -> its samples' largest over least (for `unsteady`)
UNSTEADY = 1.5             # a kernel's samples this far apart: the machine was busy while it was timed
BUSY_SHARE = 0.25          # more of a step's kernels than this unsteady, timed by the wall clock: `memfit.fit`
# says its times may be off (a small CNN's fit, two threads with the other core taken: 35-55% of its kernels; on a
# quieter machine at one thread 6%, but 51% at load 2.5, where the thread's CPU time is still the step's)
SAMPLE = 2e-4              # seconds a sample of calls spans at least (short kernels run several times per sample)
LONG = 1e-2                # a call this long is timed once
SAMPLES = 2                # samples per figure (the least is taken): fit times its leading alternatives for real
#                            (`memfit.fitting.trials`), so these figures only rank the rest (3 samples: 1.6x the cost)
STEADY = 1.1               # in `kernel_seconds`, a first sample this close to the warm-up before it: the two are the
# figure's samples (the warm-up ran warm: no set-up in it), no second taken. BERT 768x2's 110 kernels of 0.2-10 ms
# at two threads: 61 came within 10% of their warm-up, and the least of the two then came at a median 0.98x (0.94-1.0
# quartiles) of the least of two samples after it; the kernels of 0.2-10 ms were 1.9 of the 5 s `memfit.fit` spent


def timing_device(device: torch.device) -> torch.device:
    """Where a model's kernels are timed: its own device, or the CPU as a stand-in for a meta-device model (no kernel
    runs on meta: its figures say what the CPU would take, `explain()` says so)."""
    return torch.device("cpu") if device.type == "meta" else device


def clock(device: torch.device) -> Callable[[], float]:
    """The clock kernels and steps are timed by on `device`: the thread's CPU time on a CPU with one intra-op
    thread, else the wall clock (after a synchronize on CUDA)."""
    if device.type == "cuda":
        def wall() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()
        return wall
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one `fn()`: the least over `SAMPLES` samples after a warm-up (`_per_sample`). The least: what
    another process's use of the core's caches added to a sample is not the call's."""
    now = clock(device)
    t0 = now()
    fn()
    first = max(now() - t0, 1e-7)
    if first > LONG:
        return first
    calls = _per_sample(fn, now)
    times = []
    for _ in range(SAMPLES):
        t0 = now()
        for _ in range(calls):
            fn()
        times.append((now() - t0) / calls)
    return min(times)


def _per_sample(fn: Callable[[], object], now: Callable[[], float]) -> int:
    """Calls of `fn` per sample (about `SAMPLE` seconds' worth), from a warm-up of that long: a kernel's first calls
    at new shapes run up to 10x longer (oneDNN makes its primitive), so the first call says nothing of the rest."""
    return _warm_up(fn, now)[0]


def _warm_up(fn: Callable[[], object], now: Callable[[], float]) -> tuple[int, float]:
    """(calls of `fn` per sample, the warm-up's seconds per call): `_per_sample`'s warm-up of about `SAMPLE`
    seconds."""
    t0, done = now(), 0
    while done < 50 and (now() - t0 < SAMPLE or done == 0):
        fn()
        done += 1
    spent = max(now() - t0, 1e-9)
    return max(1, min(50, int(SAMPLE * done / spent))), spent / done


def kernel_seconds(kernels: Iterable[tuple], *, device: torch.device, group_bytes: int = 64 << 20) -> dict:
    """{(func, spec, shapes): seconds} for each kernel asked for: the real kernel of `func` on ones of `spec`'s
    arguments (`memfit.memory.kernel_scratch.ArgSpec`; `shapes`: a tuple of (leaf index, another shape) for
    another batch, or ()) on `device`, under no_grad; None where it fails on them (the caller prices it otherwise).
    Each is timed once per thread count and device, and kept.

    The kernels are timed in turn, a sample of each per round (as many rounds as `timed` takes samples), their
    arguments made once per group of at most `group_bytes`: a busy moment of the machine then falls on one sample
    of several kernels rather than on every sample of one (on a loaded VM one convolution timed alone, three
    samples in a row, came out 2.5x its usual time in one process of four). A kernel whose first sample came within
    `STEADY` of its warm-up (the calls after its first, at the same calls per sample) takes no second: the warm-up
    ran warm, and the least of the two is its figure."""
    from memfit.device.torch_private import disable_current_modes
    from memfit.memory.isolation import own_draw
    from memfit.memory.kernel_scratch import Ones, real_arguments
    threads = torch.get_num_threads()
    ones = Ones()                        # the arguments of kernels that write none: one buffer of ones
    own = Ones()                         # those kernels write: a group's apart, the next group's over them
    asked = list(dict.fromkeys(kernels))
    todo = [k for k in asked if (*k, threads, device) not in _SECONDS]
    now = clock(device)
    # every dispatch mode off (the fake one of a counting run, own_rng's): the real kernels
    with disable_current_modes(), torch.no_grad(), torch.autocast(device.type, enabled=False):
        while todo:
            group, size = [], 0
            while todo and (not group or size + _arguments_bytes(todo[0]) <= group_bytes):
                size += _arguments_bytes(todo[0])
                group.append(todo.pop(0))
            calls: dict[tuple, tuple] = {}       # kernel -> (the call, calls per sample, the warm-up's s a call)
            own.next_kernel()                   # the last group's written arguments are done with
            for key in group:
                func, spec, shapes = key
                try:
                    args, kwargs = real_arguments(spec, dict(shapes), device, ones=ones, func=func, own=own)
                    seeded = torch.Tag.nondeterministic_seeded in func.tags
                    call = (lambda f=func, a=args, k=kwargs: own_draw(f, a, k)) if seeded else \
                        (lambda f=func, a=args, k=kwargs: f(*a, **k))
                    t0 = now()
                    call()
                    first = max(now() - t0, 1e-7)
                except Exception:        # a kernel that needs real values (an index in range, a shape it checks)
                    _SECONDS[(*key, threads, device)] = None
                    continue
                if first > LONG:          # a long kernel: its first call is the figure (set-up is small beside it)
                    _SECONDS[(*key, threads, device)] = first
                else:
                    # a first call of at least a sample's length was the warm-up: one call a sample from there
                    calls[key] = (call, 1, first) if first >= SAMPLE else (call, *_warm_up(call, now))
            samples: dict[tuple, list] = {key: [] for key in calls}
            for r in range(SAMPLES):
                for key, (call, n, warm) in calls.items():
                    got = samples[key]
                    if r == 1 and max(warm, got[0]) <= STEADY * min(warm, got[0]):
                        got.append(warm)        # steady: the warm-up is the second sample
                        continue
                    t0 = now()
                    for _ in range(n):
                        call()
                    got.append(max((now() - t0) / n, 1e-9))
            for key, got in samples.items():
                _SECONDS[(*key, threads, device)] = min(got)
                _SPREAD[(*key, threads, device)] = max(got) / min(got)
            calls = None
    return {k: _SECONDS[(*k, threads, device)] for k in asked}


def unsteady(kernels: Iterable[tuple], device: torch.device) -> tuple[int, int]:
    """(kernels whose samples came out more than `UNSTEADY` times apart, kernels timed in samples) among those
    `kernel_seconds` timed at this thread count: many apart, the machine was busy while it timed them, and times
    predicted from them may be far off (two torch threads with the other core taken: the least of three samples
    priced micro-batch 2 of a CNN at 0.5-0.7x its plain step; it took 2.1x)."""
    threads = torch.get_num_threads()
    spreads = [_SPREAD[k] for k in {(*key, threads, device) for key in kernels} if k in _SPREAD]
    return sum(s > UNSTEADY for s in spreads), len(spreads)


def spec_bytes(spec, shapes: dict) -> int:
    """Bytes of the tensors among `spec`'s arguments (at `shapes` where given: argument index -> shape)."""
    return sum(math.prod(shapes.get(i, lf[1])) * lf[3].itemsize for i, lf in enumerate(spec.leaves)
               if isinstance(lf, tuple) and len(lf) == 4 and lf[0] == "t")


def _arguments_bytes(key: tuple) -> int:
    _, spec, shapes = key
    return spec_bytes(spec, dict(shapes))


def copy_rate(device: torch.device) -> float:
    """Bytes per second of a 32 MiB copy on `device` into memory already touched (bytes read and written), measured
    once and kept: past the caches, as the kernels it prices are (their arguments over `costs.CAP`). A clone that
    allocates its output page-faulted or not by what the process had freed before: 2.7-87 GB/s run to run on a
    2-core VM, where this copy gives 13-24."""
    key = ("copy", device, None)
    if key not in _RATES:
        with torch.no_grad():
            big = torch.ones(8 << 20, device=device)
            out = torch.empty_like(big).copy_(big)
            _RATES[key] = 2 * big.nbytes / timed(lambda: out.copy_(big), device)
    return _RATES[key]


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul (512 rows on the CPU, 2048 on CUDA) at `dtype`, measured once and kept: the
    rate of a kernel too large to time (past a few hundred rows a matmul runs near it)."""
    key = ("matmul", device, dtype)
    if key not in _RATES:
        k = 2048 if device.type == "cuda" else 512
        with torch.no_grad():
            a = torch.full((k, k), 0.5, device=device, dtype=dtype)
            _RATES[key] = 2 * k ** 3 / timed(lambda: a @ a, device)
    return _RATES[key]

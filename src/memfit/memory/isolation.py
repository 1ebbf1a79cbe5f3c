"""What a prediction leaves alone: the user's module (as every other thread sees it) and every random generator.

A memory model runs the user's code on fake tensors (`memfit.memory.fake_run`) or traces it with
`torch.export` (the planner's capture). Both swap the module's parameters for fake ones, which, done on the
user's module, every thread would see for the length of the run: a plain forward in another thread failed
(5,117 of 8,779 times during `max_batch_size(train=True)`). So the runs here work on a `structural_copy` (the
module tree copied shallowly, every tensor shared, nothing copied in memory) and never touch the user's module.
`predicting()` is around every prediction, plan and capture: its random ops (a dropout in a diagnosing run) draw
from generators of their own (`own_rng`, a dispatch mode of this thread, stepped aside in fake sections:
`fake_section`, and around real ops that cannot draw: `drawless_section`), so torch's CPU and CUDA generators are
neither advanced nor saved and restored (restoring them rewound what another thread drew meanwhile), and it runs one
prediction at a time in the process (torch's tracing machinery keeps global state).
`tracer_patches_this_thread_only()` is around `torch.export`: its fx tracer replaces `torch.nn.Module.__call__`
and `__getattr__` for the whole process while it traces, which would route another thread's plain forward of
any model into the trace. Both replacements of torch functions this needs (fx's patches, and AOT tracing's save and
restore of torch's generators, skipped inside `own_rng`) act in the predicting thread only and are put back when it
leaves (`memfit.device.torch_private.ScopedReplacement`).

Known limitations: a module reached only through a plain attribute (not a submodule, not in a dict or list
attribute) is shared with the user's, not copied; `evaluate` still puts the user's model in eval mode for its
loop (it runs the model itself).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    >>> c = structural_copy(model)
    >>> c[0] is model[0], c[0].weight is model[0].weight
    (False, True)
    >>> s = torch.get_rng_state()
    >>> with predicting():
    ...     _ = torch.rand(3)
    >>> torch.equal(s, torch.get_rng_state())
    True
"""

from __future__ import annotations

import copy
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from memfit.device.torch_private import (
    MODULE_DICTS,
    FakeTensor,
    FakeTensorMode,
    TorchDispatchMode,
    aot_rng_not_saved,
    current_dispatch_mode,
    op_schema,
    own_children,
    pop_mode_temporarily,
    tracer_patches_this_thread_only,
)

__all__ = ["drawless_section", "fake_section", "kept_rng", "own_draw", "own_rng", "predicting", "structural_copy",
           "traced_section", "tracer_patches_this_thread_only"]

# One prediction at a time in the process: torch.export's tracer and the fake-tensor runs keep global state
# (patched Module methods, gc switched off). Re-entrant: a prediction may capture, a capture may diagnose.
_ONE_AT_A_TIME = threading.RLock()


@contextmanager
def kept_rng() -> Iterator[None]:
    """Torch's CPU RNG and the RNG of every CUDA device are as found afterwards (CUDA's only when CUDA is
    initialised: reading them would initialise it). Saves and restores the global state: a draw another thread
    makes inside is rewound too, so predictions use `own_rng` instead."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


_DROPOUT = "native_dropout"       # draws, but takes no generator: replaced by what aten does, with one
_RANDOM: dict = {}                # aten op -> the overload to call with a generator, or None: it draws nothing


def _with_generator(func):
    """The overload of `func` that draws from a given generator: the one of its packet taking `func`'s arguments
    plus a `generator` (rand.default -> rand.generator, rand.out -> rand.generator_out, randint_like.low_dtype ->
    randint_like.low_generator_dtype), `func` itself when it takes one (bernoulli_, normal_, ...), `_DROPOUT` for
    native_dropout, None when it draws nothing. Worked out once per op: every op of a prediction passes here."""
    if func not in _RANDOM:
        names = [a.name for a in op_schema(func).arguments]
        found = None
        if func.overloadpacket is torch.ops.aten.native_dropout:
            found = _DROPOUT
        elif "generator" in names:
            found = func
        else:
            for name in func.overloadpacket.overloads():
                other = getattr(func.overloadpacket, name)
                taken = [a.name for a in op_schema(other).arguments]
                if "generator" in taken and [a for a in taken if a != "generator"] == names:
                    found = other
                    break
        _RANDOM[func] = found
    return _RANDOM[func]


class _OwnGenerators(TorchDispatchMode):
    """Every random op on real tensors in this thread draws from generators of its own (one per device, seeded
    0), never from torch's default ones: another thread's draws are neither taken nor rewound. Ops on fake
    tensors draw nothing and pass as they are. Dispatch modes are per thread."""

    def __init__(self):
        super().__init__()
        self.generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device) -> torch.Generator:
        device = torch.device(device)
        if device not in self.generators:
            self.generators[device] = torch.Generator(device).manual_seed(0)
        return self.generators[device]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        random = _with_generator(func)
        if random is None:                   # most ops: as they are
            return func(*args, **kwargs)
        tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
        if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors):
            return func(*args, **kwargs)     # fake and meta tensors draw nothing
        if random == _DROPOUT:
            x, p, train = args[0], args[1], (args[2] if len(args) > 2 else kwargs.get("train"))
            if not train or p == 0:
                return x.clone(), torch.ones_like(x, dtype=torch.bool)
            mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1 - p, generator=self._generator(x.device))
            return x * mask * (1.0 / (1 - p)), mask
        if kwargs.get("generator") is None:
            device = tensors[0].device if tensors else kwargs.get("device") or "cpu"
            kwargs = {**kwargs, "generator": self._generator(device)}
        return random(*args, **kwargs)


def own_draw(func, args, kwargs):
    """`func(*args, **kwargs)` on real tensors, a random op drawing from generators of its own (seeded 0, made for
    this call) as inside `own_rng`, without a dispatch mode around it: for timing a kernel alone."""
    return _OwnGenerators().__torch_dispatch__(func, (), args, kwargs)


_THIS_THREAD = threading.local()      # .own: this thread is inside own_rng


@contextmanager
def own_rng() -> Iterator[None]:
    """Inside, this thread's random ops draw from generators of their own (`_OwnGenerators`): torch's CPU and
    CUDA generators are neither advanced nor restored, so what any other thread draws is unchanged. torch.export's
    AOT tracing, which saves torch's generators and restores them afterwards (rewinding what other threads drew
    meanwhile), skips that in this thread only inside `traced_section`, around every tracer a prediction runs
    (`aot_rng_not_saved`; not here: it imports torch's AOT tracing, 1.6 s of a fresh process's first `memfit.fit`,
    which runs no tracer)."""
    if getattr(_THIS_THREAD, "own", False):   # nested (a prediction's fake run): the outer mode serves it; a
        yield                                 # second one would pass every op through Python once more
        return
    _THIS_THREAD.own = True
    try:
        with _OwnGenerators():
            yield
    finally:
        _THIS_THREAD.own = False


@contextmanager
def fake_section(mode: FakeTensorMode) -> Iterator[FakeTensorMode]:
    """`with mode:` for a section of a prediction that runs on fake tensors: own_rng's mode, when it is the
    innermost, steps aside until the section ends. Nothing inside can draw: under a FakeTensorMode a random op
    on real tensors runs on their fakes, and no random op is constant-folded (`nondeterministic_seeded`). The
    ops then pass through one Python dispatch mode, not two (own_rng made a training prediction a third
    slower)."""
    if not isinstance(current_dispatch_mode(), _OwnGenerators):
        with mode:
            yield mode
        return
    with pop_mode_temporarily(), mode:
        yield mode


@contextmanager
def traced_section() -> Iterator[None]:
    """Around a tracer that runs the user's code on fake tensors of its own (`torch.export`, its decompositions):
    own_rng's mode, when it is the innermost, steps aside until it ends. In it, a random op (a dropout in
    training mode, `torch.randn_like`) met tensors the mode took for real ones and was given own_rng's generator,
    which export then lifted into the graph as a constant it could not keep ("Custom object lifted_custom_0 is not
    in the constants dictionary"). Nothing a tracer runs draws: its tensors are fake. Inside a prediction
    (`own_rng`), AOT tracing neither saves nor restores torch's generators in this thread (`aot_rng_not_saved`)."""
    if not getattr(_THIS_THREAD, "own", False):
        yield
        return
    with aot_rng_not_saved():
        if not isinstance(current_dispatch_mode(), _OwnGenerators):
            yield
            return
        with pop_mode_temporarily():
            yield


@contextmanager
def drawless_section() -> Iterator[None]:
    """Around real ops that draw no random numbers (the planner's exactness checks of per-sample ops: a random op is
    never one, `planner.per_sample`): own_rng's mode, when it is the innermost, steps aside until it ends, so that
    each op skips a pass through Python (a fifth of those checks' time on ResNet-18's blocks)."""
    if not isinstance(current_dispatch_mode(), _OwnGenerators):
        yield
        return
    with pop_mode_temporarily():
        yield


@contextmanager
def predicting() -> Iterator[None]:
    """Around a prediction, plan or capture: one at a time in the process, its draws from generators of its own."""
    with _ONE_AT_A_TIME, own_rng():
        yield


def structural_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The module tree of `model` copied shallowly: a new object per module (a module registered twice stays
    one), with its own attribute dict, its own `_parameters`, `_buffers` and `_modules` dicts and its own copy of
    every dict or list attribute (a memo a forward fills, an LSTM's `_flat_weights`), all holding the same
    tensors. A method of a module of the tree kept in an attribute or a dict (a hook registered as
    `self._hook`) is bound to that module's copy. Swapping a parameter, setting `training` or an attribute on
    the copy changes nothing of `model`."""
    copies: dict[int, torch.nn.Module] = {}
    for m in model.modules():
        c = object.__new__(type(m))         # no __init__, no __setstate__: the attributes as they are
        c.__dict__.update({k: copy.copy(v) if isinstance(v, (dict, list)) else v for k, v in vars(m).items()})
        copies[id(m)] = c
    def rebound(v):          # a method of a module of the tree (a hook a module registered): the copy's
        own = copies.get(id(v.__self__)) if isinstance(v, types.MethodType) else None
        return types.MethodType(v.__func__, own) if own is not None else v

    for c in copies.values():
        children = own_children(c)
        for name, sub in children.items():
            if sub is not None:
                children[name] = copies[id(sub)]
        for k, v in vars(c).items():
            if isinstance(v, dict) and k not in MODULE_DICTS:
                v.update({key: rebound(f) for key, f in v.items() if isinstance(f, types.MethodType)})
            elif isinstance(v, types.MethodType):
                c.__dict__[k] = rebound(v)
    return copies[id(model)]

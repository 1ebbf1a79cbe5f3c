"""Activation checkpointing of chosen modules, only while a step runs: which modules are candidates
(`candidate_blocks`), and `checkpointed(model, names)`, which runs their forward under non-reentrant
`torch.utils.checkpoint` inside the `with` block and restores them after, even on error.

A checkpointed module keeps only its inputs for backward and runs its forward again there. Non-reentrant
checkpointing saves and restores the RNG state around the recomputation (`preserve_rng_state=True`), so dropout
draws the same masks as the plain step and the RNG ends where the plain step leaves it. On fake tensors (a memory
model's run of the step) nothing draws, so torch's save and restore of the global generator, which would rewind
what another thread drew meanwhile, is skipped there; the two generator states it takes (one kept until the
block's backward, one around the recomputation) are still taken, so the memory model counts their bytes. A
recomputed BatchNorm in training mode would update its running statistics a second time: the recomputation runs
with the module's buffers put back as they were after the first forward, so the step changes them exactly as a
plain step does.

Inside `checkpointed` only the thread that entered it checkpoints: another thread's forward of the same module
(or a memory model predicted there) runs plainly.

A transformers decoder with `use_cache=True` (the default of most) appends each block's keys and values to a cache
in its forward, and a recomputation would append them again (on a Llama: "The size of tensor a (32) must match the
size of tensor b (16)", or silently other attention where no mask stops it). Inside `checkpointed` the `use_cache`
of every transformers config in the model is False, and as it was after (`caches_off`); a checkpointed module
given a cache all the same (`use_cache=True` in the batch) is refused, naming `use_cache=False`.

Known limitations: a module whose forward mutates other state besides its buffers sees that mutation twice. A
real recomputation sets torch's global generator back to the forward's state and restores it after (torch's
`preserve_rng_state`, as every user of `torch.utils.checkpoint` gets): a random op another thread runs on the
global generator meanwhile draws repeated values and is rewound. Give such threads a `torch.Generator` of their
own.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()),
    ...                             torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    >>> candidate_blocks(model)
    ['0', '1']
    >>> with checkpointed(model, ["1"]):
    ...     "forward" in vars(model[1])
    True
    >>> "forward" in vars(model[1])
    False
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Iterator, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from memfit.device.torch_private import FakeTensor, tree_flatten

__all__ = ["caches_back", "caches_off", "candidate_blocks", "checkpointed", "install", "uninstall"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential)


def candidate_blocks(model: torch.nn.Module) -> list[str]:
    """Qualified names of the modules worth checkpointing, in forward order: the repeated blocks of a
    `ModuleList` or `Sequential` (children that hold submodules of their own, at least two in the container),
    the innermost where containers nest (a stage's layers rather than the stage); else the root's children that
    hold submodules. A leaf (one Linear, one Conv) is never a candidate: its input is saved anyway."""
    found: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, _CONTAINERS):
            continue
        kids = [(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]
        blocks = [(k, c) for k, c in kids if any(True for _ in c.children())]
        if len(blocks) >= 2:
            found += [k for k, _ in blocks]
    found = [b for b in dict.fromkeys(found) if not any(o.startswith(b + ".") for o in found)]
    if not found:
        found = [k for k, c in model.named_children() if any(True for _ in c.children())]
        found = found if len(found) >= 2 else []
    return found


class _BuffersKept:
    """Around a recomputation: the block's floating and counting buffers (BatchNorm's running statistics and
    batch count) put back afterwards as they were before it, so a module in training mode updates them once."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __enter__(self):
        self.saved = [(b, b.detach().clone()) for b in self.module.buffers()]
        return self

    def __exit__(self, *exc):
        with torch.no_grad():
            for b, v in self.saved:
                b.copy_(v)
        self.saved = []
        return False


class _StatesTaken:
    """On fake tensors, in place of `preserve_rng_state`: the generator states torch.utils.checkpoint takes,
    taken (a memory model's run logs `torch.get_rng_state`'s tensor) but never set back. One is taken when the
    contexts are made (as torch takes the forward's, kept with the recomputation until the block's backward) and
    one for the length of the recomputation (fork_rng's)."""

    def __init__(self):
        self.forward_state = torch.get_rng_state()

    def __enter__(self):
        self.around = torch.get_rng_state()
        return self

    def __exit__(self, *exc):
        self.around = None
        return False


def _context(module: torch.nn.Module, fake: bool):
    recompute = [_StatesTaken()] if fake else []         # made now: where torch takes the forward's state
    if any(True for _ in module.buffers()):
        recompute.append(_BuffersKept(module))
    return contextlib.nullcontext(), _Both(recompute)


class _Both(contextlib.ExitStack):
    """The recomputation's contexts, entered in order."""

    def __init__(self, contexts):
        super().__init__()
        self.contexts = contexts

    def __enter__(self):
        super().__enter__()
        for c in self.contexts:
            self.enter_context(c)
        return self


def _is_fake(module: torch.nn.Module, args, kwargs) -> bool:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tensors += [next(module.parameters(), None)]
    return any(isinstance(t, FakeTensor) for t in tensors)


# the names transformers' blocks take their key/value cache by (4.4x: past_key_value(s), layer_past; 5.x: cache)
_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def caches_off(model: torch.nn.Module) -> list[tuple[object, bool]]:
    """Set `use_cache` False on every transformers config of the model's modules that has it True (a config shared by
    several modules once); returns (config, value before) for `caches_back`."""
    changed, seen = [], set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen or getattr(cfg, "use_cache", None) is not True:
            continue
        seen.add(id(cfg))
        changed.append((cfg, cfg.use_cache))
        cfg.use_cache = False
    return changed


def caches_back(changed: list[tuple[object, bool]]) -> None:
    """Undo `caches_off`."""
    for cfg, value in reversed(changed):
        cfg.use_cache = value


def _refuse_cache(module: torch.nn.Module, kwargs: dict) -> None:
    given = next((k for k in _CACHE_ARGUMENTS if kwargs.get(k) is not None), None)
    if given is not None:
        raise ValueError(f"{type(module).__name__} is checkpointed and was given a key/value cache ({given}=...): "
                         "recomputing it in backward would append to the cache a second time (wrong attention, or "
                         "a shape error). Expected no cache in a training step: pass use_cache=False (leave "
                         "use_cache=True out of the batch), or leave this module out of the checkpointed ones")


def _checkpointed(cls_forward, owner: int | None, preserve_rng: bool = True):
    """The class's forward run under non-reentrant checkpointing (in thread `owner` only, the one running the
    step, unless None), as a function to bind to one module (its signature is the class forward's, for code that
    inspects it). Without `preserve_rng`, the global generator is never saved nor set back (for a step that draws
    nothing from it: fit's timed micro-steps)."""
    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        plain = functools.partial(cls_forward, self)
        # under no_grad nothing is saved: checkpointing has no use. Another thread (a memory model predicted there
        # on a structural copy, which keeps this method; a forward of its own) sees the module as it is without
        # the plan: such a prediction counted the checkpointed step, up to half the plain one's bytes
        if not torch.is_grad_enabled() or owner not in (None, threading.get_ident()):
            return plain(*args, **kwargs)
        _refuse_cache(self, kwargs)
        # on fake tensors nothing draws: the global generator is not set back (another thread's draws stay)
        fake = _is_fake(self, args, kwargs)
        return checkpoint(plain, *args, use_reentrant=False, preserve_rng_state=preserve_rng and not fake,
                          context_fn=functools.partial(_context, self, fake), **kwargs)
    return forward


def install(model: torch.nn.Module, names: Sequence[str], this_thread_only: bool = False,
            preserve_rng: bool = True) -> list[torch.nn.Module]:
    """Make the forward of each named module run under non-reentrant checkpointing (an instance attribute
    `forward` over the class's; with this_thread_only, in the calling thread only; `preserve_rng`: as
    `_checkpointed`); returns the modules changed, for `uninstall`. Refuses a module whose `forward` is already
    replaced on the instance (someone else's wrapper: ours would hide it)."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ValueError(f"no module named {missing[:3]} in {type(model).__name__}; expected qualified names as "
                         f"model.named_modules() gives them, e.g. {candidate_blocks(model)[:2] or ['0']}")
    changed = []
    try:
        for n in names:
            m = modules[n]
            if "forward" in vars(m):
                raise ValueError(f"module {n!r} ({type(m).__name__}) already has its forward replaced on the "
                                 "instance; memfit will not wrap another's wrapper. Remove it, or leave this module "
                                 "out of the checkpoint set")
            # a method of the module, not a closure over it: a structural copy of the model (a fake run's) binds
            # it to the copy, whose parameters are the fake ones
            owner = threading.get_ident() if this_thread_only else None
            m.forward = types.MethodType(_checkpointed(type(m).forward, owner, preserve_rng), m)
            changed.append(m)
    except BaseException:
        uninstall(changed)
        raise
    return changed


def uninstall(modules: Sequence[torch.nn.Module]) -> None:
    """Give each module back its class's forward."""
    for m in modules:
        vars(m).pop("forward", None)


@contextlib.contextmanager
def checkpointed(model: torch.nn.Module, names: Sequence[str], preserve_rng: bool = True) -> Iterator[torch.nn.Module]:
    """Inside the block, the named modules' forwards run under non-reentrant `torch.utils.checkpoint` in this
    thread (another thread's forward of them runs plainly), and transformers' key/value caches are off
    (`caches_off`); after it (also after an error) they are as they were."""
    changed = install(model, names, this_thread_only=True) if names else []
    caches = caches_off(model) if names else []
    try:
        yield model
    finally:
        caches_back(caches)
        uninstall(changed)

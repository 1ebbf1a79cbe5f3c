"""A function of torch replaced for the threads that ask for it only, and put back: `ScopedReplacement`.

memfit must change what a few torch functions do while it predicts (`memfit.device.torch_private` lists them: AOT
tracing's save and restore of torch's generators, fx's patches of `torch.nn.Module` while it traces, and
`torch.get_rng_state` while a fake run logs the states it makes). Python has no per-thread attribute, so the function
is replaced on its module or class, by one that looks at the calling thread: a thread inside `active()` gets memfit's
behaviour, every other thread torch's own function. It is installed while any thread is inside and put back when the
last one leaves (on an exception too). `ScopedContext` does the same for a context manager torch enters (an object,
not a function: DTensor's sharding lock).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["ScopedContext", "ScopedReplacement"]


class ScopedReplacement:
    """`owner.name` (a function of a module or a class of torch, or a method the class inherits) replaced while any
    thread is inside `active()`: a call from a thread inside it runs `inside(original, *args, **kwargs)`, a call
    from any other thread torch's own function. Reference-counted under a lock: installed by the first thread to
    enter, torch's put back (an inherited method uncovered) by the last to leave (on an exception too), unless
    something else replaced it meanwhile (theirs is kept; ours then calls torch's in every thread outside). Raises
    RuntimeError where torch no longer defines `owner.name`.

    Example:
        >>> r = ScopedReplacement(lambda: torch, "get_num_threads", lambda original: -1)
        >>> with r.active():
        ...     inside = torch.get_num_threads()
        >>> inside, torch.get_num_threads() > 0
        (-1, True)
    """

    def __init__(self, owner: Callable[[], object], name: str, inside: Callable):
        self._owner, self.name, self.inside = owner, name, inside
        self._lock = threading.Lock()
        self._here = threading.local()     # .depth: how many times this thread is inside
        self._users = 0                    # (thread, entry) pairs inside, every thread together
        self._installed = None             # (owner, torch's function, the replacement) while installed

    def _replacement(self, original: Callable) -> Callable:
        here, inside = self._here, self.inside

        @functools.wraps(original)
        def replaced(*args, **kwargs):
            if getattr(here, "depth", 0):
                return inside(original, *args, **kwargs)
            return original(*args, **kwargs)
        replaced._memfit_replaces = original
        return replaced

    @contextmanager
    def active(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                owner = self._owner()
                own = vars(owner).get(self.name)        # None: a class's method inherited from its base
                # ours left installed (another library saved it while we were in, and put it back after): the
                # function it wraps, or each call would run `inside` twice
                while own is not None and getattr(own, "_memfit_replaces", None) is not None:
                    own = own._memfit_replaces
                original = own if own is not None else getattr(owner, self.name, None)
                if original is None:
                    raise RuntimeError(
                        f"expected torch to define {getattr(owner, '__name__', owner)}.{self.name}, which memfit "
                        f"replaces in the thread that needs it; found none in torch {torch.__version__}: "
                        "memfit.device.torch_private needs updating for this torch")
                self._installed = (owner, own, self._replacement(original))
                setattr(owner, self.name, self._installed[2])
            self._users += 1
        self._here.depth = getattr(self._here, "depth", 0) + 1
        try:
            yield
        finally:
            self._here.depth -= 1
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    owner, own, replacement = self._installed
                    if vars(owner).get(self.name) is replacement:
                        if own is None:                 # inherited: uncovered again
                            delattr(owner, self.name)
                        else:
                            setattr(owner, self.name, own)
                    self._installed = None


class ScopedContext(ScopedReplacement):
    """`owner.name` a context manager torch enters (an object, not a function) replaced as `ScopedReplacement`
    replaces a function: a thread inside `active()` enters `inside(original)` where torch enters it, any other thread
    torch's own object.

    Example:
        >>> import contextlib, types
        >>> owner = types.SimpleNamespace(lock=contextlib.nullcontext("torch's"))
        >>> r = ScopedContext(lambda: owner, "lock", lambda original: contextlib.nullcontext("ours"))
        >>> with r.active(), owner.lock as inside:
        ...     pass
        >>> with owner.lock as after:
        ...     pass
        >>> inside, after
        ('ours', "torch's")
    """

    def _replacement(self, original) -> _PerThreadContext:
        return _PerThreadContext(original, self._here, self.inside)


class _PerThreadContext:
    """What `ScopedContext` installs: each `with` enters `inside(original)` in a thread inside, else `original`, and
    leaves what that thread entered (innermost first)."""

    def __init__(self, original, here: threading.local, inside: Callable):
        self._memfit_replaces, self._here, self._inside = original, here, inside
        self._entered = threading.local()          # .stack: the context managers this thread is in, innermost last

    def __enter__(self):
        cm = self._inside(self._memfit_replaces) if getattr(self._here, "depth", 0) else self._memfit_replaces
        value = cm.__enter__()
        self._entered.__dict__.setdefault("stack", []).append(cm)
        return value

    def __exit__(self, *exc):
        return self._entered.stack.pop().__exit__(*exc)

"""The values a fake run knows although its tensors have none (`KnownValues`), and transformers' questions on values
put to the run rather than skipped (`transformers_reads_values`).

A fake tensor has no values, so a question on one (`if (t == 0).all():`, `t.item()`) has no answer. But a tensor
the program makes from no input (`torch.arange(seq)`: transformers' `cache_position` and the `position_ids` a causal
LM makes from it) holds the same values in a fake run as in the real one, and so does what integer and bool ops make
of only such tensors. `KnownValues` keeps, beside each such fake tensor, a real CPU tensor with its values (its
shadow), computed for real from the shadows of the op's inputs, and answers a read of its values from the shadow.

transformers 5.x's `masking_utils` asks two such questions of every causal LM run without an attention mask: are the
position ids packed (`find_packed_sequence_indices`), and may the mask be left to SDPA's `is_causal`
(`_ignore_causal_mask_sdpa`). It skips them where `is_tracing(tensor)` says so, as it does for a fake tensor, and
then builds the mask, which the real eager run never builds: SDPA turns it to float in every layer and keeps it for
backward, 4*S^2 bytes per sample per layer (Llama, hidden 256, 4 layers, seq 256, batch 16: predicted 1.037x the
real peak; 1.15x at seq 1024). `transformers_reads_values` puts the questions to the run: answered from the shadows
(the model's own positions: not packed, no mask, as for real), or, on the user's batch, answered no, which keeps
the mask (`memfit.memory.storage_log.mask_check_answered_no`: exact for the padded batches a mask is for, an
upper bound otherwise, with a warning). Not for a `torch.compile`d model: under dynamo `is_tracing` is true and the
compiled step builds the mask, so its fake run leaves the questions unasked and the mask counts
(`StepSpec.compiled`).

A draw in [0, 1) (`torch.rand`) compared with a number outside that range answers alike for every draw: known
(transformers 4.x's LayerDrop, `if torch.rand([]) < self.layerdrop`, asked in training at layerdrop 0 too); not
once the draw was written (in place, through a view) or moved (`.data =`) since: its range is then unknown.

A value made from the batch size (`torch.arange(x.shape[0])`) is known in each run, but its answer at the sizes a
memory model runs says nothing of the others: each shadow keeps a digest of how it was made (`lineage`), and
`LoggingFakeMode` refuses a read whose digest differs from the same read in an earlier run of the prediction
(`DataDependentOnBatchSize`). `expand` keeps its input's digest: transformers 5 expands the positions to the batch
(not at batch 1) before asking `.all()`, which no copy of a row changes.

Known limitations: no shadow is kept for a floating-point tensor (its last bits may differ on another device's
kernels), a tensor of more than `KnownValues.MAX_ELEMENTS` elements (the shadow is real memory and real work), or
anything made by a random op, left unset (`empty_like`) or from the batch, the parameters or buffers; reading such a
value stays a question without an answer. An op that writes into a tensor with a shadow from inputs without one
drops the shadows on that storage and of the tensor itself; a tensor moved onto another storage (`set_`, or
`.data =`, which dispatches no op) is not known there. Not refused: a batch-size answer the sizes run cannot show,
as a sum over a known tensor `expand`ed to the batch, or a size the runs share (`torch.arange(x.shape[0] // 8)`
is empty at 1, 2 and 4), and two reads swapped between runs by the batch's shapes (refused where their digests
differ).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.weak import WeakIdKeyDictionary

from memfit.device.replacements import ScopedReplacement
from memfit.device.torch_private import (
    FakeTensor,
    disable_current_modes,
    op_schema,
    storage_key,
    version_counter,
)

__all__ = ["DataDependentOnBatchSize", "KnownValues", "READS_SCALARS", "reads_stood_in", "stand_in",
           "transformers_reads_values"]

_aten = torch.ops.aten
# ops whose values depend on their arguments only, none a tensor: a shadow is made for their output
MADE_FROM_NOTHING = frozenset({_aten.arange.default, _aten.arange.start, _aten.arange.start_step, _aten.full.default,
                               _aten.zeros.default, _aten.ones.default, _aten.scalar_tensor.default})
_EXPAND = _aten.expand.default
_MADE_FROM_NOTHING_IDS = frozenset(map(id, MADE_FROM_NOTHING))   # ids: an OpOverload's hash is 0.2 us of Python
# draws in [0, 1), and the comparisons with a number that decide the same for every such draw: transformers 4.x's
# LayerDrop, `if torch.rand([]) < self.layerdrop: skip the layer`, in training whatever the layerdrop (45 models of
# 4.46: BART, Whisper, wav2vec2...; 5.x draws only where layerdrop > 0). At layerdrop 0 nothing is skipped.
_UNIT_DRAWS = frozenset(map(id, (_aten.rand.default, _aten.rand_like.default)))
_BOUNDS = {id(_aten.lt.Scalar): lambda c: False if c <= 0 else True if c >= 1 else None,
           id(_aten.le.Scalar): lambda c: False if c < 0 else True if c >= 1 else None,
           id(_aten.gt.Scalar): lambda c: True if c < 0 else False if c >= 1 else None,
           id(_aten.ge.Scalar): lambda c: True if c <= 0 else False if c >= 1 else None}


class DataDependentOnBatchSize(RuntimeError):
    """A value read in a fake run is made from the batch size (`KnownValues.lineage` differs between the runs at two
    sizes): its answer at the sizes run says nothing of the others, so it is not answered."""


_PLAIN, _WRITES, _RANDOM = "plain", "writes", "random"    # kinds of ops (`KnownValues._kind`)


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    """The tensors among an op's arguments (`torch.cat`'s list included)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _on_cpu(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(a) for a in x)
    return torch.device("cpu") if isinstance(x, torch.device) else x


class KnownValues:
    """Real CPU copies (shadows) of the values of the small integer and bool fake tensors made from no input, and
    of what ops make of only such tensors, kept while the fake tensors live (`note` after each op, `value` to read).

    Example:
        >>> from memfit.device.torch_private import FakeTensorMode
        >>> known, mode = KnownValues(), FakeTensorMode()
        >>> with mode:
        ...     pos = torch.arange(4)
        ...     known.note(torch.ops.aten.arange.default, (4,), {}, pos)
        ...     last = pos[-1]
        ...     known.note(torch.ops.aten.select.int, (pos, 0, -1), {}, last)
        >>> known.value(last)
        tensor(3)
    """

    MAX_ELEMENTS = 1 << 20          # 8 MiB of int64 at most per shadow: a (batch, seq) position tensor up to 16 x 64Ki
    _KINDS: dict = {}               # id(op) -> `_kind(op)` (ops live as long as the process)

    def __init__(self):
        self._shadows = WeakIdKeyDictionary()        # fake tensor -> (its values, a real CPU tensor;
        #                                              `lineage`; its storage key)
        self._ids: set[int] = set()                  # id() of every tensor given a shadow (some since freed, their
        #                                              ids reused): a quick "not known" before the lookup above
        self._storages: set[int] = set()             # the storage keys of those tensors (as `_ids`)
        self._unit = WeakIdKeyDictionary()            # fake tensors drawn in [0, 1) (`_UNIT_DRAWS`) -> their
        #                                              (version, storage key) then: a write since (`r.mul_(2)`, through
        #                                              a view, `.data =`) leaves the range unknown

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The values of fake tensor `t` where they are known, else None."""
        known = self._known(t)
        return known[0] if known is not None else None

    def lineage(self, t: torch.Tensor) -> int | None:
        """A digest of how `t`'s known values were made (every op and every argument that is not a tensor, back to
        the tensors made from nothing), else None: equal in two runs only where the values are made alike, so a
        value made from the batch size (`torch.arange(x.shape[0])`) has another digest at another size."""
        known = self._known(t)
        return known[1] if known is not None else None

    def _known(self, t: torch.Tensor) -> tuple | None:
        """(values, lineage, storage key) of `t`, unless it has none or has been moved onto another storage since
        (`t.data = other` dispatches no op)."""
        known = self._shadows.get(t) if id(t) in self._ids else None
        return known if known is not None and storage_key(t.untyped_storage()) == known[2] else None

    def unknown(self, tensors) -> None:
        """The values of `tensors` are not the ones they hold here (the batch, built as zeros in the run): drop
        their shadows."""
        self._forget([t for t in tensors if isinstance(t, torch.Tensor)])

    def note(self, func, args, kwargs, out) -> None:
        """Op `func` ran on `args`, `kwargs` and gave `out`: keep the shadows of its outputs where their values are
        known (made from nothing, or from inputs that all have one), drop those it made stale."""
        if id(func) in _UNIT_DRAWS:
            drawn = _as_drawn(out)
            if drawn is not None:
                self._unit[out] = drawn
            return
        if self._unit and id(func) in _BOUNDS and args and isinstance(args[0], torch.Tensor) and args[0] in self._unit \
                and self._unit[args[0]] == _as_drawn(args[0]) \
                and isinstance(args[1], (int, float)) and (answer := _BOUNDS[id(func)](args[1])) is not None:
            # a comparison every draw in [0, 1) answers alike: known, made alike in every run
            with disable_current_modes():            # a real tensor, whatever mode the op runs under
                values = torch.full(tuple(out.shape), answer)
            self._keep(out, values, hash((id(func), "a draw in [0, 1)", args[1])))
            return
        if id(func) in _MADE_FROM_NOTHING_IDS:
            inputs, kind = None, _PLAIN
        else:
            ids = self._ids
            if not ids:                              # most ops of most runs: nothing known, nothing to look up
                return
            kind = self._KINDS.get(id(func)) or self._kind(func)
            first = args[0] if args else None
            if kind is _PLAIN and isinstance(first, torch.Tensor) and id(first) not in ids:
                return                               # most ops of the others: their first input is not known
            inputs = list(_tensors(args, kwargs))
            known = bool(inputs) and all(id(t) in ids and self._known(t) is not None for t in inputs)
            if kind is _RANDOM or not known:
                if kind is not _PLAIN:               # written from values not known: its shadows are stale
                    self._forget(inputs)
                return
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
                   and t.numel() <= self.MAX_ELEMENTS for t in outs):
            if kind is not _PLAIN and inputs:
                self._forget(inputs)
            return
        shadow = {id(t): self._known(t) for t in inputs or ()}  # id -> (values, digest, key), all known
        try:                                         # the op, its arguments, and the digests of its tensor inputs;
            # a broadcast is its input's: transformers 5 expands the positions to the batch (not at batch 1), then
            # asks a question no copy of a row changes (`.all()`)
            digest = shadow[id(args[0])][1] if func is _EXPAND else \
                hash((id(func), _digest_of(args, shadow), _digest_of(tuple(kwargs.items()), shadow)))
        except TypeError:                            # an argument without a hash: not known
            self._forget(inputs or [])
            return
        real_args = [shadow[id(a)][0] if isinstance(a, torch.Tensor) else
                     type(a)(shadow[id(t)][0] if isinstance(t, torch.Tensor) else t for t in a)
                     if isinstance(a, (list, tuple)) else _on_cpu(a) for a in args]
        real_kwargs = {k: shadow[id(v)][0] if isinstance(v, torch.Tensor) else _on_cpu(v) for k, v in kwargs.items()}
        try:
            with disable_current_modes():            # real compute, seen by no dispatch mode (no fake one)
                real = func(*real_args, **real_kwargs)   # an op that writes writes into its inputs' shadows
        except (RuntimeError, NotImplementedError, TypeError):   # no CPU kernel for it: its values stay unknown,
            self._forget(inputs or [])                           # a question on them unanswered, as without this
            return
        for t, r in zip(outs, real if isinstance(real, (tuple, list)) else (real,), strict=True):
            self._keep(t, r, digest)

    def _keep(self, t: torch.Tensor, values: torch.Tensor, digest: int) -> None:
        """`values` (real, on the CPU) as the shadow of fake tensor `t`, made as `digest` says."""
        key = storage_key(t.untyped_storage())
        self._shadows[t] = (values, digest, key)
        self._ids.add(id(t))
        self._storages.add(key)

    @classmethod
    def _kind(cls, func) -> str:
        """`_RANDOM` (draws, or leaves unset as `empty_like`: its values are not the real run's), `_WRITES` (into an
        argument), else `_PLAIN`."""
        kind = cls._KINDS.get(id(func))
        if kind is None:
            schema = op_schema(func)
            writes = schema is None or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
            unset = schema is not None and "empty" in schema.name      # empty_like: values never set, as random
            kind = cls._KINDS[id(func)] = _RANDOM if unset or torch.Tag.nondeterministic_seeded in getattr(
                func, "tags", ()) else _WRITES if writes else _PLAIN
        return kind

    def _forget(self, tensors: list[torch.Tensor]) -> None:
        """Drop the shadows of `tensors` and of every tensor on their storages (their views included). By identity
        too: `set_` has moved a tensor onto another storage by the time its op is noted."""
        for t in tensors:
            self._shadows.pop(t, None)
        keys = {storage_key(t.untyped_storage()) for t in tensors} & self._storages
        if keys:                                     # rare: an optimizer's writes meet none
            for t in [t for t in self._shadows.keys() if storage_key(t.untyped_storage()) in keys]:
                del self._shadows[t]


def _as_drawn(t: torch.Tensor) -> tuple | None:
    """(version, storage key) of a drawn tensor: both as at the draw only where nothing wrote it or moved it since;
    None for one without a version counter (an inference tensor), which stays unknown."""
    try:
        return version_counter(t), storage_key(t.untyped_storage())
    except RuntimeError:
        return None


def _digest_of(args, shadow: dict) -> tuple:
    """`args` with each tensor as the digest of its known values (`KnownValues.lineage`), lists as tuples: hashable."""
    return tuple(shadow[id(a)][1] if isinstance(a, torch.Tensor) else _digest_of(a, shadow)
                 if isinstance(a, (list, tuple)) else a for a in args)


def _fakes_are_not_tracing(is_tracing, tensor=None) -> bool:
    """transformers' `is_tracing(tensor)` without "a fake tensor is traced": dynamo, jit, fx and stream capture
    still count."""
    return is_tracing() if isinstance(tensor, FakeTensor) else is_tracing(tensor)


_IS_TRACING = ScopedReplacement(lambda: sys.modules["transformers.masking_utils"], "is_tracing",
                                _fakes_are_not_tracing)


@contextmanager
def transformers_reads_values() -> Iterator[None]:
    """Inside, on this thread only, transformers' `masking_utils` asks its questions on the values of fake tensors
    (see the module doc) rather than taking them as traced. Nothing where transformers' `masking_utils` is not
    imported (it is not imported here) or has no `is_tracing` (4.x decides without it)."""
    module = sys.modules.get("transformers.masking_utils")
    if module is None or not callable(vars(module).get("is_tracing")):
        yield
        return
    with _IS_TRACING.active():
        yield


def stand_in(t: torch.Tensor, answer: float = 1.0) -> bool | int | float | complex:
    """The answer to a value the optimizer's step reads that no fake run knows (`.item()`, `bool(t)` on a fake
    tensor): `answer` for a floating-point value (`READS_SCALARS`' for the optimizer), 1 for an integer, True for a
    bool. torch's Adafactor reads its step counter and each parameter's norm, ASGD its eta and mu, transformers'
    Adafactor compares each parameter's RMS with eps: scalars of the update (the memory models of those steps came
    out within the allocator's bytes with these answers: `tests/memory/test_value_reads.py`). Read in the forward or
    backward, a value can pick another path (mixture-of-experts routing sizes tensors by it): not stood in there;
    nor in the step of an optimizer not in `READS_SCALARS` (`reads_stood_in`)."""
    if t.dtype == torch.bool:
        return True
    return answer if t.dtype.is_floating_point else complex(answer) if t.dtype.is_complex else 1


# The optimizer steps (module, qualified name of `step`) whose every value read was read through, each with the
# answer its floating-point reads get: each scalar scales the update, except ASGD's `if mu.item() != 1:`, which
# copies a parameter (`param.sub(ax)`) where mu is not 1: 1 at a fresh optimizer's first steps, below 1 once t0
# steps have passed (ASGD(t0=0): steps 2 and 3 peaked 1.33x the first). Its reads answer 0.5, so the copy counts:
# never below a later step (above the first t0 steps' by that transient copy, one parameter's bytes). 1, not 0, for
# Adafactor: it divides by the square root of its step. Any other step is refused where it reads a value, as
# before stand-ins: a guard that skips a parameter whose gradient holds a NaN or an inf (`if torch.isnan(g).any():
# continue`) is answered True, and its memory model held no state for any parameter: 0.53-0.56x the allocator's
# bytes (`tests/memory/test_value_reads.py`).
def _step_of(cls) -> tuple[str | None, str | None]:
    """(module, qualified name) of a class's `step`, under its decorators."""
    step = inspect.unwrap(cls.step)
    return getattr(step, "__module__", None), getattr(step, "__qualname__", None)


# torch's read off its classes (no module path of torch's written here); transformers' by name (not imported here)
READS_SCALARS = {_step_of(torch.optim.Adafactor): 1.0, _step_of(torch.optim.ASGD): 0.5,
                 ("transformers.optimization", "Adafactor.step"): 1.0}


def reads_stood_in(optimizer) -> float | None:
    """The answer a value the step of `optimizer` reads gets (`stand_in`), where its class's `step` (a subclass that
    does not override it included) is one of `READS_SCALARS`; None where none is stood in."""
    return READS_SCALARS.get(_step_of(type(optimizer))) if optimizer is not None else None

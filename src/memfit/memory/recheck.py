"""An APPROXIMATE step model's bytes at one batch size, from a fake run at that size itself (`exact_total`).

A step model fits fake runs at a few small batch sizes (1 to 16, `memfit.memory.fit_ladder`). Where those runs are
neither affine nor quadratic in the batch, its line is an estimate beyond them and can be far below the real step:
a loss whose memory grows as n^3 was predicted 1.75 MB at batch 300 where the real step peaks at 325 MB, and
`max_batch_size` answered 11,513 for 64 MiB. A fake run costs the same at any batch size, so the answer is checked
by a run at it (`memfit.sizing.max_batch_size`).

`Recheck` keeps what such a run needs, weakly: the model, its loss function and optimizer are the user's, and a
memory model kept per model (`memfit.memory.cache.ModelCache`) must not keep them alive; the example batches are
kept as shapes. Where any of them is gone (or cannot be referenced weakly: a builtin function), no run is made and
the estimate stands, as its warning says; a caller holding them binds them for its call (`Recheck.bound`).
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable

import torch

from memfit.device.torch_private import tree_map
from memfit.memory.fake_run import COLUMN, StepSpec, _Run, fake_run
from memfit.memory.fit import with_step
from memfit.memory.isolation import predicting
from memfit.memory.kernel_scratch import scratch_ops
from memfit.memory.step import ExampleBatch
from memfit.memory.storage_log import LoggingFakeMode

__all__ = ["Recheck", "exact_at", "exact_total", "run_scratch"]


def run_scratch(run: _Run, n: int, other: _Run | None, m: int | None) -> list:
    """The ops of `run` (at batch n) whose scratch is measured at each size asked about, in the kind of memory of
    their phase (`memfit.memory.kernel_scratch.scratch_ops`; which dimensions carry the batch read off `other`)."""
    ends = run.phase_ends

    def column(row: int) -> int:
        if row < ends.get("forward", len(run.ops)):
            return COLUMN["activations"]
        return COLUMN["backward transient" if row < ends.get("backward", len(run.ops)) else "step transient"]
    return scratch_ops(run, n, other, m, column)


def _gone() -> None:
    return None


def _weak(obj) -> Callable[[], object] | None:
    """A weak reference to `obj` (None for None; one that is always gone where `obj` cannot have one, a builtin
    function: `Recheck.bound` can still give it)."""
    if obj is None:
        return None
    try:
        return weakref.WeakMethod(obj) if inspect.ismethod(obj) else weakref.ref(obj)
    except TypeError:
        return _gone


def _shapes(batch: ExampleBatch | None) -> ExampleBatch | None:
    meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t      # noqa: E731
    return None if batch is None else dataclasses.replace(batch, template=tree_map(meta, batch.template))


@dataclasses.dataclass(eq=False)
class Recheck:
    """What a fake run of a step model's step at another batch size needs (see the module docstring)."""
    spec: StepSpec                                # the model, loss and optimizer left out; batches as shapes
    model: Callable[[], torch.nn.Module | None]
    loss_fn: Callable[[], object] | None
    optimizer: Callable[[], object] | None
    four: _Run                                    # the run at 4, whose optimizer step the others get put in

    @classmethod
    def of(cls, spec: StepSpec, four: _Run) -> Recheck:
        rest = dataclasses.replace(spec, model=None, loss_fn=None, optimizer=None, batch=_shapes(spec.batch),
                                   target=_shapes(spec.target))
        return cls(rest, _weak(spec.model), _weak(spec.loss_fn), _weak(spec.optimizer), four)

    def bound(self, loss_fn, optimizer) -> Recheck:
        """The same with the loss and optimizer the caller holds now, referenced strongly (a caller that made the
        loss a wrapper of its own, which nothing else keeps: `memfit.memory.micro_batch`). Use it within the call,
        not kept."""
        return dataclasses.replace(self, loss_fn=None if loss_fn is None else lambda: loss_fn,
                                   optimizer=None if optimizer is None else lambda: optimizer)

    def run(self, n: int) -> _Run | None:
        """The step's fake run at batch n (None where the model, its loss or optimizer is gone, or the step cannot
        run at n)."""
        got = [None if r is None else r() for r in (self.model, self.loss_fn, self.optimizer)]
        if any(r is not None and g is None for r, g in zip((self.model, self.loss_fn, self.optimizer), got,
                                                          strict=True)):
            return None
        spec = dataclasses.replace(self.spec, model=got[0], loss_fn=got[1], optimizer=got[2])
        once = spec.train and spec.optimizer is not None      # the optimizer step ran at batch 4 only
        try:
            with predicting():
                r = fake_run(spec, n, mode=LoggingFakeMode(allow_non_fake_inputs=True), fakes={},
                             optimizer_step=not once)
        except Exception:     # noqa: BLE001 -- a size the step cannot run at (BatchNorm at 1): the estimate stands
            return None
        return with_step(r, self.four) if once else r


def exact_at(mm, n: int):
    """`mm` (a `StepMemoryModel` with a `Recheck`) with a fake run at n as its own exact run there: its
    `total_bytes(n)` and `breakdown(n, phases=...)` are that run's; None where no run can be made."""
    recheck = mm._recheck
    r = recheck.run(n) if recheck is not None else None
    if r is None:
        return None
    scratch = {}
    if mm._scratch:
        scratch = {**mm._scratch, n: mm._scratch[4] if r.ops == recheck.four.ops else
                   [s for s in run_scratch(r, n, None, None) if s.row < r.phase_ends.get("backward", len(r.ops))]}
    return dataclasses.replace(mm, _measured={**mm._measured, n: r.live},
                               _measured_ends={**mm._measured_ends, n: r.phase_ends}, _scratch=scratch,
                               _scratch_at={}, _grads_probed={**mm._grads_probed, n: r.grad_bytes}, _recheck=None)


def exact_total(mm, n: int) -> int | None:
    """`mm.total_bytes(n)` from a fake run at n itself (`exact_at`), or None where no run can be made."""
    exact = exact_at(mm, n)
    return None if exact is None else exact.total_bytes(n)

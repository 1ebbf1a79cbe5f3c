"""`memfit.fit`: choose a training step's micro-batch and activation checkpointing together, from bytes, before
running anything; `FitPlan` holds the choice, says why, and runs steps with it.

The alternatives are every micro-batch 1, 2, 4, ..., N crossed with checkpointing 0, 1/4, 1/2, 3/4 or all of the
candidate blocks (`memfit.fitting.checkpointing.candidate_blocks`, ranked by the activation bytes their forward
writes per second of recomputation; blocks within 1.25x of each other in forward order) and, with
`levers=("bf16",)`, bf16 autocast. Bytes come from the fake-tensor memory model of `accumulate`'s step with those
modules checkpointed (`training_peak`, which counts what `torch.utils.checkpoint` saves and recomputes); time from
the step's ops counted on fake tensors and their kernels timed for real on ones of their shapes
(`memfit.fitting.costs`, `memfit.fitting.timing`). The search (`memfit.fitting.search`) takes the fastest
alternative that fits and computes a checkpoint set's bytes only when it needs them. Plans are kept per model
(dropped when the model changes, as memory models are).

Example:
    >>> import torch, memfit
    >>> torch.manual_seed(0) and None
    >>> blocks = [torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    ...           for _ in range(4)]
    >>> model = torch.nn.Sequential(*blocks)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> batch = (torch.randn(32, 16), torch.randn(32, 16))
    >>> plan = memfit.fit(model, opt, batch, torch.nn.functional.mse_loss, budget="1MiB")
    >>> plan.micro_batch, plan.checkpoint
    (32, ())
    >>> plan.step(batch).n
    32
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from memfit.accumulation.checks import batch_size as _batch_size
from memfit.accumulation.checks import check_distributed as _check_distributed
from memfit.accumulation.checks import check_grad_enabled, check_optimizer_holds
from memfit.accumulation.result import StepResult
from memfit.accumulation.run import Walked, run_step
from memfit.batches import plain_batch
from memfit.budget import BudgetExceeded, format_bytes, model_device
from memfit.device.torch_private import tree_flatten
from memfit.fitting.checkpointing import candidate_blocks, checkpointed
from memfit.fitting.finder import LEVERS, TIE, Peaks, _name, prediction
from memfit.fitting.finder import agree as _agree
from memfit.fitting.finder import find as _search
from memfit.fitting.layout import (
    ModelChanged,
    apart,
    batch_shapes,
    first_sample,
    grown,
    held,
    held_error,
    layout,
    layout_error,
    optimizer_options,
    targets_at,
)
from memfit.fitting.search import Alternative, Setting
from memfit.memory.cache import ModelCache
from memfit.memory.cuda_target import device_budget
from memfit.memory.micro_batch import _signature
from memfit.own_loss import is_own, label_terms, model_loss, own_batch

__all__ = ["FitPlan", "fit"]

_PLANS = ModelCache()     # model -> {key: _Found}, dropped when the model changes
_STEPPING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its _Stepping (any plan's steps)


class _Stepping:
    """One model's steps one at a time: two threads stepping one model and optimizer at once mixed their
    gradients (weights 7e-3 off every serial order), and one saw the other's checkpointing wrapper as a change."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owner: int | None = None        # the thread running a step now


@dataclass
class FitPlan:
    """How one training step on a batch fits a budget: `micro_batch`, `checkpoint` (qualified names of the
    modules whose forward runs under non-reentrant `torch.utils.checkpoint`, empty when none), `autocast` (None,
    or torch.bfloat16 when `levers=("bf16",)` allowed it and it was chosen), `peak_bytes` (the predicted peak
    of the step), `relative_time` (step time over the plain step's: the whole batch at once, nothing
    checkpointed; measured where both were timed for real, else predicted: `explain()` says which). `step(batch)`
    runs one optimizer step with the plan; `explain()` lists the alternatives and why this one won."""
    micro_batch: int
    checkpoint: tuple[str, ...]
    autocast: torch.dtype | None
    peak_bytes: int
    relative_time: float
    budget: int
    n: int
    reason: str
    alternatives: list[Alternative] = field(repr=False)
    candidates: list[str] = field(repr=False)
    how_bytes: str = field(repr=False, default="")
    how_time: str = field(repr=False, default="")
    seconds: float = field(repr=False, default=0.0)
    device: torch.device | None = None     # the device the bytes are for (another than the model's: predicted)
    _run: Callable = field(repr=False, default=None)
    _module: torch.nn.Module = field(repr=False, default=None)
    _installed: list = field(repr=False, default_factory=list)
    _terms: bool = field(repr=False, default=False)          # fit was given terms= (a loss over terms, not samples)
    _own: object = field(repr=False, default=None)           # the model's own loss: the first sample of x (a probe)
    _marked: tuple | None = field(repr=False, default=None)   # (module, its accepts_loss_kwargs before the Trainer)
    _caches: list = field(repr=False, default_factory=list)   # transformers' use_cache turned off for the Trainer
    _layout: tuple | None = field(repr=False, default=None)   # the planned batch's (fitting.layout.layout)
    _held: tuple | None = field(repr=False, default=None)     # the model and optimizer as planned (layout.held)
    _walked: tuple | None = field(repr=False, default=None)   # (the _held state it is for, accumulation's Walked)
    _quiet: tuple | None = field(repr=False, default=None)    # batch shapes a step ran on and left the model as it was
    _stepping: _Stepping | None = field(repr=False, default=None)    # the model's, looked up at the first step

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on the batch the plan was made for."""
        return math.ceil(self.n / self.micro_batch)

    def step(self, batch) -> StepResult:
        """One optimizer step on `batch` (x, y) with this plan: `memfit.accumulate` in micro-batches of
        `micro_batch` (the full-batch gradient, an uneven last micro-batch weighted right, `terms=` and
        `distributed=` as given to `fit`), the modules in `checkpoint` checkpointed only while it runs, under
        bf16 autocast when the plan says so. The previous step's gradients are let go as it begins, as
        `optimizer.zero_grad()` does (kept to give back on a failed step with `fit(restore_grads=True)`). Returns
        accumulate's `StepResult`. A batch larger than the plan's
        in any dimension, or of other dtypes, raises ValueError, as does a model or optimizer changed since `fit`
        (a parameter unfrozen, a module replaced, parameter groups added: `memfit.fitting.layout`); call
        `memfit.fit` again then. What the model's own forward sets is not a change: each step is checked
        against the model as the last checked step left it; once a step on batches of some shapes changed
        nothing, steps on those shapes are checked before they run only, so a forward that changes its model
        only on some steps of one batch shape is refused (the error says so). Steps on one model from several
        threads run one after the other (the weights are those of one serial order); a step called from inside a
        step of the same model (its loss_fn, a hook) raises RuntimeError."""
        stepping = self._stepping
        if stepping is None:         # dict.setdefault: one per model, for every plan of it
            stepping = self._stepping = _STEPPING.setdefault(self._module, _Stepping())
        if stepping.owner == threading.get_ident():
            raise RuntimeError("plan.step was called inside a step of the same model (from its loss_fn, a hook or "
                               "its forward): one optimizer step at a time; call it after the step returns")
        with stepping.lock:
            stepping.owner = threading.get_ident()
            try:
                return self._run(batch, self)
            finally:
                stepping.owner = None

    def trainer_arguments(self, args):
        """transformers' `TrainingArguments` that train with this plan (per-device batch, gradient accumulation
        keeping the effective batch) and the plan's layers checkpointed on the model: see
        `memfit.fitting.trainer.trainer_arguments`."""
        from memfit.fitting.trainer import trainer_arguments
        return trainer_arguments(self, args)

    def explain(self) -> str:
        """The choice, why, how bytes and time were predicted, and every alternative considered."""
        sets = sorted({a.setting for a in self.alternatives}, key=lambda s: (s.autocast or "", len(s.checkpoint)))
        lines = [f"fit: one optimizer step on {self.n} samples within {format_bytes(self.budget)}"
                 + (f" on {self.device.type}" if self.device is not None and self.device.type == "cuda" else "")
                 + ": micro-batch "
                 f"{self.micro_batch} ({self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}), "
                 f"{len(self.checkpoint)} of {len(self.candidates)} candidate blocks checkpointed"
                 + (f" ({', '.join(self.checkpoint)})" if self.checkpoint else "")
                 + (f", {str(self.autocast).removeprefix('torch.')} autocast (asked for by levers=)"
                    if self.autocast else "")
                 + f"; predicted peak {format_bytes(self.peak_bytes)}, {self._time_source()} time "
                 f"{self.relative_time:.2f}x the plain step.",
                 f"why: {self.reason}.",
                 f"bytes: {self.how_bytes}.",
                 f"time: {self.how_time}.",
                 f"candidate blocks (ranked: activation bytes written per second of recomputation, those within "
                 f"{TIE:g}x of each other in forward order, the timings' noise): "
                 f"{', '.join(self.candidates) if self.candidates else 'none (no repeated blocks found)'}.",
                 f"checkpoint sets tried: {'; '.join(s.describe(len(self.candidates)) for s in sets)}.",
                 f"search: {self.seconds:.2f} s. Alternatives, fastest first (bytes not computed where a faster one "
                 "fits and they would need a memory model no faster alternative needed; exhaustive=True computes "
                 "them):",
                 f"  {'micro-batch':>11} {'checkpointed':>12} {'autocast':>9} {'predicted':>12} {'time':>6} "
                 f"{'measured':>10}  fits"]
        for a in self.alternatives:
            fits = {True: "yes", False: "no", None: "-"}[a.fits(self.budget)]
            mark = "  <- chosen" if (a.micro_batch, a.setting) == (self.micro_batch, self._setting()) else ""
            measured = f"{a.measured:.3g} s" if a.measured is not None else "-"
            lines.append(f"  {a.micro_batch:>11} {len(a.setting.checkpoint):>12} {a.setting.autocast or '-':>9} "
                         f"{format_bytes(a.bytes) if a.bytes is not None else '-':>12} {a.time:>5.2f}x "
                         f"{measured:>10}  {fits}{mark}")
        return "\n".join(lines)

    def _time_source(self) -> str:
        """'measured' where the plan and the plain step were both timed for real, else 'predicted'."""
        timed = {(a.micro_batch, a.setting) for a in self.alternatives if a.measured is not None}
        return "measured" if {(self.micro_batch, self._setting()), (self.n, Setting())} <= timed else "predicted"

    def _setting(self) -> Setting:
        return Setting(self.checkpoint, str(self.autocast).removeprefix("torch.") if self.autocast else None)

    def __str__(self) -> str:
        return self.explain().splitlines()[0]


def _check_levers(levers) -> tuple[str, ...]:
    levers = tuple(levers)
    unknown = [v for v in levers if v not in LEVERS]
    if unknown:
        raise ValueError(f"unknown lever(s) {unknown}; expected a subset of {sorted(LEVERS)} (levers that change "
                         "numerics are used only when named)")
    return levers


def _key(model, optimizer, x, n, budget, levers, candidates, loss_fn, terms, allow, world) -> tuple:
    from memfit.memory.step import forward_state
    from memfit.memory.step_model import _callable_key
    groups = optimizer_options(optimizer)         # a schedule moving lr keeps the plan: its bytes are the same
    # the DDP wrapper's bucket layout: with gradient_as_bucket_view=False the buckets are a second copy of the
    # gradients (`memory.micro_batch`); plans are kept per inner module, which several wrappings may share
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    buckets = model.gradient_as_bucket_view if ddp else None
    return (id(optimizer), type(optimizer).__name__, groups, _signature(x), n, budget, levers, tuple(candidates),
            _callable_key(loss_fn), terms is None, allow, world, buckets, forward_state(), torch.get_num_threads())


def _cast_loss(loss_fn: Callable) -> Callable:
    """loss_fn, then autocast's cached weight casts dropped, as when the autocast around a forward ends: the
    memory model counts them until the loss (`memfit.memory.step.forward_autocast`); an autocast around the whole
    accumulation would keep them through every backward."""
    def loss(out, y):
        value = loss_fn(out, y)
        torch.clear_autocast_cache()
        return value
    return loss


def fit(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn: Callable | str | None,
        budget: int | str | None = None, *,
        target=None, levers: Sequence[str] = (), candidates: Sequence[str] | None = None,
        terms: Callable | None = None, distributed: bool = False, allow_batch_dependent: bool = False,
        exhaustive: bool = False, restore_grads: bool = False, device=None, gpu=None,
        device_memory: int | str | None = None) -> FitPlan:
    """Choose the micro-batch and the modules to checkpoint that make one training step on `batch` fit `budget`
    fastest; returns a `FitPlan`. The model does not run for real: its step runs on fake tensors, and each
    distinct kernel of that step is timed on ones of its shapes (one kernel's arguments at a time).

    Args:
        model: the module (DistributedDataParallel when `distributed`), as for `memfit.accumulate`.
        optimizer: the optimizer `plan.step` steps (its state is counted, as once it has stepped).
        batch: (x, y), as for `accumulate`; or, with `target=` or a common loss, the inputs x alone. The plan
            is for batches of this size and layout; only shapes and dtypes are read.
        loss_fn: loss_fn(output, y) -> the mean loss (or one per sample). None or "model": the model's own loss
            (`out.loss`, transformers models), with `batch` the inputs alone holding their labels (`x["labels"]`),
            weighted as `accumulate` does (`memfit.own_loss`).
        budget: bytes or a size such as "8GiB" that the step's peak must fit (on CUDA: the caching allocator's
            reserved bytes and the fixed costs outside it, `memfit.memory.cuda_step`); with `device_memory`, default
            all of it.
        target: with `batch` the inputs alone, the targets' layout, as for `memory_model`: an example target
            batch (its leading dimension is the batch, rebuilt at the batch's size) or one target's sample shape
            (float targets). None with the inputs alone and a common loss (cross-entropy, NLL, MSE, L1, smooth
            L1, BCE with logits): built from the model's output (`explain()` says which was assumed).
        levers: opt-in levers that change numerics: ("bf16",) lets the plan run forward and loss under bf16
            autocast (the plan says so); none by default.
        candidates: the modules that may be checkpointed (qualified names); default `candidate_blocks(model)`.
        terms, distributed, allow_batch_dependent: as for `accumulate` (with BatchNorm in training mode and no
            opt-in, only the whole batch is considered: checkpointing alone must make it fit). Distributed, every
            rank plans for the most samples any rank holds, and takes the same plan.
        exhaustive: compute the bytes of every alternative (for `explain()` and plots), not only those needed.
        restore_grads: `plan.step` gives `.grad` back as it was when it takes no step (a loss that is not finite,
            an error), as `accumulate(restore_grads=True)`; the plan then counts the gradients held on entry,
            which stay referenced through the micro-batches. By default they are let go when a step begins, as
            `optimizer.zero_grad()` does: a loop with or without `zero_grad` gets the same plan.
        device, gpu, device_memory: plan for a CUDA device from a machine without it (device="cuda"; the model stays
            where it is): the bytes are the CUDA step's predicted here (`memfit.memory_model(device="cuda")`, the
            batch taken to be on the device), `gpu` the GPU whose stated fixed costs apply (a name such as "H100",
            a compute capability, or its memory), `device_memory` the GPU's memory (the budget when none is given).
            Its kernels cannot be timed here: the times are predicted from this machine's kernels and no alternative
            is timed for real (`explain()` says so); use the plan's micro_batch and checkpoint on that device, or
            call `fit` again there. `plan.step` runs where the model is.

    Returns:
        FitPlan: micro_batch, checkpoint, peak_bytes, relative_time, explain(), step(batch).

    Raises:
        BudgetExceeded: no alternative fits; the message has the breakdown (parameters, gradients, optimizer
            state, the rest) and what would fit.
    """
    batch = plain_batch(batch)       # a tokenizer's BatchEncoding: the dict it holds
    own = is_own(loss_fn)
    if own:                   # the model's own loss: the inputs alone, their labels inside; nothing to build a y for
        if target is not None:
            raise ValueError("memfit.fit: target= gives the layout of targets beside the inputs; loss_fn=None (or "
                             "'model') takes the model's own loss from the labels inside x: leave target= out")
        batch, loss_fn = own_batch(batch, "memfit.fit"), model_loss
    pair = isinstance(batch, (tuple, list)) and len(batch) == 2 and target is None     # (x, y)
    budget, gpu = device_budget("memfit.fit", budget, device, device_memory, gpu)
    check_grad_enabled("memfit.fit plans")      # its fake runs' backward would fail, saying nothing of why
    levers = _check_levers(levers)
    world = _check_distributed(model, distributed)
    module = model.module if distributed else model
    predict = prediction(module, device, gpu, distributed)
    check_optimizer_holds(list(module.parameters()), optimizer)
    x, y = batch if pair else (batch, None)
    note = ""
    if not pair:
        if not isinstance(batch, (torch.Tensor, tuple, list, dict)):
            raise TypeError(f"batch must be (x, y), or the inputs x with target= or a common loss; found "
                            f"{type(batch).__name__}")
        from memfit.batches import batch_len
        y, note = targets_at(module, x, batch_len(x), loss_fn, target)
    x, y = apart(x, y)          # a tensor given twice counted as two: the batches stepped later often hold two
    n = _batch_size(x, y)
    if world > 1:     # ranks holding fewer samples plan for the most any holds: the same alternatives on all
        from memfit.distributed import agree
        most = max(v[0] for v in agree(None, "memfit.fit batch sizes", (n,)))
        x, y, n = grown(x, most), grown(y, most), most
    blocks = candidate_blocks(module) if candidates is None else list(candidates)
    known = dict(module.named_modules())
    if any(c not in known for c in blocks):
        raise ValueError(f"candidates {[c for c in blocks if c not in known][:3]} are not modules of "
                         f"{type(module).__name__}; expected names from model.named_modules()")
    key = (*_key(model, optimizer, x, n, budget, levers, blocks, loss_fn, terms, allow_batch_dependent, world),
           _signature(y), note, restore_grads, tuple(map(str, predict.values())))
    kept = _PLANS.values(module)
    found, error = kept.get(key), None
    if found is None or (exhaustive and any(a.bytes is None for a in found.alternatives)):
        # torch's generators are neither drawn from nor saved and restored (which would rewind another thread's
        # draws): the fake runs and the cost counts run under `predicting` (generators of their own), the
        # machine's timing chain makes its weights under `own_rng`, a timed random kernel draws from its own
        try:
            found = kept[key] = _search(model, module, optimizer, loss_fn, x, y, n, budget, levers, blocks,
                                        allow_batch_dependent, exhaustive, entry_grads=restore_grads,
                                        predict=predict)
        except Exception as e:
            if world == 1:
                raise
            error = e
    if world > 1:
        # every call, kept plan or not: a rank whose search failed stops every rank (none waits in the gather),
        # then the ranks take one plan
        from memfit.distributed import agree
        agree(error, "memfit.fit search")
        found = _agree(found, world)
        if found.best.bytes is None:     # another rank's slower choice: this rank's search did not need its bytes
            peaks = Peaks(model, module, optimizer, loss_fn, x, y, found.best.setting, restore_grads, predict)
            found.best.bytes = peaks(found.best.micro_batch)
        error = None if found.best.bytes <= budget else BudgetExceeded(
            f"memfit.fit: the plan the ranks agreed on (micro-batch {found.best.micro_batch}, "
            f"{len(found.best.setting.checkpoint)} blocks checkpointed) needs {format_bytes(found.best.bytes)} on this "
            f"rank > its budget {format_bytes(budget)}; give every rank the same budget and batches of one layout",
            found.best.bytes, budget)
        agree(error, "memfit.fit agreed plan")     # every rank raises when the agreed plan misses one's budget
    best = found.best
    dtype = next((LEVERS[v] for v in levers if _name(LEVERS[v]) == best.setting.autocast), None)

    def run(step_batch, plan: FitPlan) -> StepResult:
        # its bytes are the planned batch's and model's: a batch larger in any dimension, a parameter unfrozen
        # since, could exceed the budget (every rank says)
        # the model as the last step left it (`State.holds`, no new fingerprint): its parameters and batch-dependent
        # modules as they were then too (`Walked`: two walks of every module a step fewer)
        step_batch = plain_batch(step_batch)
        unchanged = plan._held is not None and plan._held[0].holds(module)
        error = None if plan._held is None else held_error(plan._held, module, optimizer, unchanged)
        if isinstance(error, ModelChanged) and plan._quiet is not None:
            error = ModelChanged(f"{error}. (The last steps ran on batches of the shapes of one that changed nothing "
                                 "and were not checked after they ran: a forward that changes its own model only on "
                                 "some steps of one batch shape is taken for a change by the caller; make that change "
                                 "outside forward, or on every step, or call memfit.fit again after it)")
        step_terms = terms
        if own:
            step_batch = own_batch(step_batch, "plan.step")
            step_terms = terms if terms is not None else label_terms(module, step_batch[0])
        pair_given = isinstance(step_batch, (tuple, list)) and len(step_batch) == 2
        # the parameters and batch-dependent modules as the last step found them, where the model is as it left it
        walked = plan._walked[1] if unchanged and plan._walked is not None and plan._walked[0] is plan._held[0] \
            else None
        device = walked.params[0].device if walked is not None and walked.params else model_device(module)
        # the batch flattened once: for its layout and for its shapes, which tell whether to check after the step
        flat = tree_flatten(tuple(step_batch)) if pair_given else None
        if error is None and plan._layout is not None and pair_given:
            error = layout_error(plan._layout, plan.n, tuple(step_batch) if pair else (step_batch[0],), device,
                                 flat if pair else None)
        if world > 1:
            from memfit.distributed import agree
            agree(error, "memfit.fit plan.step batch")
        elif error is not None:
            raise error
        if walked is None:
            walked = Walked.of(model)
            plan._walked = (None if plan._held is None else plan._held[0], walked)
        shapes = batch_shapes(step_batch, flat[0] if flat is not None else None)
        # nothing checkpointed, no autocast (the plain step): no context entered
        with (checkpointed(module, plan.checkpoint) if plan.checkpoint else contextlib.nullcontext(),
              torch.autocast(device.type, dtype=plan.autocast) if plan.autocast is not None
              else contextlib.nullcontext()):
            res = run_step(model, optimizer, step_batch, loss_fn if plan.autocast is None else _cast_loss(loss_fn),
                           micro_batch=plan.micro_batch, terms=step_terms, distributed=distributed,
                           allow_batch_dependent=allow_batch_dependent, restore_grads=restore_grads, walked=walked)
        res.reason = f"memfit.fit: {plan.reason}"
        # what the step's own forward set is the model as planned (Swin sets `shift_size` at its first forward; fit's
        # fake runs saw the same): the next step is checked against the model as this one left it. A step on a batch
        # of the shapes of one that left the model as it found it (`_quiet`) is not checked after it runs: a forward
        # that set nothing on these shapes is taken to set nothing again (one that sets something every step is
        # checked after every step; one that does only now and then is refused at the next step, saying why). One
        # check a step, not two: each walks every module's attributes (ViT-tiny's 35: 0.2 ms alone, 0.4-0.6 in a step)
        if not (unchanged and plan._quiet == shapes):
            before = plan._held
            plan._held = held(module, optimizer, plan._held)
            # quiet only where the step left the model as planned (`held` gives `before` itself then; a change its
            # forward made to what the bytes depend on keeps the planned values in a new tuple: refused next step)
            plan._quiet = shapes if unchanged and before is not None and plan._held is before else None
        return res

    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        run = _no_values                # a plan for the model once it has values: no step runs on meta
    how_bytes = found.how_bytes + (f"; {note}" if note else "")
    relative = found.relative_time if found.relative_time is not None and found.best is best else best.time
    return FitPlan(best.micro_batch, best.setting.checkpoint, dtype, best.bytes, relative, budget, n, found.reason,
                   found.alternatives, found.candidates, how_bytes, found.how_time, found.seconds,
                   torch.device(predict.get("device") or model_device(module)), run, module,
                   _terms=terms is not None, _own=first_sample(x) if own else None,
                   _layout=layout(tuple(batch) if pair else (x,)), _held=held(module, optimizer))


def _no_values(step_batch, plan: FitPlan) -> StepResult:
    """plan.step of a plan made for a meta-device model (it raised torch's bare 'Cannot copy out of meta tensor')."""
    raise ValueError("plan.step runs a real step, and the model's parameters (some or all) are on the meta device "
                     "(shapes, no values): the plan says what fits; materialise the model "
                     "(model.to_empty(device=...) and initialise it, or load its weights), then call memfit.fit on it "
                     "and step with that plan")

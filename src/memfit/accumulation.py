"""One optimizer step on a logical batch that does not fit, run as micro-batches that do.

`accumulate` splits a batch (x, y) into micro-batches, weights each micro-batch's mean loss by its
share of the samples (m_i / N, so an uneven last micro-batch counts right) and accumulates the
gradients, then takes one optimizer step: the gradient equals the full-batch gradient up to float
reassociation. The micro-batch size comes from the training memory model and the budget
(`memfit.memory.micro_batch`), or is given. An out-of-memory error backs off: the failed micro-batch
alone is retried at half its size.

An OOM can strike in backward after some parameters already received the failed micro-batch's
gradient. A parameter's gradient is accumulated once per backward, complete (the autograd engine
sums every use of a parameter before its AccumulateGrad runs), so the version counter of its
`.grad` tells which parameters got it; the retry of that micro-batch runs with those parameters frozen
(`requires_grad=False`), so they get nothing twice and the others get the rest. No extra gradient
buffer is held: memory is that of plain accumulation.

Example:
    >>> import torch
    >>> torch.manual_seed(0) and None
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    >>> r = accumulate(model, opt, (x, y), torch.nn.functional.cross_entropy, micro_batch=4)
    >>> r.micro_batches, r.micro_batch, r.retries       # 4 + 4 + 2 samples
    (3, 4, 0)
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memfit.batches import batch_slice, batch_tensors, batch_to, forward
from memfit.budget import check_count, halve_after_oom, is_oom
from memfit.losses import call_loss, count_terms, loss_ignore_index
from memfit.memory.micro_batch import auto_key, chosen_size, lower_chosen
from memfit.memory.step import surrounding_autocast
from memfit.messages import first_line

__all__ = ["BatchDependentError", "NonFiniteLossError", "StepResult", "accumulate", "batch_dependent_modules"]

log = logging.getLogger("memfit.accumulate")

class BatchDependentError(ValueError):
    """The model's training-mode output depends on the other samples in the batch (batch statistics):
    micro-batches would not give the full-batch gradient."""


class NonFiniteLossError(FloatingPointError):
    """A micro-batch's loss was NaN or infinite: the optimizer did not step (`accumulate(nonfinite="raise")`)."""


NONFINITE = ("raise", "skip")        # what accumulate does when a micro-batch's loss is not finite


@dataclass
class StepResult:
    """What `accumulate` did. `loss` is the sample-weighted mean over the whole logical batch (over
    every rank when distributed); `micro_batch` the size chosen, `final_micro_batch` the size after any
    out-of-memory back-off; `skipped` why the optimizer did not step (nonfinite="skip"), '' when it did."""
    loss: float
    n: int
    micro_batch: int
    final_micro_batch: int
    micro_batches: int
    retries: int
    reason: str
    seconds: float = 0.0
    oom_sizes: list = field(default_factory=list)
    skipped: str = ""

    def __str__(self) -> str:
        if self.skipped:
            return f"no step on {self.n} samples: {self.skipped}"
        return (f"one step on {self.n} samples in {self.micro_batches} micro-batches of up to "
                f"{self.final_micro_batch} ({self.retries} out-of-memory retries), loss {self.loss:.6g}, "
                f"{self.seconds:.3f} s; micro-batch {self.micro_batch}: {self.reason}")


# ---- the batch -------------------------------------------------------------------------------------
def _batch_size(x, y) -> int:
    """N, the samples in (x, y): dim 0 of every tensor, which must agree."""
    ts = batch_tensors(x)
    if not ts:
        raise TypeError(f"batch x must be a tensor, a dict of tensors (e.g. tokenizer output) or a tuple of "
                        f"tensors; found {type(x).__name__}")
    sizes = {t.shape[0] if t.dim() else None for t in ts + batch_tensors(y)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every tensor of the batch needs the same first (batch) dimension; found sizes "
                         f"{sorted(map(str, sizes))}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("the batch is empty: nothing to accumulate")
    return n


def _slice(v, s: int, e: int, device: torch.device):
    """Samples [s, e) of v on `device` (a view when v is there already; non-tensor values pass through)."""
    return batch_to(batch_slice(v, s, e), device)


# ---- checks ------------------------------------------------------------------------------------------
def batch_dependent_modules(model: torch.nn.Module) -> list[str]:
    """'name (Type): why' for each module in training mode whose result depends on the rest of the batch.

    BatchNorm (any dimension, SyncBatchNorm, lazy) normalises by the statistics of the batch it sees, so a
    micro-batch's gradient differs from the full batch's; its running statistics and those of an
    InstanceNorm with `track_running_stats` take one momentum update per micro-batch instead of one.

    Example:
        >>> batch_dependent_modules(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3)))
        ['1 (BatchNorm1d): normalises by the statistics of the batch it sees']
    """
    kinds = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.modules.instancenorm._InstanceNorm)
    stack = [model]                   # the usual case, once a step: a plain walk, no names built
    while stack:
        m = stack.pop()
        if m.training and isinstance(m, kinds):
            break
        stack.extend(c for c in m._modules.values() if c is not None)
    else:
        return []
    out = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            out.append(f"{name or 'model'} ({type(m).__name__}): normalises by the statistics of the batch it sees")
        elif isinstance(m, torch.nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            out.append(f"{name or 'model'} ({type(m).__name__}): its running statistics take one update per "
                       "micro-batch instead of one per batch")
    return out


def _check_batch_dependence(model, allow: bool) -> None:
    found = batch_dependent_modules(model)
    if not found:
        return
    listed = "; ".join(found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    if not allow:
        raise BatchDependentError(
            f"micro-batches would not give the full-batch step: {listed}. Expected a model whose training "
            "output for a sample does not depend on the other samples. Fix: replace BatchNorm by GroupNorm or "
            "LayerNorm, put those modules in eval mode, or pass allow_batch_dependent=True to accept "
            "micro-batch statistics")
    warnings.warn(f"accumulate: allow_batch_dependent=True: the step is not the full-batch step ({listed})",
                  stacklevel=3)


def _check_micro(micro_batch) -> None:
    if micro_batch == "auto":
        return
    try:
        check_count("micro_batch", micro_batch, 1)      # numpy ints too
    except (TypeError, ValueError):
        raise ValueError(f"micro_batch must be 'auto' or an int >= 1; found {micro_batch!r}") from None


def _ddp_class():
    return torch.nn.parallel.DistributedDataParallel


def _check_distributed(model, distributed: bool) -> int:
    """World size when distributed (the model must be DDP-wrapped), else 1."""
    is_ddp = isinstance(model, _ddp_class())
    if not distributed:
        if is_ddp:
            raise ValueError("the model is DistributedDataParallel but distributed=False; pass distributed=True "
                             "so that micro-batches skip the gradient all-reduce (no_sync) and every rank's share "
                             "of the global batch is weighted right")
        return 1
    if not is_ddp:
        raise ValueError(f"distributed=True needs the model wrapped in DistributedDataParallel; found "
                         f"{type(model).__name__}: wrap it with torch.nn.parallel.DistributedDataParallel(model)")
    return torch.distributed.get_world_size()


def _trained_device(params: list[torch.nn.Parameter]) -> torch.device:
    """The device of the first parameter (as `memfit.budget.model_device`); a model without any is an error."""
    if not params:
        raise ValueError("the model has no parameters: there is nothing to train. Expected a module with "
                         "parameters (found none in model.parameters()); pass the module that holds the weights the "
                         "optimizer steps")
    return params[0].device


def _terms_differ(x, y, ignore: int = -100) -> str | None:
    """The warning to give when labels (y, or x['labels']) ignore (`ignore`: the loss's ignore_index, else -100) a
    different number of positions per sample (or some samples, one label each): a loss averaged over what counts
    weighs samples unequally, so weighting micro-batches by samples is not the full-batch step; None when they do
    not. Said, not refused: a loss that is a mean over samples is exact. Run before the step, when no gradient is
    held: its temporaries (a bool per label, an int64 per sample) then sit below the step's peak."""
    labels = [t for t in (y, x.get("labels") if isinstance(x, dict) else None)
              if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel() and not t.is_floating_point()]
    for t in labels:
        ignored = (t == ignore).reshape(t.shape[0], -1).sum(1)      # per sample (one label each: 0 or 1)
        if bool(ignored.min() != ignored.max()):
            where = "y" if t is y else "x['labels']"
            expr = "y" if t is y else 'x["labels"]'
            return (f"accumulate: {where} ignores ({ignore}) a different number of positions per sample; if "
                    "loss_fn averages over the positions that count (cross_entropy and transformers' losses do), "
                    "micro-batches weighted by samples do not give the full-batch gradient. Pass "
                    f"terms=lambda x, y: ({expr} != {ignore}).sum() to weight them by the positions that count "
                    f"(({expr}[:, 1:] != {ignore}).sum() for a causal LM that shifts its labels), or ignore this "
                    "for a loss that is a mean over samples")
    return None


# ---- the step ------------------------------------------------------------------------------------------
def _grad_marks(params: list[torch.nn.Parameter]) -> list[tuple]:
    """Each parameter's gradient tensor and its version: AccumulateGrad either sets a new tensor or adds in
    place (which bumps the version), so a changed mark means the parameter received a gradient. (Cheaper
    than hooks: adding and removing one costs about 2.5 us per parameter and step, this 0.15 us.)"""
    return [(p.grad, -1 if p.grad is None else p.grad._version) for p in params]


def _received(params, marks) -> frozenset:
    """ids of the parameters whose gradient changed since `marks`."""
    return frozenset(id(p) for p, (g, v) in zip(params, marks, strict=True)
                     if p.grad is not g or (g is not None and g._version != v))


@contextlib.contextmanager
def _frozen(params: list[torch.nn.Parameter], ids: frozenset):
    """Parameters whose ids are in `ids` get no gradient inside (they already hold this part's)."""
    changed = [p for p in params if id(p) in ids and p.requires_grad] if ids else []
    for p in changed:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in changed:
            p.requires_grad_(True)


class _MicroStep:
    """The state of one accumulated step: weights, loss sum, counts."""

    def __init__(self, model, params, loss_fn, x, y, n: int, n_total: int, world: int, device, sync_last: bool,
                 terms: Callable | None = None):
        self.model, self.loss_fn, self.x, self.y, self.n, self.terms = model, loss_fn, x, y, n, terms
        self.params = [p for p in params if p.requires_grad]
        # the samples (or the loss's terms) over every rank; DDP averages over ranks: world * m / N_total is m / N_total
        self.world, self.n_total = world, n_total
        self.device, self.sync_last = device, sync_last
        self.loss_sum: torch.Tensor | None = None
        # (index, start, end) of each micro-batch that added to the loss sum, and how many running sums were
        # finite: NaN and inf stay in a sum, so that count points at the first micro-batch whose loss was not (one
        # scalar, no sync: read only when the sum, read anyway at the end, is not finite)
        self.ranges: list[tuple[int, int, int]] = []
        self.finite: torch.Tensor | None = None
        self.before_sync: Callable | None = None     # called before the backward that all-reduces (distributed)
        self.micro_batches, self.retries, self.oom_sizes = 0, 0, []
        self.autocast = self._autocast_type()
        self.splittable = True           # an out-of-memory error may split a micro-batch

    @staticmethod
    def _autocast_type():
        for dev in ("cuda", "cpu"):
            dtype = surrounding_autocast(dev)
            if dtype is not None:
                if dtype == torch.float16:
                    # small float16 gradients flush to zero without loss scaling, and accumulate calls
                    # optimizer.step() itself, so a GradScaler around it cannot unscale them
                    raise ValueError(f"accumulate runs under float16 autocast on {dev}, which needs loss scaling "
                                     "(torch.amp.GradScaler) that accumulate does not do: its gradients could "
                                     "silently flush to zero. Use torch.autocast(..., dtype=torch.bfloat16), or run "
                                     "the micro-batches yourself with a GradScaler")
                return dev
        return None

    def attempt(self, s: int, e: int, frozen: frozenset, last: bool) -> tuple[str | None, frozenset]:
        """Run samples [s, e) forward and backward; (OOM message or None, parameters that got a gradient)."""
        marks = _grad_marks(self.params)
        sync = contextlib.nullcontext() if (last or not self.sync_last) else self.model.no_sync()
        try:
            with sync, _frozen(self.params, frozen):
                self._run(s, e)
        except Exception as err:
            if not is_oom(err):
                raise
            if last and self.sync_last:
                raise RuntimeError(f"out of memory in the last micro-batch ({e - s} samples), which all-reduces "
                                   "the gradients across ranks: it cannot be retried without leaving the other "
                                   f"ranks waiting ({type(err).__name__}); pass a smaller micro_batch") from err
            msg = first_line(err)
            return msg, _received(self.params, marks)
        return None, frozenset()

    def _run(self, s: int, e: int) -> None:
        whole = s == 0 and e == self.n          # the batch itself: no views to make
        xs = batch_to(self.x, self.device) if whole else _slice(self.x, s, e, self.device)
        ys = batch_to(self.y, self.device) if whole else _slice(self.y, s, e, self.device)
        loss = call_loss(self.loss_fn, forward(self.model, xs), ys)      # refuses (N, 1) against (N,) targets
        m = e - s
        per_sample = isinstance(loss, torch.Tensor) and loss.dim() == 1 and loss.numel() == m
        if not isinstance(loss, torch.Tensor) or not (loss.numel() == 1 or per_sample):
            raise ValueError(f"loss_fn must return the mean loss over the micro-batch (a scalar tensor) or one loss "
                             f"per sample (shape ({m},)); found "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        # per-sample losses are summed; a mean counts m times (or as many times as it has terms): either way this
        # part's share of the batch, scaled in one multiplication (none when the part is the whole batch)
        part, count = (loss.sum(), 1) if per_sample else (loss if loss.dim() == 0 else loss.reshape(()), m)
        del loss                    # per-sample losses: the vector is not needed in backward (sum saves no input)
        if self.terms is not None:
            if per_sample:
                raise ValueError(f"terms= needs loss_fn to return the mean over those terms (a scalar); found one "
                                 f"loss per sample (shape ({m},)): return their mean, or drop terms=")
            count = count_terms(self.terms, xs, ys)
            if count == 0:                  # nothing counts in this part: its mean is 0 / 0, and it adds nothing
                if self.sync_last and e == self.n:     # but DDP's all-reduce must run: a zero gradient for each
                    zero = sum(p.sum() for p in self.params if p.requires_grad) * 0.0          # parameter
                    self._before_backward(e)
                    zero.backward()
                self.micro_batches += 1
                return
        if part.requires_grad:       # not when every parameter is frozen (they all hold this part already)
            weight = count * self.world / self.n_total
            weighted = part if weight == 1 else part * weight
            self._before_backward(e)
            if self.autocast is not None:        # backward outside autocast, as torch.amp recommends
                with torch.autocast(self.autocast, enabled=False):
                    weighted.backward()
            else:
                weighted.backward()
        # a float64 copy (a scalar loss may be a view of an input-sized buffer), summed on the device: read once
        share = part.detach().double() * count if count != 1 else part.detach().double()
        self.loss_sum = share if self.loss_sum is None else self.loss_sum + share
        ok = torch.isfinite(self.loss_sum)
        if self.finite is None:
            self.finite = ok.long()
        else:
            self.finite += ok
        self.ranges.append((self.micro_batches, s, e))
        self.micro_batches += 1

    def _before_backward(self, e: int) -> None:
        if self.before_sync is not None and self.sync_last and e == self.n:
            self.before_sync()

    def first_nonfinite(self) -> tuple[int, int, int] | None:
        """(index, start, end) of the first micro-batch whose loss was not finite, or None."""
        i = 0 if self.finite is None else int(self.finite)
        return self.ranges[i] if i < len(self.ranges) else None

    def run_range(self, s: int, e: int, size: int, frozen: frozenset) -> int:
        """Accumulate samples [s, e) in micro-batches of `size`; returns the size that worked last.
        A micro-batch that runs out of memory is retried alone at half the size, with the parameters
        that already received its gradient frozen."""
        i = s
        while i < e:
            m = min(size, e - i)
            err, got = self.attempt(i, i + m, frozen, last=(i + m == self.n))
            if err is None:
                i += m
                continue
            self.retries += 1                        # outside the except block: the failed part's frames are gone
            if not self.splittable:
                self.oom_sizes.append(m)
                raise torch.OutOfMemoryError(f"out of memory in the step on the whole batch ({err}); the model has "
                                             "batch statistics (BatchNorm in training mode), so it is not split into "
                                             "micro-batches without allow_batch_dependent=True")
            size = halve_after_oom(m, err, self.device, self.oom_sizes, single="a training step on a single sample",
                                   fix="free memory, use a smaller model, input or optimizer state")
            log.info("accumulate: out of memory at a micro-batch of %d (%s); retrying it as %d", m, err, size)
            size = self.run_range(i, i + m, size, frozen | got)
            i += m
        return size


def accumulate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn: Callable,
               budget: int | str | None = None, micro_batch: int | str = "auto", *, distributed: bool = False,
               allow_batch_dependent: bool = False, terms: Callable | None = None,
               nonfinite: str = "raise") -> StepResult:
    """One optimizer step on `batch`, run as micro-batches, with the full-batch gradient.

    Gradients are zeroed first (set to None), accumulated over the micro-batches (micro-batch i's mean
    loss weighted by m_i / N), then `optimizer.step()` runs once; `.grad` keeps the step's gradient.
    Forward and loss run under the caller's `torch.autocast`; backward runs outside it.

    Args:
        model: the module (a DistributedDataParallel one when `distributed`). Its result for a sample must
            not depend on the other samples (BatchNorm in training mode does: refused, see below). Dropout
            draws other masks than one full-batch pass would: the gradient is as valid, not bitwise equal.
        optimizer: steps once.
        batch: (x, y): x a tensor, a dict of tensors (passed as keyword arguments, e.g. tokenizer output)
            or a tuple (positional); first dimension the samples. A batch on the host is copied to the
            model's device a micro-batch at a time. A memfit loader's batches work as they are.
        loss_fn: loss_fn(output, y) -> the mean loss over the samples (a scalar), or one loss per sample (summed
            and freed before backward, as the memory model counts it: a loss_fn that keeps the vector itself
            holds m floats more).
            Weighting is by samples: a loss averaged over tokens is exact when every sample has as many;
            otherwise pass `terms` (a warning says so when labels ignore a different number of positions).
        budget: bytes or '8GiB' the step must fit (default: free device memory minus a margin, plus what
            the model and optimizer hold already). Used by micro_batch='auto'.
        micro_batch: 'auto' (the largest whose predicted step fits the budget, kept for the model's later
            steps) or an int.
        distributed: every rank steps on its own batch; micro-batches skip DDP's all-reduce (`no_sync`)
            except the last one, and each is weighted by world * m / N_total so that DDP's average is the
            gradient of the mean over every rank's samples, also with uneven batches. Out-of-memory back-off
            is local, except in the last micro-batch (an error there: the other ranks are in the all-reduce).
            The ranks agree (one small all-gather with a timeout) after each micro-batch and before the
            backward that all-reduces, so an error on one rank (its forward, loss or backward) makes every
            rank raise within a micro-batch, the others `memfit.distributed.RankFailed` naming it, instead
            of waiting in DDP's all-reduce. (A rank failing inside that last backward cannot be caught so:
            the others wait for DDP's process-group timeout.)
        allow_batch_dependent: run a model with batch statistics anyway (a warning says the step differs).
        terms: terms(x, y) -> how many terms loss_fn's mean is over in a (micro-)batch, e.g.
            `lambda x, y: (y != -100).sum()` for a loss averaged over the tokens that are not ignored
            (`(y[:, 1:] != -100).sum()` for a causal LM that shifts its labels): each micro-batch is then
            weighted by its share of the terms, and `loss` is the mean over all of them.
        nonfinite: when a micro-batch's loss is NaN or infinite (on any rank): 'raise' (default)
            `NonFiniteLossError` naming the micro-batch and its samples, or 'skip': return with
            `StepResult.skipped` saying why. Either way the optimizer does not step: parameters and
            optimizer state are as they were, and `.grad` is None (this step's partial gradients are
            dropped; the previous ones were freed when the step began, as always, so that the step has
            the memory its budget counted). Checked from the loss sum that is read anyway: no extra sync.

    Precision: gradients accumulate in the parameters' dtype, as in any accumulation (bfloat16 parameters
    round each micro-batch's addition to bfloat16; under autocast the parameters, and so the sums, stay
    float32).

    Returns:
        StepResult: the loss over the whole batch, the micro-batch size chosen and why, retries.

    Raises:
        BatchDependentError: the model has BatchNorm (or similar) in training mode, micro-batches smaller than
            the batch and no opt-in (one micro-batch of the whole batch is the plain step: allowed).
        BudgetExceeded: not even one sample fits the budget.
        torch.OutOfMemoryError: a single sample runs out of memory.
        NonFiniteLossError: a micro-batch's loss is NaN or infinite (nonfinite='raise').
        memfit.distributed.RankFailed: distributed, another rank failed (named in the message).
    """
    t0 = time.perf_counter()
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"batch must be (x, y); found {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    _check_micro(micro_batch)
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}; found {nonfinite!r}")
    world = _check_distributed(model, distributed)
    x, y = batch
    params = list(model.parameters())
    # Distributed: every local step that can fail runs first, then one agreement shares the sample counts and
    # sizes; a rank that failed makes every rank raise there, none waits in a collective
    error, step, key = None, None, None
    try:
        n = _batch_size(x, y)
        whole = micro_batch != "auto" and micro_batch >= n       # one micro-batch of the whole batch: the plain step
        if not whole:
            _check_batch_dependence(model, allow_batch_dependent)
        device = _trained_device(params)
        n_total = n if terms is None else count_terms(terms, x, y)
        step = _MicroStep(model, params, loss_fn, x, y, n, n_total, world, device, sync_last=world > 1, terms=terms)
        # a model with batch statistics runs whole (no opt-in): an out-of-memory error must not split it
        step.splittable = not whole or allow_batch_dependent or not batch_dependent_modules(model)
        if micro_batch == "auto":
            key = auto_key(step.params, optimizer, x, n, budget)
            size, reason = chosen_size(model, optimizer, loss_fn, x, y, n, budget, device, 1, key)
        else:
            size, reason = min(micro_batch, n), "micro_batch given"
    except Exception as e:
        if world == 1:
            raise
        error = e
    rounds = 0
    if world > 1:
        n_total, size, reason, rounds = _agree_start(error, step, size if error is None else 0,
                                                     reason if error is None else "", micro_batch == "auto")
        step.n_total = n_total
    if n_total == 0:
        raise ValueError("terms(x, y) counts no terms in the whole batch: there is no loss to take a step on")
    optimizer.zero_grad(set_to_none=True)
    for p in step.params:            # parameters outside the optimizer too: .grad holds this step's gradient
        if p.grad is not None:
            p.grad = None
    ignore = loss_ignore_index(loss_fn)             # the loss's own (CrossEntropyLoss(ignore_index=0)), else -100
    # before the step: its temporaries never sit on the grads
    differ = _terms_differ(x, y, -100 if ignore is None else ignore) if terms is None else None
    final = _run_rounds(step, size, rounds) if world > 1 else step.run_range(0, n, size, frozenset())
    if differ is not None and step.micro_batches > 1:
        warnings.warn(differ, stacklevel=2)
    if final < size and micro_batch == "auto":          # the next step starts where this one succeeded
        lower_chosen(model, key, final)
    loss_sum = float(step.loss_sum) if step.loss_sum is not None else 0.0
    if world > 1:                    # before the step: one rank's NaN makes every rank's sum NaN, so none steps
        from memfit.distributed import all_reduce
        loss_sum = float(all_reduce(torch.tensor(loss_sum, dtype=torch.float64), what="accumulate loss"))
    skipped = ""
    if math.isfinite(loss_sum):
        optimizer.step()
    else:
        skipped = _nonfinite(step, world)
        if nonfinite == "raise":
            raise NonFiniteLossError(skipped + "; pass nonfinite='skip' to skip such steps and go on "
                                     "(StepResult.skipped says why)")
    res = StepResult(loss_sum / n_total, n, size, final, step.micro_batches, step.retries, reason,
                     time.perf_counter() - t0, step.oom_sizes, skipped)
    log.info("accumulate: micro-batch %d: %s", size, reason)
    if skipped:
        log.warning("%s", skipped)
    return res


# ---- several ranks, and a loss that is not finite --------------------------------------------------------
def _agree_start(error, step, size: int, reason: str, auto: bool) -> tuple[int, int, str, int]:
    """(samples or terms over every rank, this rank's micro-batch size, why, rounds): one agreement, which
    raises on every rank when one failed preparing its step. An 'auto' size is the smallest over the ranks
    (one size for all, as when evaluating). Rounds: the most micro-batches any rank plans; every rank makes
    one agreement per round, so each rank's last micro-batch (the one that all-reduces) is in the last."""
    from memfit.distributed import agree
    mine = (0, 0, 0, 0) if step is None else (step.n_total, step.n, size, int(auto))
    ranks = agree(error, "memfit.accumulate start", mine)
    autos = [v[2] for v in ranks if v[3]]
    if auto and min(autos) != size:
        size, reason = min(autos), f"{reason}; the smallest over ranks ({min(autos)}) is used"
    sizes = [min(autos) if v[3] else v[2] for v in ranks]
    rounds = max(-(-v[1] // m) for v, m in zip(ranks, sizes, strict=True))
    return sum(v[0] for v in ranks), size, reason, rounds


def _run_rounds(step: _MicroStep, size: int, rounds: int) -> int:
    """This rank's micro-batches in `rounds` rounds, each closed by an agreement (a rank with fewer micro-batches
    agrees idly before its last one); the last micro-batch agrees before its backward, whose DDP hooks
    all-reduce. A rank that fails raises its own error and the others `RankFailed` at that agreement, not in
    DDP's all-reduce. Returns the micro-batch size that worked last."""
    from memfit.distributed import RankFailed, agree
    starts = list(range(0, step.n, size))
    for r in range(rounds - 1):
        error = None
        if r < len(starts) - 1:
            try:
                size = step.run_range(starts[r], starts[r + 1], size, frozenset())
            except Exception as e:
                error = e
        agree(error, "memfit.accumulate micro-batch")
    where, agreed = "memfit.accumulate before the all-reducing backward", []
    step.before_sync = lambda: agreed.append(agree(None, where))
    try:
        return step.run_range(starts[-1], step.n, size, frozenset())
    except RankFailed:
        raise
    except Exception as e:
        if agreed:              # in or after the backward that all-reduces: the other ranks are in it already
            raise
        agree(e, where)         # raises e here, RankFailed on the others
        raise
    finally:
        step.before_sync = None


def _nonfinite(step: _MicroStep, world: int) -> str:
    """Why no step was taken: which micro-batch's loss (on which rank) was not finite. The step's gradients
    are dropped (`.grad` None), so an optimizer.step() by the caller cannot apply them either."""
    for p in step.params:
        p.grad = None
    bad = step.first_nonfinite()
    mine = (-1, 0, 0, 0) if bad is None else (bad[0], bad[1], bad[2], step.micro_batches)
    if world > 1:
        from memfit.distributed import agree
        ranks = agree(None, "memfit.accumulate non-finite loss", mine)
    else:
        ranks = [mine]
    where = "; ".join(f"{f'rank {r}: ' if world > 1 else ''}micro-batch {i + 1} of {k} (samples {s}..{e - 1} of "
                      f"{'its' if world > 1 else 'the'} batch)" for r, (i, s, e, k) in enumerate(ranks) if i >= 0)
    value = f" ({float(step.loss_sum)})" if bad is not None else ""
    return (f"accumulate: the loss is not finite{value} in {where or 'the sum over the ranks'}: the optimizer did "
            "not step (parameters and optimizer state are as they were; .grad is None). Check those samples, "
            "the learning rate (diverging weights) or the loss (log of 0; a mean over no terms, e.g. labels all "
            "-100, is 0/0: pass terms= to weight micro-batches by what counts)")

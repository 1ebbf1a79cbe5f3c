"""`accumulate`: one optimizer step on a logical batch that does not fit, run as micro-batches that do.

The driver: checks (`checks`), the micro-batches (`micro_step.MicroStep`), the agreements between ranks
(`ranks`), then one optimizer step, or none when a loss is not finite (the gradients set to None, or with
`restore_grads=True` the ones held before the call given back: `micro_step.KeptGrads`).
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.accumulation.checks import (
    batch_dependent_modules,
    batch_size,
    check_batch_dependence,
    check_distributed,
    check_grad_enabled,
    check_micro,
    check_optimizer_holds,
    ignored_per_sample,
    terms_differ,
    trained_device,
)
from memfit.accumulation.micro_step import KeptGrads, LossSum, MicroStep
from memfit.accumulation.ranks import agree_start, run_rounds, synchronise
from memfit.accumulation.result import NONFINITE, NonFiniteLossError, StepResult
from memfit.batches import plain_batch
from memfit.losses import batch_terms, count_terms, loss_ignore_index, said_reduction
from memfit.memory.micro_batch import auto_key, chosen_size, lower_chosen
from memfit.own_loss import LabelTerms, is_own, label_terms, model_loss, own_batch

__all__ = ["Walked", "accumulate", "run_step"]

log = logging.getLogger("memfit.accumulate")


def accumulate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch, loss_fn: Callable | str | None = None,
               budget: int | str | None = None, micro_batch: int | str = "auto", *, distributed: bool = False,
               allow_batch_dependent: bool = False, terms: Callable | None = None,
               nonfinite: str = "raise", restore_grads: bool = False) -> StepResult:
    """One optimizer step on `batch`, run as micro-batches, with the full-batch gradient.

    Gradients are set to None first, as `optimizer.zero_grad()` does (the previous step's are let go: a loop
    with or without `zero_grad` needs the same memory), accumulated over the micro-batches (micro-batch i's mean
    loss weighted by m_i / N), then `optimizer.step()` runs once; `.grad` keeps the step's gradient. When no step
    is taken (a loss that is not finite, an error before the step) `.grad` is None, unless `restore_grads=True`.
    Forward and loss run under the caller's `torch.autocast`; backward runs outside it.

    Args:
        model: the module (a DistributedDataParallel one when `distributed`). Its result for a sample must
            not depend on the other samples (BatchNorm in training mode does: refused, see below). Dropout
            draws other masks than one full-batch pass would: the gradient is as valid, not bitwise equal.
        optimizer: steps once.
        batch: (x, y): x a tensor, a dict of tensors (passed as keyword arguments, e.g. tokenizer output)
            or a tuple (positional); first dimension the samples. A batch on the host is copied to the
            model's device a micro-batch at a time. A memfit loader's batches work as they are. With the model's
            own loss (loss_fn=None): x alone, a dict holding its labels (x["labels"]), or (x, None).
        loss_fn: loss_fn(output, y) -> the mean loss over the samples (a scalar), or one loss per sample (summed
            and freed before backward, as the memory model counts it: a loss_fn that keeps the vector itself
            holds m floats more). None or "model" (the default): the model's own loss, `out.loss`, as
            transformers models compute it from `x["labels"]`; its micro-batches are weighted by the labels that
            count (not -100; a causal LM's from the second position on: `memfit.own_loss.label_terms`), so the
            gradient is the full batch's.
            Weighting is by samples: a loss averaged over tokens is exact when every sample has as many;
            otherwise pass `terms` (a warning says so when labels ignore a different number of positions).
            A torch cross entropy or NLL loss (module, F function or partial) says what its mean is over: its
            micro-batches are weighted by the targets it does not ignore times their class weights
            (`memfit.losses.batch_terms`); a torch loss with reduction='sum' gets the gradient of the batch's sum.
        budget: bytes or '8GiB' the step must fit (default: free device memory minus a margin, plus what
            the model and optimizer hold already). Used by micro_batch='auto'.
        micro_batch: 'auto' (the largest whose predicted step fits the budget, kept for the model's later
            steps) or an int.
        distributed: every rank steps on its own batch; every micro-batch runs under DDP's `no_sync` (its
            backward is local) and is weighted by world * m / N_total, so that DDP's average is the gradient
            of the mean over every rank's samples, also with uneven batches. The ranks agree (one small
            all-gather with a timeout) after each micro-batch, the last one's backward included, so an error
            on one rank (its forward, loss or backward) makes every rank raise within a micro-batch, the
            others `memfit.distributed.RankFailed` naming it; none waits in an all-reduce. Only then, with
            every loss finite, DDP all-reduces the gradients once (`accumulation.ranks.synchronise`: its
            buckets and communication hook; it no longer overlaps the last backward). Out-of-memory back-off
            is local in every micro-batch.
        allow_batch_dependent: run a model with batch statistics anyway (a warning says the step differs).
        terms: terms(x, y) -> how many terms loss_fn's mean is over in a (micro-)batch, e.g.
            `lambda x, y: (y != -100).sum()` for a loss averaged over the tokens that are not ignored
            (`(y[:, 1:] != -100).sum()` for a causal LM that shifts its labels): each micro-batch is then
            weighted by its share of the terms, and `loss` is the mean over all of them.
        nonfinite: when a micro-batch's loss is NaN or infinite (on any rank): 'raise' (default)
            `NonFiniteLossError` naming the micro-batch and its samples, or 'skip': return with
            `StepResult.skipped` saying why. Either way the optimizer does not step, nor DDP all-reduce:
            parameters, gradients (the same `.grad` tensors, or None, as before the call) and optimizer state
            are as they were, the gradients None (or, with `restore_grads`, as they were). Checked from the loss
            sum that is read anyway: no extra sync.
        restore_grads: when no step is taken, give `.grad` back as it was before the call (the same tensors, or
            None), for a caller that accumulates over several calls or reads `.grad` after a skipped step. The
            cost: the gradients held on entry stay referenced through the micro-batches (let go before
            `optimizer.step()`), a gradient's worth of memory that micro_batch='auto' then counts.

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
    return run_step(model, optimizer, batch, loss_fn, budget, micro_batch, distributed=distributed,
                    allow_batch_dependent=allow_batch_dependent, terms=terms, nonfinite=nonfinite,
                    restore_grads=restore_grads)


@dataclass
class Walked:
    """What `accumulate` reads off the model by walking every module: its parameters (`model.parameters()`) and the
    modules whose result depends on the rest of the batch (`batch_dependent_modules`). `plan.step` keeps them while
    the model is as its last step left it (`memfit.memory.fingerprint.State.holds`), saving two walks a step."""
    params: list[torch.nn.Parameter]
    dependent: list[str]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Walked:
        return cls(list(model.parameters()), batch_dependent_modules(model))


def run_step(model, optimizer, batch, loss_fn, budget=None, micro_batch="auto", *, distributed=False,
             allow_batch_dependent=False, terms=None, nonfinite="raise", restore_grads=False,
             walked: Walked | None = None) -> StepResult:
    """`accumulate`; `walked`: the model's `Walked`, known to hold (else walked here)."""
    t0 = time.perf_counter()
    given = terms
    batch = plain_batch(batch)     # a tokenizer's or collator's BatchEncoding: the dict it holds
    if is_own(loss_fn):           # the model's own loss: x alone (its labels inside), weighted by the labels that count
        batch, loss_fn = own_batch(batch, "accumulate"), model_loss
        if terms is None:
            inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            terms = label_terms(inner, batch[0])
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(f"batch must be (x, y); found {type(batch).__name__}"
                        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    check_micro(micro_batch)
    check_grad_enabled()
    if nonfinite not in NONFINITE:
        raise ValueError(f"nonfinite must be one of {NONFINITE}; found {nonfinite!r}")
    world = check_distributed(model, distributed)
    x, y = batch
    params = walked.params if walked is not None else list(model.parameters())
    if walked is None:             # plan.step: checked by fit, and its optimizer's groups by every step's layout check
        check_optimizer_holds(params, optimizer)
    # Distributed: every local step that can fail runs first, then one agreement shares the sample counts and
    # sizes; a rank that failed makes every rank raise there, none waits in a collective
    error, step, key = None, None, None
    try:
        n = batch_size(x, y)
        whole = micro_batch != "auto" and micro_batch >= n       # one micro-batch of the whole batch: the plain step
        dependent = walked.dependent if walked is not None else None
        if not whole:
            check_batch_dependence(model, allow_batch_dependent, dependent)
        device = trained_device(params)
        summed = said_reduction(loss_fn) == "sum"
        if summed and terms is not None:
            raise ValueError(f"terms= weights a loss_fn's mean by the terms it is over; loss_fn sums "
                             f"({loss_fn!r}, reduction='sum'), and the full batch's sum is the sum of the "
                             "micro-batches' sums: drop terms=, or give the loss reduction='mean'")
        # per sample, the labels the loss ignores (its ignore_index, else -100): one read of y, which both the
        # weighting by terms and the warning about unequal samples answer from. Not for the whole batch at once: no
        # warning is given for one micro-batch, and `batch_terms` reads them where it weights by them (a torch cross
        # entropy): a plain step of another loss reads no labels (a sync on a GPU; 3 kernels and a read on the CPU)
        ignore = loss_ignore_index(loss_fn)         # the loss's own (CrossEntropyLoss(ignore_index=0)), else -100
        ignore = -100 if ignore is None else ignore
        ignored = ignored_per_sample(y, ignore) if terms is None and not whole else None
        # a cross entropy whose mean divides by the targets not ignored, or by their class weights: weighted by
        # those, micro-batches give the full-batch mean (by samples they would not, silently)
        terms = terms if terms is not None else batch_terms(loss_fn, y, ignored)
        counts = getattr(terms, "per_sample", None)       # each sample's terms, on the host
        n_total = n if terms is None else sum(counts) if counts is not None else count_terms(terms, x, y)
        step = MicroStep(model, params, loss_fn, x, y, n, n_total, world, device, terms=terms)
        step.summed = summed
        # a model with batch statistics runs whole (no opt-in): an out-of-memory error must not split it
        step.splittable = not whole or allow_batch_dependent or (lambda: not (
            dependent if dependent is not None else batch_dependent_modules(model)))
        if micro_batch == "auto":
            key = auto_key(step.params, optimizer, x, n, budget, restore_grads, y)
            size, reason = chosen_size(model, optimizer, loss_fn, x, y, n, budget, device, 1, key, restore_grads)
        else:
            size, reason = min(micro_batch, n), "micro_batch given"
    except Exception as e:
        if world == 1:
            raise
        error = e
    rounds = 0
    if world > 1:
        n_total, size, reason, rounds = agree_start(error, step, size if error is None else 0,
                                                    reason if error is None else "", micro_batch == "auto")
        step.n_total = n_total
    if n_total == 0:
        raise ValueError("every label in x['labels'] is -100 (a causal LM's from the second position on): there is "
                         "no loss to take a step on" if isinstance(terms, LabelTerms) else
                         "terms(x, y) counts no terms in the whole batch: there is no loss to take a step on"
                         if given is not None else f"every target of the batch is the ignore index of {loss_fn!r}: "
                         "there is no loss to take a step on (its full-batch mean is 0 / 0)")
    # before the step: its temporaries never sit on the grads (the whole batch: only where an out-of-memory back-off
    # split it, after the step)
    differ = terms_differ(x, y, ignore, ignored) if terms is None and not whole else None
    step.ignore = ignore
    step.losses = LossSum(-(-n // size))
    # what .grad gets when no step follows: None, or the gradients held now (referenced through the micro-batches)
    kept = KeptGrads(lambda: _trained_and_stepped(params, optimizer), keep=restore_grads)
    optimizer.zero_grad(set_to_none=True)
    for p in step.params:            # parameters outside the optimizer too: .grad holds this step's gradient
        if p.grad is not None:
            p.grad = None
    try:
        final = run_rounds(step, size, rounds) if world > 1 else step.run_range(0, n, size, frozenset())
        loss_sum = step.finish()     # the one read of the losses (a sync on a GPU), needed before the step
        if world > 1:                # before the step: one rank's NaN makes every rank's sum NaN, so none steps
            from memfit.distributed import all_reduce
            loss_sum = float(all_reduce(torch.tensor(loss_sum, dtype=torch.float64), what="accumulate loss"))
        skipped = "" if math.isfinite(loss_sum) else _nonfinite(step, world, restore_grads)
    except BaseException:
        kept.restore()               # no step follows: None, or the gradients as they were
        raise
    if skipped:
        kept.restore()
        if nonfinite == "raise":
            raise NonFiniteLossError(skipped + "; pass nonfinite='skip' to skip such steps and go on "
                                     "(StepResult.skipped says why)")
    else:
        kept.release()               # freed before the optimizer's step, which may need the memory
        if world > 1:                # every rank finished with a finite loss: DDP all-reduces, once
            synchronise(model, step.params)
        optimizer.step()
    if whole and terms is None and step.micro_batches > 1:
        differ = terms_differ(x, y, ignore)
    for said in (differ, step.warning):
        if said is not None and step.micro_batches > 1:
            warnings.warn(said, stacklevel=2)
    if final < size and micro_batch == "auto":          # the next step starts where this one succeeded
        lower_chosen(model, key, final)
    res = StepResult(loss_sum if step.summed else loss_sum / n_total, n, size, final, step.micro_batches,
                     step.retries, reason, time.perf_counter() - t0, step.oom_sizes, skipped)
    log.info("accumulate: micro-batch %d: %s", size, reason)
    if skipped:
        log.warning("%s", skipped)
    return res


def _trained_and_stepped(params: list[torch.nn.Parameter], optimizer) -> list[torch.nn.Parameter]:
    """The parameters whose `.grad` the step sets to None: the model's that require a gradient and the
    optimizer's (`zero_grad`), each once."""
    seen, out = set(), []
    for p in [*params, *(q for g in optimizer.param_groups for q in g["params"])]:
        if id(p) not in seen and (p.requires_grad or p.grad is not None):
            seen.add(id(p))
            out.append(p)
    return out


def _nonfinite(step: MicroStep, world: int, restored: bool) -> str:
    """Why no step was taken: which micro-batch's loss (on which rank) was not finite."""
    bad = step.first_nonfinite()
    mine = (-1, 0, 0, 0) if bad is None else (bad[0], bad[1], bad[2], step.micro_batches)
    if world > 1:
        from memfit.distributed import agree
        ranks = agree(None, "memfit.accumulate non-finite loss", mine)
    else:
        ranks = [mine]
    where = "; ".join(f"{f'rank {r}: ' if world > 1 else ''}micro-batch {i + 1} of {k} (samples {s}..{e - 1} of "
                      f"{'its' if world > 1 else 'the'} batch)" for r, (i, s, e, k) in enumerate(ranks) if i >= 0)
    value = f" ({step.loss_sum})" if bad is not None else ""
    grads = "the gradients too" if restored else "the gradients None: restore_grads=True gives them back"
    return (f"accumulate: the loss is not finite{value} in {where or 'the sum over the ranks'}: the optimizer did "
            f"not step (parameters and optimizer state are as they were before the call, {grads}). Check those "
            "samples, the learning rate (diverging weights) or the loss (log of 0; a mean over no terms, e.g. "
            "labels all -100, is 0/0: pass terms= to weight micro-batches by what counts)")

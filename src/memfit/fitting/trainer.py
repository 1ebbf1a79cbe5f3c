"""Hand a `memfit.fitting.FitPlan` to transformers' `Trainer` (4.4x and 5.x): `trainer_arguments(plan, args)` returns a
copy of the `TrainingArguments` with the plan's per-device batch and the gradient-accumulation steps that keep the
effective batch, and checkpoints the plan's layers on the model (only those: transformers' own checkpointing would
take every layer, so it is set off, under its 4.x name `gradient_checkpointing` and its 5.x name
`activation_checkpointing` alike). With layers checkpointed the model's key/value cache is off (`use_cache`: a
recomputed layer would append to it again). `remove_checkpointing(plan)` undoes all of it.

The gradient is the effective batch's, as far as the Trainer can give it:
- a plan made without `terms=` for a `loss_fn` (a mean over samples): the model is marked
  `accepts_loss_kwargs = False`, so that the Trainer divides each micro-batch's mean loss by the accumulation steps.
  A model whose forward takes `**kwargs` but whose loss ignores `num_items_in_batch` (BERT's sequence
  classification, transformers 5.x) would otherwise be trained on the sum of the micro-batches' means, `steps`
  times the gradient (measured: weights 7e-3 apart after two AdamW steps, against 1e-5 with the mark);
- with `terms=`, the Trainer's own weighting by `num_items_in_batch` is kept;
- the model's own loss (`loss_fn=None`): kept too where the model's loss divides by the `num_items_in_batch` the
  Trainer passes (a causal LM's: every token weighs the same, as in `plan.step`), which is tried on one sample of
  the planned batch (`weighs_items`); else the model is marked as above. transformers 4.x counts a causal LM's
  labels unshifted (its loss is the batch's sum over one token more per row than `plan.step` divides by: a constant
  factor per step, the same as the Trainer's own full-batch step); before 4.46 the Trainer divides every
  micro-batch's mean by the steps, whatever the model.

The Trainer cannot run an uneven last micro-batch: when the plan's micro-batch does not divide the batch, the
per-device batch is the largest divisor of the batch below it (fewer bytes; the choice says so).

Example (not run here: it needs transformers):
    plan = memfit.fit(model, optimizer, batch, None, "8GiB")      # batch: one effective per-device batch
    trainer = transformers.Trainer(model, plan.trainer_arguments(args), train_dataset=ds)
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from memfit.batches import batch_to, forward
from memfit.budget import model_device
from memfit.fitting.checkpointing import caches_back, caches_off, install, uninstall
from memfit.own_loss import model_loss

__all__ = ["per_device_split", "remove_checkpointing", "trainer_arguments", "weighs_items"]

log = logging.getLogger("memfit.fit")
_UNSET = object()
# transformers' own checkpointing: its 4.x name, and 5.x's (the old one a deprecated alias that mirrors it)
_CHECKPOINTING = ("gradient_checkpointing", "activation_checkpointing")


def per_device_split(n: int, micro_batch: int) -> tuple[int, int]:
    """(per-device batch, accumulation steps) with batch * steps == n and batch <= micro_batch, fewest steps.

    Example:
        >>> per_device_split(32, 8), per_device_split(24, 16), per_device_split(7, 3)
        ((8, 4), (12, 2), (1, 7))
    """
    steps = -(-n // micro_batch)
    while n % steps:
        steps += 1
    return n // steps, steps


def weighs_items(module: torch.nn.Module, sample) -> bool:
    """Whether `module`'s own loss divides by the `num_items_in_batch` the Trainer passes it (transformers' losses
    through `self.loss_function` do; BERT's sequence classifier's does not): its loss on `sample` (one sample of the
    inputs, labels inside) with num_items_in_batch 1 and 2, in eval mode (no dropout) and without gradients; each
    module's mode comes back after. False where the forward does not take it or the loss is 0 or not finite."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        sample = batch_to(sample, model_device(module))
        one = torch.tensor(1, device=model_device(module))
        with torch.no_grad():
            a = model_loss(forward(module, {**sample, "num_items_in_batch": one}))
            b = model_loss(forward(module, {**sample, "num_items_in_batch": one + 1}))
    except TypeError:              # the forward takes no such argument: the Trainer divides by the steps itself
        return False
    finally:
        for m, training in modes:
            m.training = training
    a, b = float(a), float(b)          # the sum over the sample's labels, then half of it where it divides by them
    return math.isfinite(a) and a != 0 and abs(a - 2 * b) <= 1e-4 * abs(a)


def trainer_arguments(plan, args):
    """A copy of `args` (transformers.TrainingArguments) that trains as `plan` says, and the plan's layers
    checkpointed on its model (non-reentrant, until `remove_checkpointing(plan)`).

    The plan must be for one effective per-device batch: `args.per_device_train_batch_size *
    args.gradient_accumulation_steps` samples (the batch given to `memfit.fit`).

    Raises:
        ValueError: the plan was made for another batch size, or uses bf16 autocast and `args` does not
            (set `bf16=True` in the arguments: the Trainer runs the autocast itself).
    """
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
    if effective != plan.n:
        raise ValueError(f"the plan is for a batch of {plan.n} samples; the TrainingArguments give an effective "
                         f"per-device batch of {effective} (per_device_train_batch_size "
                         f"{args.per_device_train_batch_size} x gradient_accumulation_steps "
                         f"{args.gradient_accumulation_steps}); call memfit.fit on a batch of {effective}")
    if plan.autocast is not None and not args.bf16:
        raise ValueError("the plan runs under bf16 autocast (levers=('bf16',)); pass TrainingArguments(bf16=True) so "
                         "that the Trainer runs it, or make a plan without the lever")
    batch, steps = per_device_split(plan.n, plan.micro_batch)
    if batch != plan.micro_batch:
        log.info("memfit.fit: the Trainer needs even micro-batches: %d x %d instead of micro-batch %d", batch, steps,
                 plan.micro_batch)
    remove_checkpointing(plan)
    plan._installed = install(plan._module, plan.checkpoint)
    plan._caches = caches_off(plan._module) if plan.checkpoint else []
    # the Trainer's weighting by num_items_in_batch is kept where the loss is over terms (terms=, or the model's own
    # loss that divides by it); a mean over samples is divided by the accumulation steps
    if not plan._terms and (plan._own is None or not weighs_items(plan._module, plan._own)):
        plan._marked = (plan._module, vars(plan._module).get("accepts_loss_kwargs", _UNSET))
        plan._module.accepts_loss_kwargs = False
    off = {f.name: False for f in dataclasses.fields(args) if f.name in _CHECKPOINTING}
    return dataclasses.replace(args, per_device_train_batch_size=batch, gradient_accumulation_steps=steps, **off)


def remove_checkpointing(plan) -> None:
    """Give the plan's checkpointed layers their own forward back, and the model its `accepts_loss_kwargs` and
    `use_cache`, as before `trainer_arguments`."""
    uninstall(plan._installed)
    plan._installed = []
    caches_back(plan._caches)
    plan._caches = []
    if plan._marked is not None:
        module, before = plan._marked
        if before is _UNSET:
            vars(module).pop("accepts_loss_kwargs", None)
        else:
            module.accepts_loss_kwargs = before
        plan._marked = None

"""Hand a `memfit.fitting.FitPlan` to transformers' `Trainer`: `trainer_arguments(plan, args)` returns a copy of the
`TrainingArguments` with the plan's per-device batch and the gradient-accumulation steps that keep the effective
batch, and checkpoints the plan's layers on the model (only those: transformers' own `gradient_checkpointing`
would checkpoint every layer, so it is set off). `remove_checkpointing(plan)` undoes what it did to the model.

The gradient is the effective batch's, as `memfit.accumulate` gives it. For a plan made without `terms=` (the
loss is a mean over samples) the model is marked `accepts_loss_kwargs = False`, so that the Trainer divides each
micro-batch's mean loss by the accumulation steps: a model whose forward takes `**kwargs` but whose loss
ignores `num_items_in_batch` (BERT's sequence classification, transformers 5.x) would otherwise be trained on
the sum of the micro-batches' means, `steps` times the gradient (measured: weights 7e-3 apart after two AdamW
steps, against 1e-5 with the mark). With `terms=` the Trainer's own weighting by `num_items_in_batch` is kept.

The Trainer cannot run an uneven last micro-batch: when the plan's micro-batch does not divide the batch, the
per-device batch is the largest divisor of the batch below it (fewer bytes; the choice says so).

Example (not run here: it needs transformers):
    plan = memfit.fit(model, optimizer, batch, loss_fn, "8GiB")      # batch: one effective per-device batch
    trainer = transformers.Trainer(model, memfit.fitting.trainer.trainer_arguments(plan, args), train_dataset=ds)
"""

from __future__ import annotations

import dataclasses
import logging

from memfit.fitting.checkpointing import install, uninstall

__all__ = ["per_device_split", "remove_checkpointing", "trainer_arguments"]

log = logging.getLogger("memfit.fit")
_UNSET = object()


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
    if not plan._terms:                  # a mean over samples: the Trainer divides by the accumulation steps
        plan._marked = (plan._module, vars(plan._module).get("accepts_loss_kwargs", _UNSET))
        plan._module.accepts_loss_kwargs = False
    return dataclasses.replace(args, per_device_train_batch_size=batch, gradient_accumulation_steps=steps,
                               gradient_checkpointing=False)


def remove_checkpointing(plan) -> None:
    """Give the plan's checkpointed layers their own forward back, and the model its `accepts_loss_kwargs`, as
    before `trainer_arguments`."""
    uninstall(plan._installed)
    plan._installed = []
    if plan._marked is not None:
        module, before = plan._marked
        if before is _UNSET:
            vars(module).pop("accepts_loss_kwargs", None)
        else:
            module.accepts_loss_kwargs = before
        plan._marked = None

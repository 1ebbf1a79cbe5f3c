"""What `memfit.fit` says when no alternative fits: `BudgetExceeded` with the breakdown of the least any
alternative needs (parameters, gradients, optimizer state, the rest) and what would fit, each only where it would
help: a number of FSDP2 ranks (predicted by `memfit.sizing.ranks_needed`), bf16 autocast (its memory model at the
smallest micro-batch, as `levers=("bf16",)` would run it), an optimizer with less state (where the model's holds
some, and the step without it would fit)."""

from __future__ import annotations

import contextlib

import torch

from memfit.accumulation.checks import batch_dependent_modules
from memfit.batches import batch_slice
from memfit.budget import BudgetExceeded, format_bytes, model_device
from memfit.fitting.checkpointing import checkpointed
from memfit.memory.micro_batch import training_peak
from memfit.messages import first_line

__all__ = ["nothing_fits", "optimizer_state_bytes"]


def nothing_fits(model, module, optimizer, loss_fn, x, y, budget, choice, levers, bytes_of,
                 entry_grads: bool = False, predict: dict | None = None) -> BudgetExceeded:
    """BudgetExceeded with the breakdown of the least any alternative needs, and what would fit. `bytes_of(setting)`:
    the search's memory models of a setting (`finder.Peaks`); `entry_grads`: the plan keeps the gradients held on
    entry to give back (`restore_grads=True`); `predict`: the device the bytes are for (`training_peak`'s `device=`,
    `gpu=`; none: the model's)."""
    predict = predict or {}
    params = sum(p.nbytes for p in {id(p): p for p in module.parameters()}.values())
    grads = sum(p.nbytes for p in {id(p): p for p in module.parameters() if p.requires_grad}.values())
    least = min((a for a in choice.alternatives if a.bytes is not None), key=lambda a: a.bytes)
    # under the least's autocast too, as the search's memory model ran it (`finder.Peaks`): without it a bf16 plan's
    # breakdown was the float32 step's (a CNN with BatchNorm: 'bfloat16 autocast ... is 20.44 MiB', its 10.77 MiB)
    dtype = getattr(torch, least.setting.autocast) if least.setting.autocast else None
    with contextlib.ExitStack() as on:
        on.enter_context(checkpointed(module, least.setting.checkpoint))
        if dtype is not None and not predict:          # (for another device: `autocast=` names it)
            on.enter_context(torch.autocast(model_device(module).type, dtype=dtype))
        first = training_peak(model, optimizer, loss_fn, x, y, autocast=dtype, **predict)[0](least.micro_batch)
        need = training_peak(model, optimizer, loss_fn, x, y, entry_grads=True, autocast=dtype,
                             **predict)[0](least.micro_batch) if entry_grads else first     # first: none on entry
    state = optimizer_state_bytes(optimizer, module)
    static = params + grads + state
    items = [("parameters", params), ("gradients", grads), ("optimizer state", state),
             (f"activations and the rest at micro-batch {least.micro_batch}", max(0, first - static)),
             ("the previous step's gradients, kept through the micro-batches to give back (restore_grads=True)",
              max(0, need - max(first, static)))]
    what = ", ".join(f"{k} {format_bytes(v)}" for k, v in items if v or k != items[-1][0])
    if static > budget:
        head = (f"nothing fits: parameters + gradients + optimizer state alone need {format_bytes(static)} > budget "
                f"{format_bytes(budget)}")
    else:
        head = (f"nothing fits: the least any alternative needs (micro-batch {least.micro_batch}, "
                f"{least.setting.describe()}) is {format_bytes(need)} > budget {format_bytes(budget)}")
    dependent = batch_dependent_modules(module)       # batch statistics: two samples a rank at least
    more = _sharded(module, optimizer, loss_fn, x, y, budget, static, max(0, first - static), bool(predict),
                    2 if dependent else 1)
    if dependent:                                    # fewer samples per rank than in the batch
        more = [f"{h} (but {dependent[0].split(':')[0]} and any other batch statistics would then be each rank's "
                "samples', not the batch's: torch.nn.SyncBatchNorm.convert_sync_batchnorm keeps the batch's)"
                for h in more]
    smallest = min(a.micro_batch for a in choice.alternatives)
    cast = [] if "bf16" in levers or static > budget else _bf16(bytes_of, smallest, budget)
    # without its state (plain SGD keeps none) the step needs about that much less: offered where that would fit
    lighter = [f"an optimizer with less state (plain SGD keeps none; this one {format_bytes(state)}: about "
               f"{format_bytes(need - state)} without it)"] if state and need - state <= budget else []
    fixes = more + cast + lighter + ["a larger budget"]
    return BudgetExceeded(f"{head} ({what}). What would fit: {'; or '.join(fixes)}", needed=need, budget=budget,
                          items=items)


def _bf16(bytes_of, m: int, budget: int) -> list[str]:
    """levers=('bf16',) as a fix where its memory model (plain step at micro-batch m under bf16 autocast, as the
    lever runs it: not with checkpointing) fits the budget; said to be unchecked where that model fails."""
    from memfit.fitting.search import Setting
    try:
        need = bytes_of(Setting((), "bfloat16"))(m)
    except Exception as e:         # a hint inside an error: never replace the BudgetExceeded
        return [f"perhaps levers=('bf16',) (bf16 autocast; not checked: its memory model failed: {first_line(e)})"]
    if need > budget:
        return []
    return [f"levers=('bf16',) (bf16 autocast at micro-batch {m}: {format_bytes(need)} predicted)"]


MAX_WORLD = 64                  # the most FSDP2 ranks the hint tries


def _sharded(module, optimizer, loss_fn, x, y, budget: int, static: int, rest: int,
             elsewhere: bool = False, per_rank: int = 1) -> list[str]:
    """How many FSDP2 ranks a step at `per_rank` samples per rank (2 where batch statistics need them) needs, as
    a fix to offer. Each rank holds at least its
    shards of the parameters, gradients and optimizer state at once (in the optimizer's step): `static / d`, so the
    search starts at the smallest d where that fits, a lower bound (`static / d + rest` is not one: the optimizer's
    transients in `rest` shard too), and `ranks_needed` tries every count from there up, from one run of FSDP2's
    real code on fake tensors (CPU models). On another device (or bytes for another device, `elsewhere`: FSDP2 on
    CUDA is not predicted per rank), or where that run fails, the even split `static / d + rest` is offered, said
    to be an estimate."""
    low = next((d for d in range(2, MAX_WORLD + 1) if -(-static // d) <= budget), None)
    est = next((d for d in range(2, MAX_WORLD + 1) if static // d + rest <= budget), None)
    if low is None:
        return []
    even = "" if est is None else (f"about {est} devices sharding parameters, gradients and optimizer state (FSDP / "
                                   f"ZeRO: {format_bytes(static // est + rest)} each if they shard evenly")
    if elsewhere:
        return [even + "; FSDP2's per-rank peak on CUDA is not predicted)"] if even else []
    if any(t.device.type != "cpu" for t in module.parameters()):
        return [even + "; memfit.sizing.ranks_needed(model.cpu(), ...) predicts FSDP2's per-rank peak)"] if even else []
    from memfit.memory.fewest_ranks import NoWorldFits, ranks_needed
    try:
        w = ranks_needed(module, batch_slice(x, 0, per_rank), budget, per_rank, optimizer=optimizer,
                         loss_fn=loss_fn, target=batch_slice(y, 0, per_rank), at_least=low, max_world=MAX_WORLD)
    except NoWorldFits:            # predicted: sharding alone does not make it fit
        return [f"FSDP2 with checkpointing or bf16 ({MAX_WORLD} FSDP2 ranks alone still need more than the budget "
                f"per rank at {'one sample' if per_rank == 1 else f'{per_rank} samples'} each: activations do not "
                "shard)"]
    except Exception as e:         # a hint inside an error: never replace the BudgetExceeded
        return [even + f"; FSDP2's per-rank peak could not be predicted: {first_line(e)})"] if even else []
    return [f"{w} FSDP2 ranks (fully_shard on each block and the root, a plain step of "
            f"{'one sample' if per_rank == 1 else f'{per_rank} samples'} per rank, no "
            f"checkpointing: per-rank peak predicted by memfit.sizing.ranks_needed, from {low} ranks up)"]


def optimizer_state_bytes(optimizer, module) -> int:
    """Bytes of the optimizer's state once it has stepped: what it holds, else its kind's per-parameter state
    (Adam/AdamW: two tensors like each parameter; SGD with momentum: one)."""
    held = sum(v.nbytes for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    if held:
        return held
    trainable = sum(p.nbytes for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    name = type(optimizer).__name__.lower()
    per = 2 if "adam" in name else 1 if any(g.get("momentum") for g in optimizer.param_groups) else 0
    return per * trainable

"""What `memfit.fit` says when no alternative fits: `BudgetExceeded` with the breakdown of the least any
alternative needs (parameters, gradients, optimizer state, the rest) and what would fit (devices sharding the
state, bf16, an optimizer with less state)."""

from __future__ import annotations

import torch

from memfit.budget import BudgetExceeded, format_bytes
from memfit.fitting.checkpointing import checkpointed
from memfit.memory.micro_batch import training_peak

__all__ = ["nothing_fits", "optimizer_state_bytes"]


def nothing_fits(model, module, optimizer, loss_fn, x, y, budget, choice, levers) -> BudgetExceeded:
    """BudgetExceeded with the breakdown of the least any alternative needs, and what would fit."""
    params = sum(p.nbytes for p in {id(p): p for p in module.parameters()}.values())
    grads = sum(p.nbytes for p in {id(p): p for p in module.parameters() if p.requires_grad}.values())
    least = min((a for a in choice.alternatives if a.bytes is not None), key=lambda a: a.bytes)
    with checkpointed(module, least.setting.checkpoint):
        peak, _ = training_peak(model, optimizer, loss_fn, x, y)
        need = peak(least.micro_batch)
    state = optimizer_state_bytes(optimizer, module)
    static = params + grads + state
    items = [("parameters", params), ("gradients", grads), ("optimizer state", state),
             ("activations and the rest at micro-batch 1", max(0, need - static))]
    what = ", ".join(f"{k} {format_bytes(v)}" for k, v in items)
    if static > budget:
        head = (f"nothing fits: parameters + gradients + optimizer state alone need {format_bytes(static)} > budget "
                f"{format_bytes(budget)}")
    else:
        head = (f"nothing fits: the least any alternative needs (micro-batch {least.micro_batch}, "
                f"{least.setting.describe()}) is {format_bytes(need)} > budget {format_bytes(budget)}")
    more = [f"{d} devices sharding parameters, gradients and optimizer state (FSDP / ZeRO) need about "
            f"{format_bytes(static // d + max(0, need - static))} each" for d in (2, 4, 8)
            if static // d + max(0, need - static) <= budget][:1]
    cast = [] if "bf16" in levers or static > budget else ["levers=('bf16',) (bf16 autocast: fewer activation bytes)"]
    fixes = more + cast + \
        ["an optimizer with less state (SGD: none; AdamW: 2x the parameters)", "a larger budget"]
    return BudgetExceeded(f"{head} ({what}). What would fit: {'; or '.join(fixes)}", needed=need, budget=budget,
                          items=items)


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

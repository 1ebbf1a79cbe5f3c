"""The micro-batch size `memfit.accumulate` chooses: one whose predicted training step fits the budget.

`training_peak` turns two fake-tensor memory models of accumulate's own step (`step_memory_model` with the
output dropped once the loss is computed: the first micro-batch as a plain step, the later ones with the
gradients already held, which backward adds into) into the peak of the step in micro-batches of m; the
micro-batches are views of a batch already on the device. `choose_micro_batch` searches m in the budget.
The size chosen for a model is kept for its next steps (`chosen_size`: predicting runs whole fake steps, too
slow to repeat every step) and lowered there after an out-of-memory back-off (`lower_chosen`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch

from memfit.batches import batch_len, batch_slice, batch_tensors, batch_to
from memfit.budget import (
    BudgetExceeded,
    format_bytes,
    largest_fitting,
    model_device,
    parse_bytes,
    resolve_budget,
)
from memfit.device.allocators import rounder
from memfit.device.measure import held_bytes
from memfit.device.torch_private import storage_key
from memfit.memory.cache import ModelCache
from memfit.memory.recheck import exact_at
from memfit.memory.step import forward_state, same_tensor_key
from memfit.messages import first_line, whole_words

__all__ = ["auto_key", "choose_micro_batch", "chosen_size", "lower_chosen", "shared_tensors", "training_peak"]

MICRO_PHASES = ("forward", "backward")      # a micro-batch's ops (`StepMemoryModel.breakdown(phases=...)`)
STEP_PHASES = ("step", "zero_grad")         # the optimizer's step after the last, and what follows it

# model -> {auto key: (micro-batch size, why)}, for the model's next steps
_CHOSEN = ModelCache(fingerprinted=False)     # model -> {auto_key: (size, why)}: see auto_key for why not fingerprinted


def _scalar_loss(loss_fn: Callable, y_given: bool) -> Callable:
    """loss_fn as the memory model calls it: loss_fn(out) without a target, and a scalar (per-sample losses
    summed: the same ops and bytes as the weighting accumulate applies)."""
    def loss(out, *target):
        v = loss_fn(out, target[0] if y_given else None)
        return v.sum() if v.dim() else v
    return loss


def training_peak(model, optimizer, loss_fn, x, y, *, entry_grads: bool = False, device=None, gpu=None,
                  autocast: torch.dtype | None = None, steps: dict | None = None) -> tuple[Callable[[int], int], str]:
    """peak(m): predicted bytes of accumulate's step in micro-batches of m on the batch (x, y).

    Two fake-tensor memory models of accumulate's step (`step_memory_model(..., keep_output=False)`: the
    output is dropped once the loss is computed, as accumulate does). The first micro-batch, or the whole
    batch at once, is a plain step (parameters, gradients, optimizer state, activations, the backward's
    transient). Every later micro-batch runs with the gradients the first one left already there (backward
    adds into them: their storages, which a gradient that is a view of a larger buffer keeps whole); that run
    is made only when a micro-batch size is asked for. The optimizer step after the last is the plain step's.
    peak(m) is the largest over the first micro-batch (m), the middle ones (m) and the last (what is left), so
    it need not grow with m at every step: the search then stops at a size that fits, perhaps not the largest.
    The micro-batch is a view of the batch already on the device (the batch's bytes once, not the
    micro-batch's inputs). A DistributedDataParallel model also holds its gradient buckets.
    `entry_grads`: the gradients of the step before are held on entry (a gradient's worth): accumulate with
    `restore_grads=True` keeps them referenced through the micro-batches' forward and backward and lets them go
    before the optimizer's step (`accumulation.micro_step.KeptGrads`), so they are counted there and not in the
    step (where the peak of AdamW's step is: counting them there too put LeNet's prediction 6% above the real step
    at micro-batch 2). Without (accumulate's default), they are let go when the step begins and not counted.
    `device`, `gpu`: the device the bytes are for, as for `memfit.memory_model` (default the model's; "cuda" from a
    machine without a GPU predicts the CUDA step, the batch counted as on that device); `autocast`: forward and loss
    under this dtype (default the surrounding autocast's); `steps`: the optimizer step's source across the memory
    models of one `memfit.fit` (`step_memory_model(steps=)`).
    """
    from memfit.memory.step_model import step_memory_model  # one training step on fake tensors
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if ddp:
        from memfit.memory.rank_checks import check_ddp_wrapping
        check_ddp_wrapping(model)        # mixed_precision= and comm hooks hold bytes this model does not count
    module = model.module if ddp else model
    here, n = model_device(model), batch_len(x)
    # the device the bytes are for; another type than the model's: predicted, the batch to be on it (a view there)
    elsewhere = device is not None and torch.device(device).type != here.type
    device = torch.device(device) if elsewhere else here
    k = min(2, n)
    # The fake run counts lazily created optimizer state as held from the start, so an optimizer without
    # state gives the same figure; one with state fails there (AdamW's `step` is read with .item()).
    stateless = copy.copy(optimizer)
    stateless.state = defaultdict(dict)
    target = None if y is None else batch_to(batch_slice(y, 0, k), here)
    example = batch_to(batch_slice(x, 0, k), here)
    models = {}
    plain_runs: dict = {}       # the first micro-batch's runs, until the later ones' model is derived from them
    scalar_loss = _scalar_loss(loss_fn, y is not None)     # one wrapper: a run at another size uses it too

    def fit(held: bool):
        if held not in models:
            models[held] = step_memory_model(module, example, train=True, optimizer=stateless, target=target,
                                             loss_fn=scalar_loss, grads_held=held, plain_runs=plain_runs, steps=steps,
                                             keep_output=False, autocast=autocast,
                                             device=device if elsewhere else None, gpu=gpu)
        return models[held]
    fit(False)                  # fails here, not in the search, when the step cannot run on fake tensors
    exact: dict = {}

    def at(held: bool, m: int):
        """The model for micro-batches of m: an APPROXIMATE one (an estimate beyond the sizes it ran) with a run
        at m itself (`memory.recheck.exact_at`; a fake run costs the same at any size), else the model."""
        mm = fit(held)
        if getattr(mm, "_recheck", None) is None:
            return mm
        if (held, m) not in exact:
            bound = dataclasses.replace(mm, _recheck=mm._recheck.bound(scalar_loss, stateless))
            exact[held, m] = exact_at(bound, m) or mm
        return exact[held, m]
    grads = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    buckets = grads if ddp and not getattr(model, "gradient_as_bucket_view", False) else 0
    on_device = {same_tensor_key(t): t for t in batch_tensors(x) + batch_tensors(y) if t.device == device or elsewhere}
    batch_bytes = sum(t.nbytes for t in on_device.values())     # a tensor given twice, `(ids, ids)`, once
    # Micro-batches of tensors already on the device (x, y or both) are views: their bytes are in batch_bytes,
    # not new (two slices of a tensor given twice are one, as the memory model counts them); those on the host are
    # copied per micro-batch, each slice apart (two copies of a tensor given twice), and counted

    # accumulate's own: a micro-batch's weighted loss alive in backward (a block of its own on CUDA) and the
    # float64 buffer of the micro-batches' losses and a flag (`accumulation.micro_step.LossSum`), for k micro-batches
    rounded = rounder(device)
    scalars = lambda k: rounded(8) + rounded(8 * (k + 1))

    # the gradients held on entry: those a step in micro-batches of m leaves (the first micro-batch's storages,
    # larger than the parameters' where a gradient is a view of a larger buffer), or the ones held now if larger
    rounded_storages = {storage_key(s): rounded(s.nbytes()) for p in module.parameters() if p.grad is not None
                        for s in [p.grad.untyped_storage()]}
    held_now = sum(rounded_storages.values())
    entry = lambda m: max(fit(False).gradient_bytes(min(m, n)), held_now) if entry_grads else 0

    def step_at(m: int, first: int | None = None, last: bool = True, entered: int = 0) -> int:
        """A micro-batch of m: the first (first=None), or a later one after a first of `first` samples; with
        `last`, the optimizer's step after it too; `entered`: the bytes of the gradients held on entry."""
        held = first is not None
        k = -(-n // (first or m))                # micro-batches of the step (a later one's size need not be m)
        # the gradients a later micro-batch adds into are those the first one's backward left: where one is a
        # view of a larger buffer (a slice of torch.cat's), all of that buffer stays, not the parameter's bytes
        views = max(0, fit(False).gradient_bytes(first) - fit(True).gradient_bytes(m)) if held else 0

        def over(phases: tuple[str, ...]) -> int:
            parts = at(held, m).breakdown(m, phases=phases)
            inputs = min(parts.get("inputs", 0), batch_bytes * m // n)   # rounded down: never below reality
            return sum(parts.values()) - inputs + batch_bytes + buckets + scalars(k) + views
        micro = over(MICRO_PHASES) + entered     # the gradients held on entry: referenced until the step
        return max(micro, over(STEP_PHASES)) if last else micro

    def peak(m: int) -> int:
        held = entry(m)
        if m >= n:
            return step_at(n, entered=held)
        parts = -(-n // m)                 # micro-batches of m, the last one of what is left
        last = n - (parts - 1) * m
        middle = [step_at(m, first=m, last=False, entered=held)] if parts > 2 else []
        return max(step_at(m, last=False, entered=held), *middle, step_at(last, first=m, entered=held))
    how = (f"{models[False].method}; micro-batches after the first: the same with the gradients held"
           + (" + DDP gradient buckets" if buckets else ""))
    return peak, how


def choose_micro_batch(model, optimizer, loss_fn, x, y, n: int, budget, device,
                       entry_grads: bool = False) -> tuple[int, str]:
    """(micro-batch size, why): the whole batch when its predicted step fits the budget, else the micro-batch
    the search finds (the largest that fits where peak(m) grows with m, as it does but for the uneven last
    micro-batch; never one that does not fit). `entry_grads`: accumulate's `restore_grads` (the gradients held on
    entry stay referenced through the micro-batches: counted, whether held now or not, so that one size is kept
    for every step)."""
    limit = resolve_budget(budget, device)
    if budget is None:          # free memory does not count what the model and optimizer hold already
        limit += held_bytes(model, optimizer, grads=True)
    try:                        # the run with the gradients held is made in the search, so it is in here too
        peak, how = training_peak(model, optimizer, loss_fn, x, y, entry_grads=entry_grads)
        whole = peak(n)
        m = n if whole <= limit else largest_fitting(peak, limit, n - 1)
    except Exception as e:
        raise RuntimeError(f"micro_batch='auto' could not predict the training step's memory "
                           f"({whole_words(first_line(e), 200)}); pass "
                           "micro_batch=<int> (out-of-memory errors still back off)") from e
    if m == n:                  # the whole batch: no run with the gradients held is needed
        return n, f"the whole batch fits: predicted step {format_bytes(whole)} <= budget {format_bytes(limit)}"
    if m == 0:
        raise BudgetExceeded(f"a training step on one sample needs {format_bytes(peak(1))} (the batch's bytes "
                             f"included; {how}) but the budget is {format_bytes(limit)}; raise the budget, use a "
                             "smaller model or an optimizer with less state", needed=peak(1), budget=limit)
    above = peak(m + 1)             # peak need not grow with m at every step (the uneven last micro-batch)
    nxt = f", {m + 1} samples would need {format_bytes(above)}" if above > limit else ""
    return m, (f"predicted step {format_bytes(peak(m))} within the budget {format_bytes(limit)}{nxt}; the whole "
               f"batch of {n} needs {format_bytes(whole)} ({how})")


def auto_key(params: list[torch.nn.Parameter], optimizer, x, n: int, budget, restore_grads: bool = False,
             y=None) -> tuple:
    """What a kept size depends on: the optimizer, the trainable parameters, the batch's size and layout (and which
    of its tensors and y's are one tensor given twice),
    the budget, whether the gradients held on entry are kept (`restore_grads`), the surrounding autocast, the
    intra-op thread count (the memory model's kernel scratch is
    measured per thread count, as `step_memory_model` keys it). (Not the model's other state, which would
    cost a walk of every module each step: a size kept after, say, checkpointing is switched off backs off at
    the first out-of-memory.)"""
    trainable = sum(p.numel() for p in params)    # the trainable parameters: frozen layers need less
    return (id(optimizer), type(optimizer).__name__, trainable, n, None if budget is None else parse_bytes(budget),
            _signature(x), shared_tensors(x, y), restore_grads, forward_state(), torch.get_num_threads())


def chosen_size(model, optimizer, loss_fn, x, y, n, budget, device, world, key,
                entry_grads: bool = False) -> tuple[int, str]:
    """(size, why): the size kept for the model under `key`, chosen by `choose_micro_batch` the first time;
    with world > 1 the smallest over the ranks."""
    m, why = _CHOSEN.get(model, key, lambda: choose_micro_batch(model, optimizer, loss_fn, x, y, n, budget, device,
                                                                entry_grads))
    if world > 1:       # one size for all ranks, agreed every step: a rank's cache may hold what another's lacks
        from memfit.distributed import all_reduce
        agreed = int(all_reduce(torch.tensor([m], dtype=torch.int64), op=torch.distributed.ReduceOp.MIN,
                                what="micro-batch size"))
        if agreed != m:
            m, why = agreed, f"{why}; the smallest over ranks ({agreed}) is used"
    return m, why


def _signature(x) -> tuple:
    return tuple((t.shape[1:], t.dtype, t.device) for t in batch_tensors(x))


def shared_tensors(x, y) -> tuple:
    """Which tensors of x and then y are one tensor given twice (`(ids, ids)`): (index, index of the first) pairs,
    a part of the keys of what is kept for a batch layout, since such a batch holds the tensor once."""
    first: dict = {}
    return tuple((i, j) for i, t in enumerate(batch_tensors(x) + batch_tensors(y))
                 if (j := first.setdefault(same_tensor_key(t), i)) != i)


def lower_chosen(model, key: tuple, final: int) -> None:
    """After an out-of-memory back-off to `final`, the model's next steps start there."""
    kept = _CHOSEN.peek(model, key)
    if kept is not None:
        _CHOSEN.put(model, key, (final, f"{kept[1]}; lowered to {final} after an out-of-memory error"))

"""Checks `memfit.accumulate` makes before a step: the batch, the model (batch statistics, DDP), the sizes and
the loss's terms. Each raises (or warns) saying what was expected, what was found and how to fix it."""

from __future__ import annotations

import warnings

import torch

from memfit.accumulation.result import BatchDependentError
from memfit.batches import batch_slice, batch_tensors, batch_to
from memfit.budget import check_count
from memfit.device.torch_private import BatchNormBase, InstanceNormBase, own_children

__all__ = ["batch_dependent_modules", "batch_size", "check_batch_dependence", "check_distributed", "check_micro",
           "ignored_per_sample", "part_of", "terms_differ", "trained_device"]


# ---- the batch -------------------------------------------------------------------------------------
def batch_size(x, y) -> int:
    """N, the samples in (x, y): dim 0 of every tensor, which must agree."""
    ts = batch_tensors(x)
    if not ts:
        arrays = _places((x, y), lambda v: type(v).__module__ == "numpy")
        if arrays:
            raise TypeError(f"batch x must hold torch tensors; found numpy arrays at {', '.join(arrays)}. Fix: "
                            "torch.from_numpy(a) (.float() for float64 arrays a float32 model takes)")
        raise TypeError(f"batch x must be a tensor, a dict of tensors (e.g. tokenizer output) or a tuple of "
                        f"tensors; found {type(x).__name__}")
    sizes = {t.shape[0] if t.dim() else None for t in ts + batch_tensors(y)}
    if len(sizes) != 1 or None in sizes:
        found = _places((x, y), lambda v: isinstance(v, torch.Tensor), lambda t: t.shape[0] if t.dim() else "0-d")
        raise ValueError(f"every tensor of the batch needs the same first (batch) dimension, its samples; found "
                         f"{', '.join(found)}. Fix: give every tensor one row per sample (a per-batch value that is "
                         "not per sample, such as a flag, can pass as a Python value)")
    n = sizes.pop()
    if n == 0:
        raise ValueError("the batch is empty: nothing to accumulate")
    return n


def _places(batch, keep, say=None) -> list[str]:
    """"x['labels'] 4": the places in (x, y) of the leaves `keep` takes, each with `say(leaf)` when given."""
    from memfit.device.torch_private import keystr, tree_flatten_with_path
    out = []
    for path, v in tree_flatten_with_path(batch)[0]:
        if keep(v):
            text = keystr(path)
            out.append({"[0]": "x", "[1]": "y"}.get(text[:3], "the batch") + text[3:]
                       + ("" if say is None else f" {say(v)}"))
    return out


def part_of(v, s: int, e: int, device: torch.device):
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
    kinds = (BatchNormBase, InstanceNormBase)
    stack = [model]                   # the usual case, once a step: a plain walk, no names built
    while stack:
        m = stack.pop()
        if m.training and isinstance(m, kinds):
            break
        stack.extend(c for c in own_children(m).values() if c is not None)
    else:
        return []
    out = []
    for name, m in model.named_modules():
        if not m.training:
            continue
        if isinstance(m, BatchNormBase):
            out.append(f"{name or 'model'} ({type(m).__name__}): normalises by the statistics of the batch it sees")
        elif isinstance(m, InstanceNormBase) and m.track_running_stats:
            out.append(f"{name or 'model'} ({type(m).__name__}): its running statistics take one update per "
                       "micro-batch instead of one per batch")
    return out


def check_batch_dependence(model, allow: bool, found: list[str] | None = None) -> None:
    """Refuse (or with `allow`, warn about) `batch_dependent_modules(model)` (`found`: known already)."""
    found = batch_dependent_modules(model) if found is None else found
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


def check_micro(micro_batch) -> None:
    if micro_batch == "auto":
        return
    try:
        check_count("micro_batch", micro_batch, 1)      # numpy ints too
    except (TypeError, ValueError):
        raise ValueError(f"micro_batch must be 'auto' or an int >= 1; found {micro_batch!r}") from None


def check_grad_enabled(what: str = "accumulate (and plan.step, which runs it) takes") -> None:
    """Refuse a step with autograd off around it (`torch.no_grad()`, `torch.inference_mode()`): its forward records
    no graph, so no micro-batch gets a gradient and the optimizer's step changes nothing, silently (a plain loop's
    `loss.backward()` raises there)."""
    if not torch.is_grad_enabled():
        where = ("torch.inference_mode()" if torch.is_inference_mode_enabled()
                 else "torch.no_grad() or torch.set_grad_enabled(False)")
        raise RuntimeError(f"{what} a training step, and autograd is off "
                           f"around the call ({where}): no gradient would be computed and the optimizer would change "
                           "nothing. Expected gradients enabled; call it outside that block (or inside "
                           "torch.enable_grad())")


def _ddp_class():
    return torch.nn.parallel.DistributedDataParallel


def check_distributed(model, distributed: bool) -> int:
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


def trained_device(params: list[torch.nn.Parameter]) -> torch.device:
    """The device of the first parameter (as `memfit.budget.model_device`); a model without any is an error."""
    if not params:
        raise ValueError("the model has no parameters: there is nothing to train. Expected a module with "
                         "parameters (found none in model.parameters()); pass the module that holds the weights the "
                         "optimizer steps")
    return params[0].device


def check_optimizer_holds(params: list[torch.nn.Parameter], optimizer) -> None:
    """Refuse an optimizer that holds none of the model's trainable parameters: its step would change nothing
    (the usual cause: the model was copied, moved by `.to()` onto new tensors, or rebuilt after the optimizer was
    made from it)."""
    trained = [p for p in params if p.requires_grad]
    held = {id(q) for g in optimizer.param_groups for q in g["params"]}
    if trained and not any(id(p) in held for p in trained):
        raise ValueError(f"the optimizer holds none of the model's {len(trained)} trainable parameters (it holds "
                         f"{len(held)} others), so its step would change nothing. Expected an optimizer made from "
                         "this model's parameters: build it from model.parameters() after the model is copied, "
                         "moved or rebuilt")


def ignored_per_sample(y, ignore: int) -> list[int] | None:
    """Per sample, how many labels of y equal `ignore` (the loss's ignore_index, else -100), read in one transfer
    (one sync where y is on a GPU; `batch_terms` and `terms_differ` both answer from it); None where y is not
    integer labels. Its temporaries (a bool per label, an int64 per sample) are freed before the step."""
    if not (isinstance(y, torch.Tensor) and y.dim() >= 1 and y.numel() and not y.is_floating_point()):
        return None
    return (y == ignore).reshape(y.shape[0], -1).sum(1).tolist()


def terms_differ(x, y, ignore: int = -100, ignored: list[int] | None = None) -> str | None:
    """The warning to give when labels (y, or x['labels']) ignore (`ignore`: the loss's ignore_index, else -100) a
    different number of positions per sample (or some samples, one label each): a loss averaged over what counts
    weighs samples unequally, so weighting micro-batches by samples is not the full-batch step; None when they do
    not. Said, not refused: a loss that is a mean over samples is exact. Run before the step, when no gradient is
    held: its temporaries (a bool per label, an int64 per sample) then sit below the step's peak. `ignored`: y's
    counts per sample (`ignored_per_sample`), already read."""
    for t in (y, x.get("labels") if isinstance(x, dict) else None):
        counts = ignored if t is y and ignored is not None else ignored_per_sample(t, ignore)
        if counts is not None and min(counts) != max(counts):
            where = "y" if t is y else "x['labels']"
            expr = "y" if t is y else 'x["labels"]'
            return (f"accumulate: {where} ignores ({ignore}) a different number of positions per sample; if "
                    "loss_fn averages over the positions that count (cross_entropy and transformers' losses do), "
                    "micro-batches weighted by samples do not give the full-batch gradient. Pass "
                    f"terms=lambda x, y: ({expr} != {ignore}).sum() to weight them by the positions that count "
                    f"(({expr}[:, 1:] != {ignore}).sum() for a causal LM that shifts its labels), or ignore this "
                    "for a loss that is a mean over samples")
    return None

"""What a batch of n needs, for inference or a whole training step, without running it at full size: the answers
users ask for (`memory_model`, `max_batch_size`), from the engine (`memfit.memory`) or, when asked, the planner.

Every answer is for what the user runs:
- inference (train=False): the user's own `model(x)` under `torch.no_grad()` (an eager forward run on fake
  tensors by `memfit.memory.step_model`: nothing is allocated);
- planned=True: the planned forward `memfit.plan(model)` gives (the planner's arena: `memfit.planner.arena_model`),
  which holds only where that planned module runs;
- train=True: one training step (forward, loss, backward, optimizer step, zero_grad), from fake-tensor runs;
- parallel="ddp" or "fsdp": one rank's training step (`memfit.memory.ranks`).
On CUDA every answer is the caching allocator's reserved bytes (its replay over the step's allocations and
frees) plus the fixed costs (the CUDA context, cuBLAS workspaces), from any machine: `device="cuda"` without a GPU
predicts the CUDA step from here, with a GPU family's stated defaults (`gpu="H100"`, or a memory such as
"24GiB"). A `torch.compile`d module is predicted through the module it wraps (`method` says so). `max_batch_size`
searches the largest batch in a budget (`largest_fitting`: doubling, then bisection); on CUDA the largest batch the
allocator serves in it (`MemoryModel.serves`: with c10's retry after freeing its cache).

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).eval()
    >>> mm = memory_model(model, (64,))
    >>> mm.total_bytes(1000) > mm.total_bytes(10) > mm.param_bytes
    True
    >>> max_batch_size(model, (64,), "1MiB") > 0
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from memfit.budget import BudgetExceeded, check_count, format_bytes, largest_fitting, model_device
from memfit.memory.cuda_target import device_budget
from memfit.memory.fewest_ranks import ranks_needed
from memfit.memory.isolation import predicting
from memfit.memory.kinds import MemoryModel
from memfit.memory.ranks import rank_memory_model
from memfit.memory.step import is_shape, predicted_module, sample_shape, surrounding_autocast
from memfit.memory.step_model import step_memory_model
from memfit.planner.kept import planned_model_of

__all__ = ["activation_bytes", "max_batch_size", "memory_model", "plot_memory", "ranks_needed"]


@predicting()          # one prediction at a time; every RNG as found
def memory_model(model: torch.nn.Module, example_or_sample_shape, *, train: bool = False, planned: bool = False,
                 optimizer=None, loss_fn: Callable | None = None, target=None, autocast: torch.dtype | None = None,
                 dtype: torch.dtype = torch.float32, device=None, algorithm: str = "greedy_by_size",
                 parallel: str | None = None, world_size: int = 1, gpu=None, **parallel_options) -> MemoryModel:
    """The bytes `model` needs per batch size n: `.total_bytes(n)`, `.breakdown(n)`, `.method`, `.explain()`.

    By default the figures are for what you run yourself: inference is your `model(x)` under `torch.no_grad()`
    (eager, as PyTorch runs it), training (train=True) one step of forward, loss, backward, `optimizer.step()` and
    `zero_grad()`. Both come from running the real code on fake tensors at a few small batch sizes: nothing is
    allocated, and the model and optimizer are left as they were. With planned=True the figures are for the
    planned forward `memfit.plan(model)` gives (every activation in one arena: often less than eager, and only
    where that planned module runs).

    Args:
        model: the module (on its own device). A `torch.compile`d module is predicted through the module it wraps.
        example_or_sample_shape: one sample's shape without the batch dimension, or an example batch (a
            tensor, a tuple of tensors, or a dict such as input_ids + attention_mask); its leading
            dimension is the batch and is rescaled.
        train: the memory of one training step (forward, loss, backward, optimizer step, zero_grad).
        planned: the planned forward's memory (`memfit.plan`), for one input tensor; inference only.
        optimizer: the optimizer whose step and state are counted (train=True).
        loss_fn: `loss_fn(output, target)`; default the output's `.loss` or the sum of the outputs.
        target: an example target batch (or its sample shape), for loss_fn. None with a common loss
            (cross-entropy, NLL, MSE, L1, smooth L1, BCE with logits): built from the model's output, and
            `method` says which target was assumed; with any other loss, an error says what to pass.
        autocast: run forward and loss under `torch.autocast` with this dtype (e.g. torch.bfloat16); by default
            the dtype of the `torch.autocast` the call runs inside, if any.
        dtype: the input dtype when a sample shape is given.
        device: the device to predict for (default: the model's). "cuda" on a machine without a GPU predicts the
            CUDA step from here (the model stays where it is): fake runs with CUDA's kernels, the caching allocator
            replayed, the fixed costs of `gpu`'s stated defaults; `method` says how.
        gpu: on CUDA, the GPU the fixed costs are for: a name ("H100", "A100-40GB", "RTX 4090"), a compute
            capability such as (8, 6) or the GPU's memory ("24GiB"); default the GPU here (measured), else
            compute capability 9.0's stated defaults.
        algorithm: the planner's offset algorithm (planned=True).
        parallel: "ddp" or "fsdp" (train=True): the bytes one of `world_size` ranks holds, n being the batch per
            rank (`memfit.memory.ranks.rank_memory_model`, a `RankMemoryModel`).
        world_size: the number of ranks, with parallel.
        parallel_options: with parallel="fsdp", the wrapping (`units`, `reshard_after_forward`, `mp_policy`) and
            `backend` of `rank_memory_model`.

    Example:
        >>> import torch
        >>> mm = memory_model(torch.nn.Linear(8, 4), (8,))
        >>> mm.param_bytes, mm.total_bytes(2) - mm.param_bytes      # inputs 64 + output 32 + the CPU's margin 16
        (144, 112)
    """
    given, (model, note) = model, predicted_module(model)     # step_memory_model is given the compiled module
    if parallel_options and parallel is None:
        raise ValueError(f"{sorted(parallel_options)} are options of parallel='ddp' or 'fsdp'; found them without "
                         "parallel (memory_model takes no other keyword arguments)")
    training_only = [k for k, v in (("optimizer", optimizer), ("loss_fn", loss_fn), ("target", target))
                     if v is not None]
    if training_only and not train:      # else counted nowhere: the inference forward's figure, unsaid
        named = " and ".join(k + "=" for k in training_only)
        raise ValueError(f"{named} {'is' if len(training_only) == 1 else 'are'} for a training step, but train=False "
                         "(the default) predicts the inference forward, model(x) under torch.no_grad(), which has no "
                         f"optimizer or loss: pass train=True for the training step, or drop "
                         f"{named} for the forward")
    if parallel is not None:
        if not train:
            raise ValueError(f"parallel={parallel!r} models a training step; pass train=True")
        if device is not None or gpu is not None:
            parallel_options = {**parallel_options, "device": device, "gpu": gpu}
        return rank_memory_model(model, example_or_sample_shape, optimizer=optimizer, loss_fn=loss_fn,
                                 target=target, parallel=parallel, world_size=world_size, autocast=autocast,
                                 dtype=dtype, **parallel_options)
    if planned:
        if gpu is not None:
            raise ValueError(f"gpu={gpu!r} is for a CUDA prediction from another machine; the planned forward is "
                             "captured on the model's own device: drop gpu= or planned=True")
        return _planned(model, example_or_sample_shape, train, autocast, dtype, device, algorithm)
    if autocast is None:             # the forward runs under the autocast around the call: count that one
        autocast = surrounding_autocast(torch.device(device).type if device is not None else model_device(model).type)
    return step_memory_model(given, example_or_sample_shape, train=train, optimizer=optimizer, loss_fn=loss_fn,
                             target=target, autocast=autocast, dtype=dtype, device=device, why=note, gpu=gpu)


def _planned(model, example, train: bool, autocast, dtype, device, algorithm: str):
    """The planned forward's memory model (`memfit.planner.kept.planned_model_of`), or why it cannot be asked for."""
    how = "planned=True is the memory of the planned forward memfit.plan gives"
    if train:
        raise ValueError(f"{how}, an inference forward; a training step is not planned: pass train=True without "
                         "planned=True")
    if isinstance(example, torch.Tensor):
        example, dtype = tuple(example.shape[1:]), example.dtype
    if not is_shape(example):
        raise ValueError(f"{how}, for one input tensor; found {type(example).__name__} inputs: drop planned=True "
                         "for the eager forward's memory")
    if autocast is not None or surrounding_autocast(model_device(model).type) is not None:
        raise ValueError(f"{how}, which does not run under torch.autocast; drop planned=True for the eager forward "
                         "under autocast")
    if device is not None and torch.device(device) != model_device(model):
        raise ValueError(f"{how} on the model's own device ({model_device(model)}); found device={str(device)!r}: "
                         "move the model there, or drop planned=True")
    return planned_model_of(model, sample_shape(example), dtype, algorithm)


def activation_bytes(model: torch.nn.Module, sample_shape, batch_sizes: Sequence[int],
                     dtype: torch.dtype = torch.float32, **options) -> list[int]:
    """`memory_model(model, sample_shape, dtype=dtype, **options).total_bytes(n)` for each batch size, in order.

    Example:
        >>> import torch
        >>> a, b = activation_bytes(torch.nn.Linear(8, 4), (8,), [10, 20])
        >>> b - a                # 10 more samples: inputs 320 + outputs 160 bytes
        480
    """
    mm = memory_model(model, sample_shape, dtype=dtype, **options)
    return [mm.total_bytes(n) for n in batch_sizes]


def max_batch_size(model: torch.nn.Module, sample_shape, budget: int | str | None = None, *, train: bool = False,
                   planned: bool = False, optimizer=None, loss_fn: Callable | None = None, target=None,
                   autocast: torch.dtype | None = None, dtype: torch.dtype = torch.float32, device=None,
                   extra_bytes_per_sample: int = 0, limit: int = 2**31, parallel: str | None = None,
                   world_size: int = 1, device_memory: int | str | None = None, gpu=None) -> int:
    """The largest batch n whose `memory_model(...).total_bytes(n)` + `extra_bytes_per_sample * n` fit `budget`;
    on CUDA, the largest the caching allocator serves in it (`serves`: reserved bytes, with c10's retry after
    freeing its cache, in what the fixed costs leave).

    By default for your own `model(x)` under `torch.no_grad()`; with train=True (and optimizer, loss_fn, target)
    the largest batch one training step fits; with planned=True the largest the planned forward (`memfit.plan`) fits.

    Args:
        sample_shape: one sample's shape, or an example batch (see `memory_model`).
        budget: bytes, or a string such as "64MiB"; with `device_memory`, default all of it.
        device_memory: the GPU's memory (e.g. "24GiB") for a CUDA prediction (device="cuda"): the budget when none
            is given, and the GPU family whose stated fixed costs apply when `gpu` is not given.
        gpu: the GPU the fixed costs are for (see `memory_model`).
        extra_bytes_per_sample: anything else held per sample (a compact copy of the batch, say).
        limit: the largest batch considered.
        parallel, world_size: "ddp" or "fsdp" on that many ranks (train=True): the largest batch per rank.

    Raises:
        BudgetExceeded: not even one sample fits; the message lists what one sample needs.

    Example:
        >>> import torch
        >>> max_batch_size(torch.nn.Linear(8, 4), (8,), 144 + 16 + 48 * 10)  # params, CPU margin, 48 B a sample
        10
    """
    budget, gpu = device_budget("max_batch_size", budget, device, device_memory, gpu)
    extra_bytes_per_sample = check_count("extra_bytes_per_sample", extra_bytes_per_sample, 0)
    mm = memory_model(model, sample_shape, train=train, planned=planned, optimizer=optimizer, loss_fn=loss_fn,
                      target=target, autocast=autocast, dtype=dtype, device=device, parallel=parallel,
                      world_size=world_size, gpu=gpu)
    need = lambda n: mm.total_bytes(n) + extra_bytes_per_sample * n
    if mm.device.type == "cuda" and hasattr(mm, "serves"):     # what the allocator serves: extra bytes taken first
        n = largest_fitting(lambda n: 0 if mm.serves(n, budget - extra_bytes_per_sample * n) else budget + 1,
                            budget, limit)
    else:
        lower = getattr(mm, "lower_bytes", None)   # a step model: its measured workspaces asked near the answer only
        n = largest_fitting(need, budget, limit,
                            below=None if lower is None else lambda n: lower(n) + extra_bytes_per_sample * n)
        if n and getattr(mm, "_recheck", None) is not None:
            n = _checked(mm, n, budget, extra_bytes_per_sample)
    if n == 0:
        parts = {**mm.breakdown(1), **({"extra per sample": extra_bytes_per_sample} if extra_bytes_per_sample else {})}
        what = ", ".join(f"{k} {format_bytes(v)}" for k, v in parts.items() if v)
        raise BudgetExceeded(f"not even a batch of 1 fits: it needs {format_bytes(need(1))} ({what}) but the budget "
                             f"is {format_bytes(budget)}; raise the budget or use a smaller model",
                             needed=need(1), budget=budget, items=list(parts.items()))
    return n


def _checked(mm, n: int, budget: int, extra: int) -> int:
    """An APPROXIMATE step model's answer n checked by a fake run at n, and, where that does not fit, the largest
    batch whose own run fits (bisection; a fake run costs the same at any size): its line is an estimate beyond the
    sizes it ran, and was 185x below a real step whose memory grows as n^3 (`memfit.memory.recheck`)."""
    from memfit.memory.recheck import exact_total

    def fits(k: int) -> bool:
        total = exact_total(mm, k)
        return total is None or total + extra * k <= budget     # None: no run possible, the estimate stands
    if fits(n):
        return n
    lo, hi = 0, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    warnings.warn(f"max_batch_size: the memory model is an estimate beyond the batch sizes it ran, and its answer "
                  f"{n} does not fit {format_bytes(budget)} when run at {n}; {lo} is the largest batch whose own "
                  "fake run fits", stacklevel=3)
    return lo


def plot_memory(mm: MemoryModel, path, max_batch: int, budget: int | None = None, *,
                name: str = "", largest: int | None = None):
    """Write a picture of the bytes by kind (stacked) against the batch size, 1..max_batch, with the budget line
    and, when `largest` is given, a line at the largest batch within it. `name` heads the title (the model).

    Needs matplotlib (optional, imported here). Returns the path written.
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plot_memory needs matplotlib, which is not installed; pip install matplotlib "
                          "(or 'memfit[demo]')") from None
    import textwrap
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # 17 sizes, each exact: a training model runs the kernels whose scratch it measures at every size asked about
    # (65 sizes cost minutes on a CNN), and the stack is piecewise linear between them
    sizes = sorted({max(1, round(max_batch * i / 16)) for i in range(17)} | ({largest} if largest else set()))
    parts = [mm.breakdown(n) for n in sizes]
    kinds = list(dict.fromkeys(k for p in parts for k in p))
    mib = 2.0 ** 20
    fig, ax = plt.subplots(figsize=(8, 4.8))
    ax.stackplot(sizes, [[p.get(k, 0) / mib for p in parts] for k in kinds], labels=kinds, alpha=0.85)
    if budget is not None:
        ax.axhline(budget / mib, color="black", linestyle="--", label=f"budget {format_bytes(budget)}")
    if largest:
        ax.axvline(largest, color="black", linestyle=":", label=f"largest batch within it: {largest}")
    ax.set_xlabel("batch size")
    ax.set_ylabel("MiB at the peak")
    what = "one training step" if mm.train else "one forward"
    # the whole method, wrapped: a title cut at a fixed width ended mid-word
    ax.set_title(f"{name + ': ' if name else ''}{what}, bytes at the peak by kind\n"
                 + "\n".join(textwrap.wrap(mm.method, 125)), fontsize=7, loc="left")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

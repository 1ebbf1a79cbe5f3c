"""Evaluation in chunks: exact whole-set metrics, a chunk size from the budget, OOM back-off.

A common work-around for evaluating MNIST on a 1 GB GPU splits the test set into chunks of 50 and
averages the chunk accuracies, which is wrong when the last chunk is smaller. `evaluate` keeps
metrics as sums and counts (`memfit.metrics`), picks the largest chunk whose peak memory fits
the budget (from the activation planner when it can capture the model, else from two small
measured runs), and when a chunk still runs out of memory it frees the chunk, halves it,
retries only that chunk and grows back afterwards.

Example:
    >>> import torch, numpy as np
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 3))
    >>> x = np.random.default_rng(0).integers(0, 256, (100, 1, 4, 4), dtype=np.uint8)
    >>> y = np.arange(100) % 3
    >>> r = evaluate(model, (x, y), chunk_size=7, device="cpu", progress=False)
    >>> r.n, r.chunks, sorted(r.metrics)
    (100, 15, ['accuracy', 'loss'])
"""

from __future__ import annotations

import gc
import textwrap
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from memfit.budget import BudgetExceeded, check_count, format_bytes, plural, resolve_budget, resolve_device
from memfit.dataset import CompactDataset
from memfit.fields import batch_len, batch_nbytes, batch_slice, batch_to, forward
from memfit.metrics import Metric, logits_of, make_metric
from memfit.progress import progress as progress_bar

OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
                "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input")


def is_oom(e: BaseException) -> bool:
    """True for torch.OutOfMemoryError and the allocator errors of CUDA, HIP, MPS and the CPU."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not isinstance(e, BudgetExceeded):
        return True
    return isinstance(e, RuntimeError) and any(m.lower() in str(e).lower() for m in OOM_MESSAGES)


@dataclass
class EvalResult:
    """What `evaluate` measured. `metrics` maps each requested metric to its whole-set value."""
    metrics: dict
    n: int
    chunk_size: int
    chunks: int
    retries: int
    peak_bytes: int | None          # None: not measured (CPU with a fixed chunk size or a small set)
    seconds: float
    runner: str = "eager"
    reason: str = ""                # how the chunk size and runner were chosen, whole sentences
    oom_sizes: list = field(default_factory=list)

    def __str__(self) -> str:
        vals = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {type(v).__name__}"
                         for k, v in self.metrics.items())
        peak = "not measured" if self.peak_bytes is None else format_bytes(self.peak_bytes)
        head = (f"evaluated {plural(self.n, 'sample')} in {plural(self.chunks, 'chunk')} of up to {self.chunk_size} "
                f"({plural(self.retries, 'out-of-memory retry', 'out-of-memory retries')}), {self.seconds:.2f} s, "
                f"peak {peak}, {self.runner}: {vals}")
        if not self.reason:
            return head
        # wrapped, never cut: the reason is the part that explains a surprising choice
        return head + "\n" + textwrap.fill(f"why: {self.reason}", width=100, subsequent_indent="     ",
                                           break_long_words=False, break_on_hyphens=False)


# ---- data -----------------------------------------------------------------------------------------
class _Chunks:
    """Decoded chunks [s, e) of a CompactDataset, copied compact to `device` and decoded there."""

    def __init__(self, ds: CompactDataset, device: torch.device):
        self.ds, self.device, self.n = ds, device, len(ds)
        self.sample_shape, self.dtype = ds.sample_shape, ds.dtype
        self.fields = ds.fields is not None      # a dict of inputs: model(**x), not planned
        self.compact_per_sample = ds.row_nbytes if ds.device != device else 0
        self.decoded_per_sample = ds.batch_nbytes(1)

    def get(self, s: int, e: int):
        idx = torch.arange(s, e, device=self.ds.device)
        rows = self.ds.rows(idx)
        y = None if self.ds.y is None else self.ds.y[s:e]
        if self.ds.device != self.device:          # compact bytes cross the bus, not float32
            rows = rows.to(self.device, non_blocking=True)
            y = None if y is None else y.to(self.device, non_blocking=True)
        return self.ds.decode(rows), (None if y is None else y.long())


def as_chunks(data, device: torch.device):
    """A CompactDataset, a memfit Loader (any iterable of (x, y) batches) or (x, y) arrays."""
    if isinstance(data, CompactDataset):
        if len(data) == 0:
            raise ValueError("the data is empty: nothing to evaluate")
        return _Chunks(data, device)
    if isinstance(data, tuple) and len(data) == 2:
        x, y = data
        if isinstance(x, dict):     # several inputs per sample; from_arrays checks every count
            return _Chunks(CompactDataset.from_arrays(x, y, device="cpu"), device)
        if y is not None and len(y) != len(x):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)} labels; they must match")
        if len(x) == 0:
            raise ValueError("the data is empty: nothing to evaluate")
        # stored compactly on the host; each chunk crosses to the device compact and is decoded there
        return _Chunks(CompactDataset.from_arrays(x, y, device="cpu"), device)
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, dict)):
        return data
    raise TypeError(f"data must be a CompactDataset, a memfit Loader (or iterable of (x, y) batches) or an "
                    f"(x, y) tuple of arrays; found {type(data).__name__}")


# ---- chunk size ------------------------------------------------------------------------------------
def param_bytes(model: torch.nn.Module) -> int:
    return sum(t.nbytes for t in model.parameters()) + sum(t.nbytes for t in model.buffers())


def _planned_peak(model, sample_shape, dtype) -> tuple[Callable[[int], int] | None, str]:
    """(peak(n) from the activation planner, "planner"), or (None, why not) when it cannot capture the model."""
    try:
        from memfit.planner.cache import memory_model_of
        mm = memory_model_of(model, sample_shape, dtype)
    except Exception:          # export failures are expected for some models; the runner says why
        return None, ", as the planner could not capture the model"
    return mm.total_bytes, "planner"


def _fake_peak(model, chunks: _Chunks, why: str) -> tuple[Callable[[int], int] | None, str]:
    """peak(n) of an eager forward from fake-tensor runs (`memfit.footprint`; no export, nothing allocated),
    cached per model; (None, why) when even that fails."""
    try:
        from memfit.planner.cache import forward_memory_of
        x, _ = chunks.get(0, 1)
        mm = forward_memory_of(model, x)
    except Exception as e:     # a model fake tensors cannot run: measure real runs instead
        return None, f"{why}; fake-tensor estimate failed: {first_line(e)}"
    return mm.total_bytes, f"fake-tensor forward{why}"


def _measured_peak(model, runner, chunks: _Chunks, sizes=(4, 16)) -> Callable[[int], int]:
    """Fit peak(n) = a + b*n from two small measured runs (live bytes above the start)."""
    from memfit.measure import track_memory
    points = []
    for n in sorted({min(s, chunks.n) for s in sizes}):
        x, _ = chunks.get(0, n)
        with torch.inference_mode(), track_memory(chunks.device) as mem:
            out = forward(runner, x)
            del out
        points.append((n, mem.peak + batch_nbytes(x)))
        del x
    if len(points) == 1:
        n, p = points[0]
        b, a = p / n, 0.0
    else:
        (n1, p1), (n2, p2) = points
        b = max((p2 - p1) / (n2 - n1), 0.0)
        a = max(p1 - b * n1, 0.0)
    base = param_bytes(model)
    # 10% head-room on the slope: extrapolating from small sizes tends to under-estimate
    return lambda n: int(base + a + 1.1 * b * n)


def largest_fitting(peak: Callable[[int], int], budget: int, upper: int) -> int:
    """Largest n in [1, upper] with peak(n) <= budget (peak is non-decreasing), 0 when none fits."""
    if peak(1) > budget:
        return 0
    lo, hi = 1, 1
    while hi < upper and peak(min(2 * hi, upper)) <= budget:
        lo = hi = min(2 * hi, upper)
        if hi == upper:
            return upper
    hi = min(2 * hi, upper)
    while lo < hi:                      # invariant: peak(lo) fits, the answer is < hi + 1
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid - 1)
    return lo


# Beyond a few thousand samples a chunk only holds more memory: it runs no faster (on 2 CPU cores a
# 4-layer CNN took 3.4 s for 10,000 samples in chunks of 2,500 and 4.5 s in one chunk of 10,000), and
# every GPU is saturated well below it. chunk_size=int forces a larger one.
MAX_AUTO_CHUNK = 4096


def choose_chunk(model, chunks, budget: int, runner, use_plan: bool = True) -> tuple[int, Callable[[int], int], str]:
    """(chunk size, peak estimate, how it was chosen) for the largest chunk within the budget,
    at most MAX_AUTO_CHUNK samples."""
    extra = chunks.compact_per_sample
    peak, how = None, (", as the planner takes one input tensor and this data has several fields" if chunks.fields
                       else ", as planned=False")
    if use_plan and not chunks.fields:
        peak, how = _planned_peak(model, chunks.sample_shape, chunks.dtype)
    if peak is None:
        peak, how = _fake_peak(model, chunks, how)
    if peak is None:
        peak, how = _measured_peak(model, runner, chunks), f"measured at 2 sizes{how}"
    total = lambda n: peak(n) + extra * n
    n = largest_fitting(total, budget, chunks.n)
    if n == 0:
        raise BudgetExceeded(f"one sample needs {format_bytes(total(1))} ({how}: parameters "
                             f"{format_bytes(param_bytes(model))} included) but the budget is {format_bytes(budget)}; "
                             "raise the budget or use a smaller model", needed=total(1), budget=budget)
    if n > MAX_AUTO_CHUNK:
        return MAX_AUTO_CHUNK, total, (f"{MAX_AUTO_CHUNK} samples (estimated peak ({how}) "
                                       f"{format_bytes(total(MAX_AUTO_CHUNK))}): {n} would fit the budget "
                                       f"{format_bytes(budget)}, but larger chunks hold more memory and run no faster")
    return n, total, (f"largest chunk whose estimated peak ({how}) {format_bytes(total(n))} fits the budget "
                      f"{format_bytes(budget)}")


# ---- the loop --------------------------------------------------------------------------------------
def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _run_chunk(runner, metrics: dict[str, Metric], x, y, output_fn, watch):
    """Forward one chunk and compute every metric's contribution; nothing is committed here."""
    out = logits_of(forward(runner, x), output_fn)
    watch(out)
    return [m.contribution(out, y) for m in metrics.values()]


class NanWatch:
    """Warns once when a chunk's outputs are all NaN (a broken model then scores chance, silently)."""

    def __init__(self) -> None:
        self.where, self.warned = "", False

    def __call__(self, out: torch.Tensor) -> None:
        if self.warned or not out.is_floating_point() or not out.numel() or not bool(torch.isnan(out).all()):
            return
        self.warned = True
        warnings.warn(f"the model's outputs are all NaN for {self.where}: its metrics there are meaningless "
                      "(check the weights, the input normalisation and the dtype)", RuntimeWarning, stacklevel=2)


def evaluate(model: torch.nn.Module, data, *, metrics=("accuracy", "loss"), loss_fn: Callable | None = None,
             loss_reduction: str | None = None, output_fn: Callable | None = None,
             chunk_size: int | str = "auto", budget: int | str | None = None, device=None,
             progress: bool | None = True, planned: bool | None = None, distributed: bool = False) -> EvalResult:
    """Evaluate `model` on `data` in chunks and return exact whole-set metrics.

    Args:
        model: a module that maps a batch (n, *sample_shape) to outputs (n, classes); a dataset of
            fields (`from_arrays({"input_ids": ..., "attention_mask": ...}, y)`) is passed as `model(**x)`.
        data: a CompactDataset, a memfit Loader (any iterable of (x, y) batches), or (x, y) arrays,
            which are stored compactly (and losslessly) on the host on the way in.
        metrics: names ('accuracy', 'topk:5', 'loss', 'confusion') or torchmetrics-style objects
            (keyed by class name, '_2' added when repeated), or a dict {result key: either}.
        loss_fn: used by 'loss'; default cross entropy. torch losses, partials and functions with a
            `reduction` parameter are asked for per-sample values; a function that returns a scalar
            needs `loss_reduction`.
        loss_reduction: 'mean' or 'sum': what a scalar-returning `loss_fn` does over a chunk.
        output_fn: picks the logits from the model's output; default rule (`memfit.metrics.logits_of`):
            a tensor; `.logits` of a ModelOutput; `["logits"]` of a dict; the first element of a tuple/list.
        chunk_size: 'auto' (the largest that fits `budget`, at most MAX_AUTO_CHUNK = 4096 samples:
            larger chunks run no faster) or an int.
        budget: bytes or a string like '1GiB': parameters, activations, the decoded chunk and outputs
            must fit. Default: the device's free memory minus a margin, plus the model's own bytes.
        device: where to evaluate; default the model's device.
        progress: a progress bar counting samples (only on a terminal).
        planned: run through the activation planner (`memfit.plan`): None = when chunk_size is 'auto',
            the set is not small (capture would cost more than the run) and the planner can capture
            the model; `EvalResult.reason` says which and why.
        distributed: every rank of the initialised process group evaluates its shard (a whole
            CompactDataset or arrays are sharded here; a Loader should be distributed already);
            sums and counts are all-reduced, so every rank returns the single-process result.
            The auto chunk size is the minimum over ranks; out-of-memory back-off stays local.

    Raises:
        ValueError/TypeError for bad input; BudgetExceeded when one sample does not fit; the
        original error when a single sample runs out of memory; with `distributed`, an error on
        every rank naming the rank that failed.
    """
    t0 = time.perf_counter()
    dev = _model_device(model, device)
    mets = _metrics(metrics, loss_fn, loss_reduction)
    if not mets:
        raise ValueError("metrics is empty; ask for at least one, e.g. metrics=('accuracy',)")
    if distributed:
        from memfit import distributed as mdist
        if not mdist.is_distributed():
            raise ValueError("distributed=True needs an initialised torch.distributed process group "
                             "(start with torchrun, or call init_process_group first)")
    was_training = model.training
    model.eval()
    error, res, runner, runner_name = None, None, model, "eager"
    try:
        chunks = as_chunks(_shard(data) if distributed else data, dev)
        size, estimate, reason = _chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned)
        if isinstance(chunks, _Chunks) and _use_planner(chunks, chunk_size, planned, budget, distributed):
            runner, why = _planned_runner(model, chunks, size, planned)
            runner_name = "planned" if runner is not model else "eager"
            reason = f"{reason}; {why}" if why else reason
        res = _loop(runner, chunks, mets, size, dev, progress, output_fn, allow_empty=distributed)
    except Exception as e:
        if not distributed or isinstance(e, mdist.RankFailed):    # every rank already knows: agree no further
            raise
        error = e
    finally:
        model.train(was_training)
        if runner is not model:
            from memfit.planner.cache import give_back
            give_back(runner)       # the arena is freed now; the plans stay for the next call
    if distributed:
        mdist.agree(error, "memfit.evaluate")       # every rank learns whether one failed, then raises
        mdist.reduce_states([m.state for m in mets.values() if m.reduce])
        for m in mets.values():
            if m.reduce and "n" in m.state:
                m.n = int(m.state["n"])
        counts = torch.tensor([res["n"], res["chunks"], res["retries"]], dtype=torch.int64)
        mdist.all_reduce(counts, what="evaluate counts")
        res["n"], res["chunks"], res["retries"] = (int(v) for v in counts)
    peak = _peak(dev, estimate, res["max_n"])
    values = {k: m.compute() for k, m in mets.items()}
    return EvalResult(values, res["n"], size or res["max_n"], res["chunks"], res["retries"], peak,
                      time.perf_counter() - t0, runner_name, reason, res["oom_sizes"])


# A set this small runs in one eager chunk: capturing the model for the planner (0.5 to 10 s for a
# real model) would cost more than the whole run (HF ResNet-50 on 32 images: 8.6 s planned, 2.0 s eager).
SMALL_SET = 1024


def _small(chunks, chunk_size, planned, budget) -> bool:
    """One eager chunk, no capture and no measured runs: a small set under the default budget."""
    return (isinstance(chunks, _Chunks) and chunk_size == "auto" and planned is None and budget is None
            and chunks.n <= SMALL_SET)


def _use_planner(chunks, chunk_size, planned, budget, distributed) -> bool:
    if planned is False or chunks.fields:
        return False
    if planned:
        return True
    return chunk_size == "auto" and not (not distributed and _small(chunks, chunk_size, planned, budget))


def _shard(data):
    """This rank's part of whole data; shards and iterables (a distributed Loader) pass through."""
    if isinstance(data, CompactDataset):
        return data if data.shard_info is not None else data.shard()
    if isinstance(data, tuple) and len(data) == 2:
        return CompactDataset.from_arrays(*data, device="cpu").shard()
    return data


def _chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned) -> tuple[int, Callable | None, str]:
    if not isinstance(chunks, _Chunks):
        return 0, None, "batches of the loader"
    if chunk_size != "auto":
        why = ("" if planned else "; the planner is not used with a fixed chunk_size (pass planned=True to "
               "run it, or chunk_size='auto' to size chunks from it)")
        return _forced(chunk_size, chunks.n), None, f"chunk_size {chunk_size} given{why}"
    if not distributed and _small(chunks, chunk_size, planned, budget):
        return chunks.n, None, (f"one eager chunk of all {chunks.n} samples: a set this small (<= {SMALL_SET}) runs "
                                "faster than capturing the model for the planner; out-of-memory back-off halves "
                                "the chunk if needed")
    limit = resolve_budget(budget, dev) + (param_bytes(model) if budget is None else 0)
    size, estimate, reason = choose_chunk(model, chunks, limit, model, use_plan=planned is not False)
    if distributed:             # one size for all: a rank's back-off then never waits on another's
        from memfit import distributed as mdist
        agreed = mdist.smallest(size, "memfit.evaluate chunk size")     # also stops every rank if one failed
        if agreed != size:
            size, reason = agreed, f"{reason}; the smallest over ranks ({agreed}) is used"
    return size, estimate, reason


def _metrics(specs, loss_fn, loss_reduction=None) -> dict[str, Metric]:
    """{result key: metric}: names key themselves, objects their class name (suffixed when repeated);
    a dict names its own keys."""
    items = specs.items() if isinstance(specs, dict) else ((None, s) for s in specs)
    out: dict[str, Metric] = {}
    for key, spec in items:
        metric = make_metric(spec, loss_fn, loss_reduction)
        key = key or (spec if isinstance(spec, str) else metric.name)
        base, i = key, 2
        while key in out:
            key, i = f"{base}_{i}", i + 1
        out[key] = metric
    return out


def _forced(chunk_size, n: int) -> int:
    try:
        return min(check_count("chunk_size", chunk_size, 1), n)
    except (TypeError, ValueError):                   # 'auto' is the other valid value: say so
        raise ValueError(f"chunk_size must be 'auto' or an int >= 1; found {chunk_size!r}") from None


def _model_device(model, device) -> torch.device:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; found {type(model).__name__}")
    params = next(iter(model.parameters()), None)
    have = params.device if params is not None else None
    dev = resolve_device(device if device is not None else have)
    if have is not None and have != dev and not (have.type == dev.type == "cuda" and have.index == dev.index):
        raise ValueError(f"the model is on {have} but device={str(dev)!r}; move it with model.to('{dev}') "
                         f"or pass device='{have}'")
    return dev


def first_line(e: BaseException) -> str:
    """'TypeName: first line of the message', whole: never cut mid-word."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _planned_runner(model, chunks: _Chunks, size: int, required: bool | None):
    try:
        from memfit.planner.cache import borrow_plan
        example = torch.empty((min(size, chunks.n), *chunks.sample_shape), dtype=chunks.dtype, device=chunks.device)
        return borrow_plan(model, example), ""      # captured once per model, given back below
    except Exception as e:
        if required:
            raise
        return model, f"run eagerly: the planner could not capture the model ({first_line(e)})"


def _peak(dev: torch.device, estimate, max_n: int) -> int | None:
    """The device's measured peak on CUDA; else the estimate the chunk was sized by; None: not measured."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev)
    return int(estimate(max_n)) if estimate is not None else None


def _loop(runner, chunks, metrics: dict[str, Metric], size: int, dev: torch.device, show, output_fn=None,
          allow_empty: bool = False) -> dict:
    total = chunks.n if isinstance(chunks, _Chunks) else None
    bar = progress_bar(total, "evaluating", unit="sample", enabled=show)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    stats = {"n": 0, "chunks": 0, "retries": 0, "max_n": 0, "oom_sizes": []}
    limit, failed, watch = size, set(), NanWatch()
    run = lambda x, y: _run_chunk(runner, metrics, x, y, output_fn, watch)
    with torch.inference_mode():
        if isinstance(chunks, _Chunks):
            s, cur = 0, size
            while s < chunks.n:
                n = min(cur, chunks.n - s)
                watch.where = f"samples {s}..{s + n - 1}"
                err = _attempt(run, metrics, lambda s=s, n=n: chunks.get(s, s + n))
                if err is not None:                 # outside the except block: the chunk's frames are gone
                    cur, limit = _back_off(err, n, failed, limit, stats, dev)
                    continue
                s, stats["chunks"], stats["n"] = s + n, stats["chunks"] + 1, stats["n"] + n
                stats["max_n"] = max(stats["max_n"], n)
                bar.update(n)
                cur = min(limit, cur * 2) if cur < limit else cur     # grow back towards the chosen size
        else:
            for i, batch in enumerate(chunks):
                x, y = batch[0], (batch[1] if len(batch) > 1 else None)
                watch.where = f"batch {i} of the loader"
                _split_run(run, metrics, x, y, stats, dev, failed, bar)
    bar.close()
    if stats["n"] == 0 and not allow_empty:
        raise ValueError("the data is empty: nothing to evaluate")
    return stats


def _attempt(run, metrics, fetch) -> str | None:
    """Run one chunk and commit it; return the OOM message instead of raising one."""
    try:
        x, y = fetch()
        parts = run(x, y)
    except Exception as e:
        if not is_oom(e):
            mistake = dtype_mistake(e, locals().get("x"))
            if mistake is not None:
                raise mistake from e
            raise
        return first_line(e)
    for m, p in zip(metrics.values(), parts, strict=True):
        m.commit(p)
    return None


def dtype_mistake(e: BaseException, x) -> TypeError | None:
    """A TypeError saying the inputs have the wrong dtype for the model (and how to fix it), when torch's error
    is one of its dtype mismatches; else None."""
    text = str(e)
    if not isinstance(e, RuntimeError) or x is None or not any(
            k in text for k in ("scalar type", "scalar types", "same dtype", "should be the same", "expected both")):
        return None
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in (x.values() if isinstance(x, dict) else [x])})
    floats = all(t.is_floating_point() for t in (x.values() if isinstance(x, dict) else [x]))
    if floats and ("Long" in text or "Int" in text):
        fix = ("the model wants integer inputs (token ids, e.g. an Embedding first); give integer arrays (they "
               "decode to int64) or CompactDataset.from_arrays(..., dtype=torch.long); on the command line "
               "--dtype int64")
    else:
        fix = ("the model wants float inputs; build the data with a float dtype, e.g. "
               "CompactDataset.from_arrays(..., dtype=torch.float32); on the command line --dtype float32")
    return TypeError(f"the inputs are {', '.join(dtypes)} but {fix} ({first_line(e)})")


def _back_off(err: str, n: int, failed: set, limit: int, stats: dict, dev) -> tuple[int, int]:
    _release(dev)
    stats["retries"] += 1
    stats["oom_sizes"].append(n)
    if n == 1:
        raise torch.OutOfMemoryError(f"a single sample does not fit in memory ({err}); free memory on {dev}, "
                                     "use a smaller model or input, or another device")
    if n in failed:                 # failed twice at this size: stop growing back to it
        limit = min(limit, n // 2)
    failed.add(n)
    return max(1, n // 2), limit


def _split_run(run, metrics, x, y, stats, dev, failed, bar) -> None:
    """A loader batch that runs out of memory is halved (recursively) and each half retried."""
    x, y = batch_to(x, dev), (None if y is None else y.to(dev, non_blocking=True))
    err = _attempt(run, metrics, lambda: (x, y))
    n = batch_len(x)
    if err is None:
        stats["chunks"] += 1
        stats["n"] += n
        stats["max_n"] = max(stats["max_n"], n)
        bar.update(n)
        return
    _back_off(err, n, failed, n, stats, dev)
    h = n // 2
    _split_run(run, metrics, batch_slice(x, 0, h), None if y is None else y[:h], stats, dev, failed, bar)
    _split_run(run, metrics, batch_slice(x, h, n), None if y is None else y[h:], stats, dev, failed, bar)

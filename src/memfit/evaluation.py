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

import textwrap
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from memfit import chunking
from memfit.batches import batch_len, batch_slice, batch_to, forward
from memfit.budget import (
    check_count,
    format_bytes,
    halve_after_oom,
    is_oom,
    model_device,
    resolve_budget,
    resolve_device,
)
from memfit.chunking import (
    Chunks,
    as_chunks,
    choose_chunk,
)
from memfit.compact import CompactDataset
from memfit.input_mistakes import dtype_mistake
from memfit.memory.measure import held_bytes
from memfit.messages import first_line, plural, whole_words
from memfit.metrics import Metric, default_metrics, logits_of, make_metric, output_for
from memfit.progress import progress_bar


@dataclass(eq=False)
class EvalResult(Mapping):
    """What `evaluate` measured. `metrics` maps each requested metric to its whole-set value, and the result
    reads as that mapping too: `res["accuracy"]`, `for name in res`, `dict(res)`, `len(res)`.

    Example:
        >>> r = EvalResult({"accuracy": 0.5, "loss": 0.7}, n=4, chunk_size=4, chunks=1, retries=0,
        ...                peak_bytes=None, seconds=0.0)
        >>> r["accuracy"], list(r), dict(r) == r.metrics
        (0.5, ['accuracy', 'loss'], True)
    """
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

    def __getitem__(self, key: str):
        if key not in self.metrics:
            raise KeyError(f"no metric {key!r} in this result; it has {sorted(self.metrics)} (ask evaluate for it "
                           f"with metrics=[..., {key!r}])")
        return self.metrics[key]

    def __iter__(self):
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

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


# ---- the loop --------------------------------------------------------------------------------------
def _run_chunk(runner, metrics: dict[str, Metric], x, y, output_fn, watch):
    """Forward one chunk and compute every metric's contribution; nothing is committed here. A metric that
    names a target of a dict of targets reads the model's output of that name (`metrics.output_for`)."""
    try:
        out = forward(runner, x)
    except Exception as e:       # the forward's dtype mistakes only: a metric's or loss_fn's own error stays its own
        mistake = None if is_oom(e) else dtype_mistake(e, x)
        if mistake is not None:
            raise mistake from e
        raise
    names = list(y) if isinstance(y, dict) else []
    logits, parts, watched = None, [], set()
    for m in metrics.values():
        if m.target is None:
            if logits is None:
                logits = logits_of(out, output_fn)
            pred, target = logits, y
        elif m.target in names:
            pred, target = output_for(out, m.target, names, output_fn), y[m.target]
        else:
            has = f"targets {names}" if names else "one target, not a dict of them"
            raise ValueError(f"metric {m.name!r} reads target {m.target!r}, but the data has {has}; name one of "
                             "its targets, or leave the target out")
        if id(pred) not in watched:
            watched.add(id(pred))
            watch(pred)
        parts.append(m.contribution(pred, target))
    return parts


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


def evaluate(model: torch.nn.Module, data, *, metrics="auto", loss_fn: Callable | None = None,
             loss_reduction: str | None = None, output_fn: Callable | None = None,
             chunk_size: int | str = "auto", budget: int | str | None = None, device=None,
             progress: bool | None = True, planned: bool | None = None, distributed: bool = False,
             sharded: bool = False) -> EvalResult:
    """Evaluate `model` on `data` in chunks and return exact whole-set metrics.

    Args:
        model: a module that maps a batch (n, *sample_shape) to outputs (n, classes); a dataset of
            fields (`from_arrays({"input_ids": ..., "attention_mask": ...}, y)`) is passed as `model(**x)`.
        data: a CompactDataset, a memfit Loader (any iterable of (x, y) batches: x a tensor, a tuple
            passed as `model(*x)` or a dict passed as `model(**x)`), or (x, y) arrays, which are stored
            compactly (and losslessly) on the host on the way in.
        metrics: 'auto' (from the targets: class ids and labels 'accuracy' and 'loss'; float targets 'mse'
            and 'mae'; a dict of targets each its own, keyed 'accuracy@NAME'), or names ('accuracy', 'topk:5',
            'loss', 'confusion', 'iou', 'perplexity', 'mse', 'mae'; 'NAME@TARGET' for one target of a dict),
            `memfit.metrics.Metric` objects or torchmetrics-style objects (keyed by class name, '_2' added when
            repeated), or a dict {result key: either}. Class scores may be (N, C), (N, C, *d) or (N, *d, C)
            for labels (N,) or (N, *d); labels equal to the data's ignore_index (else -100) count nowhere.
        loss_fn: used by 'loss'; default cross entropy. torch losses, partials and functions with a
            `reduction` parameter are asked for per-sample values; a function that returns a scalar
            needs `loss_reduction`. The result is torch's mean over the whole set: targets equal to
            `ignore_index` are not counted, class weights divide by sum(weight[y]) (CrossEntropyLoss,
            NLLLoss), KLDivLoss 'batchmean' divides by the number of samples; CTCLoss is refused.
        loss_reduction: 'mean' or 'sum': what a scalar-returning `loss_fn` does over a chunk.
        output_fn: picks the logits from the model's output; default rule (`memfit.metrics.logits_of`):
            a tensor; `.logits` of a ModelOutput; `["logits"]` of a dict; the first element of a tuple/list.
        chunk_size: 'auto' (the largest that fits `budget`, at most MAX_AUTO_CHUNK = 512 samples:
            larger chunks run no faster) or an int.
        budget: bytes or a string like '1GiB': parameters, activations, the decoded chunk and outputs
            must fit. Default: the device's free memory minus a margin, plus the model's own bytes.
        device: where to evaluate; default the model's device.
        progress: a progress bar counting samples (only on a terminal).
        planned: run through the activation planner (`memfit.plan`). None: only where capture pays, i.e.
            chunk_size 'auto', more than SMALL_SET samples, and the eager forward's estimate cannot fit
            the chunk in the budget (the planner's arena fits more); True: always; False: never.
            `EvalResult.reason` says which and why.
        distributed: every rank of the initialised process group evaluates its shard and sums and counts
            are all-reduced, so every rank returns the single-process result over the whole set. Every
            rank passes the same whole set (a CompactDataset or arrays: sharded here; or this rank's
            `CompactDataset.shard()`; or a `loader(..., distributed=True)`): before any work the ranks
            compare its size and a fingerprint (layout, 16 sampled rows) and all raise, naming each rank's
            size, when they differ. The auto chunk size is the minimum over ranks; out-of-memory back-off
            stays local. A rank with nothing to evaluate (fewer samples than ranks, its loader empty)
            adds nothing.
        sharded: with `distributed`, `data` is this rank's own part, split beforehand (arrays, a
            CompactDataset, a Loader built without distributed=True): each rank evaluates all of its
            part, of any size, and the metrics and `n` are over the union of the parts. Any other
            iterable of batches is always taken as this rank's own.

    Raises:
        ValueError/TypeError for bad input; BudgetExceeded when one sample does not fit; the
        original error when a single sample runs out of memory; with `distributed`, an error on
        every rank naming the rank that failed.
    """
    t0 = time.perf_counter()
    dev = _model_device(model, device)
    auto = isinstance(metrics, str) and metrics == "auto"
    mets = {} if auto else _metrics(metrics, loss_fn, loss_reduction)     # a bad name is said before any work
    if not auto and not mets:
        raise ValueError("metrics is empty; ask for at least one, e.g. metrics=('accuracy',)")
    if not isinstance(sharded, bool) or (sharded and not distributed):
        raise ValueError(f"sharded=True says each rank holds its own part, so it needs distributed=True; found "
                         f"sharded={sharded!r}, distributed={distributed!r}")
    if distributed:
        from memfit import distributed as mdist
        if not mdist.is_distributed():
            raise ValueError("distributed=True needs an initialised torch.distributed process group "
                             "(start with torchrun, or call init_process_group first)")
        data = _agreed_data(data, sharded)      # before any work: one whole set on every rank, or parts
    modes = [(m, m.training) for m in model.modules()]       # each module's own mode comes back afterwards
    if any(training for _, training in modes):
        model.eval()
    error, res, runner, runner_name = None, None, model, "eager"
    try:
        chunks = _local_chunks(data, dev, sharded) if distributed else as_chunks(data, dev)
        targets = getattr(chunks.ds if isinstance(chunks, Chunks) else chunks, "targets", None)
        if targets is None and hasattr(chunks, "dataset"):           # a memfit Loader
            targets = chunks.dataset.targets
        if auto:
            mets.update(_metrics(default_metrics(None if targets is None else targets.kind), loss_fn, loss_reduction))
        _bind(mets, targets)
        size, estimate, reason = _chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned)
        if isinstance(chunks, Chunks) and _use_planner(chunks, planned, estimate):
            runner, why = _planned_runner(model, chunks, size, planned)
            runner_name = "planned" if runner is not model else "eager"
            if runner is model and estimate is not None and estimate.planned and not distributed:
                # the chunk was sized for the planned forward, which will not run: size it for the eager one
                size, estimate, again = choose_chunk(model, chunks, _limit(model, budget, dev), model,
                                                     use_plan=False)
                why = f"{why}; chunk sized again for the eager forward: {again}"
            reason = f"{reason}; {why}" if why else reason
        res = _loop(runner, chunks, mets, size, dev, progress, output_fn, allow_empty=distributed)
    except Exception as e:
        if not distributed or isinstance(e, mdist.RankFailed):    # every rank already knows: agree no further
            raise
        error = e
    finally:
        if any(training for _, training in modes):
            model.train(modes[0][1])                      # an overridden train() undoes what its eval() did
            for m, training in modes:                     # then each module's own mode (a frozen submodule)
                if m.training != training:
                    m.training = training
        if runner is not model:
            from memfit.memory.cache import give_back
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
        if res["n"] == 0:          # every rank has the same sum: every rank raises, none waits
            raise ValueError("the data is empty on every rank: nothing to evaluate")
    peak = _peak(dev, estimate, res["max_n"])
    values = {k: m.compute() for k, m in mets.items()}
    return EvalResult(values, res["n"], size or res["max_n"], res["chunks"], res["retries"], peak,
                      time.perf_counter() - t0, runner_name, reason, res["oom_sizes"])


# A set this small runs in one eager chunk: capturing the model for the planner (0.5 to 10 s for a
# real model) would cost more than the whole run (HF ResNet-50 on 32 images: 8.6 s planned, 2.0 s eager).
SMALL_SET = 1024


def _small_set(chunks, chunk_size, planned) -> bool:
    """A set small enough that capturing the model for the planner would cost more than running it."""
    return isinstance(chunks, Chunks) and chunk_size == "auto" and planned is None and chunks.n <= SMALL_SET


def _small(chunks, chunk_size, planned, budget) -> bool:
    """One eager chunk, no capture and no estimate: a small set under the default budget."""
    return _small_set(chunks, chunk_size, planned) and budget is None


def _use_planner(chunks, planned, estimate) -> bool:
    """planned=True: always; None: when the chunk was sized by the planner (memory binds); False: never."""
    if planned is False or chunks.fields:
        return False
    return bool(planned) or (estimate is not None and estimate.planned)


def _bind(mets: dict[str, Metric], targets) -> None:
    """Each metric takes the ignore_index of the target it reads, unless it was given one."""
    for m in mets.values():
        part = None if targets is None else targets.parts.get(m.target)
        m.bind(None if part is None else part.ignore_index)


class _NoChunks(tuple):
    """An empty shard's chunks: none, with the targets the other ranks have (their kind picks the metrics)."""
    targets = None


def _agreed_data(data, sharded: bool):
    """The data as a CompactDataset (arrays are encoded whole, so every rank decodes with the same codec and
    normalisation), after the ranks agreed that they hold one whole set of one size and content, or each its
    own part (sharded=True). Raises on every rank when they do not, or when one failed preparing its data."""
    from memfit import distributed as mdist
    error, identity = None, (0, 0, 0, 0)
    try:
        if isinstance(data, tuple) and len(data) == 2:
            data = CompactDataset.from_arrays(*data, device="cpu")
        identity = mdist.data_identity(data, sharded)
    except Exception as e:
        error = e
    mdist.check_same_data(mdist.agree(error, "memfit.evaluate data", identity), "evaluate")
    return data


def _local_chunks(data, dev, sharded: bool):
    """This rank's chunks: its shard of a whole set; its own part (sharded) or batches as they are. An empty
    shard (fewer samples than ranks) is no chunk at all: the rank still makes every agreement and reduction,
    adding nothing."""
    from memfit.distributed import rank_world, shard_data
    part = data if sharded else shard_data(data, *rank_world())[0]
    if isinstance(part, CompactDataset) and len(part) == 0:
        empty = _NoChunks()
        empty.targets = part.targets
        return empty
    return as_chunks(part, dev)


def _limit(model, budget, dev) -> int:
    """The bytes a chunk may use: the budget, or the free memory plus what the model already holds."""
    return resolve_budget(budget, dev) + (held_bytes(model) if budget is None else 0)


# What a rank without chunks of its own (a loader, an empty shard) offers when the ranks agree on a chunk size
NO_CHUNK = 2**62


def _chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned) -> tuple[int, Callable | None, str]:
    size, estimate, reason = _local_chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned)
    if distributed and isinstance(chunk_size, str) and chunk_size == "auto":
        # one size for all, so a rank's back-off never waits on another's; every rank agrees, one with no
        # chunks too (a loader, an empty shard): the ranks must make the same collectives
        from memfit import distributed as mdist
        agreed = mdist.smallest(size or NO_CHUNK, "memfit.evaluate chunk size")   # also stops all if one failed
        if size and agreed != size:
            size, reason = agreed, f"{reason}; the smallest over ranks ({agreed}) is used"
    return size, estimate, reason


def _local_chunk_size(model, chunks, chunk_size, budget, dev, distributed, planned) -> tuple[int, Callable | None, str]:
    if not isinstance(chunks, Chunks):
        return 0, None, "batches of the loader"
    if chunk_size != "auto":
        why = ("" if planned else "; the planner is not used with a fixed chunk_size (pass planned=True to "
               "run it, or chunk_size='auto' to size chunks from it)")
        return _forced(chunk_size, chunks.n), None, f"chunk_size {chunk_size} given{why}"
    if not distributed and _small(chunks, chunk_size, planned, budget):
        size = min(chunks.n, chunking.MAX_AUTO_CHUNK)
        what = f"one eager chunk of all {chunks.n} samples" if size == chunks.n else f"eager chunks of {size} samples"
        return size, None, (f"{what}: a set this small (<= {SMALL_SET}) runs faster than capturing the model for "
                            "the planner; out-of-memory back-off halves the chunk if needed")
    limit = _limit(model, budget, dev)
    small = not distributed and _small_set(chunks, chunk_size, planned)
    use = False if planned is False or small else (True if planned else None)
    size, estimate, reason = choose_chunk(model, chunks, limit, model, use_plan=use)
    if small:
        reason += (f"; run eagerly: a set this small (<= {SMALL_SET} samples) runs faster than capturing the "
                   "model for the planner")
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
    have = model_device(model, default=None)
    dev = resolve_device(device if device is not None else have)
    if have is not None and have != dev and not (have.type == dev.type == "cuda" and have.index == dev.index):
        raise ValueError(f"the model is on {have} but device={str(dev)!r}; move it with model.to('{dev}') "
                         f"or pass device='{have}'")
    return dev


def _planned_runner(model, chunks: Chunks, size: int, required: bool | None):
    try:
        from memfit.memory.cache import borrow_plan, known_memory_model
        from memfit.memory.inference import InferenceMemoryModel
        mm = known_memory_model(model, chunks.sample_shape, chunks.dtype)      # made when sizing the chunk
        if mm is not None and not isinstance(mm, (InferenceMemoryModel, Exception)):   # capture failed: don't pay again
            return model, f"run eagerly: {whole_words(mm.method.split('; fake-tensor')[0], 200)}"
        # zeros, not empty: integer inputs (token ids) must be valid indices
        example = torch.zeros((min(size, chunks.n), *chunks.sample_shape), dtype=chunks.dtype, device=chunks.device)
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
    total = chunks.n if isinstance(chunks, Chunks) else None
    bar = progress_bar(total, "evaluating", unit="sample", enabled=show)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    stats = {"n": 0, "chunks": 0, "retries": 0, "max_n": 0, "oom_sizes": []}
    limit, failed, watch = size, set(), NanWatch()
    run = lambda x, y: _run_chunk(runner, metrics, x, y, output_fn, watch)
    with torch.inference_mode():
        if isinstance(chunks, Chunks):
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
            raise
        return first_line(e)
    for m, p in zip(metrics.values(), parts, strict=True):
        m.commit(p)
    return None


def _back_off(err: str, n: int, failed: set, limit: int, stats: dict, dev) -> tuple[int, int]:
    stats["retries"] += 1
    half = halve_after_oom(n, err, dev, stats["oom_sizes"], single="a single sample",
                           fix=f"free memory on {dev}, use a smaller model or input, or another device")
    if n in failed:                 # failed twice at this size: stop growing back to it
        limit = min(limit, half)
    failed.add(n)
    return half, limit


def _split_run(run, metrics, x, y, stats, dev, failed, bar) -> None:
    """A loader batch that runs out of memory is halved (recursively) and each half retried."""
    x, y = batch_to(x, dev), batch_to(y, dev)
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
    _split_run(run, metrics, batch_slice(x, 0, h), batch_slice(y, 0, h), stats, dev, failed, bar)
    _split_run(run, metrics, batch_slice(x, h, n), batch_slice(y, h, n), stats, dev, failed, bar)

"""The chunk loop: each chunk forward, its metrics' sums and counts committed only when the whole chunk ran, and
an out-of-memory error met by halving that chunk and retrying it alone (then growing back)."""

from __future__ import annotations

import warnings

import torch

from memfit.batches import batch_len, batch_slice, batch_to, forward, plain_batch
from memfit.budget import halve_after_oom, is_oom
from memfit.device.measure import reset_cuda_peak
from memfit.evaluation.chunks import Chunks
from memfit.input_mistakes import dtype_mistake
from memfit.messages import first_line
from memfit.metrics import Metric, logits_of, order_error, output_for
from memfit.progress import progress_bar

__all__ = ["NanWatch", "run_chunks"]


def _run_chunk(runner, metrics: dict[str, Metric], x, y, output_fn, watch, labels=None):
    """Forward one chunk and compute every metric's contribution; nothing is committed here. A metric that
    names a target of a dict of targets reads the model's output of that name (`metrics.output_for`).
    `labels(x, y)`: the labels to score against (a causal LM's shifted ones, `evaluation.causal`), or raises."""
    if labels is not None:
        y = labels(x, y)
    if y is None and isinstance(x, dict) and "labels" in x and any(
            m.target is None and not getattr(m, "reads_output", False) for m in metrics.values()):
        # a loader's dict batches: the labels ride inside the inputs, which only the model's own loss reads
        raise ValueError(f"the batches hold their labels inside the inputs (x['labels'], keys {list(x)[:6]}) and no "
                         f"targets beside them: the metrics {', '.join(m.name for m in metrics.values())} have none to "
                         "score against. Fix: loss_fn='model' (the model's own loss, out.loss; the other metrics then "
                         "read x['labels']), or batches (x, y) with the targets beside the inputs")
    try:
        out = forward(runner, x)
    except Exception as e:       # the forward's dtype mistakes only: a metric's or loss_fn's own error stays its own
        mistake = None if is_oom(e) else dtype_mistake(e, x, runner if isinstance(runner, torch.nn.Module) else None)
        if mistake is not None:
            raise mistake from e
        raise
    names = list(y) if isinstance(y, dict) else []
    if names and not watch.order_checked:          # a tuple of outputs matched to the targets by their order
        watch.order_checked = True
        error = order_error(out, y, {m.target: m.ignored for m in metrics.values()}, output_fn)
        if error is not None:
            raise error
    logits, parts, watched = None, [], set()
    for m in metrics.values():
        if getattr(m, "reads_output", False):     # the model's own loss: its whole output
            parts.append(m.contribution(out, y, x))
            continue
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
        parts.append(m.contribution(pred, target, x) if m.reads_inputs else m.contribution(pred, target))
    return parts


class NanWatch:
    """Warns once when a chunk's outputs are all NaN (a broken model then scores chance, silently). Also holds
    whether the order of a tuple of outputs against a dict of targets was checked (`metrics.order_error`)."""

    def __init__(self) -> None:
        self.where, self.warned, self.order_checked = "", False, False

    def __call__(self, out: torch.Tensor) -> None:
        if self.warned or not out.is_floating_point() or not out.numel() or not bool(torch.isnan(out).all()):
            return
        self.warned = True
        warnings.warn(f"the model's outputs are all NaN for {self.where}: its metrics there are meaningless "
                      "(check the weights, the input normalisation and the dtype)", RuntimeWarning, stacklevel=2)


def run_chunks(runner, chunks, metrics: dict[str, Metric], size: int, dev: torch.device, show, output_fn=None,
               allow_empty: bool = False, labels=None) -> dict:
    total = chunks.n if isinstance(chunks, Chunks) else None
    bar = progress_bar(total, "evaluating", unit="sample", enabled=show)
    if dev.type == "cuda":                  # `_peak` reads the chunks' peak; a track_memory around keeps its own
        reset_cuda_peak(dev)
    stats = {"n": 0, "chunks": 0, "retries": 0, "max_n": 0, "oom_sizes": []}
    limit, failed, watch = size, set(), NanWatch()
    run = lambda x, y: _run_chunk(runner, metrics, x, y, output_fn, watch, labels)
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
                batch = plain_batch(batch)       # a data collator's BatchEncoding: the dict it holds
                # a dict is the inputs alone (labels inside, for the model's own loss)
                x, y = (batch, None) if isinstance(batch, dict) else (batch[0], batch[1] if len(batch) > 1 else None)
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

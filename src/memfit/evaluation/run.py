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

import time
import warnings
from collections.abc import Callable

import torch

from memfit.budget import check_count, model_device, resolve_budget
from memfit.device.machine import resolve_device
from memfit.device.measure import held_bytes
from memfit.evaluation import ranks
from memfit.evaluation.causal import label_rule
from memfit.evaluation.chunks import Chunks, as_chunks
from memfit.evaluation.decision import Ask, decide, without_plan
from memfit.evaluation.estimates import choose_chunk
from memfit.evaluation.loop import run_chunks
from memfit.evaluation.result import EvalResult
from memfit.losses import loss_ignore_index
from memfit.messages import first_line, whole_words
from memfit.metrics import Loss, Metric, default_metrics, make_metric
from memfit.own_loss import LabelTerms, is_causal_lm, is_own, model_loss
from memfit.targets import IGNORE_INDEX, Targets

__all__ = ["evaluate"]


def evaluate(model: torch.nn.Module, data, *, metrics="auto", loss_fn: Callable | str | None = None,
             loss_reduction: str | None = None, terms: Callable | None = None, ignore_index: int | None = None,
             output_fn: Callable | None = None, shift_labels: bool | None = None,
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
            for labels (N,) or (N, *d); labels equal to the ignore index (`ignore_index`) count nowhere.
        loss_fn: used by 'loss'; default cross entropy. "model": the model's own loss (`out.loss`, labels inside
            the inputs: `x["labels"]`, as transformers models take them), the whole set's mean over the labels
            that count (not -100; a causal LM's from the second position on), as one batch of it would give; the
            other metrics read `x["labels"]` (a causal LM's shifted, as its own loss does, unless
            `shift_labels=False`). None does the same where the data holds no targets but its inputs hold
            "labels" (a CompactDataset of fields, or (x, None) arrays) and metrics are 'auto' (then 'loss').
            torch losses, partials and functions with a
            `reduction` parameter are asked for per-sample values; a function that returns a scalar
            needs `loss_reduction` (or `terms`). The result is torch's mean over the whole set: targets equal
            to `ignore_index` are not counted, class weights divide by sum(weight[y]) (CrossEntropyLoss,
            NLLLoss), KLDivLoss 'batchmean' divides by the number of samples; CTCLoss is refused. Outputs and
            targets that an elementwise loss would broadcast into each other ((N, 1) against (N,)) are refused.
        loss_reduction: 'mean' or 'sum': what a scalar-returning `loss_fn` does over a chunk ('sum': the loss
            is then per sample). A 'mean' is weighted by samples: refused on integer targets whose ignored
            positions differ per sample, unless `terms` says what it is over.
        terms: terms(x, y) -> how many terms loss_fn's mean (or sum) is over in a chunk, as in `accumulate`:
            `lambda x, y: (y != -100).sum()` for a loss averaged over the tokens that count; 'loss' is then the
            sum over the set divided by the total of terms.
        ignore_index: the label that marks a position without one, for every metric (and for arrays stored on
            the way in). Default: the loss's own (CrossEntropyLoss(ignore_index=0), a partial of
            F.cross_entropy), else the data's (`memfit.CompactDataset.from_arrays(..., ignore_index=)`, a
            loader's), else -100. Raises
            when `loss_fn` says another one (the loss would count what the metrics ignore).
        output_fn: picks the logits from the model's output; default rule (`memfit.metrics.logits_of`):
            a tensor; `.logits` of a ModelOutput; `["logits"]` of a dict; the first element of a tuple/list.
        shift_labels: True: token labels (n, T) are shifted as a `transformers` causal LM's own loss shifts
            `labels=input_ids` (the logits at t scored against the label at t+1, the last position ignored), for
            every metric, loss_fn and terms. False: each position against the label at the same position, as
            given. None: as given, but a `transformers` causal LM whose labels equal its input ids raises
            (`memfit.evaluation.causal`: the loss and perplexity would not be the model's own).
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
    # resolve: the device, the metrics, the data (on several ranks: agreed on before any work)
    dev = _model_device(model, device)
    auto = isinstance(metrics, str) and metrics == "auto"
    own = loss_fn is not None and is_own(loss_fn)     # "model"; None: decided from the data, below
    make = lambda spec: make_metric(spec, model_loss, None, terms or LabelTerms(is_causal_lm(model))) if own \
        else make_metric(spec, loss_fn, loss_reduction, terms)
    mets = {} if auto else _metrics(metrics, make)     # a bad name is said before any work
    asked = _asked_ignore_index(ignore_index, None if own else loss_fn)
    rule = label_rule(model, shift_labels)
    if not auto and not mets:
        raise ValueError("metrics is empty; ask for at least one, e.g. metrics=('accuracy',)")
    if not isinstance(sharded, bool) or (sharded and not distributed):
        raise ValueError(f"sharded=True says each rank holds its own part, so it needs distributed=True; found "
                         f"sharded={sharded!r}, distributed={distributed!r}")
    if chunk_size != "auto":
        chunk_size = _forced(chunk_size)
    if distributed:
        from memfit import distributed as mdist
        if not mdist.is_distributed():
            raise ValueError("distributed=True needs an initialised torch.distributed process group "
                             "(start with torchrun, or call init_process_group first)")
        data = ranks.agreed_data(data, sharded, asked)      # before any work: one whole set on every rank, or parts
    modes = [(m, m.training) for m in model.modules()]       # each module's own mode comes back afterwards
    if any(training for _, training in modes):
        model.eval()
    error, res, runner, decision = None, None, model, None
    try:
        chunks = ranks.local_chunks(data, dev, sharded) if distributed else as_chunks(data, dev, asked)
        if loss_fn is None and auto and _labels_inside(chunks):
            own = True                  # no targets, labels inside the inputs: the model's own loss
        if own:
            mets = mets if mets else {"loss": make("loss")}
            # the other metrics read the labels inside the inputs (a causal LM's shifted, as its own loss shifts)
            rule = label_rule(model, True if shift_labels is None and is_causal_lm(model) else shift_labels)
        _resolve_metrics(mets, chunks, auto and not own, make, asked, None if own else loss_ignore_index(loss_fn))
        # decide: chunk size and runner, in one place
        whole = isinstance(chunks, Chunks)
        ask = Ask(chunks.n if whole else None, chunk_size, planned, budget is not None, distributed,
                  whole and chunks.fields)
        size_for = lambda use_plan: choose_chunk(model, chunks, _limit(model, budget, dev), model, use_plan=use_plan)
        decision = decide(ask, size_for)
        if distributed and chunk_size == "auto":
            decision = ranks.agreed_chunk_size(decision)
        if decision.runner == "planned":
            runner, why = _planned_runner(model, chunks, decision.chunk_size, planned)
            if runner is model:
                decision = without_plan(decision, why, ask, size_for)
        # loop
        ignore = _ignored(mets)
        labels = None if rule is None else (lambda x, y: rule(x, y, ignore))
        if own:
            labels = _inside(labels)
        res = run_chunks(runner, chunks, mets, decision.chunk_size, dev, progress, output_fn,
                         allow_empty=distributed, labels=labels)
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
            from memfit.planner.kept import give_back
            give_back(runner)       # the arena is freed now; the plans stay for the next call
    # reduce: over the ranks, then each metric's whole-set value
    if distributed:
        ranks.reduce_results(error, mets, res)
    peak = _peak(dev, decision.estimate, res["max_n"])
    values = {k: m.compute() for k, m in mets.items()}
    return EvalResult(values, res["n"], decision.chunk_size or res["max_n"], res["chunks"], res["retries"], peak,
                      time.perf_counter() - t0, decision.runner, decision.reason, res["oom_sizes"])


def _labels_inside(chunks) -> bool:
    """The data holds no targets, and its inputs hold "labels" (a CompactDataset of fields, or arrays stored as one)."""
    if not isinstance(chunks, Chunks):
        return False
    fields = chunks.ds.fields or {}
    return chunks.ds.y is None and "labels" in fields


def _inside(rule: Callable | None) -> Callable:
    """labels(x, y) for the model's own loss: the labels inside the inputs, x["labels"] (through `rule`, a causal LM's
    shift), where there are no targets y beside them."""
    def labels(x, y):
        if y is None and isinstance(x, dict) and "labels" in x:
            y = x["labels"]
        return y if rule is None else rule(x, y)
    return labels


def _resolve_metrics(mets: dict[str, Metric], chunks, auto: bool, make, asked: tuple[int, str] | None,
                     loss_index: int | None) -> None:
    """With metrics='auto', the metrics the targets' kind asks for; then each metric's ignore index."""
    if getattr(chunks, "drop_last", False):        # a memfit Loader that leaves its last batch out: not the whole set
        warnings.warn("evaluating a loader built with drop_last=True: its last incomplete batch is left out, so the "
                      "metrics are not over the whole set (EvalResult.n says how many); build the loader with "
                      "drop_last=False, or pass the CompactDataset itself, to evaluate every sample",
                      UserWarning, stacklevel=4)
    targets = getattr(chunks.ds if isinstance(chunks, Chunks) else chunks, "targets", None)
    if targets is None:      # a memfit Loader's CompactDataset; a torch DataLoader's dataset has none of memfit's
        targets = getattr(getattr(chunks, "dataset", None), "targets", None)
    if not isinstance(targets, Targets):     # a torchvision dataset's .targets is a tensor or a list of labels
        targets = None
    if auto:
        mets.update(_metrics(default_metrics(None if targets is None else targets.kind), make))
    _bind(mets, targets, asked, loss_index)


def _asked_ignore_index(given, loss_fn) -> tuple[int, str] | None:
    """(the ignore index asked for, who asked): `ignore_index` given to evaluate, else the loss's own when it is
    not torch's default (CrossEntropyLoss(ignore_index=0)); None: neither (the data's, else -100)."""
    from_loss = loss_ignore_index(loss_fn)
    if given is None:
        return None if from_loss in (None, IGNORE_INDEX) else (from_loss, "loss_fn")
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"ignore_index must be an int (the label that marks a position without one, e.g. -100 or "
                        f"255); found {type(given).__name__} {given!r}")
    if from_loss is not None and from_loss != given:
        raise ValueError(f"ignore_index={given}, but loss_fn ignores {from_loss}: the loss would count the labels "
                         f"the other metrics leave out. Fix: give the loss the same one (e.g. "
                         f"torch.nn.CrossEntropyLoss(ignore_index={given})), or leave ignore_index out")
    return given, "ignore_index"


def _bind(mets: dict[str, Metric], targets, asked: tuple[int, str] | None, loss_index: int | None) -> None:
    """Each metric (unless it was given its own) takes the ignore index asked for, else the data's of the target
    it reads, else -100. Unless evaluate was given one, a loss_fn whose own index (`loss_index`, torch's -100
    by default) is not the data's (other than -100) raises: it would count those positions as a class."""
    for m in mets.values():
        part = None if targets is None else targets.parts.get(m.target)
        data = None if part is None else part.ignore_index
        if (isinstance(m, Loss) and m.loss_fn is not None and loss_index is not None and data not in
                (None, IGNORE_INDEX, loss_index) and (asked is None or asked[1] == "loss_fn")):
            default = " (torch's default)" if loss_index == IGNORE_INDEX else ""
            raise ValueError(f"the data marks positions without a label with {data} (its ignore_index), but loss_fn "
                             f"ignores {loss_index}{default}, so the loss would count them as class {data}; give the "
                             f"loss the same one (e.g. torch.nn.CrossEntropyLoss(ignore_index={data})), or build the "
                             "data with the loss's (memfit.CompactDataset.from_arrays(..., ignore_index=))")
        if asked is not None and asked[1] == "ignore_index" and data not in (None, IGNORE_INDEX, asked[0]):
            raise ValueError(f"ignore_index={asked[0]}, but the data marks positions without a label with {data} "
                             f"(its ignore_index): the metrics would not leave those positions out. Fix: "
                             f"leave ignore_index out (the data's is used), or pass ignore_index={data}")
        m.bind(data if asked is None else asked[0])


def _ignored(mets: dict[str, Metric]) -> int:
    """The ignore index the metrics were bound to (`_bind`: one for all but those given their own): the first's."""
    return next((m.ignored for m in mets.values() if m.target is None and m.reduce), IGNORE_INDEX)


def _limit(model, budget, dev) -> int:
    """The bytes a chunk may use: the budget, or the free memory plus what the model already holds."""
    return resolve_budget(budget, dev) + (held_bytes(model) if budget is None else 0)


def _metrics(specs, make: Callable) -> dict[str, Metric]:
    """{result key: metric}: names key themselves, objects their class name (suffixed when repeated);
    a dict names its own keys."""
    items = specs.items() if isinstance(specs, dict) else ((None, s) for s in specs)
    out: dict[str, Metric] = {}
    for key, spec in items:
        metric = make(spec)
        key = key or (spec if isinstance(spec, str) else metric.name)
        base, i = key, 2
        while key in out:
            key, i = f"{base}_{i}", i + 1
        out[key] = metric
    return out


def _forced(chunk_size) -> int:
    try:
        return check_count("chunk_size", chunk_size, 1)
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
    """(the borrowed planned module, "") or (model, why it runs eagerly); with planned=True a failure raises."""
    try:
        from memfit.planner.kept import borrow_plan, known_planned_model
        mm = known_planned_model(model, chunks.sample_shape, chunks.dtype)     # made when sizing the chunk
        if isinstance(mm, Exception):                 # capture failed when sizing: don't pay again
            return model, f"run eagerly: the planner could not capture the model ({whole_words(first_line(mm), 200)})"
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

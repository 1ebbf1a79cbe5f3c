"""One accumulated step as micro-batches: forward, weighted loss, backward, out-of-memory back-off.

An OOM can strike in backward after some parameters already received the failed micro-batch's gradient. A
parameter's gradient is accumulated once per backward, complete (the autograd engine sums every use of a
parameter before its AccumulateGrad runs), so the version counter of its `.grad` tells which parameters got
it; the retry of that micro-batch runs with those parameters frozen (`requires_grad=False`), so they get
nothing twice and the others get the rest. No extra gradient buffer is held: memory is that of plain
accumulation.

With DistributedDataParallel every micro-batch runs under `no_sync` (its backward is local, so an error there
or an out-of-memory back-off concerns this rank only); the gradients are all-reduced once afterwards, by
`memfit.accumulation.ranks.synchronise`, after the ranks agreed that every one finished.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
from collections.abc import Callable

import torch

from memfit.accumulation.checks import part_of
from memfit.batches import batch_to, forward
from memfit.budget import halve_after_oom, is_oom
from memfit.device.torch_private import version_counter
from memfit.losses import call_loss, class_weighted_mean, count_terms
from memfit.memory.step import surrounding_autocast
from memfit.messages import first_line

__all__ = ["KeptGrads", "MicroStep"]

log = logging.getLogger("memfit.accumulate")


class KeptGrads:
    """The `.grad` each parameter gets when no optimizer step follows (a loss that is not finite, an error before
    the step). With `keep` (accumulate's `restore_grads=True`), the one it held when the step began: `.grad` is
    then exactly as it was, the same tensors (a zero tensor stays a zero tensor, None stays None), only
    referenced, not copied, so they stay held until the step ends (a gradient's worth, counted by
    `training_peak(entry_grads=True)`). Without (the default), None, as `optimizer.zero_grad()` leaves it: the
    gradients held on entry are let go when the step begins, as in a plain loop, and the failed step's partial
    sums are dropped. `params()` gives the parameters whose `.grad` this is about; without `keep` it is called only
    where `restore` runs (a step that succeeds walks none: ViT-tiny's 40 parameters and its optimizer's, 9 us)."""

    def __init__(self, params: Callable[[], list[torch.nn.Parameter]], keep: bool = True):
        self.params = params
        self.held = [(p, p.grad) for p in params()] if keep else None

    def restore(self) -> None:
        for p, g in self.held if self.held is not None else ((p, None) for p in self.params()):
            p.grad = g

    def release(self) -> None:
        self.held = []


class LossSum:
    """The micro-batches' losses, each times its count (samples or terms), summed in float64 as `accumulate`
    reports it, read once at the end instead of once per micro-batch. Each micro-batch's loss is copied into its
    slot of a float64 buffer beside it (one small copy, no sync; a copy, since a scalar loss may be a view of an
    input-sized buffer that a reference would keep); `read` brings the buffer to the host in one transfer and sums
    there exactly as a running float64 sum on the device did (float64(loss_i) * count_i, added in order: IEEE
    products and sums, the same bits), and finds the first micro-batch after which the sum was not finite. Slot 0
    holds a flag `note`d on the way (a check's answer, read with the sums). The buffer (8 bytes a micro-batch,
    and the flag's) is counted by `memfit.memory.micro_batch.training_peak`."""

    def __init__(self, parts: int):
        self.parts = max(1, parts)          # the micro-batches planned (more after an out-of-memory back-off)
        self.buffer: torch.Tensor | None = None
        self.counts: list = []
        self.noted = False

    def add(self, loss: torch.Tensor, count) -> None:
        i = len(self.counts) + 1
        if self.buffer is None:
            self.buffer = torch.empty(self.parts + 1, dtype=torch.float64, device=loss.device)
        elif i == self.buffer.numel():      # more micro-batches than planned (a back-off): a larger buffer
            self.buffer = torch.cat([self.buffer, torch.empty_like(self.buffer)])
        self.buffer[i] = loss.detach()
        self.counts.append(count)

    def note(self, flag: torch.Tensor) -> None:
        """Keep a 0-d bool for `read` (after the first `add`)."""
        self.buffer[0] = flag
        self.noted = True

    def read(self) -> tuple[float, int | None, bool]:
        """(the sum, 0.0 when nothing was added; the index of the first running sum that was not finite, or None;
        the flag noted, False if none). The buffer stays until the step ends (through the optimizer's step too,
        where `training_peak` counts it as everywhere else)."""
        if self.buffer is None:
            values = [0.0]
        else:                               # the one sync; the buffer whole where every slot is filled (no view)
            k = len(self.counts) + 1
            values = (self.buffer if k == self.buffer.numel() else self.buffer[:k]).tolist()
        total, first = 0.0, None
        for i, (v, c) in enumerate(zip(values[1:], self.counts, strict=True)):
            share = v * c if c != 1 else v
            total = share if i == 0 else total + share
            if first is None and not math.isfinite(total):
                first = i
        return total, first, self.noted and values[0] != 0


_GRAD = operator.attrgetter("grad")


def _grad_marks(params: list[torch.nn.Parameter]) -> tuple[list, list]:
    """Each parameter's gradient tensor and its version: AccumulateGrad either sets a new tensor or adds in
    place (which bumps the version), so a changed mark means the parameter received a gradient. (Cheaper
    than hooks: adding and removing one costs about 2.5 us per parameter and step, this 0.15 us.)"""
    grads = list(map(_GRAD, params))
    return grads, [-1 if g is None else version_counter(g) for g in grads]


def _received(params, marks) -> frozenset:
    """ids of the parameters whose gradient changed since `marks`."""
    grads, versions = marks
    return frozenset(id(p) for p, g, v in zip(params, grads, versions, strict=True)
                     if p.grad is not g or (g is not None and version_counter(g) != v))


@contextlib.contextmanager
def _frozen(params: list[torch.nn.Parameter], ids: frozenset):
    """Parameters whose ids are in `ids` get no gradient inside (they already hold this part's)."""
    changed = [p for p in params if id(p) in ids and p.requires_grad] if ids else []
    for p in changed:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in changed:
            p.requires_grad_(True)


class MicroStep:
    """The state of one accumulated step: weights, loss sum, counts."""

    def __init__(self, model, params, loss_fn, x, y, n: int, n_total: int, world: int, device,
                 terms: Callable | None = None):
        self.model, self.loss_fn, self.x, self.y, self.n, self.terms = model, loss_fn, x, y, n, terms
        self.params = [p for p in params if p.requires_grad]
        # the samples (or the loss's terms) over every rank; DDP averages over ranks: world * m / N_total is m / N_total
        self.world, self.n_total, self.device = world, n_total, device
        self.losses = LossSum(1)          # the loss sum, read once after the last micro-batch (`finish`)
        self.loss_sum = 0.0               # ... as read; and the first micro-batch after which it was not finite
        self.first_bad: int | None = None
        # (index, start, end) of each micro-batch that added to the loss sum (NaN and inf stay in a sum, so the
        # first running sum that is not finite points at the first micro-batch whose loss was not)
        self.ranges: list[tuple[int, int, int]] = []
        # per sample, the terms of a class-index loss without class weights, known on the host: a micro-batch's
        # count is a sum, not a read of the device
        self.counts: list[int] | None = getattr(terms, "per_sample", None)
        self.defer = world == 1           # the label check read with the loss sum (ranks must agree at once)
        self.deferred: int | None = None  # the classes it looked at, when deferred
        self.micro_batches, self.retries, self.oom_sizes = 0, 0, []
        self.autocast = self._autocast_type()
        # an out-of-memory error may split a micro-batch: a bool, or a function answering it, asked only when one
        # strikes (the whole batch's answer walks every module for batch statistics: ViT-tiny's 35, 19 us)
        self.splittable: bool | Callable[[], bool] = True
        self.ignore = -100               # the ignore index accumulate knows of (the loss's own, else -100)
        self.summed = False              # loss_fn sums over its batch (reduction='sum'): every part weighs 1
        self.warning: str | None = None  # said after the step: a class-weighted mean inside loss_fn, unweighted
        self.labels_checked = False      # class ids the loss ignores unsaid: looked for at the first micro-batch

    @staticmethod
    def _autocast_type():
        for dev in ("cuda", "cpu"):
            dtype = surrounding_autocast(dev)
            if dtype is not None:
                if dtype == torch.float16:
                    # small float16 gradients flush to zero without loss scaling, and accumulate calls
                    # optimizer.step() itself, so a GradScaler around it cannot unscale them
                    raise ValueError(f"accumulate runs under float16 autocast on {dev}, which needs loss scaling "
                                     "(torch.amp.GradScaler) that accumulate does not do: its gradients could "
                                     "silently flush to zero. Use torch.autocast(..., dtype=torch.bfloat16), or run "
                                     "the micro-batches yourself with a GradScaler")
                return dev
        return None

    def attempt(self, s: int, e: int, frozen: frozenset) -> tuple[str | None, frozenset]:
        """Run samples [s, e) forward and backward; (OOM message or None, parameters that got a gradient)."""
        marks = _grad_marks(self.params)
        # DDP: every backward is local; the one all-reduce comes after the ranks agreed (ranks.synchronise)
        local = self.model.no_sync() if self.world > 1 else contextlib.nullcontext()
        try:
            with local, _frozen(self.params, frozen) if frozen else contextlib.nullcontext():
                self._run(s, e)
        except Exception as err:
            if not is_oom(err):
                raise
            return first_line(err), _received(self.params, marks)
        return None, frozenset()

    def _run(self, s: int, e: int) -> None:
        whole = s == 0 and e == self.n          # the batch itself: no views to make
        xs = batch_to(self.x, self.device) if whole else part_of(self.x, s, e, self.device)
        ys = batch_to(self.y, self.device) if whole else part_of(self.y, s, e, self.device)
        # counted before the forward: a count's temporaries (a bool per label) never sit on the activations
        terms = None if self.terms is None else \
            sum(self.counts[s:e]) if self.counts is not None else count_terms(self.terms, xs, ys)
        out = forward(self.model, xs)
        m = e - s
        # the class weights of a cross entropy loss_fn averages inside, looked at once, where the weighting is ours
        weighted = [] if not self.labels_checked and terms is None and not self.summed and m < self.n_total else None
        loss = call_loss(self.loss_fn, out, ys, weighted)      # refuses (N, 1) against (N,) targets
        if weighted is not None:
            self.warning = class_weighted_mean(weighted)
        per_sample = isinstance(loss, torch.Tensor) and loss.dim() == 1 and loss.numel() == m
        # the classes the output holds, for the check after this backward (not now: its temporaries, a bool per
        # label, would sit on this micro-batch's activations at the step's peak). Looked for at the first part
        # smaller than the batch (an out-of-memory retry of a whole batch included): the whole batch is exact
        check_classes = None
        if not self.labels_checked and m < self.n_total:          # several ranks weigh by samples too
            self.labels_checked = True
            if (self.terms is None and not per_sample and isinstance(out, torch.Tensor)
                    and isinstance(ys, torch.Tensor) and out.dim() == ys.dim() + 1):
                # the classes on dimension 1 (N, C, *d) or last (N, *d, C), where the rest matches the labels: a
                # token model's (N, T, V) logits, transposed in loss_fn, have V classes, not T
                sizes = [c for c, rest in ((out.shape[1], out.shape[2:]), (out.shape[-1], out.shape[1:-1]))
                         if rest == ys.shape[1:]]
                check_classes = max(sizes) if sizes else None
        del out
        if not isinstance(loss, torch.Tensor) or not (loss.numel() == 1 or per_sample):
            raise ValueError(f"loss_fn must return the mean loss over the micro-batch (a scalar tensor) or one loss "
                             f"per sample (shape ({m},)); found "
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
        # per-sample losses are summed; a mean counts m times (or as many times as it has terms): either way this
        # part's share of the batch, scaled in one multiplication (none when the part is the whole batch)
        part, count = (loss.sum(), 1) if per_sample else (loss if loss.dim() == 0 else loss.reshape(()), m)
        del loss                    # per-sample losses: the vector is not needed in backward (sum saves no input)
        if self.summed:             # the full batch's sum is the sum of the parts' sums (DDP averages the ranks')
            count = 1
        if terms is not None:
            if per_sample:
                raise ValueError(f"terms= needs loss_fn to return the mean over those terms (a scalar); found one "
                                 f"loss per sample (shape ({m},)): return their mean, or drop terms=")
            count = terms
            if count == 0:                  # nothing counts in this part: its mean is 0 / 0, and it adds nothing
                self.micro_batches += 1
                return
        if part.requires_grad:       # not when every parameter is frozen (they all hold this part already)
            weight = 1 if self.summed else count * self.world / self.n_total
            weighted = part if weight == 1 else part * weight
            if self.autocast is not None:        # backward outside autocast, as torch.amp recommends
                with torch.autocast(self.autocast, enabled=False):
                    weighted.backward()
            else:
                weighted.backward()
        self.losses.add(part, count)
        self.ranges.append((self.micro_batches, s, e))
        self.micro_batches += 1
        if check_classes is not None and _class_ids(self.y):     # raising takes no step: the gradients held come back
            if self.defer:                  # whether any label is outside: read with the loss sum, no sync now
                self.losses.note(_outside(check_classes, self.y, self.ignore).any())
                self.deferred = check_classes
            else:
                unsaid_ignored_labels(check_classes, self.y, self.ignore)

    def finish(self) -> float:
        """The loss sum (of every micro-batch's loss times its count), read from the device once; raises where the
        deferred label check finds labels the loss ignores unsaid."""
        self.loss_sum, self.first_bad, outside = self.losses.read()
        if outside:
            unsaid_ignored_labels(self.deferred, self.y, self.ignore)
        return self.loss_sum

    def first_nonfinite(self) -> tuple[int, int, int] | None:
        """(index, start, end) of the first micro-batch whose loss was not finite, or None (after `finish`)."""
        return None if self.first_bad is None else self.ranges[self.first_bad]

    def run_range(self, s: int, e: int, size: int, frozen: frozenset) -> int:
        """Accumulate samples [s, e) in micro-batches of `size`; returns the size that worked last.
        A micro-batch that runs out of memory is retried alone at half the size, with the parameters
        that already received its gradient frozen."""
        i = s
        while i < e:
            m = min(size, e - i)
            err, got = self.attempt(i, i + m, frozen)
            if err is None:
                i += m
                continue
            self.retries += 1                        # outside the except block: the failed part's frames are gone
            if not (self.splittable() if callable(self.splittable) else self.splittable):
                self.oom_sizes.append(m)
                raise torch.OutOfMemoryError(f"out of memory in the step on the whole batch ({err}); the model has "
                                             "batch statistics (BatchNorm in training mode), so it is not split into "
                                             "micro-batches without allow_batch_dependent=True")
            size = halve_after_oom(m, err, self.device, self.oom_sizes, single="a training step on a single sample",
                                   fix="free memory, use a smaller model, input or optimizer state")
            log.info("accumulate: out of memory at a micro-batch of %d (%s); retrying it as %d", m, err, size)
            size = self.run_range(i, i + m, size, frozen | got)
            i += m
        return size


def unsaid_ignored_labels(classes: int, y, said: int) -> None:
    """Refuse class ids outside the output's classes that a mean loss ran on without failing (it must ignore
    them, e.g. cross_entropy(..., ignore_index=255) in a lambda) when samples hold different numbers of them:
    micro-batches weighted by samples would then not give the full-batch gradient, silently. `said` is the
    ignore index accumulate already knows of (it warns about that one)."""
    if not _class_ids(y):
        return
    outside = _outside(classes, y, said)
    if not bool(outside.any()):
        return
    label = int(y[outside].flatten()[0])
    per_sample = (y == label).reshape(y.shape[0], -1).sum(1)
    if bool(per_sample.min() != per_sample.max()):
        raise ValueError(f"accumulate: y holds label {label}, outside the output's {classes} classes, and loss_fn "
                         f"ran on it without failing, so it ignores it; samples hold different numbers of it "
                         f"({int(per_sample.min())} to {int(per_sample.max())}), so micro-batches weighted by samples "
                         f"would not give the full-batch gradient. Pass terms=lambda x, y: (y != {label}).sum() "
                         f"(the positions the loss averages over), or have loss_fn return one loss per sample")



def _class_ids(y) -> bool:
    """y holds class ids in more than one dimension (a label per token or per pixel): what `unsaid_ignored_labels`
    looks at."""
    return isinstance(y, torch.Tensor) and not y.is_floating_point() and y.dim() >= 2 and y.numel() > 0


def _outside(classes: int, y: torch.Tensor, said: int) -> torch.Tensor:
    """Where the class ids y are outside [0, classes) and not `said`."""
    outside = (y < 0) | (y >= classes)        # class ids sit on the output's dimension 1 (as cross_entropy's)
    outside &= y != said
    return outside

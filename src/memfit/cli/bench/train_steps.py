"""Real training steps, measured by the allocator (`memfit.device.measure.track_memory`): the plain step the
benchmarks compare against, the bytes a step holds and peaks at, the largest batch that really fits, and the
gradient difference between two models after a step. Shared by `bench train` and its tables.
"""

from __future__ import annotations

import torch

from memfit.accumulation.run import accumulate
from memfit.batches import batch_tensors, forward
from memfit.cli.bench.train_cases import Case
from memfit.device.measure import optimizer_state, track_memory, unique_bytes
from memfit.device.torch_private import BatchNormBase

__all__ = ["accumulate_peak", "adamw", "bn_eval", "grad_rel_error", "held_bytes", "largest_really_fitting",
           "measured_peak", "plain_step"]


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def plain_step(model, opt, x, y, loss_fn) -> None:
    opt.zero_grad(set_to_none=True)
    loss_fn(forward(model, x), y).backward()
    opt.step()


def held_bytes(model, opt, x, y) -> int:
    """Bytes held before a step: parameters, buffers, gradients, optimizer state and the batch."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return unique_bytes([*model.parameters(), *model.buffers(), *grads, *optimizer_state(opt),
                         *batch_tensors(x), *batch_tensors(y)])


def measured_peak(case: Case, n: int) -> int:
    """Bytes of the first two real training steps on n samples (the larger), from a fresh model: the
    allocator's peak above what the step holds (`memfit.device.measure.track_memory`) plus what it holds."""
    model = case.make()
    device = next(model.parameters()).device
    opt = adamw(model)
    x, y = case.batch(n)
    peaks = []
    for _ in range(2):                 # the first step creates AdamW's state, the second starts with it
        opt.zero_grad(set_to_none=True)
        base = held_bytes(model, opt, x, y)
        with track_memory(device) as mem:        # a training loop's locals: out and loss live to the end
            out = forward(model, x)
            loss = case.loss(out, y)
            loss.backward()
            opt.step()
            del out, loss
        peaks.append(base + mem.peak)
    return max(peaks)


def largest_really_fitting(case: Case, budget: int, guess: int) -> tuple[int, bool]:
    """(largest n whose measured step fits `budget`, whether `guess` fits), searched from `guess`: gallop up
    from it while it fits (one or two real steps when the guess is right), else bisect below it."""
    fits = lambda n: measured_peak(case, n) <= budget
    guess_fits = guess >= 1 and fits(guess)
    if guess_fits:
        lo, step = guess, 1
        while fits(lo + step):                      # lo fits; lo + step is the next try
            lo, step = lo + step, step * 2
        hi = lo + step                              # does not fit
    else:
        lo, hi = 0, max(guess, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, guess_fits


def bn_eval(model):
    for m in model.modules():
        if isinstance(m, BatchNormBase):
            m.eval()
    return model


def grad_rel_error(ref, mod) -> float:
    """Largest |difference| of a gradient relative to that tensor's largest |gradient|, floored at 1e-3 of the
    model's largest: an attention key bias has a zero true gradient (softmax ignores a constant added to
    every score), so its computed gradient is float noise (1e-13) and relative to itself means nothing."""
    pairs = [(p.grad, q.grad) for p, q in zip(ref.parameters(), mod.parameters(), strict=True) if p.grad is not None]
    top = max(g.abs().max().item() for g, _ in pairs)
    return max(((g - h).abs().max() / max(g.abs().max().item(), 1e-3 * top, 1e-30)).item() for g, h in pairs)


def accumulate_peak(model, opt, x, y, loss, grads_held: bool = False, **kw):
    """(live bytes at the peak of one real accumulate step, its StepResult), what it holds before included; with
    `grads_held`, the gradients of the step before (the same call's: the steady state) are held on entry (else
    dropped first). That step runs inside a `track_memory` enclosing the measured one: a free counts there only
    where the block's allocation was seen (c10's size for an older block may be another block's), and accumulate
    lets the held gradients go before the optimizer's step (LeNet's step measured 6.4% high at micro-batch 2 when
    they were not counted freed)."""
    device = next(model.parameters()).device
    with track_memory(device):
        if grads_held:
            accumulate(model, opt, (x, y), loss, **kw)
        else:
            model.zero_grad(set_to_none=True)
        base = held_bytes(model, opt, x, y)
        with track_memory(device) as mem:
            r = accumulate(model, opt, (x, y), loss, **kw)
    return base + mem.peak, r

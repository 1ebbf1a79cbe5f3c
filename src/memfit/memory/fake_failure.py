"""Why a fake-tensor run of a model failed, in words a user can act on: the optimizer's step does not run on fake
tensors, the code reads tensor values (data-dependent control flow or shapes), or an op's fake kernel is missing.
"""

from __future__ import annotations

import inspect
import traceback

from memfit.device.torch_private import READ_VALUE
from memfit.memory.known_values import reads_stood_in
from memfit.messages import first_line, whole_words

__all__ = ["explain_fake_failure"]


def explain_fake_failure(e: Exception, model, optimizer, train: bool, n: int, instead: str = "") -> str:
    """Why a fake run failed, and what to do: in the optimizer's step, on a value the code reads, or in an op's
    fake kernel. `instead`: what to do where the optimizer's step failed (default: predict without it)."""
    what = "one training step" if train else "the forward"
    head = f"could not run {what} of {type(model).__name__} on fake tensors at batch {n} " \
           f"({whole_words(first_line(e), 300)})"
    measure = "measure a real step instead with memfit.measure_step"
    step = inspect.unwrap(type(optimizer).step) if optimizer is not None else None
    step_code = getattr(step, "__code__", None)
    frames = [f for f, _ in traceback.walk_tb(e.__traceback__)]
    data_dependent = any(k in type(e).__name__ for k in ("DataDependent", "DynamicOutputShape")) \
        or "data-dependent" in str(e).lower() or str(READ_VALUE) in str(e)     # .item(), x[x > 0]
    if step_code is not None and any(f.f_code is step_code for f in frames):
        read_refused = str(READ_VALUE) in str(e) and reads_stood_in(optimizer) is None
        return (f"{head}: {type(optimizer).__name__}.step() "
                + ("reads tensor values (`.item()`, a comparison), which fake tensors do not have: they are answered "
                   "only in the steps read through (torch's Adafactor and ASGD, transformers' Adafactor: scalars of "
                   "the update, `known_values.READS_SCALARS`); in another a value "
                   "can pick a branch that allocates (a guard that skips a parameter whose gradient holds a NaN "
                   "keeps no state for it)" if data_dependent and read_refused else
                   "makes a size from tensor values (`x[x > 0]`, `nonzero`), which fake tensors do not have (a "
                   "scalar it reads, `.item()`, is answered: it scales the update; a size cannot be)" if data_dependent
                   else
                   "does not run on fake tensors")
                + (f". {instead}" if instead else
                   ". Predict without the step (optimizer=None: forward, loss, backward, gradients) and add the "
                   f"optimizer's state, or {measure}"))
    if data_dependent:
        return (f"{head}. Fake tensors have shapes but no values: data-dependent Python control flow or "
                f"shapes (`if x.sum() > 0`, `.item()`, `.tolist()`, `x[x > 0]`) cannot run on them; {measure}, or "
                "make the branch or shape independent of the values")
    return (f"{head}. If the same step runs for real, this is a limit of torch's fake (shape-only) kernel for "
            f"that op; {measure}, or use another implementation of that layer")

"""What `memfit.accumulate` returns (`StepResult`) and the errors only it raises."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NONFINITE", "BatchDependentError", "NonFiniteLossError", "StepResult"]


class BatchDependentError(ValueError):
    """The model's training-mode output depends on the other samples in the batch (batch statistics):
    micro-batches would not give the full-batch gradient."""


class NonFiniteLossError(FloatingPointError):
    """A micro-batch's loss was NaN or infinite: the optimizer did not step, parameters and optimizer state are as
    they were before the call, the gradients None (as they were with `restore_grads=True`) (`accumulate(nonfinite=
    "raise")`)."""


NONFINITE = ("raise", "skip")        # what accumulate does when a micro-batch's loss is not finite


@dataclass
class StepResult:
    """What `accumulate` did. `loss` is the sample-weighted mean over the whole logical batch (over
    every rank when distributed); `micro_batch` the size chosen, `final_micro_batch` the size after any
    out-of-memory back-off; `skipped` why the optimizer did not step (nonfinite="skip"), '' when it did."""
    loss: float
    n: int
    micro_batch: int
    final_micro_batch: int
    micro_batches: int
    retries: int
    reason: str
    seconds: float = 0.0
    oom_sizes: list = field(default_factory=list)
    skipped: str = ""

    def __str__(self) -> str:
        if self.skipped:
            return f"no step on {self.n} samples: {self.skipped}"
        parts = f"{self.micro_batches} micro-batch{'es' if self.micro_batches != 1 else ''}"
        return (f"one step on {self.n} samples in {parts} of up to "
                f"{self.final_micro_batch} ({self.retries} out-of-memory retries), loss {self.loss:.6g}, "
                f"{self.seconds:.3f} s; micro-batch {self.micro_batch}: {self.reason}")

"""The errors memfit raises that a caller may want to catch, in one place (each is defined beside the code that
raises it; this module only gathers them).

- `BudgetExceeded` (a `MemoryError`): nothing fits the memory budget; `.needed`, `.budget` and `.items` say why.
- `BatchDependentError`: a model whose output for a sample depends on the rest of the batch (BatchNorm in training
  mode) asked to run in micro-batches, which would change its result.
- `NonFiniteLossError`: a micro-batch's loss was NaN or infinite; no step was taken.
- `CaptureError`: `memfit.plan` could not capture the model (its `kind` says why); the eager model still runs.
- `FakeRunError`: a memory model could not run the model on fake tensors (data-dependent control flow, say).
- `ModelChanged`: a `FitPlan` was used on a model, optimizer or batch that changed since it was planned.
- `RankFailed`: another rank of a distributed call failed; every rank raises it.
- `FileMemoryError` (a `MemoryError`): reading a file ran out of memory; the message names the file and the need.

Example:
    >>> import memfit
    >>> issubclass(memfit.errors.BudgetExceeded, MemoryError)
    True
"""

from memfit.accumulation.result import BatchDependentError, NonFiniteLossError
from memfit.bounded import FileMemoryError
from memfit.budget import BudgetExceeded
from memfit.distributed import RankFailed
from memfit.fitting.layout import ModelChanged
from memfit.memory.fake_run import FakeRunError
from memfit.planner.capture import CaptureError

__all__ = ["BatchDependentError", "BudgetExceeded", "CaptureError", "FakeRunError", "FileMemoryError", "ModelChanged",
           "NonFiniteLossError", "RankFailed"]

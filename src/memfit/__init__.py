"""memfit: make deep-learning work fit in the accelerator memory you have.

- `CompactDataset`: datasets stored compactly on the device (uint8, q8, q4, bits1, ...), decoded per batch.
- `loader` / `Loader` / `LoaderConfig`: minibatches by the resident, stream or macro strategy, chosen from a
  memory budget.
- `plan` / `PlannedModule`: every activation of a model in one arena; `memory_model`, `activation_bytes` and
  `max_batch_size` say what a batch (of inference or of a whole training step) needs and what fits,
  without running it at full size.
- `evaluate`: exact whole-set metrics in chunks sized to a memory budget, with out-of-memory back-off.
- `accumulate`: one optimizer step on a batch too large for the budget, as micro-batches, with the
  full-batch gradient and out-of-memory back-off.
- `fit` / `FitPlan`: the micro-batch and the modules to checkpoint that make a training step fit a budget
  fastest, chosen from bytes before anything runs, with the alternatives and why; `plan.step(batch)` runs it.
- `parse_bytes` / `format_bytes` / `device_memory`: sizes and the memory each device has.
- `MemoryModel` (the interface of `InferenceMemoryModel` and `StepMemoryModel`), `MemoryKind`, `measure_step`,
  `check_prediction`: what memory models return, one real step's peak, and the prediction checked against it.

Submodules: `memfit.codecs` (the codecs), `memfit.targets` (class ids, labels, float targets, a dict of
them), `memfit.readers` (readers for MNIST, CIFAR-10, .npy/.npz, digits, synthetic data), `memfit.metrics`,
`memfit.losses`, `memfit.distributed`, `memfit.loading`, `memfit.planner`. See README.md.
"""

from memfit import codecs, metrics, readers
from memfit.accumulation.result import BatchDependentError, NonFiniteLossError, StepResult
from memfit.accumulation.run import accumulate
from memfit.budget import BudgetExceeded, format_bytes, parse_bytes
from memfit.compact import CompactDataset
from memfit.device.machine import device_memory
from memfit.distributed import RankFailed
from memfit.evaluation.result import EvalResult
from memfit.evaluation.run import evaluate
from memfit.fitting.fitter import FitPlan, fit
from memfit.loading.minibatches import Loader, LoaderConfig, loader
from memfit.memory.fake_run import FakeRunError
from memfit.memory.inference import InferenceMemoryModel
from memfit.memory.kinds import MemoryKind, MemoryModel
from memfit.memory.prediction_check import check_prediction
from memfit.memory.ranks import RankMemoryModel, ranks_needed
from memfit.memory.sizing import activation_bytes, max_batch_size, memory_model
from memfit.memory.step import measure_rank_step, measure_step
from memfit.memory.step_model import StepMemoryModel
from memfit.planner.capture import CaptureError
from memfit.planner.planned import PlannedModule, plan

__version__ = "0.1.0"

__all__ = [
    "BatchDependentError",
    "BudgetExceeded",
    "CaptureError",
    "CompactDataset",
    "EvalResult",
    "FitPlan",
    "FakeRunError",
    "InferenceMemoryModel",
    "Loader",
    "LoaderConfig",
    "MemoryKind",
    "MemoryModel",
    "NonFiniteLossError",
    "PlannedModule",
    "RankFailed",
    "RankMemoryModel",
    "StepMemoryModel",
    "StepResult",
    "accumulate",
    "activation_bytes",
    "check_prediction",
    "codecs",
    "readers",
    "device_memory",
    "evaluate",
    "fit",
    "format_bytes",
    "loader",
    "max_batch_size",
    "measure_rank_step",
    "measure_step",
    "memory_model",
    "metrics",
    "parse_bytes",
    "plan",
    "ranks_needed",
]

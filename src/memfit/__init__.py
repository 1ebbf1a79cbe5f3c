"""memfit: make deep-learning work fit in the accelerator memory you have.

What you call:
- `fit`: the micro-batch and the modules to checkpoint that make your training step fit a memory budget fastest,
  chosen before anything runs; `plan.step(batch)` runs it (a `memfit.fitting.FitPlan`).
- `accumulate`: one optimizer step on a batch too large for the budget, as micro-batches, with the full-batch
  gradient and out-of-memory back-off.
- `memory_model` / `max_batch_size`: the bytes your `model(x)` (or one training step, train=True) needs at any
  batch size, and the largest batch that fits, without running it at full size.
- `measure_step`: one real training step's peak bytes, by the allocator (to check a prediction).
- `evaluate`: exact whole-set metrics in chunks sized to a memory budget, with out-of-memory back-off.
- `CompactDataset` and `loader`: a dataset stored compactly on the device (uint8, q8, q4, ...), decoded per batch,
  loaded by the resident, stream or macro strategy chosen from a budget.
- `plan`: a planned forward with every activation in one arena (`memfit.planner.PlannedModule`).
- `BudgetExceeded`: raised when nothing fits; the message says what each part needs.

Submodules: `memfit.readers` (MNIST, CIFAR-10, .npy/.npz, digits, synthetic data), `memfit.codecs`,
`memfit.metrics`, `memfit.errors` (every error to catch). The rest of the library, by concept: `memfit.sizing`
(memory models, `ranks_needed`, `plot_memory`), `memfit.memory` (the engine: `MemoryModel`, `MemoryKind`,
`StepMemoryModel`, `RankMemoryModel`, `check_prediction`), `memfit.fitting`, `memfit.accumulation`,
`memfit.evaluation`, `memfit.loading`, `memfit.planner`, `memfit.budget` (`parse_bytes`, `format_bytes`),
`memfit.device` (`device_memory`), `memfit.distributed`. See README.md.
"""

import importlib
import warnings

from memfit import augment, codecs, errors, metrics, readers
from memfit.accumulation.run import accumulate
from memfit.budget import BudgetExceeded
from memfit.compact import CompactDataset
from memfit.evaluation.run import evaluate
from memfit.fitting.fitter import fit
from memfit.loading.minibatches import loader
from memfit.memory.step import measure_step
from memfit.planner.planned import plan
from memfit.sizing import max_batch_size, memory_model

__version__ = "0.1.0"

__all__ = [
    "BudgetExceeded",
    "CompactDataset",
    "accumulate",
    "augment",
    "codecs",
    "errors",
    "evaluate",
    "fit",
    "loader",
    "max_batch_size",
    "measure_step",
    "memory_model",
    "metrics",
    "plan",
    "readers",
]

# Names that were on `memfit` before the surface shrank, and where they live now: still reachable here, with a
# DeprecationWarning naming the new home, so code written for 0.1 keeps running.
_MOVED = {
    "BatchDependentError": "memfit.errors", "CaptureError": "memfit.errors", "FakeRunError": "memfit.errors",
    "NonFiniteLossError": "memfit.errors", "RankFailed": "memfit.errors",
    "EvalResult": "memfit.evaluation", "FitPlan": "memfit.fitting", "StepResult": "memfit.accumulation",
    "Loader": "memfit.loading", "LoaderConfig": "memfit.loading", "PlannedModule": "memfit.planner",
    "MemoryKind": "memfit.memory", "MemoryModel": "memfit.memory", "StepMemoryModel": "memfit.memory",
    "RankMemoryModel": "memfit.memory", "check_prediction": "memfit.memory", "measure_rank_step": "memfit.memory",
    "activation_bytes": "memfit.sizing", "ranks_needed": "memfit.sizing",
    "format_bytes": "memfit.budget", "parse_bytes": "memfit.budget", "device_memory": "memfit.device",
}


def __getattr__(name: str):
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module 'memfit' has no attribute {name!r}")
    warnings.warn(f"memfit.{name} moved to {home}.{name}; import it from there", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(home), name)

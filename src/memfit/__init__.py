"""memfit: make deep-learning work fit in the accelerator memory you have.

- `CompactDataset`: datasets stored compactly on the device (uint8, q8, q4, bits1, ...), decoded per batch.
- `evaluate`: exact whole-set metrics in chunks sized to a memory budget, with out-of-memory back-off.
- `parse_bytes` / `format_bytes` / `device_memory`: sizes and the memory each device has.

Submodules: `memfit.codecs` (the codecs), `memfit.datasets` (readers for MNIST, CIFAR-10, .npy/.npz,
digits, synthetic data), `memfit.metrics`, `memfit.distributed`. See README.md.
"""

from memfit import codecs, datasets, metrics
from memfit.budget import BudgetExceeded, device_memory, format_bytes, parse_bytes
from memfit.dataset import CompactDataset
from memfit.evaluate import EvalResult, evaluate

__version__ = "0.1.0"

__all__ = [
    "BudgetExceeded",
    "CompactDataset",
    "EvalResult",
    "codecs",
    "datasets",
    "device_memory",
    "evaluate",
    "format_bytes",
    "metrics",
    "parse_bytes",
]

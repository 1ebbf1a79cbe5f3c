"""memfit: make deep-learning work fit in the accelerator memory you have.

Compact datasets in device memory, minibatch loading strategies chosen by budget, one activation
arena planned for any model, and exact evaluation in chunks. See README.md.
"""

from memfit.budget import BudgetExceeded, device_memory, format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "BudgetExceeded",
    "device_memory",
    "format_bytes",
    "parse_bytes",
]

"""A training step's predicted bytes against real steps of the same model, at batch sizes the prediction did not
probe: what `memfit.memory.check_prediction` returns, for benchmarks and for users checking their own model.

The originals are never touched: every real step runs on deep copies of the model and optimizer.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

from memfit.memory.step import measure_step, training_step
from memfit.memory.step_model import forget_step_model, step_memory_model

__all__ = ["check_prediction"]


def check_prediction(model, example_at: Callable[[int], object], sizes=(8, 32), *, optimizer=None, loss_fn=None,
                     target_at: Callable[[int], object] | None = None, autocast=None) -> list[dict]:
    """Predicted vs measured bytes of one training step at each batch size (for benchmarks).

    `example_at(n)` / `target_at(n)` build a real batch of n. The prediction is `step_memory_model`'s
    (what `memfit.memory_model(train=True)` returns) from the batch at 2; each measurement runs `measure_step` on deep
    copies of the model and optimizer (the originals are not touched). Rows: n, predicted, measured,
    ratio (predicted / measured), predict_s (seconds to build the memory model), step_s (seconds of one
    real step at n, untracked).
    """
    forget_step_model(model)                                  # time the prediction itself, not a cache hit
    t0 = time.perf_counter()
    mm = step_memory_model(model, example_at(2), train=True, optimizer=optimizer, loss_fn=loss_fn,
                           target=target_at(2) if target_at else None, autocast=autocast)
    predict_s = time.perf_counter() - t0
    rows = []
    for n in sizes:
        m, opt = copy.deepcopy((model, optimizer))             # one deepcopy: opt stays on m's parameters
        x, y = example_at(n), target_at(n) if target_at else None
        measured = measure_step(m, x, opt, loss_fn, y, autocast=autocast)
        t0 = time.perf_counter()
        training_step(m, x, opt, loss_fn, y, autocast)
        step_s = time.perf_counter() - t0
        rows.append({"n": n, "predicted": mm.total_bytes(n), "measured": measured,
                     "ratio": mm.total_bytes(n) / measured, "predict_s": predict_s, "step_s": step_s})
    return rows

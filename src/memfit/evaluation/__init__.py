"""Evaluation in chunks: exact whole-set metrics however the work is split (`memfit.evaluate`).

`evaluate` (in `run`) reads resolve -> decide -> loop -> reduce:

- `chunks`: the data as chunks decoded on the device (compact rows cross the bus);
- `estimates`: the peak bytes of a chunk of n (the planner's arena, a fake-tensor forward, or measured runs,
  labelled APPROXIMATE) and the largest chunk that fits a budget;
- `decision`: the one place the chunk size and runner are chosen (`decide` -> `Decision`);
- `loop`: the chunks run, their sums and counts committed, an out-of-memory chunk halved and retried;
- `ranks`: several ranks agreeing on the data and the chunk size, and summing their results;
- `result`: `EvalResult`.

The entry point is `memfit.evaluate`; this package exports its result, `EvalResult`.
"""

from memfit.evaluation.result import EvalResult

__all__ = ["EvalResult"]

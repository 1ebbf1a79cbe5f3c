"""Making a training step fit a budget by choosing its micro-batch and activation checkpointing (`memfit.fit`).

Modules: `search` (pure: the alternatives, their predicted time from a cost model, the choice and why),
`costs` (the cost model's inputs, counted on fake tensors: kernel launches, FLOPs and bytes written per
block and per step; the machine's rates, measured once on small kernels), `checkpointing` (which modules are
candidates; running chosen ones under non-reentrant `torch.utils.checkpoint` only while a step runs),
`finder` (the search wired to a model: the settings, their costs and their bytes, each micro-batch size's
computed when first needed), `fitter` (`fit` and `FitPlan`), `trainer` (the hand-off to transformers'
`Trainer`), `plot` (the alternatives against the budget).

The entry point is `memfit.fit`; this package exports its result, `FitPlan`.
"""

from memfit.fitting.fitter import FitPlan

__all__ = ["FitPlan"]

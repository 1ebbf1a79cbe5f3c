"""Memory models: the bytes a forward or a whole training step needs at any batch size, before it runs.

- `memory_model(model, example, train=...)` -> a `MemoryModel` (`total_bytes(n)`, `breakdown(n)` by `MemoryKind`,
  `method`, `explain()`): `InferenceMemoryModel` for a forward the planner captures (its arena, exact at any
  n), `StepMemoryModel` for anything else (an eager forward, a training step) from fake-tensor runs.
- `max_batch_size`, `activation_bytes`: what fits a budget, from the model.
- `measure_step`: one real step's peak bytes; `check_prediction`: the prediction against real steps.

Every public name lives on `memfit` (`memfit.memory_model`, `memfit.MemoryModel`, ...); this package
exports nothing of its own.

Modules: `kinds` (the `MemoryKind` enum, the `MemoryModel` interface), `allocator` (what the allocators add: CUDA
blocks and margin, CPU alignment), `step` (what one training step is; measuring it for real), `fake_run` (that step or
a forward on fake tensors; `storage_log`: every storage it allocates and frees, per op), `fake_kernels` (the bytes
real kernels give where fake ones differ), `kernel_scratch` (what kernels allocate inside, oneDNN's workspaces and the
scratch of kernels on half-precision arguments, measured at each batch size asked about), `fit` (fake runs at a few
sizes fitted into lines per op), `fit_ladder` (which fit, and which runs: the ladder of fitters), `step_model`
(`StepMemoryModel`; `fake_failure`: why a fake run failed, in words), `prediction_check` (`check_prediction`),
`inference` (`InferenceMemoryModel`, from the planner's arena), `sizing` (`memory_model`, `max_batch_size`,
`activation_bytes`, `plot_memory`), `micro_batch` (the micro-batch size `accumulate` picks), `fingerprint` (what kept
plans and predictions depend on; `fingerprint_check`: the quick check that a kept one still holds), `cache` (plans and
models kept per model), `measure` (live bytes of real runs), `isolation` (what a prediction leaves alone: the user's
module as other threads see it, every RNG), `example_target` (the example target of a common loss, built from the
output), `ranks` (`RankMemoryModel`: one rank of DDP or FSDP2, `ranks_needed`), `fsdp_run` (a `fully_shard` step on
fake tensors under a fake process group); a rank's real peak is `step.measure_rank_step`, counted at the CPU allocator
by `measure.track_memory`.

Known limitations: library workspaces (cuBLAS, cuDNN) are not counted on CUDA. On the CPU, what kernels
allocate inside is measured from the real kernels for the ops `fake_kernels.WORKSPACE` lists (found by
measuring) and for every op on half-precision arguments (`kernel_scratch`); any other kernel that allocates
inside is seen by `measure` (the allocator's events) only.

Example:
    >>> import torch
    >>> from memfit import MemoryModel, memory_model
    >>> mm = memory_model(torch.nn.Linear(8, 4), (8,))
    >>> isinstance(mm, MemoryModel), sorted(mm.breakdown(2))[:2]
    (True, ['activations (arena)', 'activations (outside the arena)'])
"""

__all__: list[str] = []

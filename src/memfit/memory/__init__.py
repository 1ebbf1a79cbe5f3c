"""The engine: the bytes a forward or a whole training step needs at any batch size, before it runs.

One mechanism answers every question: the user's own step (an eager forward under no_grad, a training step, one
rank's DDP or FSDP2 step) runs for real on fake tensors at a few small batch sizes (nothing is allocated), every
storage it allocates and frees is logged per op, and the runs are fitted into bytes at any n (`StepMemoryModel`,
`RankMemoryModel`, both `MemoryModel`s). The user-facing answers (`memfit.memory_model`, `memfit.max_batch_size`)
are in `memfit.sizing`; the planner's arena (`planned=True`) is a consumer of this package, never a dependency:
nothing here imports `memfit.planner`.

Exports: `MemoryModel` (the interface: `total_bytes(n)`, `breakdown(n)` by `MemoryKind`, `method`, `explain()`),
`MemoryKind`, `StepMemoryModel`, `RankMemoryModel`, `measure_rank_step` (a real rank's step's peak by the allocator;
`memfit.measure_step` one process's), `check_prediction` (the prediction against real steps).

Modules: `kinds` (the `MemoryKind` enum, the `MemoryModel` interface), `step` (what one training step is; measuring
it for real), `fake_model` (`FakeModel`: the one set-up of a model on fake tensors),
`fake_run` (that step or a forward on fake tensors; `storage_log`: every storage it allocates and frees,
per op; `known_values`: the values it knows, those the program makes from no input), `fake_kernels` (the bytes
real kernels give where fake ones differ), `kernel_scratch` (what kernels allocate inside, oneDNN's workspaces, the
scratch of kernels on half-precision arguments and matmuls' copies of arguments BLAS cannot read, measured at each batch
size asked about), `fit` (fake runs at a few sizes fitted into lines per op), `fit_ladder` (which fit, and which runs:
the ladder of fitters), `step_model` (`StepMemoryModel`; `fake_failure`: why a fake run failed, in words; `recheck`: an
APPROXIMATE model's bytes at one size from a run at it), `prediction_check`
(`check_prediction`), `micro_batch` (the micro-batch size `accumulate` picks; `held_grads`: the model of a later
micro-batch, its gradients held, derived from the first one's runs where they show it is the same), `fingerprint`
(what kept plans and predictions depend on: `model_value` its pieces, `fingerprint_check` the quick check that a kept
one still holds),
`cache` (`ModelCache`: values kept per model), `isolation` (what a prediction leaves alone: the user's module as other
threads see it, every RNG), `global_caches` (function caches a fake run must leave without fake tensors),
`example_target` (the example target of a common loss, built from the output), `ranks` (`RankMemoryModel`: one rank
of DDP or FSDP2), `fewest_ranks` (`ranks_needed`), `fsdp_run` (a `fully_shard` step on fake tensors under a fake
process group; `fsdp_log`: how its storages are tagged), `world_scaling` (its bytes at any world size); on CUDA,
`cuda_target` (which CUDA device a prediction is for: the GPU here, or one predicted from any machine, and its fixed
costs), `cuda_step` (`CudaStep`: the caching allocator replayed over the runs' allocations, fitted per event;
`cuda_held`: the blocks held before the step: parameters in `.to` order, DDP's buckets). The allocator's rules and
real measurements are below it, in `memfit.device`.

Known limitations: cuDNN's workspaces, and what the eval fast paths of transformer layers make inside, are not
counted on CUDA. On the CPU, what kernels
allocate inside is measured from the real kernels for the ops `fake_kernels.WORKSPACE` lists (found by
measuring), for every op on half-precision arguments and for matmuls on arguments BLAS cannot read as they are
(`kernel_scratch`); any other kernel that allocates
inside is seen by `memfit.device.measure` (the allocator's events) only.

Example:
    >>> import torch
    >>> from memfit.memory import MemoryModel
    >>> from memfit.sizing import memory_model
    >>> mm = memory_model(torch.nn.Linear(8, 4), (8,))
    >>> isinstance(mm, MemoryModel), sorted(mm.breakdown(2))[:2]
    (True, ['activations', 'allocator margin'])
"""

from memfit.memory.kinds import MemoryKind, MemoryModel
from memfit.memory.prediction_check import check_prediction
from memfit.memory.ranks import RankMemoryModel
from memfit.memory.step import measure_rank_step
from memfit.memory.step_model import StepMemoryModel

__all__ = ["MemoryKind", "MemoryModel", "RankMemoryModel", "StepMemoryModel", "check_prediction", "measure_rank_step"]

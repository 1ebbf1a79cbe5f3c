"""Activation memory planner: every intermediate tensor of a model in one arena, never on a live input.

- `plan(model, example_inputs)` -> `PlannedModule`: captures the model once with torch.export (the
  batch dimension symbolic, so every batch size is planned from that one capture), places each
  intermediate at an offset of one byte arena (tensors live at the same op never overlap;
  allowlisted elementwise ops may write over a dead input that no other operand of the op views;
  an op whose output costs less memory outside the arena runs eagerly) and runs the model there.
- The bytes the planned forward needs at a batch of n, without running it: `memfit.memory_model(..., planned=True)`
  (`arena_model`).
- `memfit plan MODULE:FACTORY --input 1,3,224,224` prints the plan (`memfit.cli.plan`, not
  imported here: the library never imports the command line).

Modules: `arena` (lifetimes, offsets, verifier: pure functions), `ops` (out= kernels, views,
in-place allowlist), `capture` (torch.export, error diagnosis), `graph` (aliases, lifetimes, sizes
at a batch size), `order` (the op order of the fewest peak bytes), `captured` (`capture_model`: one
capture for every batch size), `placement` (`place_at(capture, n)`: exact sizes at any batch, which ops
run eagerly, offsets), `codegen` (the generated forward), `planned` (`plan`, `PlannedModule`), `report`,
`slicing` (a memory-heavy stem run in slices of the batch, checked bit-identical on the example), `slice_rule`
(whether and in what slices each runs at each batch), `op_cost` (an op's bytes and estimated time there), `remat`
(input-free tensors recomputed at each reader), `arena_model` (`PlannedMemoryModel`: the planned forward's bytes at
any batch, `memfit.memory_model(planned=True)`), `kept` (plans and planned memory models kept per model).

The entry point is `memfit.plan` (`memfit.errors.CaptureError` when it cannot capture); this package
exports the planner's own types and pure functions.

Example:
    >>> import torch
    >>> from memfit import plan
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    >>> pm = plan(model, (torch.randn(4, 8),))
    >>> print(pm.report.summary().splitlines()[0])
    memory plan (greedy_by_size, 5 ops, 1 tensor in the arena)
"""

from memfit.planner.arena import ALGORITHMS, Buffer, OverlapError, assign_offsets, lower_bound, verify
from memfit.planner.arena_model import PlannedMemoryModel
from memfit.planner.planned import PlannedModule
from memfit.planner.report import Report, Row

__all__ = [
    "ALGORITHMS",
    "Buffer",
    "OverlapError",
    "PlannedMemoryModel",
    "PlannedModule",
    "Report",
    "Row",
    "assign_offsets",
    "lower_bound",
    "verify",
]

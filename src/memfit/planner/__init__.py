"""Activation memory planner: every intermediate tensor of a model in one arena, never on a live input.

- `plan(model, example_inputs)` -> `PlannedModule`: captures the model once with torch.export (the
  batch dimension symbolic, so every batch size is planned from that one capture), places each
  intermediate at an offset of one byte arena (tensors live at the same op never overlap;
  allowlisted elementwise ops may write over a dead input that no other operand of the op views;
  an op whose output costs less memory outside the arena runs eagerly) and runs the model there.
- `memory_model`, `activation_bytes`, `max_batch_size`: the bytes a batch of n needs, from plans,
  without running the model at full size.
- `memfit plan MODULE:FACTORY --input 1,3,224,224` prints the plan (`memfit.cli.plan`, not
  imported here: the library never imports the command line).

Modules: `arena` (lifetimes, offsets, verifier: pure functions), `ops` (out= kernels, views,
in-place allowlist), `capture` (torch.export, error diagnosis), `graph` (aliases, lifetimes, sizes
at a batch size), `codegen` (the generated forward), `planned` (`plan`, `PlannedModule`,
`capture_model` + `place_at(capture, n)`: exact sizes at any batch from one capture), `sizing`
(`memory_model`, `max_batch_size`), `report`, `cache` (plans `evaluate` borrows), `training` (what
one training step is, and measuring it for real), `fake_step` (that step or a forward run on fake
tensors, every storage logged), `footprint` (those runs fit into the bytes of an eager forward or
training step at any batch size), `fingerprint` (what kept plans and predictions depend on),
`global_caches` (function caches a fake run must leave without fake tensors).

The public entry points live on `memfit` (`memfit.plan`, `memfit.memory_model`, ...); this package
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
from memfit.planner.capture import CaptureError
from memfit.planner.report import Report, Row
from memfit.planner.sizing import MemoryModel

__all__ = [
    "ALGORITHMS",
    "Buffer",
    "CaptureError",
    "MemoryModel",
    "OverlapError",
    "Report",
    "Row",
    "assign_offsets",
    "lower_bound",
    "verify",
]

"""One row of `memfit bench planner`'s tables (the zoo, the real models, the held-out ones): a plan's bytes by the
allocator (its arena and the peak of what the call allocates beyond it) beside eager's, the graph's own op order's
beside the chosen one, and the latency of the planned call against eager's (called in turn). Its own module:
`bench.planner` and `bench.held_out` both build their rows with it.
"""

from __future__ import annotations

import torch

from memfit.cli.bench.common import paired_ratio, rounds_for
from memfit.device.measure import track_memory
from memfit.planner.planned import plan_captured

__all__ = ["peak", "planned_row"]


def peak(fn, x) -> int:
    """The allocator's peak of `fn(x)` under inference mode, above what was live before it."""
    with torch.inference_mode(), track_memory(x.device) as mem:
        out = fn(x)
        del out
    return mem.peak


def planned_row(name: str, model, pm, x: torch.Tensor, repeat: int, plan_s: float) -> dict:
    """Bytes and latency of `pm` against `model` on `x` (planned for x's shape on first call)."""
    dev, batch = x.device, x.shape[0]
    with torch.inference_mode():
        torch.testing.assert_close(pm(x), model(x), rtol=1e-3, atol=1e-3)
        rep = pm.report
        eager_peak = peak(model, x)
        outside = peak(pm, x)               # bytes the planned run allocates beyond its arena
        # fast models need many rounds for a stable median: at least ~0.5 s of calls of each, and 3x `repeat`
        reps = rounds_for(lambda: model(x), seconds=0.5, at_least=3 * repeat, at_most=1000, device=dev)
        # eager and planned in turn, call by call: drift in the machine, and whatever one call leaves for
        # the next, hit both alike (timed in two blocks, the block run second was faster on a shared VM)
        t_eager, t_planned, ratio = paired_ratio(lambda: model(x), lambda: pm(x), repeat=reps, warmup=2,
                                                 device=dev, what=f"{name} batch {batch} planned / eager")
    planned_total = rep.arena_bytes + outside
    # the graph's order beside the chosen one (`planner.order`): same capture, measured the same way
    kept = plan_captured(next(c for c in pm.captures if c.accepts((x,))), (x,), algorithm=pm.algorithm,
                         inplace=pm.inplace, eager_where_cheaper=pm.eager_where_cheaper, reorder=False)
    with torch.inference_mode():
        graph_order_total = kept.report.arena_bytes + peak(kept, x)
    return {
        "order": rep.order, "graph_order_total": graph_order_total,
        "reorder_saved": graph_order_total - planned_total,
        "model": name, "batch": batch, "naive": rep.naive_bytes, "eager_peak": eager_peak,
        # no arena (every op run by torch) is the bound, 0 of 0
        "arena": rep.arena_bytes, "bound": rep.lower_bound,
        "arena/bound": rep.arena_bytes / rep.lower_bound if rep.lower_bound else 1.0,
        "naive/arena": rep.naive_bytes / max(rep.arena_bytes, 1), "unplanned": outside,
        "planned_total": planned_total, "total/eager": planned_total / max(eager_peak, 1),
        "eager_ms": 1e3 * t_eager, "planned_ms": 1e3 * t_planned, "latency_ratio": ratio, "plan_s": plan_s,
        "captures": len(pm.captures),
        "unplanned_ops": ", ".join(f"{k} x{v}" for k, v in sorted(rep.unplanned_ops.items())),
    }

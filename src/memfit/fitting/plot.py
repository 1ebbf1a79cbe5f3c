"""A picture of `memfit.fit`'s alternatives: predicted peak bytes against predicted step time, the budget as a
line, the chosen plan marked (`plot_fit`). Needs matplotlib (imported when called)."""

from __future__ import annotations

from pathlib import Path

from memfit.budget import format_bytes

__all__ = ["plot_fit"]


def plot_fit(plan, path, *, name: str = "") -> Path:
    """Write one point per alternative of `plan` (a `memfit.fitting.FitPlan`) whose bytes were computed: x the predicted
    time relative to the plain step, y the predicted peak in MiB, colour the number of checkpointed blocks,
    marker the micro-batch; the budget a dashed line, the chosen plan circled. Returns the path written."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plot_fit needs matplotlib, which is not installed; pip install matplotlib "
                          "(or 'memfit[demo]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mib = 2.0 ** 20
    shown = [a for a in plan.alternatives if a.bytes is not None]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    blocks = max(1, len(plan.candidates))
    for m in sorted({a.micro_batch for a in shown}):
        pts = [a for a in shown if a.micro_batch == m]
        sc = ax.scatter([a.time for a in pts], [a.bytes / mib for a in pts],
                        c=[len(a.setting.checkpoint) / blocks for a in pts], cmap="viridis", vmin=0, vmax=1,
                        marker="o" if m == plan.n else "s", s=20 + 60 * m / plan.n, label=f"micro-batch {m}",
                        edgecolors=["red" if a.setting.autocast else "none" for a in pts])
    ax.axhline(plan.budget / mib, color="black", linestyle="--", label=f"budget {format_bytes(plan.budget)}")
    ax.scatter([plan.relative_time], [plan.peak_bytes / mib], s=260, facecolors="none", edgecolors="black",
               linewidths=1.5, label="chosen")
    if shown:
        fig.colorbar(sc, ax=ax, label="fraction of candidate blocks checkpointed")
    ax.set_xscale("log")
    ax.set_xlabel("predicted step time / plain step (log)")
    ax.set_ylabel("predicted peak, MiB")
    ax.set_title(f"{name + ': ' if name else ''}memfit.fit alternatives for a batch of {plan.n} "
                 "(red edge: bf16 autocast)", fontsize=8, loc="left")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

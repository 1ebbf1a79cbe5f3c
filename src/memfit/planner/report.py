"""What a plan holds, as a table and a picture of the arena over time."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from memfit.budget import format_bytes
from memfit.planner.arena import Buffer, assign_offsets

__all__ = ["Report", "Row"]


@dataclass(frozen=True)
class Row:
    """One tensor allocation. `offset` is None outside the arena (`kind` 'call' or 'output');
    `inplace` lists the op outputs written over it in place."""
    name: str
    shape: tuple
    dtype: str
    bytes: int
    lifetime: tuple[int, int]
    offset: int | None
    kind: str
    inplace: tuple[str, ...] = ()


@dataclass
class Report:
    """Bytes of one plan. All sizes in bytes.

    Attributes:
        naive_bytes: every planned op output in its own region (no reuse, no in-place).
        arena_bytes: the arena the plan allocates.
        lower_bound: the most bytes of planned tensors live at any one op (64-byte padded): no
            arena can be smaller; `arena_bytes / lower_bound` is how far the planner is from it.
        unplanned_bytes: the most bytes live at any one op outside the arena: outputs of ops with
            no real `out=` kernel (convolution and layer norm on the CPU) and the model's outputs.
        param_bytes: parameters, buffers and constants the graph reads.
        input_bytes: the example inputs.
        rows: one `Row` per allocation, in order of first use.
        algorithm: the offset algorithm used.
        unplanned_ops: op name -> count of ops run without an `out=` kernel.
        unplanned_reasons: op name -> why it runs outside the arena (no out= variant, an out= variant
            that allocates and copies, ...).
        capture: how the graph was captured ("one capture, batch symbolic in [1, inf)", or static and why).
    """
    naive_bytes: int
    arena_bytes: int
    lower_bound: int
    unplanned_bytes: int
    param_bytes: int
    input_bytes: int
    rows: list[Row]
    algorithm: str
    n_ops: int
    unplanned_ops: dict[str, int] = field(default_factory=dict)
    capture: str = ""
    unplanned_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Parameters + inputs + arena + unplanned: an upper bound of what one call holds."""
        return self.param_bytes + self.input_bytes + self.arena_bytes + self.unplanned_bytes

    def summary(self) -> str:
        ratio = self.arena_bytes / self.lower_bound if self.lower_bound else 1.0
        unplanned = ", ".join(f"{k} x{v}" for k, v in sorted(self.unplanned_ops.items()))
        return "\n".join([
            f"memory plan ({self.algorithm}, {self.n_ops} ops, {sum(r.kind == 'arena' for r in self.rows)} "
            f"tensors in the arena)",
            f"  naive (one region per tensor)  {format_bytes(self.naive_bytes):>12}",
            f"  planned arena                  {format_bytes(self.arena_bytes):>12}  "
            f"({self.naive_bytes / max(self.arena_bytes, 1):.1f}x less than naive)",
            f"  lower bound (most live at once){format_bytes(self.lower_bound):>12}  (arena / bound {ratio:.3f})",
            f"  unplanned (outside the arena)  {format_bytes(self.unplanned_bytes):>12}"
            + (f"  ({unplanned})" if unplanned else ""),
            f"  parameters                     {format_bytes(self.param_bytes):>12}",
            f"  total with inputs              {format_bytes(self.total_bytes):>12}",
        ] + [f"    {op}: {why}" for op, why in sorted(self.unplanned_reasons.items())]
          + ([f"  capture: {self.capture}"] if self.capture else []))

    def table(self, limit: int | None = 60) -> str:
        head = f"  {'tensor':<28} {'shape':<20} {'dtype':<9} {'bytes':>11} {'lifetime':>11} {'offset':>11}  kind"
        rows = self.rows if limit is None else self.rows[:limit]
        out = [head]
        for r in rows:
            life = f"{r.lifetime[0]}..{r.lifetime[1]}"
            off = "-" if r.offset is None else str(r.offset)
            extra = f" (+{', '.join(r.inplace)} in place)" if r.inplace else ""
            out.append(f"  {r.name[:28]:<28} {str(list(r.shape))[:20]:<20} {r.dtype:<9} {r.bytes:>11} {life:>11} "
                       f"{off:>11}  {r.kind}{extra}")
        if limit is not None and len(self.rows) > limit:
            out.append(f"  ... {len(self.rows) - limit} more (report.table(limit=None) lists all)")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()

    def to_dict(self) -> dict:
        return {"naive_bytes": self.naive_bytes, "arena_bytes": self.arena_bytes, "lower_bound": self.lower_bound,
                "unplanned_bytes": self.unplanned_bytes, "param_bytes": self.param_bytes,
                "input_bytes": self.input_bytes, "algorithm": self.algorithm, "n_ops": self.n_ops,
                "unplanned_ops": dict(self.unplanned_ops), "unplanned_reasons": dict(self.unplanned_reasons),
                "capture": self.capture,
                "rows": [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes,
                          "lifetime": list(r.lifetime), "offset": r.offset, "kind": r.kind,
                          "inplace": list(r.inplace)} for r in self.rows]}

    def plot(self, path: str | os.PathLike) -> Path:
        """Write a PNG of the arena over time: one rectangle per tensor (x = op index, y = offset).

        Raises:
            ImportError: matplotlib is not installed (`pip install matplotlib`).
        """
        try:
            import matplotlib
        except ImportError:
            raise ImportError("Report.plot needs matplotlib, which is not installed; "
                              "pip install matplotlib (or 'memfit[demo]')") from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(8, 4.4))
        cmap = plt.get_cmap("tab20")
        scale, unit = (2**20, "MiB") if self.arena_bytes >= 2**20 else (2**10, "KiB")
        for i, r in enumerate(r for r in self.rows if r.kind == "arena"):
            ax.add_patch(Rectangle((r.lifetime[0], r.offset / scale), r.lifetime[1] - r.lifetime[0] + 1,
                                   r.bytes / scale, facecolor=cmap(i % 20), edgecolor="black", linewidth=0.3))
        # tensors made by ops without an out= kernel live outside the arena: drawn above it, hatched
        outside = [r for r in self.rows if r.kind == "call" and r.bytes]
        top = self.arena_bytes
        if outside:
            offs, size = assign_offsets([Buffer(r.name, r.bytes, *r.lifetime) for r in outside], "greedy_by_size", 1)
            for r, off in zip(outside, offs, strict=True):
                ax.add_patch(Rectangle((r.lifetime[0], (self.arena_bytes + off) / scale),
                                       r.lifetime[1] - r.lifetime[0] + 1, r.bytes / scale, facecolor="0.85",
                                       edgecolor="0.4", hatch="//", linewidth=0.3))
            top += size
            label = f"outside the arena (no out= kernel), up to {format_bytes(self.unplanned_bytes)}"
            ax.add_patch(Rectangle((0, 0), 0, 0, facecolor="0.85", edgecolor="0.4", hatch="//", label=label))
        ax.axhline(self.arena_bytes / scale, color="red", linewidth=1, label=f"arena {format_bytes(self.arena_bytes)}")
        ax.axhline(self.lower_bound / scale, color="gray", linestyle="--", linewidth=1,
                   label=f"lower bound {format_bytes(self.lower_bound)}")
        ax.set(xlim=(0, max(self.n_ops, 1)), ylim=(0, max(top, 1) / scale * 1.08),
               xlabel="op index", ylabel=f"offset ({unit})",
               title=f"memfit activation arena ({self.algorithm}): one rectangle per tensor")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

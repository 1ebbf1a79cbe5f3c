"""What a plan holds, as a table and a picture of the arena over time."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from memfit.budget import format_bytes
from memfit.messages import plural
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
            no real `out=` kernel (convolution and layer norm on the CPU), of ops run eagerly because
            that costs less memory (`plan(..., eager_where_cheaper=True)`), and the model's outputs.
        param_bytes: parameters, buffers and constants the graph reads.
        input_bytes: the example inputs.
        rows: one `Row` per allocation, in order of first use.
        algorithm: the offset algorithm used.
        unplanned_ops: op name -> count of ops whose outputs torch allocates (run without `out=`).
        unplanned_reasons: op name -> why it runs outside the arena (no out= variant, an out= variant
            that allocates and copies, ...).
        capture: how the graph was captured ("one capture, batch symbolic in [2, inf]", or static and why).
        order: the op order that runs: "graph" (the exported graph's), or the `planner.order` candidate
            that needs fewer bytes ("lpmf", "bfs", "dfs", "optimal"); `plan(..., reorder=False)` keeps the graph's.
        graph_order_bytes: arena + unplanned bytes with the graph's order (what reordering bought:
            `graph_order_bytes - (arena_bytes + unplanned_bytes)`).
        no_arena: where the plan has no arena (every op run by torch), why, in words ("" where it has one).
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
    order: str = "graph"
    graph_order_bytes: int = 0
    no_arena: str = ""

    @property
    def total_bytes(self) -> int:
        """Parameters + inputs + arena + unplanned: an upper bound of what one call holds."""
        return self.param_bytes + self.input_bytes + self.arena_bytes + self.unplanned_bytes

    def summary(self) -> str:
        unplanned = ", ".join(f"{k} x{v}" for k, v in sorted(self.unplanned_ops.items()))
        if self.arena_bytes:
            ratio = self.arena_bytes / self.lower_bound if self.lower_bound else 1.0
            arena = [
                f"memory plan ({self.algorithm}, {plural(self.n_ops, 'op')}, "
                f"{plural(sum(r.kind == 'arena' for r in self.rows), 'tensor')} in the arena)",
                f"  naive (one region per tensor)  {format_bytes(self.naive_bytes):>12}",
                f"  planned arena                  {format_bytes(self.arena_bytes):>12}  "
                f"({self.naive_bytes / self.arena_bytes:.1f}x less than naive)",
                f"  lower bound (most live at once){format_bytes(self.lower_bound):>12}  (arena / bound {ratio:.3f})",
                f"  unplanned (outside the arena)  {format_bytes(self.unplanned_bytes):>12}"]
        else:           # no arena: three lines of 0 B would say nothing (issue 35)
            arena = [
                f"memory plan ({plural(self.n_ops, 'op')}, no arena: every op runs eagerly, torch allocating its "
                "output, in place where the rules allow)",
                f"  why: {self.no_arena or 'no op writes into an arena here'}",
                f"  peak of the call (torch's)     {format_bytes(self.unplanned_bytes):>12}"]
        return "\n".join(arena[:-1] + [arena[-1] + (f"  ({unplanned})" if unplanned else "")] + [
            f"  parameters                     {format_bytes(self.param_bytes):>12}",
            f"  total with inputs              {format_bytes(self.total_bytes):>12}",
        ] + [f"    {op}: {why}" for op, why in sorted(self.unplanned_reasons.items())]
          + ([f"  capture: {self.capture}"] if self.capture else [])
          + ([f"  op order: {self.order} (arena + unplanned {format_bytes(self.arena_bytes + self.unplanned_bytes)}, "
               f"{format_bytes(self.graph_order_bytes)} in the graph's order)"]
             if not self.order.startswith("graph") else []))

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
                "capture": self.capture, "order": self.order, "graph_order_bytes": self.graph_order_bytes,
                "no_arena": self.no_arena,
                "rows": [{"name": r.name, "shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes,
                          "lifetime": list(r.lifetime), "offset": r.offset, "kind": r.kind,
                          "inplace": list(r.inplace)} for r in self.rows]}

    def plot(self, path: str | os.PathLike, labels: int = 10) -> Path:
        """Write a PNG of the arena over time (see `figure`) to `path`; returns the path.

        Raises:
            ImportError: matplotlib is not installed (`pip install matplotlib`).
        """
        fig = self.figure(labels)                          # raises the ImportError with its fix first
        import matplotlib.pyplot as plt
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path

    def figure(self, labels: int = 10):
        """A matplotlib Figure of the arena over time: one rectangle per tensor (x = op index, y = offset).

        A tensor with lifetime first..last (as in `table`) covers the cells of ops first to last,
        each cell centred on its op's index. The largest tensors (up to `labels`) carry their name
        and size where the text fits; the arena and the lower bound are drawn as two lines, the
        bound dashed on top so that both show when they are equal.

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
        from matplotlib.ticker import MaxNLocator

        fig, ax = plt.subplots(figsize=(9, 5), dpi=120)
        cmap = plt.get_cmap("tab20")
        scale, unit = (2**20, "MiB") if self.arena_bytes >= 2**20 else (2**10, "KiB")
        cell = lambda r, off: ((r.lifetime[0] - 0.5, off / scale), r.lifetime[1] - r.lifetime[0] + 1, r.bytes / scale)
        arena = [r for r in self.rows if r.kind == "arena"]
        drawn = [(r, r.offset) for r in arena]               # (row, offset drawn at), for the labels
        for i, r in enumerate(arena):
            ax.add_patch(Rectangle(*cell(r, r.offset), facecolor=cmap(i % 20), edgecolor="black", linewidth=0.3))
        # tensors made by ops without an out= kernel live outside the arena: drawn above it, hatched
        outside = [r for r in self.rows if r.kind == "call" and r.bytes]
        top = self.arena_bytes
        if outside:
            offs, size = assign_offsets([Buffer(r.name, r.bytes, *r.lifetime) for r in outside], "greedy_by_size", 1)
            for r, off in zip(outside, offs, strict=True):
                drawn.append((r, self.arena_bytes + off))
                ax.add_patch(Rectangle(*cell(r, self.arena_bytes + off), facecolor="0.88", edgecolor="0.4",
                                       hatch="//", linewidth=0.3))
            top += size
            label = f"outside the arena (allocated by torch), up to {format_bytes(self.unplanned_bytes)}"
            ax.add_patch(Rectangle((0, 0), 0, 0, facecolor="0.88", edgecolor="0.4", hatch="//", label=label))
        same = " (= arena)" if self.lower_bound == self.arena_bytes else ""
        ax.axhline(self.arena_bytes / scale, color="tab:red", linewidth=2.4, zorder=3,
                   label=f"arena {format_bytes(self.arena_bytes)}")
        ax.axhline(self.lower_bound / scale, color="black", linestyle=(0, (4, 3)), linewidth=1.2, zorder=4,
                   label=f"lower bound {format_bytes(self.lower_bound)}{same}")
        ax.set(xlim=(-0.5, max(self.n_ops, 1) - 0.5), ylim=(0, max(top, 1) / scale * 1.08),
               xlabel="op index (a tensor spans the ops of its lifetime, first..last, as in the table)",
               ylabel=f"offset ({unit})", title=f"memfit activation arena ({self.algorithm}): one rectangle per tensor")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8, frameon=False)
        fig.tight_layout()
        _label_largest(fig, ax, drawn, labels, scale)
        return fig


def _label_largest(fig, ax, drawn: list[tuple[Row, int]], n: int, scale: int) -> None:
    """Write name and size inside the `n` largest tensors' rectangles ((row, offset drawn at)), where
    the text fits (turned upright in a tall, narrow one)."""
    fig.canvas.draw()                                      # fixes the axes' size in pixels
    to_px = ax.transData.transform
    for r, offset in sorted(drawn, key=lambda d: d[0].bytes, reverse=True)[:n]:
        (x0, y0), (x1, y1) = to_px([(r.lifetime[0] - 0.5, offset / scale),
                                    (r.lifetime[1] + 0.5, (offset + r.bytes) / scale)])
        w, h = x1 - x0, y1 - y0
        for text, size in itertools.product((f"{_short(r.name)}\n{format_bytes(r.bytes)}", format_bytes(r.bytes)),
                                            (8, 7, 6)):
            px = size * fig.dpi / 72                       # the font's height in pixels
            lines = text.splitlines()
            tw, th = 0.62 * px * max(map(len, lines)), 1.25 * px * len(lines)   # about 0.62 em a character
            rotation = 0 if tw <= w - 4 and th <= h - 2 else 90 if th <= w - 2 and tw <= h - 4 else None
            if rotation is not None:
                ax.text((r.lifetime[0] + r.lifetime[1]) / 2, (offset + r.bytes / 2) / scale, text,
                        ha="center", va="center", fontsize=size, rotation=rotation, zorder=5, clip_on=True,
                        bbox={"facecolor": "white", "alpha": 0.6, "edgecolor": "none", "pad": 0.5})  # over hatching
                break


def _short(name: str, most: int = 20) -> str:
    """A tensor's name for a label: without the '__out0' of multi-output ops, middle elided when long
    ('native_ba...training_4'); its end, which tells tensors of one op apart, stays."""
    name = re.sub(r"_+out\d+$", "", name).lstrip("_")
    return name if len(name) <= most else f"{name[:8]}...{name[-(most - 11):]}"

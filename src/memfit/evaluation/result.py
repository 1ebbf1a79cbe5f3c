"""What `evaluate` returns: the whole-set metrics, and how the work was split and why."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field

from memfit.budget import format_bytes
from memfit.messages import plural

__all__ = ["EvalResult"]


@dataclass(eq=False)
class EvalResult(Mapping):
    """What `evaluate` measured. `metrics` maps each requested metric to its whole-set value, and the result
    reads as that mapping too: `res["accuracy"]`, `for name in res`, `dict(res)`, `len(res)`.

    Example:
        >>> r = EvalResult({"accuracy": 0.5, "loss": 0.7}, n=4, chunk_size=4, chunks=1, retries=0,
        ...                peak_bytes=None, seconds=0.0)
        >>> r["accuracy"], list(r), dict(r) == r.metrics
        (0.5, ['accuracy', 'loss'], True)
    """
    metrics: dict
    n: int
    chunk_size: int
    chunks: int
    retries: int
    peak_bytes: int | None          # None: not measured (CPU with a fixed chunk size or a small set)
    seconds: float
    runner: str = "eager"
    reason: str = ""                # how the chunk size and runner were chosen, whole sentences
    oom_sizes: list = field(default_factory=list)

    def __getitem__(self, key: str):
        if key not in self.metrics:
            raise KeyError(f"no metric {key!r} in this result; it has {sorted(self.metrics)} (ask evaluate for it "
                           f"with metrics=[..., {key!r}])")
        return self.metrics[key]

    def __iter__(self):
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def __str__(self) -> str:
        vals = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {type(v).__name__}"
                         for k, v in self.metrics.items())
        peak = "not measured" if self.peak_bytes is None else format_bytes(self.peak_bytes)
        head = (f"evaluated {plural(self.n, 'sample')} in {plural(self.chunks, 'chunk')} of up to {self.chunk_size} "
                f"({plural(self.retries, 'out-of-memory retry', 'out-of-memory retries')}), {self.seconds:.2f} s, "
                f"peak {peak}, {self.runner}: {vals}")
        if not self.reason:
            return head
        # wrapped, never cut: the reason is the part that explains a surprising choice
        return head + "\n" + textwrap.fill(f"why: {self.reason}", width=100, subsequent_indent="     ",
                                           break_long_words=False, break_on_hyphens=False)

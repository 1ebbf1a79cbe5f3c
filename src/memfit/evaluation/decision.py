"""How `evaluate` runs: the chunk size, eager or planned, the estimate it was sized by, and why; one decision.

`decide` is the one place the choice is made, from what was asked (`Ask`) and a function that sizes a chunk
from the peak estimates (`choose_chunk`, or a stand-in in tests); `without_plan` is the same decision when
the planned forward turns out not to be available. Both return a `Decision`, which the caller follows.

Example:
    >>> from memfit.evaluation.estimates import Estimate, Source
    >>> size_for = lambda use_plan: (100, Estimate(lambda n: 10 * n, 0, Source.PLANNER), "fits")
    >>> d = decide(Ask(n=5000, chunk_size="auto", planned=None, budget_given=True), size_for)
    >>> d.chunk_size, d.runner, d.source
    (100, 'planned', <Source.PLANNER: "the planner's arena">)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memfit.evaluation.estimates import MAX_AUTO_CHUNK, Estimate, Source

__all__ = ["SMALL_SET", "Ask", "Decision", "decide", "without_plan"]

# A set this small runs in one eager chunk: capturing the model for the planner (0.5 to 10 s for a
# real model) would cost more than the whole run (HF ResNet-50 on 32 images: 8.6 s planned, 2.0 s eager).
SMALL_SET = 1024


@dataclass(frozen=True)
class Ask:
    """What the caller asked, and what the data is."""
    n: int | None                   # samples in the set; None: a loader's batches, run as they come
    chunk_size: int | str           # 'auto' or a checked int
    planned: bool | None            # True: always the planner; False: never; None: where it pays
    budget_given: bool = False      # the user gave a budget (else: the device's free memory)
    distributed: bool = False       # ranks agree on one chunk size afterwards
    fields: bool = False            # several inputs per sample: the planner takes one tensor

    @property
    def small(self) -> bool:
        """Small enough that capturing the model for the planner costs more than running the set."""
        return (not self.distributed and self.chunk_size == "auto" and self.planned is None
                and self.n is not None and self.n <= SMALL_SET)


@dataclass(frozen=True)
class Decision:
    """What `evaluate` follows: chunks of `chunk_size` (0: the loader's batches) through `runner`."""
    chunk_size: int
    runner: str                     # 'eager' or 'planned'
    estimate: Estimate | None       # the peak estimate the chunk was sized by; None: not sized from memory
    reason: str                     # whole sentences, for EvalResult.reason

    @property
    def source(self) -> Source | None:
        return None if self.estimate is None else self.estimate.source


SizeFor = Callable[[bool | None], tuple[int, Estimate, str]]   # use_plan -> (size, estimate, how)


def decide(ask: Ask, size_for: SizeFor) -> Decision:
    """The chunk size and runner for `ask`; `size_for(use_plan)` sizes a chunk from the estimates (use_plan:
    True the planner's, False the eager forward's, None the eager one first and the planner where it binds)."""
    if ask.n is None:
        return Decision(0, "eager", None, "batches of the loader")
    runner = "planned" if ask.planned and not ask.fields else "eager"
    if ask.chunk_size != "auto":
        why = ("" if ask.planned else "; the planner is not used with a fixed chunk_size (pass planned=True to "
               "run it, or chunk_size='auto' to size chunks from it)")
        return Decision(min(ask.chunk_size, ask.n), runner, None, f"chunk_size {ask.chunk_size} given{why}")
    if ask.small and not ask.budget_given:
        size = min(ask.n, MAX_AUTO_CHUNK)
        what = f"one eager chunk of all {ask.n} samples" if size == ask.n else f"eager chunks of {size} samples"
        return Decision(size, "eager", None, f"{what}: a set this small (<= {SMALL_SET}) runs faster than "
                        "capturing the model for the planner; out-of-memory back-off halves the chunk if needed")
    use = False if ask.planned is False or ask.small else (True if ask.planned else None)
    size, estimate, reason = size_for(use)
    if ask.small:
        reason += (f"; run eagerly: a set this small (<= {SMALL_SET} samples) runs faster than capturing the "
                   "model for the planner")
    if estimate.planned and not ask.fields and ask.planned is not False:
        runner = "planned"
    return Decision(size, runner, estimate, reason)


def without_plan(d: Decision, why: str, ask: Ask, size_for: SizeFor) -> Decision:
    """`d` when its planned forward cannot run (`why`): eager, sized again for the eager forward where the
    chunk was sized for the planner's arena (one rank alone cannot: the ranks agreed on the size)."""
    if d.estimate is not None and d.estimate.planned and not ask.distributed:
        size, estimate, again = size_for(False)
        return Decision(size, "eager", estimate, f"{d.reason}; {why}; chunk sized again for the eager forward: "
                        f"{again}")
    return replace(d, runner="eager", reason=f"{d.reason}; {why}" if why else d.reason)

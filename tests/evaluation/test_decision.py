"""evaluation/decision.py alone: the chunk size and runner for every kind of request, with stand-in estimates
(no model runs), so each rule of the choice is checked where it is made."""
import pytest

from memfit.evaluation.decision import SMALL_SET, Ask, decide, without_plan
from memfit.evaluation.estimates import MAX_AUTO_CHUNK, Estimate, Source


class SizeFor:
    """A stand-in for choose_chunk: records each use_plan asked for, answers from a table."""

    def __init__(self, planned=(300, Source.PLANNER), eager=(100, Source.FAKE_FORWARD)):
        self.asked, self.planned, self.eager = [], planned, eager

    def __call__(self, use_plan):
        self.asked.append(use_plan)
        size, source = self.eager if use_plan is False else self.planned
        return size, Estimate(lambda n: 10 * n, 0, source), f"sized from {source.name}"


def test_a_loader_runs_its_own_batches():
    d = decide(Ask(n=None, chunk_size="auto", planned=None), SizeFor())
    assert (d.chunk_size, d.runner, d.estimate) == (0, "eager", None)


@pytest.mark.parametrize("planned, runner", [(None, "eager"), (False, "eager"), (True, "planned")])
def test_a_given_chunk_size_is_used_as_given_and_the_planner_only_when_asked(planned, runner):
    size_for = SizeFor()
    d = decide(Ask(n=50, chunk_size=64, planned=planned), size_for)
    assert d.chunk_size == 50 and d.runner == runner and size_for.asked == []      # nothing estimated
    assert ("planner is not used with a fixed chunk_size" in d.reason) == (not planned)


def test_a_small_set_without_a_budget_runs_eagerly_without_estimates():
    size_for = SizeFor()
    d = decide(Ask(n=SMALL_SET, chunk_size="auto", planned=None), size_for)
    assert d.runner == "eager" and d.chunk_size == min(SMALL_SET, MAX_AUTO_CHUNK) and size_for.asked == []


def test_a_small_set_with_a_budget_is_sized_from_the_eager_forward():
    size_for = SizeFor()
    d = decide(Ask(n=500, chunk_size="auto", planned=None, budget_given=True), size_for)
    assert size_for.asked == [False] and d.runner == "eager" and "set this small" in d.reason


@pytest.mark.parametrize("planned, use, runner", [(None, None, "planned"), (True, True, "planned"),
                                                  (False, False, "eager")])
def test_a_large_set_is_sized_and_runs_where_the_estimate_says(planned, use, runner):
    size_for = SizeFor()
    d = decide(Ask(n=5000, chunk_size="auto", planned=planned, budget_given=True), size_for)
    assert size_for.asked == [use] and d.runner == runner
    assert d.source is (Source.FAKE_FORWARD if use is False else Source.PLANNER)


def test_an_eager_estimate_runs_eagerly_and_fields_never_plan():
    d = decide(Ask(n=5000, chunk_size="auto", planned=None), SizeFor(planned=(200, Source.FAKE_FORWARD)))
    assert d.runner == "eager" and d.source is Source.FAKE_FORWARD
    d = decide(Ask(n=5000, chunk_size="auto", planned=True, fields=True), SizeFor())
    assert d.runner == "eager"


def test_distributed_sets_are_never_small():
    size_for = SizeFor()
    d = decide(Ask(n=10, chunk_size="auto", planned=None, distributed=True), size_for)
    assert size_for.asked == [None] and d.runner == "planned"


def test_without_the_plan_a_planner_sized_chunk_is_sized_again_for_the_eager_forward():
    size_for = SizeFor()
    ask = Ask(n=5000, chunk_size="auto", planned=None, budget_given=True)
    d = without_plan(decide(ask, size_for), "run eagerly: no arena", ask, size_for)
    assert (d.chunk_size, d.runner, d.source) == (100, "eager", Source.FAKE_FORWARD)
    assert "no arena" in d.reason and "sized again" in d.reason
    ranks = Ask(n=5000, chunk_size="auto", planned=None, distributed=True)       # the ranks agreed: keep it
    d = without_plan(decide(ranks, size_for), "run eagerly: no arena", ranks, size_for)
    assert (d.chunk_size, d.runner) == (300, "eager")

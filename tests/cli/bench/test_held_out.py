"""`memfit bench planner --held-out`'s models (`memfit.testing.held_out`): the issue's among them, and a model not on
the list refused by name (its rows are `planner_rows.planned_row`'s, tested in test_planner_rows.py)."""
import pytest

from memfit.testing.held_out import HELD_OUT, ISSUE, build_held_out


def test_the_held_out_list_names_the_issue_models_and_refuses_others():
    assert set(ISSUE) <= set(HELD_OUT)
    with pytest.raises(ValueError, match="unknown held-out model 'resnet18'; expected one of"):
        build_held_out("resnet18")

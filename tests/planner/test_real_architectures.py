"""The planner on real architectures from `transformers` configs (random weights, tiny sizes, no
download): outputs equal eager, one capture serves two batch sizes, every unplanned op has a reason, and
every op's kernel gives the strides the arena gives its output."""
import pytest
import torch

pytest.importorskip("transformers")

from memfit import plan  # noqa: E402
from memfit.testing.zoo import build_real  # noqa: E402


@pytest.mark.parametrize("name", ["bert", "convnext"])
def test_real_model_planned_equals_eager_at_two_batch_sizes_from_one_capture(name):
    model, make_input = build_real(name, quick=True)
    pm = plan(model, (make_input(2),))
    for batch in (2, 5):
        x = make_input(batch)
        with torch.no_grad():
            torch.testing.assert_close(pm(x), model(x), rtol=1e-5, atol=1e-5)
    assert len(pm.captures) == 1 and pm.captures[0].dynamic
    assert pm.captures[0].kernel_layouts == {}          # every arena view has the strides its kernel gives
    rep = pm.report
    assert rep.lower_bound <= rep.arena_bytes <= 1.02 * rep.lower_bound
    assert set(rep.unplanned_reasons) == set(rep.unplanned_ops) and all(rep.unplanned_reasons.values())

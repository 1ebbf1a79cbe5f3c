"""Recomputing at each reader (`planner.remat`): an input-free mask read by several layers lives for one op each
time, not across the layers between; outputs bit-identical to eager."""

import torch
from torch import nn

from memfit import plan
from memfit.device.measure import track_memory


class MaskedLayers(nn.Module):
    """A mask from `arange` (as BERT's attention mask) read by two layers, a wide layer between them."""

    def __init__(self):
        super().__init__()
        self.wide, self.back = nn.Linear(64, 4096), nn.Linear(4096, 64)

    def forward(self, x):                                    # (N, 64)
        mask = torch.arange(64) >= 3                         # (64,) bool, from no input
        h = torch.where(mask, x, 0.0)
        h = self.back(torch.relu(self.wide(h)))              # (N, 4096) between the two reads of the mask
        return torch.where(mask, h, 1.0)


def test_an_input_free_mask_is_recomputed_at_each_reader():
    model, x = MaskedLayers().eval(), torch.randn(4, 64)
    pm = plan(model, (x,))
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))
        with track_memory("cpu") as mem:
            out = pm(x)
            del out
    graph = pm.placements[pm._last_key].graph
    masks = [r for r in graph.roots.values() if r.dtype == torch.bool]
    assert len(masks) == 2                                   # one per reader
    assert all(r.last - r.first <= 2 for r in masks)         # made, (viewed,) read: never across the wide layer
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= mem.peak



def test_random_draws_and_uninitialised_memory_are_never_recomputed():
    """A second `rand` would draw other values, a second `empty` hold other garbage: neither is recomputed (export
    refuses a model that draws, so the rule is checked on the ops)."""
    from memfit.planner.remat import _deterministic
    aten = torch.ops.aten
    assert _deterministic(aten.arange.start_step) and _deterministic(aten.ge.Scalar)
    assert not any(_deterministic(op) for op in (aten.rand.default, aten.bernoulli.p, aten.randint.low,
                                                 aten.empty.memory_format, aten.empty_strided.default))

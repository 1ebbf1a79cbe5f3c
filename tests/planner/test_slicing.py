"""Batch slicing (`planner.slicing`): a convolution stem run in slices of the batch, bit-identical to eager, with
its bytes counted; refused where slices would not be bit-identical."""

import pytest
import torch
from torch import nn

from memfit import plan
from memfit.memory.measure import track_memory
from memfit.planner import slicing
from memfit.planner.captured import capture_model


def stem_net() -> nn.Module:
    """A ResNet-like stem (its convolution's output the largest tensor) and a small head."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                        nn.Conv2d(32, 16, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
    net[1].running_mean.uniform_(-0.1, 0.1)
    net[1].running_var.uniform_(0.5, 1.5)
    return net


def _peak(fn, x) -> int:
    with torch.inference_mode(), track_memory(x.device) as mem:
        out = fn(x)
        del out
    return mem.peak


def test_a_stem_runs_in_slices_bit_identical_below_eager_and_counted():
    model = stem_net()
    pm = plan(model, (torch.randn(4, 3, 64, 64),))
    assert pm.report.unplanned_ops.get("batch_slices") == 1
    assert "convolution" not in pm.report.unplanned_ops       # the only convolution ran sliced
    for n in (4, 5, 8):                                          # the example's batch, an odd one, another
        x = torch.randn(n, 3, 64, 64)
        with torch.inference_mode():
            assert torch.equal(pm(x), model(x))
    x = torch.randn(8, 3, 64, 64)
    conv_out = 8 * 32 * 32 * 32 * 4
    planned, eager = _peak(pm, x), _peak(model, x)
    assert eager >= 2 * conv_out                     # eager holds the convolution's output twice (oneDNN's copy)
    assert planned < conv_out                        # sliced: never the whole convolution output
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= planned     # the report is never below


def test_a_segment_whose_slices_differ_from_the_whole_is_refused(monkeypatch):
    monkeypatch.setattr(slicing, "_same", lambda a, b: False)          # as if oneDNN's result moved with the batch
    model = stem_net()
    pm = plan(model, (torch.randn(4, 3, 64, 64),))
    assert "batch_slices" not in pm.report.unplanned_ops
    x = torch.randn(4, 3, 64, 64)
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))


def test_the_check_compares_slices_with_the_whole_batch():
    """A step whose result depends on the batch size (as an algorithm picked by size may): not exact."""
    x = torch.randn(4, 3)
    step = slicing._Step(lambda v: v * v.shape[0], ("x",), {}, None, None)
    assert not slicing._exact(slicing.SlicedSegment((step,), 1, None, ()), x, ())
    same = slicing._Step(torch.relu, ("x",), {}, None, None)
    assert slicing._exact(slicing.SlicedSegment((same,), 1, None, ()), x, ())


@pytest.mark.parametrize("n", [2, 3, 7])
def test_slices_cover_the_batch_once(n):
    for k in (1, 2):
        cuts = slicing.SlicedSegment((), k, None, ()).slices(n)
        assert [i for a, b in cuts for i in range(a, b)] == list(range(n))
        assert all(k <= b - a < 2 * k for a, b in cuts) or n < k


def test_a_small_convolution_is_not_sliced():
    """Where the stem is not where the call peaks (a wide layer after it), nothing is sliced."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 4096)).eval()
    cap = capture_model(model, torch.randn(2, 3, 8, 8))
    assert cap.sliced == {}


def test_an_op_not_exact_in_slices_is_left_out_and_the_exact_run_before_it_sliced(monkeypatch):
    """Exactness is checked per op: an op whose slices differ (here max pooling, as if its kernel moved with the
    batch) runs on the whole batch, and the exact run before it (convolution, batch norm, ReLU) still in slices."""
    exact = slicing._exact
    monkeypatch.setattr(slicing, "_exact", lambda seg, x, p: exact(seg, x, p) and not any(
        s.target is torch.ops.aten.max_pool2d_with_indices.default for s in seg.steps))
    model = stem_net()
    pm = plan(model, (torch.randn(8, 3, 64, 64),))      # a run of 3 ops saves 1/4 of its peak at 8
    assert pm.report.unplanned_ops.get("batch_slices") == 1
    assert "max_pool2d_with_indices" in pm.report.unplanned_ops
    x = torch.randn(5, 3, 64, 64)
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))


def test_the_choice_does_not_depend_on_the_examples_values():
    """The exactness check runs on seeded stand-ins of the example's shape: an example of zeros (which any slicing
    would pass) or of NaN (which never compares equal, as uninitialised memory may hold) chooses as a random one,
    so a memory model's capture and a user's plan agree whatever examples they were given."""
    model = stem_net()
    chosen = {}
    for name, x in [("randn", torch.randn(4, 3, 64, 64)), ("zeros", torch.zeros(4, 3, 64, 64)),
                    ("nan", torch.full((4, 3, 64, 64), float("nan")))]:
        rep = plan(model, (x,)).report
        chosen[name] = (rep.unplanned_ops.get("batch_slices"), rep.unplanned_bytes)
    assert chosen["randn"][0] == 1
    assert chosen["zeros"] == chosen["randn"] == chosen["nan"], chosen


@pytest.mark.parametrize("n", [3, 5])                 # one slice of 3; slices of 2 and 3
def test_the_memory_model_counts_the_whole_output_after_the_first_slice_only(monkeypatch, n):
    """`SlicedSegment` allocates the whole output after the first slice ran: a batch that is one slice holds its
    peak without the output (and the output twice while the result is copied). Counting the output beside the
    first slice put the prediction at 1.11x the allocator (a small CNN at batch 3 in slices of 2)."""
    import memfit
    monkeypatch.setattr(slicing, "SLICE_SIZES", (2,))
    model = stem_net()
    mm = memfit.memory_model(model, (3, 64, 64))
    x = torch.randn(n, 3, 64, 64)
    pm = plan(model, (x,))
    assert pm.report.unplanned_ops.get("batch_slices") == 1
    params = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    real = params + x.nbytes + pm.arena_bytes + _peak(pm, x)
    assert 1.0 <= mm.total_bytes(n) / real <= 1.05, (mm.total_bytes(n), real)
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= _peak(pm, x)

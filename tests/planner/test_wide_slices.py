"""Wide slices (`planner.slicing.WIDE_SLICE_SIZES`): a CNN on small images (16 KiB a sample in its largest
tensor) fills `MIN_SLICE_BYTES` only at 16 samples a slice, so with slices of 1-8 it ran whole at every batch
(eager's peak). Checked against the allocator, plain PyTorch and the exactness check's own batches."""

import torch
from torch import nn

from memfit import memory_model, plan
from memfit.device.measure import track_memory
from memfit.memory.kinds import MemoryKind
from memfit.planner import slice_check, sliced, slicing
from memfit.planner.captured import capture_model

SHAPE = (1, 8, 8)


def small_cnn() -> nn.Module:
    """The demo's CNN (`memfit.cli.demo.small_cnn(1, 10, 8)`): 64 channels at 8x8, 16 KiB a sample."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                         nn.Linear(64 * 16, 10)).eval()


def _peak(fn, x) -> int:
    with torch.inference_mode(), track_memory(x.device) as mem:
        out = fn(x)
        del out
    return mem.peak


def _segments(cap) -> list:
    return [n.target for n in cap.ep.graph.nodes if isinstance(n.target, sliced.SlicedSegment)]


def test_a_cnn_on_small_images_runs_in_wide_slices_below_eager_and_counted():
    """One capture at batch 2 (as `memory_model` makes it) plans every batch: whole at 2 (two slices of 16 need
    32 samples), in slices of 16 or more at 64 and 256, bit-identical to eager; the allocator's peak at 256 well
    below eager's; the memory model within [1.00, 1.05] of the allocator at each batch."""
    model = small_cnn()
    pm = plan(model, (torch.randn(2, *SHAPE),))
    [seg] = _segments(pm.captures[0])
    assert seg.size(2) is None and seg.size(64) >= 16 and seg.size(256) >= 16
    mm = memory_model(model, SHAPE, planned=True)
    held = {MemoryKind.PARAMETERS.value, MemoryKind.INPUTS.value}
    for b in (2, 64, 256):
        x = torch.randn(b, *SHAPE)
        with torch.inference_mode():
            assert torch.equal(pm(x), model(x))
        real = pm.report.arena_bytes + _peak(pm, x)
        predicted = sum(v for k, v in mm.breakdown(b).items() if k not in held)
        assert 1.0 <= predicted / real <= 1.05, (b, predicted, real)
        if b == 256:
            assert real < 0.4 * _peak(model, x), (real, _peak(model, x))


def test_every_wide_size_the_rule_may_use_is_checked_at_twice_it_plus_one(monkeypatch):
    """A slice size is exact only where checked at a batch of two slices or more (the last one k+1 samples): each
    wide size an option lists was compared whole against sliced at 2k+1; a size whose check fails is not used."""
    seen: dict[int, set] = {}
    same = slice_check.same

    def spy(a, b):
        seen.setdefault(a.shape[0], set()).add(a.shape)
        return same(a, b)
    monkeypatch.setattr(slice_check, "same", spy)
    [seg] = _segments(capture_model(small_cnn(), torch.randn(2, *SHAPE)))
    wide = [k for k in seg.rule.options[seg.index].sizes if k not in slicing.SLICE_SIZES]
    assert wide and all(2 * k + 1 in seen for k in wide), (wide, sorted(seen))
    monkeypatch.setattr(slice_check, "same", lambda a, b: a.shape[0] < 33 and same(a, b))    # wrong from 33 on
    assert capture_model(small_cnn(), torch.randn(2, *SHAPE)).sliced == {}


def test_large_samples_check_no_wide_size(monkeypatch):
    """A sample that fills `MIN_SLICE_BYTES` within 8 samples (ResNet's stem at 64x64: 128 KiB) gets no wide size,
    so no extra check at capture (big models capture no slower)."""
    checked = []
    exact_steps = slice_check.exact_steps
    monkeypatch.setattr(slice_check, "exact_steps", lambda *a: checked.append(a[-1]) or exact_steps(*a))
    model = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1), nn.Flatten(),
                          nn.Linear(32 * 16 * 16, 10)).eval()
    capture_model(model, torch.randn(2, 3, 64, 64))
    assert checked == [()]

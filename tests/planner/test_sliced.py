"""The callable a sliced segment runs (`memfit.planner.sliced`): the bytes it says a slice holds, kept per sizes."""
import torch
from torch import nn

from memfit.memory import kernel_scratch
from memfit.planner.capture import capture, constants
from memfit.planner.segment import build_segment
from memfit.planner.sliced import SlicedSegment


def _segment() -> SlicedSegment:
    """A convolution stem's steps as one segment (128 KiB a sample out of its convolution), from a static capture at
    batch 4 (sizes at any batch: the first dimension replaced)."""
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 32, 7, 2, 3), nn.ReLU(), nn.MaxPool2d(3, 2, 1)).eval()
    ep = capture(stem, (torch.randn(4, 3, 64, 64),))
    consts = constants(ep, stem)
    x = next(node for node in ep.graph.nodes if node.op == "placeholder" and node.name not in consts)
    return build_segment(x, [node for node in ep.graph.nodes if node.op == "call_function"], 1)[0]


def _fresh(seg: SlicedSegment, k: int) -> SlicedSegment:
    """The same steps in slices of k, with nothing worked out yet."""
    return SlicedSegment(seg.steps, k, seg.input_val, seg.param_vals, symbol=seg.symbol)


def test_the_bytes_a_segment_keeps_per_sizes_are_those_worked_out_anew(monkeypatch):
    """The slicing rule asks each segment's bytes at every slice size at each of 17 batch sizes, more than once
    (`with_size`): kept per sizes and thread count, and the sizes' variants kept, each figure is the one a segment
    with nothing kept works out, at every thread count (the bytes kernels allocate inside are measured per thread
    count; here made to depend on it)."""
    seg = _segment()
    assert seg.with_size(2) is seg.with_size(2) and seg.with_size(2).size(8) == 2
    inside = kernel_scratch.inside_parts
    monkeypatch.setattr(kernel_scratch, "inside_parts", lambda target, *a, **k: (
        lambda c, g: (c, g + 4096 * torch.get_num_threads()))(*inside(target, *a, **k)))
    threads = torch.get_num_threads()
    figures = []
    try:
        for t in (1, 2, 1):
            torch.set_num_threads(t)
            asked = [(k, n, into, dies) for k in (1, 2, 4) for n in (2, 8, 37) for into, dies in
                     ((False, 0), (True, 0), (False, 1000))]
            kept = [seg.with_size(k).slice_bytes({}, n, into, dies) for k, n, into, dies in asked]
            assert kept == [_fresh(seg, k).slice_bytes({}, n, into, dies) for k, n, into, dies in asked], t
            figures.append(kept)
    finally:
        torch.set_num_threads(threads)
    assert figures[0] == figures[2] != figures[1]  # what each thread count's kernels allocate, not the first's

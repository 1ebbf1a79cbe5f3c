"""What kernels allocate inside, beyond their outputs, counted in the planner's report (`planner.workspaces`):
the report's peak is never below the allocator's."""

import torch
from torch import nn

from memfit import plan
from memfit.memory.measure import track_memory


class NormOverPermuted(nn.Module):
    """Layer norm over a channels-last view of an NCHW tensor (as ConvNeXt does): the CPU kernel copies its
    non-contiguous input contiguous inside."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)

    def forward(self, x):                                   # (N, 16, 8, 8)
        return self.norm(x.permute(0, 2, 3, 1)).sum(-1)     # (N, 8, 8, 16) -> (N, 8, 8)


def _allocator_peak(fn, x) -> int:
    with torch.inference_mode(), track_memory(x.device) as mem:
        out = fn(x)
        del out
    return mem.peak


def test_layer_norm_copying_a_permuted_input_inside_is_counted():
    model, x = NormOverPermuted().eval(), torch.randn(4, 16, 8, 8)
    pm = plan(model, (x,))
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))
    real = _allocator_peak(pm, x)
    copy = x.nbytes                                         # the contiguous copy of the permuted input
    assert real >= copy + x.nbytes                          # the copy and the normalised output, live together
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= real


def test_max_pooling_run_without_indices_counts_the_indices_its_kernel_still_makes():
    """The planner runs max pooling whose indices nobody reads as `torch.max_pool2d`, which on the CPU still makes
    the int64 indices (twice the values' bytes) inside: counted, so the report is not below the allocator."""
    model = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Flatten(), nn.Linear(8 * 14 * 14, 4)).eval()
    x = torch.randn(4, 8, 14, 14)
    pm = plan(model, (x,))
    with torch.inference_mode():
        assert torch.equal(pm(x), model(x))
    assert pm.report.arena_bytes + pm.report.unplanned_bytes >= _allocator_peak(pm, x)

"""What kernels allocate inside, beyond their outputs, counted in the planner's report (`planner.workspaces`):
the report's peak is never below the allocator's."""

import torch
from torch import nn

from memfit import plan
from memfit.device.measure import track_memory


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


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10)).eval()


def test_the_scratch_of_kernels_on_bfloat16_is_counted():
    """`mean` of a bfloat16 tensor sums a float32 copy of it inside (twice the input's bytes), which no op output
    shows: a bf16 CNN's planned forward peaked there, and `memory_model` predicted 0.64x the allocator at batch 8
    (0.55x at 13) before the kernels on half-precision arguments were measured (`kernel_scratch`)."""
    import memfit
    model = small_cnn().to(torch.bfloat16)
    mm = memfit.memory_model(model, torch.zeros(2, 3, 32, 32, dtype=torch.bfloat16), planned=True)
    params = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    pm = plan(model, (torch.randn(3, 3, 32, 32, dtype=torch.bfloat16),))     # one capture, 8 planned from it too
    for n in (3, 8):                               # rising: the shared arena is the plan at n's
        x = torch.randn(n, 3, 32, 32, dtype=torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(pm(x), model(x))    # placed at n before the measured call
        real = params + x.nbytes + pm.arena_bytes + _allocator_peak(pm, x)
        assert 1.0 <= mm.total_bytes(n) / real <= 1.05, (n, mm.total_bytes(n), real)
    # the kernel itself: its float32 copy, and the bytes the planner counts for it, against the allocator
    from memfit.memory.kernel_scratch import inside_parts
    x = torch.randn(8, 32, 16, 16, dtype=torch.bfloat16)
    with torch.inference_mode(), track_memory() as mem:
        out = torch.mean(x, [-1, -2], True)
    assert mem.peak - out.nbytes >= 2 * x.nbytes
    assert sum(inside_parts(torch.ops.aten.mean.dim, (x.to("meta"), [-1, -2], True), {})) == mem.peak - out.nbytes

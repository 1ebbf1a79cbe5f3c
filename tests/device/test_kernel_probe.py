"""What real CPU kernels allocate inside (`memfit.device.kernel_probe`), against the allocator's events of the same
kernel called again; one measurement per kernel, arguments and thread count whoever asks."""
import pytest
import torch
from torch.utils._pytree import tree_flatten

from memfit.device.kernel_probe import inside_bytes, probe_bytes, zeros
from memfit.device.measure import track_memory

aten = torch.ops.aten


def _tracked(func, args) -> int:
    """Bytes beyond the outputs of one call, by the allocator's events."""
    with track_memory("cpu") as mem:
        out = func(*args)
    return max(0, mem.peak - sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                                 if isinstance(t, torch.Tensor)))


def _conv(n):
    return aten.convolution.default, (torch.zeros(n, 8, 12, 12), torch.zeros(16, 8, 3, 3), torch.zeros(16),
                                      [1, 1], [1, 1], [1, 1], False, [0, 0], 1)


def _conv_backward(n):
    return aten.convolution_backward.default, (torch.zeros(n, 16, 12, 12), torch.zeros(n, 8, 12, 12),
                                               torch.zeros(16, 8, 3, 3), [16], [1, 1], [1, 1], [1, 1], False,
                                               [0, 0], 1, [True, True, True])


def _max_pool(n):
    return aten.max_pool2d_with_indices.default, (torch.zeros(n, 8, 12, 12), [2, 2], [2, 2])


def _batch_norm_backward(n):
    x, w = torch.zeros(n, 8, 12, 12), torch.ones(8)
    return aten.native_batch_norm_backward.default, (x, x.clone(), w, None, None, torch.zeros(8), torch.ones(8), True,
                                                     1e-5, [True, True, True])


def _bf16_mm(n):       # a weight's gradient: the batch is the reduced dimension, packed by oneDNN
    return aten.mm.default, (torch.zeros(48, n * 7, dtype=torch.bfloat16), torch.zeros(n * 7, 40, dtype=torch.bfloat16))


def _bf16_layer_norm(n):
    return aten.native_layer_norm.default, (torch.zeros(n, 9, 48, dtype=torch.bfloat16), [48], torch.ones(48),
                                            torch.zeros(48), 1e-5)


@pytest.mark.parametrize("case", [_conv, _conv_backward, _max_pool, _batch_norm_backward, _bf16_mm, _bf16_layer_norm])
def test_a_kernels_first_call_at_a_new_shape_allocates_what_its_later_calls_do(case):
    """`inside_bytes` runs a kernel untracked first only the first time it meets it: at every later shape its first
    call must allocate what the calls of a training loop do (its second, third...)."""
    inside_bytes(*case(2), {})                       # the kernel has run (at another shape)
    for n in (3, 17):
        func, args = case(n)
        first = inside_bytes(func, args, {})
        assert first == _tracked(func, args) == _tracked(func, args), (func, n)



def test_the_probe_measures_a_kernel_once_per_arguments_and_threads_whoever_asks(monkeypatch):
    """The memory model's scratch, its workspaces and the planner's ask the same probe: one measurement of a kernel
    on arguments of one layout at one thread count, a new one for another layout or another count."""
    from memfit.device import kernel_probe
    calls = []
    measure = kernel_probe.inside_bytes
    monkeypatch.setattr(kernel_probe, "inside_bytes", lambda *a: calls.append(a[0]) or measure(*a))
    monkeypatch.setattr(kernel_probe, "_BYTES", {})
    x, w = zeros((8, 64), (64, 1), torch.bfloat16), zeros((64, 32), (32, 1), torch.bfloat16)
    first = probe_bytes(aten.mm.default, (x, w), {})
    assert first == _tracked(aten.mm.default, (x, w))                       # the allocator's bytes
    assert probe_bytes(aten.mm.default, (x.clone(), w.clone()), {}) == first and len(calls) == 1
    probe_bytes(aten.mm.default, (x, w.t().contiguous().t()), {})          # another layout: measured
    assert len(calls) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        probe_bytes(aten.mm.default, (x, w), {})                             # another thread count: measured
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    kernel_probe.forget()
    assert probe_bytes(aten.mm.default, (x, w), {}) == first and len(calls) == 4

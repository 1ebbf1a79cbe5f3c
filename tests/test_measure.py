import pytest
import torch

from memfit.measure import track_memory


def test_counts_each_new_buffer_and_its_free():
    with track_memory("cpu") as mem:
        a = torch.ones(1000)                       # 4000 B
        b = a * 2                                  # +4000 B
        del a                                      # -4000 B
        c = b + 1                                  # +4000 B: peak stays 8000
    assert mem.peak == 8000
    assert mem.current == 8000                     # b and c still alive
    del b, c


def test_views_and_inplace_writes_are_not_new_memory():
    x = torch.ones(256, 256)
    with track_memory("cpu") as mem:
        v = x.view(-1)[:100]
        x.mul_(2)
        t = x.t()
    assert mem.peak == 0
    del v, t


def test_matches_hand_count_for_an_mlp():
    m = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10))
    x = torch.randn(64, 100)
    with torch.inference_mode(), track_memory("cpu") as mem:
        m(x)
    # the first Linear's output and ReLU's output are both live at the ReLU
    assert mem.peak == 2 * 64 * 200 * 4
    assert mem.current == 0


@pytest.mark.cuda
def test_cuda_uses_the_allocator_statistics():
    with track_memory("cuda") as mem:
        a = torch.ones(1 << 20, device="cuda")
    assert mem.peak >= a.nbytes

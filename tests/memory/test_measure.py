import pytest
import torch

from memfit.memory.measure import track_memory


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


# ---- held bytes: each storage once ------------------------------------------------------------------------------
class TiedLM(torch.nn.Module):
    """An embedding and an output layer sharing one (V, D) weight, as language models tie them."""

    def __init__(self, V=50, D=8, same_parameter=True):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.mid = torch.nn.Linear(D, D)
        self.out = torch.nn.Linear(D, V, bias=False)
        # tied the usual way (one Parameter in two modules), or as two Parameters over one storage
        self.out.weight = self.emb.weight if same_parameter else torch.nn.Parameter(self.emb.weight.detach())
        self.register_buffer("scale", torch.ones(D))

    def forward(self, ids):
        return self.out(self.mid(self.emb(ids)) * self.scale)


@pytest.mark.parametrize("same_parameter", [True, False])
def test_held_bytes_counts_a_tied_weight_once(same_parameter):
    from memfit.memory.measure import held_bytes
    V, D = 50, 8
    m = TiedLM(V, D, same_parameter)
    assert m.out.weight.untyped_storage().data_ptr() == m.emb.weight.untyped_storage().data_ptr()
    # unique storages by hand: the shared (V, D) weight, mid's (D, D) weight and (D,) bias, the (D,) buffer
    by_hand = 4 * (V * D + D * D + D + D)
    assert held_bytes(m) == by_hand
    summed = sum(t.nbytes for t in [*m.parameters(), *m.buffers()])
    assert summed == by_hand + (0 if same_parameter else 4 * V * D)     # what a plain sum would have said
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randint(0, V, (4, 3))).sum().backward()
    trained = by_hand - 4 * D                      # parameters only, the buffer has no gradient or state
    grads = trained + (0 if same_parameter else 4 * V * D)      # two Parameters: two gradient tensors
    assert held_bytes(m, grads=True) == by_hand + grads
    opt.step()
    # Adam: exp_avg and exp_avg_sq per parameter tensor, and a float32 0-d `step` per parameter
    params = len(list(m.parameters()))
    state = 2 * grads + 4 * params
    assert held_bytes(m, opt) == by_hand + state
    assert held_bytes(m, opt, grads=True) == by_hand + grads + state



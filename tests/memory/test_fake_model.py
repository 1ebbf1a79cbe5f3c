"""memfit.memory.fake_model: the one set-up of a model on fake tensors (the memory model's step, the example
target's forward, fit's op counts): tied weights stay tied, the user's module is never touched, a model in eval
mode trains when asked, and the runs of one prediction share their fakes."""
import torch
from torch import nn

from memfit.device.torch_private import FakeTensor, FakeTensorMode
from memfit.memory.fake_model import FakeModel


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_the_copy_runs_on_fakes_with_tied_weights_tied_and_the_model_untouched():
    model = Tied().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mode, memo = FakeTensorMode(allow_non_fake_inputs=True), {}
    fm = FakeModel(model, mode, torch.device("cpu"), memo, train=True)
    assert fm.named["head.weight"] is fm.named["emb.weight"] and isinstance(fm.named["emb.weight"], nn.Parameter)
    assert fm.copy.training and not model.training                  # trains when asked; the user's stays in eval
    with fm.running() as run:
        out = run(torch.zeros(8, dtype=torch.long))
        assert isinstance(out, FakeTensor) and out.shape == (8, 50)
        assert isinstance(run.emb.weight, FakeTensor) and not isinstance(model.emb.weight, FakeTensor)
    assert not isinstance(fm.copy.emb.weight, FakeTensor)           # swapped back out when the run ends
    for k, v in model.state_dict().items():                         # running stats and counters as they were
        assert not isinstance(v, FakeTensor) and torch.equal(v, before[k]), k
    again = FakeModel(model, mode, torch.device("cpu"), memo)       # another run of the same prediction
    assert again.named["emb.weight"] is fm.named["emb.weight"] and not again.copy.training
    assert fm.fake(model.norm.running_mean) is fm.named["norm.running_mean"]

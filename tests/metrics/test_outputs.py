"""memfit.metrics.outputs: a dict (or tuple) of outputs and targets, each with its own metrics."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from metric_cases import N, check, decoded, reg_data

from memfit import CompactDataset, evaluate


class TwoHeads(torch.nn.Module):
    def __init__(self, as_tuple=False):
        super().__init__()
        torch.manual_seed(0)
        self.cls, self.box, self.as_tuple = torch.nn.Linear(6, 5), torch.nn.Linear(6, 2), as_tuple

    def forward(self, x):
        out = {"label": self.cls(x), "box": self.box(x)}
        return tuple(out.values()) if self.as_tuple else out


@pytest.mark.parametrize("as_tuple", [False, True])
def test_a_dict_of_targets_gets_each_its_own_metrics(as_tuple):
    x, box = reg_data((2,))
    label = np.random.default_rng(4).integers(0, 5, N)
    model = TwoHeads(as_tuple)
    ds = CompactDataset.from_arrays(x, {"label": label, "box": box}, device="cpu")
    res = evaluate(model, ds, chunk_size=6, device="cpu", progress=False)
    assert list(res) == ["accuracy@label", "loss@label", "mse@box", "mae@box"]
    xb, yb = decoded(ds)
    with torch.no_grad():
        z, b = model.cls(xb).double(), model.box(xb).double()
    check({k.split("@")[0]: v for k, v in res.items()},
          {"accuracy": (z.argmax(1) == yb["label"]).double().mean().item(),
           "loss": F.cross_entropy(z, yb["label"]).item(), "mse": ((b - yb["box"]) ** 2).mean().item(),
           "mae": (b - yb["box"]).abs().mean().item()})

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


def test_a_tuple_of_outputs_that_fits_the_targets_in_another_order_is_refused():
    """A 2-class head and a 2-value box returned as a tuple: matched by the targets' order, a dict written
    {"box": ..., "label": ...} scored the box against the labels and the logits against the boxes, silently.
    Either order fits the shapes, so it is refused, and output_fn naming each output gives the reference."""
    torch.manual_seed(0)
    model = TwoHeads(as_tuple=True)
    model.cls = torch.nn.Linear(6, 2)
    x, box = reg_data((2,))
    label = np.random.default_rng(4).integers(0, 2, N)
    for targets in ({"label": label, "box": box}, {"box": box, "label": label}):
        with pytest.raises(ValueError, match=r"order \[.*\] fits the outputs' shapes as well.*output_fn=lambda out: "):
            evaluate(model, (x, targets), chunk_size=6, progress=False)
    res = evaluate(model, (x, {"box": box, "label": label}), output_fn=lambda out: {"label": out[0], "box": out[1]},
                   chunk_size=6, progress=False)
    with torch.no_grad():
        z, b = model.cls(torch.from_numpy(x)).double(), model.box(torch.from_numpy(x)).double()
    y = torch.from_numpy(label)
    check({k.split("@")[0]: v for k, v in res.items()},
          {"accuracy": (z.argmax(1) == y).double().mean().item(), "loss": F.cross_entropy(z, y).item(),
           "mse": ((b - torch.from_numpy(box).double()) ** 2).mean().item(),
           "mae": (b - torch.from_numpy(box).double()).abs().mean().item()})

"""Data, models and float64 plain-PyTorch references shared by the metric tests (tests/metrics/)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

N = 29                                     # odd: 2 ranks hold 15 and 14 samples


def seg_data():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (N, 3, 5, 6), dtype=np.uint8)
    y = rng.integers(0, 4, (N, 5, 6))
    y[rng.random((N, 5, 6)) < 0.2] = 255                      # void pixels
    return x, y


def seg_model():
    torch.manual_seed(0)
    return torch.nn.Conv2d(3, 4, 1)                           # (N, 4, 5, 6): classes on dimension 1


def reg_data(shape=(3,)):
    rng = np.random.default_rng(3)
    return rng.normal(size=(N, 6)).astype(np.float32), rng.normal(size=(N, *shape))     # float64 targets


def reg_model(out=3):
    torch.manual_seed(0)
    return torch.nn.Linear(6, out)


def decoded(ds):
    """The whole set as the dataset decodes it, and the model's outputs in float64."""
    return ds.batch(slice(None))


def seg_reference(model, ds):
    x, y = decoded(ds)
    with torch.no_grad():
        z = model(x).double()
    keep = y != 255
    pred = z.argmax(1)
    iou = []
    for c in range(4):
        inter = ((pred == c) & (y == c) & keep).sum().item()
        union = (((pred == c) | (y == c)) & keep).sum().item()
        if union:
            iou.append(inter / union)
    return {"accuracy": (pred == y)[keep].double().mean().item(),
            "loss": F.cross_entropy(z, y, ignore_index=255).item(), "iou": float(np.mean(iou))}


def check(res, ref):
    """Counts (accuracy, IoU) exactly; sums of errors and losses to float32 rounding: the model's float32
    outputs themselves change with the chunk size (another conv/matmul blocking).
    `test_metric_sums_are_exact_for_any_partition` checks the metrics alone, on fixed float64 outputs, to
    summation order."""
    for k, v in ref.items():
        if k in ("accuracy", "iou"):
            assert res[k] == pytest.approx(v, rel=1e-15), k
        else:
            assert res[k] == pytest.approx(v, rel=1e-6), k

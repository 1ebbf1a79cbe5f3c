"""memfit.metrics.checks: the class dimension, the targets' ignore index and dtype, bad input that says what was
expected and found."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from metric_cases import N, check, reg_data, reg_model, seg_data, seg_model, seg_reference

from memfit import CompactDataset, evaluate, metrics


def test_the_segmentation_ignore_index_comes_from_the_data():
    x, y = seg_data()
    model = seg_model()
    ds = CompactDataset.from_arrays(x, y, ignore_index=255, device="cpu")
    res = evaluate(model, ds, chunk_size=5, device="cpu", progress=False)        # default metrics, bound to 255
    assert list(res) == ["accuracy", "loss"]
    check(res, {k: v for k, v in seg_reference(model, ds).items() if k != "iou"})
    iou = metrics.IoU()
    evaluate(model, ds, metrics=[iou], chunk_size=4, device="cpu", progress=False)
    per = iou.per_class()
    assert per.shape == (4,) and float(per[~per.isnan()].mean()) == pytest.approx(seg_reference(model, ds)["iou"])


@pytest.mark.parametrize("data, model, kwargs, match", [
    (reg_data(()), reg_model(1), dict(metrics=("accuracy",)),
     r"accuracy compares class ids, but the targets are float \(torch.float64, shape \(6,\)\): use metrics 'mse' "
     r"and 'mae'"),
    (reg_data(()), reg_model(1), dict(metrics=("loss",)),
     r"loss without loss_fn is cross entropy, which needs class ids; the targets are float"),
    ((seg_data()[0], seg_data()[1][:, :4]), seg_model(), dict(metrics=("accuracy",)),
     r"accuracy: found outputs of shape \(6, 4, 5, 6\) and targets of shape \(6, 4, 6\); .*the shapes other than "
     r"the classes must match"),
    ((np.zeros((N, 6), np.float32), np.zeros((N, 4), np.float32)), reg_model(3), dict(),
     r"mse compares outputs with targets of the same shape; found outputs \(6, 3\) and targets \(6, 4\)"),
    ((np.zeros((N, 6), np.float32), np.zeros((N, 6), np.int64)),
     torch.nn.Sequential(torch.nn.Linear(6, 36), torch.nn.Unflatten(1, (6, 6))), dict(metrics=("accuracy",)),
     r"outputs \(6, 6, 6\) with targets \(6, 6\) fit classes on dimension 1 and on the last one; say which: "
     r"metrics=\[memfit.metrics.Accuracy\(class_dim=1\)\]"),
    ((np.zeros((N, 6), np.float32), np.full(N, 7)), reg_model(3), dict(),
     r"label 7 is out of range for a model with 3 outputs \(labels must be in 0..2, or ignore_index -100"),
    (reg_data(()), reg_model(1), dict(metrics=("mse@box",)), r"metric 'mse' reads target 'box', but the data has "
     r"one target, not a dict"),
    ((np.zeros((N, 6), np.float32), {"box": np.zeros((N, 2))}), reg_model(2), dict(metrics=("mse@box",)),
     r"target 'box': expected the model to return a dict with a tensor 'box'"),
    # integer values to regress, and class ids stored as floats: the error says how to give each (a new user's
    # first try; the messages spoke of labels and shapes only)
    ((np.zeros((N, 6), np.float32), np.arange(N) - 10), reg_model(1), dict(),
     r"holds label -10.*or y_dtype=torch.float32 if y holds values to regress"),
    ((np.zeros((N, 6), np.float32), np.arange(N)), reg_model(1), dict(),
     r"label \d+ is out of range for a model with 1 output .*one output regresses a value.*y.astype\(np.float32\)"),
    ((seg_data()[0], np.where(seg_data()[1] == 255, 255, 0)), seg_model(), dict(),
     r"label 255 is out of range for a model with 4 outputs .*; if 255 marks positions without a label, pass "
     r"ignore_index=255"),
    ((np.zeros((N, 6), np.float32), (np.arange(N) % 3).astype(np.float32)), reg_model(3), dict(),
     r"found outputs \(6, 3\) and targets \(6,\).*class ids stored as floats, give them as integers, "
     r"y.astype\(np.int64\)"),
])
def test_bad_input_says_what_was_expected_and_found(data, model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        evaluate(model, data, chunk_size=6, device="cpu", progress=False, **kwargs)


def test_an_ambiguous_class_dimension_is_said_and_given():
    x = np.random.default_rng(5).normal(size=(N, 6)).astype(np.float32)
    y = np.random.default_rng(6).integers(0, 6, (N, 6))
    model = torch.nn.Sequential(torch.nn.Linear(6, 36), torch.nn.Unflatten(1, (6, 6)))
    res = evaluate(model, (x, y), metrics=[metrics.Accuracy(class_dim=-1)], chunk_size=7, device="cpu",
                   progress=False)
    xb = torch.from_numpy(x)
    with torch.no_grad():
        want = (model(xb).argmax(-1) == torch.from_numpy(y)).double().mean().item()
    assert res["accuracy"] == want


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_labels_from_batches_give_the_int64_values(dtype):
    """A loader's uint8 masks (void 255) or int32 labels: the default loss, perplexity and the confusion matrix
    equal torch's on int64 labels (old: uint8 labels overflowed y * classes in the confusion matrix, the
    ignored positions were filled with -100 wrapped to 156 and counted as class 156; int16/int32 crashed)."""
    torch.manual_seed(0)
    classes = 200
    model = torch.nn.Linear(3, classes)
    x, y = torch.randn(24, 3), torch.randint(0, classes, (24,))
    y[:5] = 255
    batches = [(x[:10], y[:10].to(dtype)), (x[10:], y[10:].to(dtype))]
    with torch.no_grad():
        logits = model(x)
    keep = y != 255
    ref_loss = F.cross_entropy(logits.double(), y, ignore_index=255)
    ref_conf = torch.bincount(y[keep] * classes + logits.argmax(1)[keep], minlength=classes ** 2).view(classes, -1)
    res = evaluate(model, batches, progress=False,
                   metrics={"loss": metrics.Loss(ignore_index=255), "ppl": metrics.Perplexity(ignore_index=255),
                            "confusion": metrics.Confusion(ignore_index=255)})
    assert res["loss"] == pytest.approx(float(ref_loss), rel=1e-6)
    assert res["ppl"] == pytest.approx(float(ref_loss.exp()), rel=1e-6)
    assert torch.equal(res["confusion"], ref_conf)


@pytest.mark.parametrize("chunk", [1, 4, N])
def test_a_one_channel_output_meets_masks_without_it_value_for_value(chunk):
    """A binary-segmentation head (N, 1, H, W) against float masks (N, H, W), or the other way round: 'mse' and
    'mae' compare pixel for pixel, as torch on matching shapes (old: refused as a shape mismatch)."""
    rng = np.random.default_rng(7)
    x, masks = rng.normal(size=(N, 3, 4, 5)).astype(np.float32), (rng.random((N, 4, 5)) > 0.5).astype(np.float32)
    torch.manual_seed(0)
    head = torch.nn.Conv2d(3, 1, 1)
    with torch.no_grad():
        out = head(torch.from_numpy(x)).double()[:, 0]
    ref = {"mse": ((out - torch.from_numpy(masks)) ** 2).mean().item(),
           "mae": (out - torch.from_numpy(masks)).abs().mean().item()}
    check(evaluate(head, (x, masks), chunk_size=chunk, progress=False).metrics, ref)
    squeezed = torch.nn.Sequential(head, torch.nn.Flatten(1, 2))          # (N, 4, 5) outputs, (N, 1, 4, 5) masks
    check(evaluate(squeezed, (x, masks[:, None]), chunk_size=chunk, progress=False).metrics, ref)

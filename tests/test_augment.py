"""memfit.augment on a batch alone: each op against a plain per-sample reference written here (numpy's pad and
slices, one sample at a time), bit for bit, for each padding mode, odd sizes, channels first and last, and every
dtype a lossless codec stores; the parameters' draws; the errors.

Run: `python -m pytest -q tests/test_augment.py`.
"""
import numpy as np
import pytest
import torch

import memfit
from memfit.augment import Crop, CutMix, Cutout, Flip, MixUp, Translate

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]


def batch(shape, dtype, seed=0):
    """Distinct values in `dtype`: every value moved to a wrong place shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g)
    return x.to(dtype)


def to_hwc(s, layout):
    """One sample as (H, W, rest) numpy (float64 for floats: every bf16/fp16 value is exact there)."""
    a = s.double().numpy() if s.is_floating_point() else s.numpy()
    if a.ndim == 2:
        return a[:, :, None]
    return a.transpose(1, 2, 0) if layout == "CHW" else a


def from_hwc(a, like, layout):
    if like.dim() == 2:
        a = a[:, :, 0]
    elif layout == "CHW":
        a = a.transpose(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(a)).to(like.dtype)


def reference(x, op, params, y=None, num_classes=None):
    """The op applied one sample at a time with numpy, from the same parameters."""
    layout = getattr(op, "layout", "CHW")
    out = []
    for i in range(len(x)):
        s = to_hwc(x[i], layout)
        p = {k: int(v[i]) if v.dtype != torch.float32 else v[i] for k, v in params.items()}
        if isinstance(op, Crop):
            h, w = op.out_size(s.shape[:2])
            pad = ((op.padding, op.padding), (op.padding, op.padding), (0, 0))
            sp = np.pad(s, pad, mode="constant", constant_values=op.fill) if op.mode == "zero" else \
                np.pad(s, pad, mode="reflect")
            s = sp[p["top"]:p["top"] + h, p["left"]:p["left"] + w]
        elif isinstance(op, Flip):
            s = s[:, ::-1] if p["flip"] else s
        elif isinstance(op, Cutout):
            s = s.copy()
            if p.get("on", 1):
                s[p["top"]:p["top"] + p["height"], p["left"]:p["left"] + p["width"]] = op.fill
        elif isinstance(op, CutMix):
            s = s.copy()
            prev = to_hwc(x[i - 1], layout)
            r = slice(p["top"], p["top"] + p["height"]), slice(p["left"], p["left"] + p["width"])
            s[r] = prev[r]
        out.append(from_hwc(s, x[i], layout))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout, shape", [("CHW", (5, 3, 7, 9)), ("HWC", (5, 7, 9, 3)), ("CHW", (5, 6, 5))])
@pytest.mark.parametrize("op", [Crop(5, padding=3, mode="zero", fill=7), Crop((9, 4), padding=2, mode="reflect"),
                                Crop(3), Translate(2, mode="reflect"), Flip(), Cutout(3, fill=-5),
                                Cutout((2, 4), fill=1, p=0.5, inside=True), Cutout(4)])
def test_each_op_is_the_per_sample_reference_bit_for_bit(op, layout, shape, dtype):
    if dtype == torch.uint8 and getattr(op, "fill", 0) < 0:
        op = type(op)(**{**op.__dict__, "fill": 3}) if not isinstance(op, Translate) else op
    op = _with_layout(op, layout)
    x = batch(shape, dtype)
    size = memfit.augment.kernels.spatial_size(tuple(x.shape[1:]), layout)
    params = op.draw(len(x), size, torch.Generator().manual_seed(1))
    got, _ = op.apply(x, None, params)
    want = reference(x, op, params)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got, want)


def _with_layout(op, layout):
    if isinstance(op, Translate):
        return Translate(op.padding, op.mode, op.fill, layout)
    return type(op)(**{**op.__dict__, "layout": layout})


def test_a_batch_alone_draws_from_the_generator_and_keeps_its_form():
    x = batch((6, 3, 8, 8), torch.uint8)
    ops = [Crop(8, padding=2, mode="reflect"), Flip(), Cutout(3)]
    a, b = x, x
    for op in ops:
        a = op(a, torch.Generator().manual_seed(3))
        b = op(b, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and not torch.equal(a, x)           # the same seed, the same batch; augmented
    y = torch.arange(6)
    xb, yb = Flip(p=1.0)((x, y))
    assert torch.equal(xb, x.flip(3)) and yb is y
    assert torch.equal(x, batch((6, 3, 8, 8), torch.uint8))     # the input is left as it was


def test_the_draws_cover_every_position_and_follow_p():
    g = torch.Generator().manual_seed(0)
    p = Crop(4, padding=1).draw(4000, (6, 6), g)
    assert sorted(p["top"].unique().tolist()) == [0, 1, 2, 3, 4] == sorted(p["left"].unique().tolist())
    share = Flip(p=0.25).draw(4000, (6, 6), g)["flip"].float().mean().item()
    assert 0.2 < share < 0.3
    c = Cutout(3).draw(4000, (6, 6), g)      # the centre anywhere, 1 past the square's edge: clipped at the sides
    rows = {(t, t + h) for t, h in zip(c["top"].tolist(), c["height"].tolist(), strict=True)}
    assert rows == {(0, 2), (0, 3), (1, 4), (2, 5), (3, 6), (4, 6)}
    c = Cutout(3, inside=True).draw(4000, (6, 6), g)
    assert set(c["top"].tolist()) == {0, 1, 2, 3} and set(c["height"].tolist()) == {3}


@pytest.mark.parametrize("layout, shape", [("CHW", (6, 2, 5, 7)), ("HWC", (6, 5, 7, 2))])
def test_cutmix_pastes_the_previous_sample_and_mixes_targets_by_area(layout, shape):
    x = batch(shape, torch.int16)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    op = CutMix(alpha=1.0, num_classes=3, layout=layout)
    params = op.draw(len(x), memfit.augment.kernels.spatial_size(tuple(x.shape[1:]), layout),
                     torch.Generator().manual_seed(2))
    got, soft = op.apply(x, y, params)
    assert torch.equal(got, reference(x, op, params))
    area = (params["height"] * params["width"]).float()
    kept = 1 - area / 35.0
    onehot = torch.nn.functional.one_hot(y, 3).float()
    for i in range(len(x)):                                 # the targets, one sample at a time
        want = onehot[i] * kept[i] + onehot[i - 1] * (1 - kept[i])
        assert torch.equal(soft[i], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_mixup_mixes_with_the_previous_sample(dtype):
    x = batch((5, 3, 4, 4), dtype) / 7
    y = torch.tensor([1, 0, 3, 3, 2])
    op = MixUp(alpha=0.4, num_classes=4)
    params = op.draw(5, (4, 4), torch.Generator().manual_seed(0))
    got, soft = op.apply(x, y, params)
    lam = params["lam"]
    assert ((lam > 0) & (lam < 1)).all()
    for i in range(5):
        own, other = lam[i].to(dtype), (1 - lam[i]).to(dtype)
        assert torch.equal(got[i], x[i] * own + x[i - 1] * other)
    one = torch.nn.functional.one_hot(y, 4).float()
    assert torch.equal(soft, torch.stack([one[i] * lam[i] + one[i - 1] * (1 - lam[i]) for i in range(5)]))
    _, again = op.apply(x, soft, params)                 # soft targets mix as they are
    assert again.shape == (5, 4)


def test_bad_options_and_batches_say_what_to_do():
    with pytest.raises(ValueError, match="mode to be one of"):
        Crop(32, padding=4, mode="edge")
    with pytest.raises(ValueError, match="size to be an int >= 1"):
        Crop(0)
    with pytest.raises(ValueError, match="reflect padding must be smaller"):
        Crop(8, padding=4, mode="reflect").draw(2, (4, 4), None)
    with pytest.raises(ValueError, match="does not fit in a 4x4 sample padded by 1"):
        Crop(7, padding=1).draw(2, (4, 4), None)
    with pytest.raises(ValueError, match="probability"):
        Flip(p=2)
    with pytest.raises(ValueError, match="needs num_classes"):
        MixUp()((torch.zeros(2, 3), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="give it an \\(x, y\\) batch"):
        MixUp(num_classes=2)(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="samples of shape \\(C, H, W\\)"):
        Flip()(torch.zeros(2, 1, 3, 4, 4))
    with pytest.raises(TypeError, match="a batch tensor"):
        Flip()([1, 2, 3])
    with pytest.raises(ValueError, match="fit inside a 4x4 sample"):
        Cutout(5, inside=True).draw(2, (4, 4), None)

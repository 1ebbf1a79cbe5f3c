"""Targets of every kind (class ids, dense labels with an ignore index, float targets, a dict of them): stored
compactly and decoded to exactly what was given, through every path a batch takes."""
import numpy as np
import pytest
import torch

from memfit import CompactDataset, accumulate, evaluate, loader
from memfit.readers import load_array
from memfit.targets import encode_target

RNG = np.random.default_rng(0)
N = 37                                                                 # no batch size below divides it
X = RNG.integers(0, 256, (N, 1, 4, 4), dtype=np.uint8)
MASK = RNG.integers(0, 5, (N, 4, 4))
MASK[MASK == 4] = 255                                                  # a segmentation set's "void"
TOKENS = RNG.integers(0, 50, (N, 6))
TOKENS[:, 4:][RNG.random((N, 2)) < 0.5] = -100                        # padding
TARGETS = {      # name: (y, from_arrays keywords, expected kind, stored dtype, decoded dtype)
    "class ids": (RNG.integers(0, 10, N), {}, "class", torch.uint8, torch.int64),
    "mask, ignore 255": (MASK, {"ignore_index": 255}, "labels", torch.uint8, torch.int64),
    "tokens, -100": (TOKENS, {}, "labels", torch.int8, torch.int64),
    "float (N,)": (RNG.normal(size=N).astype(np.float32), {}, "float", torch.float32, torch.float32),
    "float64 (N, 3)": (RNG.normal(size=(N, 3)), {}, "float", torch.float64, torch.float64),
    "halves (N, 2)": (RNG.integers(-40, 40, (N, 2)) / 4, {}, "float", torch.float16, torch.float32),
    "whole floats": (RNG.integers(0, 60, N).astype(np.float32), {}, "float", torch.uint8, torch.float32),
    "bool (N, 9)": (RNG.random((N, 9)) < 0.3, {}, "float", torch.uint8, torch.float32),
}


def expected(y):
    """What a loss expects: integers as int64, floats as given, bools as 0/1 floats."""
    t = torch.as_tensor(np.asarray(y))
    return t.long() if not t.is_floating_point() and t.dtype != torch.bool else t


def same(got, want):
    """Exactly the values given (compared in float64 for floats), in a dtype that holds them."""
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            same(got[k], want[k])
        return
    assert got.shape == want.shape, (got.shape, want.shape)
    if want.is_floating_point() or want.dtype == torch.bool:
        assert got.is_floating_point() and torch.equal(got.double(), want.double())
    else:
        assert got.dtype == torch.int64 and torch.equal(got, want)


def cat(batches):
    if isinstance(batches[0], dict):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return torch.cat(batches)


CASES = {k: (v[0], v[1]) for k, v in TARGETS.items()}
CASES["a dict"] = ({"label": TARGETS["class ids"][0], "box": TARGETS["float64 (N, 3)"][0],
                    "mask": MASK}, {"ignore_index": {"mask": 255}})


def want_of(y):
    return {k: expected(v) for k, v in y.items()} if isinstance(y, dict) else expected(y)


@pytest.mark.parametrize("name", list(TARGETS))
def test_each_kind_is_stored_compactly_and_decoded_exactly(name):
    y, kw, kind, stored, decoded = TARGETS[name]
    ds = CompactDataset.from_arrays(X, y, device="cpu", **kw)
    assert ds.targets.kind == kind and ds.y.dtype == stored
    xb, yb = ds.batch(slice(None))
    same(yb, expected(y))
    assert yb.dtype == decoded
    # its bytes are counted: the stored targets in nbytes and the row, the decoded ones in a batch
    per = ds.y[:1].nbytes
    assert ds.nbytes == ds.x.nbytes + ds.y.nbytes + ds._scale.nbytes + ds._shift.nbytes
    assert ds.row_nbytes == 16 + per and ds.batch_nbytes(5) == 5 * (16 * 4 + yb[:1].nbytes)
    assert "targets: " in ds.explain()
    if kind != "float":
        kept = expected(y)[expected(y) != kw.get("ignore_index", -100)]
        assert ds.num_classes == int(kept.max()) + 1
    else:
        assert ds.num_classes is None


def test_a_float_array_is_never_made_class_ids_unless_asked():
    y = np.array([3.0, 1.0, 2.0, 0.0] * 5)
    ds = CompactDataset.from_arrays(X[:20], y, device="cpu")
    assert ds.batch([0])[1].dtype == torch.float32 and ds.targets.kind == "float"
    asked = CompactDataset.from_arrays(X[:20], y, device="cpu", y_dtype=torch.int64)
    assert asked.targets.kind == "class" and asked.batch([0, 1])[1].tolist() == [3, 1]
    assert asked.num_classes == 4


def test_float32_asked_for_float64_targets_reports_its_error_bound():
    y = RNG.normal(size=(N, 2)) * 1e3
    ds = CompactDataset.from_arrays(X, y, device="cpu", y_dtype="float32")
    yb = ds.batch(slice(None))[1]
    err = (yb.double() - torch.from_numpy(y)).abs().max().item()
    bound = ds.targets.parts[None].codec.max_abs_error
    assert yb.dtype == torch.float32 and 0 < err <= bound and "LOSSY" in ds.explain()


def test_a_dict_of_targets_is_packed_in_one_row_and_decoded_to_a_dict():
    y, kw = CASES["a dict"]
    ds = CompactDataset.from_arrays(X, y, device="cpu", **kw)
    assert ds.y.dtype == torch.uint8 and ds.y.shape[1] % 8 == 0
    assert ds.targets.kind == {"label": "class", "box": "float", "mask": "labels"}
    same(ds.batch(slice(None))[1], want_of(y))
    # one byte of label, 24 of box, 16 of mask, rounded to 8
    assert ds.y.shape[1] == 48


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("strategy", ["resident", "stream", "macro", "file"])
def test_every_loader_strategy_decodes_the_targets(name, strategy, tmp_path):
    y, kw = CASES[name]
    x = X
    if strategy == "file":
        np.save(tmp_path / "x.npy", X)
        x, strategy = load_array(str(tmp_path / "x.npy")), "macro"
    extra = {"macro_batch": 10} if strategy == "macro" else {}
    ld = loader((x, y), 5, strategy=strategy, device="cpu", shuffle=False, **extra, **kw)
    same(cat([b for _, b in ld]), want_of(y))
    shuffled = loader((x, y), 5, strategy=strategy, device="cpu", seed=1, **extra, **kw)
    order = shuffled.epoch_order(0)
    want = want_of(y)
    want = {k: v[order] for k, v in want.items()} if isinstance(want, dict) else want[order]
    same(cat([b for _, b in shuffled]), want)


@pytest.mark.parametrize("name", list(CASES))
def test_shards_dataloader_and_subset_decode_the_targets(name):
    y, kw = CASES[name]
    ds = CompactDataset.from_arrays(X, y, device="cpu", **kw)
    same(cat([ds.shard(r, 3).batch(slice(None))[1] for r in range(3)]), want_of(y))
    dl = torch.utils.data.DataLoader(ds, batch_size=8)                    # default collate, per-sample views
    same(cat([b for _, b in dl]), want_of(y))
    same(ds.subset([5, 2])[slice(None)][1], ds.batch([5, 2])[1])
    one = ds.batch([3])[1]
    same(ds[3][1], {k: v[0] for k, v in one.items()} if isinstance(one, dict) else one[0])


class Record:
    """A torchmetrics-style object that keeps what evaluate hands it."""

    def __init__(self):
        self.targets = []

    def update(self, preds, target):
        self.targets.append(target)

    def compute(self):
        return len(self.targets)


@pytest.mark.parametrize("name", list(CASES))
def test_evaluate_hands_each_chunk_its_decoded_targets(name):
    y, kw = CASES[name]
    rec = Record()
    model = torch.nn.Flatten()
    evaluate(model, CompactDataset.from_arrays(X, y, device="cpu", **kw), metrics=[rec], chunk_size=8,
             device="cpu", progress=False)
    same(cat(rec.targets), want_of(y))
    if not kw:                     # arrays straight to evaluate: stored as from_arrays stores them
        rec = Record()
        evaluate(model, (X, y), metrics=[rec], chunk_size=6, device="cpu", progress=False)
        same(cat(rec.targets), want_of(y))


def test_accumulate_takes_a_loader_batch_of_float_and_dict_targets():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 13))
    y, kw = CASES["a dict"]

    def loss_fn(out, t):
        ce = torch.nn.functional.cross_entropy(out[:, :10], t["label"])
        return ce + torch.nn.functional.mse_loss(out[:, 10:].double(), t["box"]).float()

    xb, yb = next(iter(loader((X, y), N, device="cpu", shuffle=False, **kw)))
    ref = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 13))
    ref.load_state_dict(model.state_dict())
    loss_fn(ref(xb), yb).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    accumulate(model, opt, (xb, yb), loss_fn, micro_batch=5)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("y, kw, match", [
    (np.zeros(5), {}, r"x has 37 samples but y has 5 targets"),
    ({"a": np.zeros(N), "b": np.zeros(3)}, {}, r"y\['b'\] has 3 targets"),
    ({"a": np.zeros(N)}, {"ignore_index": {"c": 1}}, r"ignore_index names targets \['c'\] that y does not have"),
    (np.full(N, np.nan), {}, r"y: codec 'float64' needs finite values; found 37 NaN"),
    (np.full(N, 1.0), {"y_dtype": torch.float16}, r"y_dtype torch.float16 is not offered"),
    ({"m": np.full((N, 2), -3)}, {}, r"y\['m'\] holds label -3, which is neither a class id"),
])
def test_bad_targets_say_what_was_expected_and_found(y, kw, match):
    with pytest.raises(ValueError, match=match):
        CompactDataset.from_arrays(X, y, device="cpu", **kw)


def test_bfloat16_targets_are_kept_exactly_and_what_is_refused_says_expected_found_fix():
    """bfloat16 targets (a bf16 model's labels) are stored exactly and decode to float32; asking for a decoded
    dtype that is not offered, or giving a float8 target, says what was expected and found and how to fix it
    (it used to stop at 'is not offered', and float8 raised torch's NotImplementedError about isfinite)."""
    y = (torch.arange(6, dtype=torch.float32) * 1.25 - 2e30 * (torch.arange(6) == 5)).bfloat16()   # one beyond fp16
    stored, t = encode_target(y, 6)
    assert t.kind == "float" and torch.equal(t.decode(stored), y.float())
    with pytest.raises(ValueError, match=r"y_dtype torch.bfloat16 is not offered: targets decode to int64 .*float32 "
                                         r"or float64.*found y_dtype=torch.bfloat16 for torch.bfloat16 targets; leave "
                                         r"y_dtype=None: torch.bfloat16 targets are then stored exactly"):
        encode_target(y, 6, y_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"float targets \(float16, bfloat16, float32 or float64\); found dtype "
                                        r"torch.float8_e4m3fn; convert them first, e.g. y.float\(\)"):
        encode_target(torch.zeros(3).to(torch.float8_e4m3fn), 3)
    with pytest.raises(TypeError, match=r"found dtype <U1; convert them first, e.g. np.asarray\(y, dtype=np.float32"):
        encode_target(np.array(["a", "b"]), 2)


def test_encode_target_keeps_integer_targets_as_float_when_asked():
    stored, t = encode_target(np.array([1, 5, 7]), 3, y_dtype=torch.float32)
    assert t.kind == "float" and t.decode(stored).tolist() == [1.0, 5.0, 7.0]


def test_integer_targets_up_to_2_24_are_float32_when_asked_and_beyond_are_refused_naming_the_value():
    """Counts or prices above 65,535 (stored in int32) are exact in float32 up to 2**24 (old: refused as 'beyond
    2**24' whatever their size)."""
    y = np.array([70_000, 2**24, -3, 0])
    stored, t = encode_target(y, 4, y_dtype=torch.float32)
    out = t.decode(stored)
    assert out.dtype == torch.float32 and out.tolist() == y.tolist()
    with pytest.raises(ValueError, match=r"holds the integer 16777217, beyond 2\*\*24.*y_dtype=torch.float64"):
        encode_target(np.array([1, 2**24 + 1]), 2, y_dtype=torch.float32)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mask, ignore 255", "float64 (N, 3)", "a dict"])
@pytest.mark.parametrize("strategy", ["resident", "stream", "macro"])
def test_cuda_loaders_decode_the_targets_as_the_cpu_does(name, strategy):
    y, kw = CASES[name]
    extra = {"macro_batch": 10} if strategy == "macro" else {}
    ld = loader((X, y), 5, strategy=strategy, device="cuda", seed=2, **extra, **kw)     # pinned staging, side stream
    order = ld.epoch_order(0)
    got = cat([b for _, b in ld])
    got = {k: v.cpu() for k, v in got.items()} if isinstance(got, dict) else got.cpu()
    want = want_of(y)
    same(got, {k: v[order] for k, v in want.items()} if isinstance(want, dict) else want[order])

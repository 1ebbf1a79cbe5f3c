"""CompactDataset against the float32 reference pipeline: (x_float - mean) / std, gathered."""
import re

import numpy as np
import pytest
import torch

import memfit.arrays as arrays_mod
from memfit.arrays import channel_mean_std, channel_min_max
from memfit.codecs import make_codec
from memfit.compact import CompactDataset, as_words

RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, (300, 3, 6, 5), dtype=np.uint8)        # 8-bit data, odd spatial size
FLOATS = RNG.normal(3.0, 20.0, (300, 3, 6, 5)).astype(np.float32)    # float data
LABELS = RNG.integers(0, 10, 300)
IDX = torch.from_numpy(RNG.permutation(300)[:97])


def reference(x, normalize, ds):
    """The float32 pipeline users write today: normalise the whole array in float, then index."""
    x = x.astype(np.float64)
    if normalize is None:
        return x
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean, std = (ds.mean.numpy(), ds.std.numpy()) if normalize == "dataset" else map(np.asarray, normalize)
    return (x - mean.reshape(shape)) / std.reshape(shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalize", [None, "dataset", ([120.0, 125.0, 130.0], [60.0, 61.0, 62.0])])
@pytest.mark.parametrize("codec, data", [
    ("uint8", IMAGES), ("int8", IMAGES), ("q8", IMAGES), ("q4", IMAGES), ("float32", IMAGES),
    ("fp16", IMAGES), ("bf16", IMAGES),
    ("q8", FLOATS), ("q4", FLOATS), ("float32", FLOATS), ("fp16", FLOATS), ("bf16", FLOATS),
])
def test_decoded_batches_equal_float32_reference(codec, data, normalize, dtype):
    ds = CompactDataset.from_arrays(data, LABELS, codec=codec, normalize=normalize, device="cpu", dtype=dtype)
    xb, yb = ds.batch(IDX)
    ref = reference(data, normalize, ds)[IDX.numpy()]
    assert xb.dtype == dtype and xb.shape == (len(IDX), 3, 6, 5)
    assert yb.dtype == torch.int64 and np.array_equal(yb.numpy(), LABELS[IDX.numpy()])
    scale = 1.0 if normalize is None else float(np.min(ds.std.numpy()))
    # the codec's own worst error, in normalised units, plus one rounding to the output dtype
    tol = ds.codec.max_abs_error / scale + torch.finfo(dtype).eps * (np.abs(ref).max() + 1) * 2
    assert np.abs(xb.double().numpy() - ref).max() <= tol
    if codec in ("uint8", "int8", "float32") and data is IMAGES:
        assert ds.codec.max_abs_error == 0


def test_bits1_and_bool_input():
    b = RNG.random((50, 1, 9, 9)) > 0.5
    ds = CompactDataset.from_arrays(b, device="cpu")
    assert ds.codec.name == "bits1"
    xb, yb = ds.batch(range(50))
    assert yb is None and np.array_equal(xb.numpy(), b.astype(np.float32))


def test_bytes_held_against_float32():
    x = RNG.integers(0, 256, (1000, 1, 28, 28), dtype=np.uint8)
    for codec, ratio in (("uint8", 0.25), ("int8", 0.25), ("q8", 0.25), ("q4", 0.125), ("fp16", 0.5)):
        ds = CompactDataset.from_arrays(x, codec=codec, device="cpu")
        assert ds.x.nbytes / x.size / 4 == ratio
    binary = (x > 127).astype(np.uint8)
    assert CompactDataset.from_arrays(binary, codec="bits1", device="cpu").x.nbytes / x.size / 4 == 1 / 32
    ds = CompactDataset.from_arrays(x, LABELS.repeat(4)[:1000], device="cpu")
    assert ds.nbytes == 1000 * 784 + 1000 * 1 + 8          # rows, uint8 labels, scalar scale/shift
    assert ds.dense_nbytes == 1000 * 784 * 4 + 1000 * 8
    assert ds.row_nbytes == 785 and ds.batch_nbytes(10) == 10 * (784 * 4 + 8)


@pytest.mark.parametrize("labels, dtype", [([0, 9], torch.uint8), ([-1, 5], torch.int8),
                                           ([0, 1000], torch.int16), ([0, 70000], torch.int32),
                                           ([0, 2**40], torch.int64)])
def test_labels_in_smallest_dtype(labels, dtype):
    # a negative label is an ignore index, said so (a class id is >= 0)
    ds = CompactDataset.from_arrays(np.zeros((2, 1), np.uint8), np.array(labels), device="cpu",
                                    ignore_index=min(-1, min(labels)))
    assert ds.y.dtype == dtype and ds.batch([0, 1])[1].tolist() == labels
    assert ds.num_classes == max(labels) + 1


def test_indexing_forms():
    ds = CompactDataset.from_arrays(IMAGES, LABELS, device="cpu")
    ref = IMAGES.astype(np.float32)
    x, y = ds[5]
    assert x.shape == (3, 6, 5) and np.array_equal(x.numpy(), ref[5]) and y.item() == LABELS[5]
    assert np.array_equal(ds[-1][0].numpy(), ref[-1])
    assert np.array_equal(ds[10:20:3][0].numpy(), ref[10:20:3])
    assert np.array_equal(ds.batch([-2, 0])[0].numpy(), ref[[-2, 0]])
    mask = np.zeros(300, bool)
    mask[[3, 7]] = True
    assert np.array_equal(ds.batch(torch.from_numpy(mask))[0].numpy(), ref[[3, 7]])
    assert np.array_equal(ds.batch(np.array([4, 4]))[0].numpy(), ref[[4, 4]])
    with pytest.raises(IndexError, match="index 300 is out of range for a dataset of 300"):
        ds.batch([0, 300])
    with pytest.raises(TypeError, match="indices must be integers"):
        ds.batch(torch.tensor([0.5]))
    with pytest.raises(ValueError, match=r"boolean mask must have shape \(300,\)"):
        ds.batch(torch.ones(3, dtype=torch.bool))


def test_float32_codec_never_hands_out_stored_rows():
    ds = CompactDataset.from_arrays(FLOATS, codec="float32", device="cpu")
    before = ds.x.clone()
    for xb in (ds[0:5][0], ds.batch([1, 2])[0], ds[3][0]):
        xb.fill_(-7)
    assert torch.equal(ds.x, before)


def test_dataloader_gives_the_same_batches():
    ds = CompactDataset.from_arrays(IMAGES, LABELS, normalize="dataset", device="cpu")
    order = torch.randperm(300, generator=torch.Generator().manual_seed(3)).tolist()
    dl = torch.utils.data.DataLoader(ds, batch_size=64, sampler=order, collate_fn=CompactDataset.collate)
    batches = list(dl)
    assert len(batches) == 5
    for i, (xb, yb) in enumerate(batches):
        rx, ry = ds.batch(order[i * 64:(i + 1) * 64])
        assert torch.equal(xb, rx) and torch.equal(yb, ry)
    # the batch-sampler form (no auto-collation) calls __getitem__ with a list of indices
    sampler = torch.utils.data.BatchSampler(order, 100, drop_last=False)
    xb, yb = next(iter(torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=None)))
    assert torch.equal(xb, ds.batch(order[:100])[0])


def test_memmap_input_equals_in_memory(tmp_path, monkeypatch):
    path = tmp_path / "x.npy"
    np.save(path, FLOATS)
    mm = np.load(path, mmap_mode="r")
    monkeypatch.setattr(arrays_mod, "CHUNK_BYTES", 7 * FLOATS[0].nbytes)     # many uneven chunks
    a = CompactDataset.from_arrays(mm, LABELS, codec="q8", normalize="dataset", device="cpu")
    monkeypatch.undo()
    b = CompactDataset.from_arrays(FLOATS, LABELS, codec="q8", normalize="dataset", device="cpu")
    assert torch.equal(a.x, b.x)
    assert torch.allclose(a.mean, b.mean, rtol=1e-12) and torch.allclose(a.std, b.std, rtol=1e-12)
    assert a.codec.max_abs_error == b.codec.max_abs_error


@pytest.mark.parametrize("source", ["array", "memmap", "tensor"])
def test_channel_statistics_match_numpy_in_bounded_chunks(tmp_path, monkeypatch, source):
    """Per-channel min/max and mean/std against numpy over the whole array, read 13 rows at a time
    (a memmap is never read whole); a large mean makes naive running sums lose digits."""
    big = RNG.normal(1e4, 3.0, (200, 2, 4)).astype(np.float32)
    data = big
    if source == "memmap":
        np.save(tmp_path / "big.npy", big)
        data = np.load(tmp_path / "big.npy", mmap_mode="r")
    elif source == "tensor":
        data = torch.from_numpy(big)
    monkeypatch.setattr(arrays_mod, "CHUNK_BYTES", 13 * big[0].nbytes)
    read = []
    to_tensor = arrays_mod.to_tensor
    monkeypatch.setattr(arrays_mod, "to_tensor", lambda chunk: read.append(len(chunk)) or to_tensor(chunk))
    mean, std = channel_mean_std(data)
    lo, hi = channel_min_max(data)
    assert max(read) == 13 and sum(read) == 2 * 200          # two passes of bounded reads
    ref = big.astype(np.float64)
    assert np.allclose(mean.numpy(), ref.mean(axis=(0, 2)), rtol=1e-12)
    assert np.allclose(std.numpy(), ref.std(axis=(0, 2)), rtol=1e-9)
    assert np.array_equal(lo.numpy(), ref.min(axis=(0, 2))) and np.array_equal(hi.numpy(), ref.max(axis=(0, 2)))
    assert lo.dtype == hi.dtype == mean.dtype == std.dtype == torch.float64


@pytest.mark.parametrize("dtype, row", [(torch.uint8, (3, 8)), (torch.uint8, (7,)), (torch.int16, (4,)),
                                        (torch.float32, (2, 3)), (torch.int64, (2,)), (torch.uint8, (0,))])
def test_rows_as_words_gather_the_same_bytes(dtype, row):
    """`as_words` is a view of the same bytes when the rows are whole words, else None; gathers through
    `rows` (with and without `out`) equal a plain index_select either way."""
    x = torch.from_numpy(RNG.integers(0, 100, (30, *row))).to(dtype)
    words = as_words(x)
    whole_words = x[:1].nbytes % 8 == 0 and x[:1].nbytes > 0 and x.element_size() < 8
    assert (words is not None) == whole_words
    if words is not None:
        assert words.dtype == torch.int64 and words.data_ptr() == x.data_ptr()
        assert words.view(dtype).view(x.shape).equal(x)
    assert as_words(x[::2]) is None                              # every other row: not contiguous
    ds = CompactDataset(x, None, make_codec("uint8"), row, torch.float32)
    idx = torch.tensor([29, 0, 5, 5, 17])
    ref = x.index_select(0, idx)
    assert torch.equal(ds.rows(idx), ref)
    out = torch.empty_like(ref)
    assert ds.rows(idx, out=out) is out and torch.equal(out, ref)


def test_bytes_per_row_and_batch_match_the_tensors_produced(tmp_path):
    """`row_nbytes` and `batch_nbytes` against the bytes of the stored rows and the decoded batches,
    for a dataset, a dataset of fields, and the loaders' sources (in memory and memory-mapped)."""
    from memfit.loading.sources import make_source
    np.save(tmp_path / "x.npy", FLOATS)
    datasets = {"images": CompactDataset.from_arrays(IMAGES, LABELS, normalize="dataset", device="cpu"),
                "q4 fp16": CompactDataset.from_arrays(FLOATS, LABELS, codec="q4", dtype="fp16", device="cpu"),
                "no labels": CompactDataset.from_arrays(FLOATS, device="cpu"),
                "fields": CompactDataset.from_arrays(FIELDS, LABELS[:120], device="cpu")}
    for name, ds in datasets.items():
        xb, yb = ds.batch(range(7))
        decoded = sum(v.nbytes for v in xb.values()) if isinstance(xb, dict) else xb.nbytes
        assert ds.batch_nbytes(7) == decoded + (0 if yb is None else yb.nbytes), name
        assert ds.row_nbytes == ds.x[0].nbytes + (0 if ds.y is None else ds.y[0].nbytes), name
        src = make_source(ds)
        assert (src.row_nbytes, src.batch_nbytes(7)) == (ds.row_nbytes, ds.batch_nbytes(7)), name
    mapped = make_source((np.load(tmp_path / "x.npy", mmap_mode="r"), LABELS), codec="q8")
    in_memory = CompactDataset.from_arrays(FLOATS, LABELS, codec="q8", device="cpu")
    assert (mapped.row_nbytes, mapped.batch_nbytes(5)) == (in_memory.row_nbytes, in_memory.batch_nbytes(5))


def test_flat_features_are_channels():
    x = RNG.normal(size=(40, 5)).astype(np.float32)
    ds = CompactDataset.from_arrays(x, normalize="dataset", device="cpu")
    xb = ds.batch(range(40))[0].double().numpy()
    assert np.allclose(xb.mean(0), 0, atol=0.02) and np.allclose(xb.std(0), 1, atol=0.02)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=np.full((4, 1, 2), 300.0), codec="uint8"), ValueError,
     r"codec 'uint8' needs values in \[0, 255\], found 300"),
    (dict(x=np.full((4, 1, 2), 300.0), codec="int8"), ValueError, r"codec 'int8' needs values"),
    (dict(x=np.full((4, 1, 2), 2, np.uint8), codec="bits1"), ValueError, r"codec 'bits1' needs values in \[0, 1\]"),
    (dict(x=np.array([[[np.nan, 1.0]]] * 4)), ValueError, r"codec 'float64' needs finite values"),
    (dict(x=np.zeros((4, 1, 2)), y=np.zeros(5)), ValueError, r"x has 4 samples but y has 5 targets"),
    (dict(x=np.zeros((4, 1, 2)), y=np.full(4, 0.5), y_dtype=torch.int64), ValueError,
     r"y_dtype=torch.int64 asks for class ids, but y holds 0.5 \(sample 0\).*leave y_dtype=None"),
    (dict(x=np.zeros((4, 1, 2)), y=np.array([0, 3, -1, 2])), ValueError,
     r"y holds label -1, which is neither a class id \(>= 0\) nor ignore_index -100; pass ignore_index=-1"),
    (dict(x=np.zeros((4, 1, 2)), y=np.array(["a"] * 4)), TypeError, r"y: expected integer class ids"),
    (dict(x=np.zeros(4)), ValueError, r"expected x of shape \(N, C, \.\.\.\).*found shape \(4,\)"),
    (dict(x=np.zeros((0, 3))), ValueError, r"x has no samples"),
    (dict(x="pixels"), TypeError, r"expected x as a numpy array or torch tensor"),
    (dict(x=np.zeros((4, 1, 2)), codec="jpeg"), ValueError, r"unknown codec 'jpeg'"),
    (dict(x=np.zeros((4, 1, 2)), dtype="complex64"), ValueError, r"expected an output dtype float32, float16"),
    (dict(x=np.full((4, 1, 2), 0.5), dtype=torch.long), ValueError, r"dtype torch.int64 needs integer data"),
    (dict(x=np.zeros((4, 1, 2), np.int64), dtype=torch.long, normalize="dataset"), ValueError,
     r"normalize applies to float"),
    (dict(x=np.zeros((4, 3, 2)), normalize=([1, 2], [1, 1])), ValueError,
     r"normalize mean has 2 values but x has 3 channels"),
    (dict(x=np.zeros((4, 2, 2)), normalize=([0, 0], [1, 0])), ValueError, r"std must be finite and non-zero"),
    (dict(x=np.zeros((4, 2, 2)), normalize="imagenet"), ValueError, r"normalize must be None \(or 'none'\), 'dataset'"),
    (dict(x=np.zeros((4, 2, 2)), device="tpu"), ValueError, r"expected a device"),
])
def test_bad_input_raises_clearly(kwargs, error, match):
    x = kwargs.pop("x")
    with pytest.raises(error, match=match):
        CompactDataset.from_arrays(x, device=kwargs.pop("device", "cpu"), **kwargs)


def test_to_and_pin_on_cpu_only_machine():
    ds = CompactDataset.from_arrays(IMAGES, LABELS, device="cpu")
    assert ds.to("cpu") is ds
    sub = ds.subset([5, 2])
    assert len(sub) == 2 and torch.equal(sub.batch([0, 1])[0], ds.batch([5, 2])[0])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned memory needs CUDA"):
            ds.pin_memory()


@pytest.mark.cuda
def test_cuda_batches_equal_cpu_batches():
    cpu = CompactDataset.from_arrays(FLOATS, LABELS, codec="q8", normalize="dataset", device="cpu")
    gpu = CompactDataset.from_arrays(FLOATS, LABELS, codec="q8", normalize="dataset", device="cuda")
    assert gpu.x.device.type == "cuda" and torch.equal(gpu.x.cpu(), cpu.x)
    xg, yg = gpu.batch(IDX.cuda())
    xc, yc = cpu.batch(IDX)
    assert torch.allclose(xg.cpu(), xc, atol=1e-5) and torch.equal(yg.cpu(), yc)
    pinned = cpu.pin_memory()
    assert pinned.is_pinned and torch.equal(pinned.to("cuda").x.cpu(), cpu.x)


# ---- integer data and several inputs per sample ---------------------------------------------------------
TOKENS = RNG.integers(0, 30522, (120, 9))                      # BERT-sized vocabulary, (N, L) int64


def test_token_ids_are_stored_narrow_and_yielded_as_long():
    ds = CompactDataset.from_arrays(TOKENS, LABELS[:120], device="cpu")
    assert ds.codec.name == "int16" and ds.x.dtype == torch.int16 and ds.dtype == torch.int64
    xb, _ = ds.batch([3, 0])
    assert xb.dtype == torch.int64 and torch.equal(xb, torch.from_numpy(TOKENS[[3, 0]]))
    assert ds.nbytes < ds.dense_nbytes / 3.5                  # 2 bytes a token instead of 8
    as32 = CompactDataset.from_arrays(TOKENS, dtype=torch.int32, device="cpu")
    assert as32.batch([1])[0].dtype == torch.int32
    assert CompactDataset.from_arrays(TOKENS, dtype=torch.long, device="cpu").batch([1])[0].dtype == torch.long


FIELDS = {"input_ids": TOKENS, "attention_mask": (TOKENS % 3 > 0).astype(np.int64),
          "image": RNG.integers(0, 256, (120, 3, 2, 2), dtype=np.uint8),
          "meta": RNG.standard_normal((120, 5)).astype(np.float32)}


def test_fields_decode_to_a_dict_equal_to_each_array():
    ds = CompactDataset.from_arrays(FIELDS, LABELS[:120], device="cpu")
    assert ds.x.shape[1] % 8 == 0 and ds.x.dtype == torch.uint8      # one packed byte row per sample
    idx = [7, 0, 119, 7]
    xb, yb = ds.batch(idx)
    assert set(xb) == set(FIELDS) and torch.equal(yb, torch.from_numpy(LABELS[idx]).long())
    for name, arr in FIELDS.items():
        single = CompactDataset.from_arrays(arr, device="cpu").batch(idx)[0]     # each field on its own
        assert torch.equal(xb[name], single), name
    assert torch.equal(xb["input_ids"], torch.from_numpy(TOKENS[idx]))
    x0, y0 = ds[7]
    assert torch.equal(x0["meta"], torch.from_numpy(FIELDS["meta"][7])) and int(y0) == LABELS[7]
    part = ds.subset([119])
    assert torch.equal(part.batch([0])[0]["image"], xb["image"][2:3])
    assert "input_ids: shape (9,) stored as int16 (lossless)" in ds.explain()


@pytest.mark.parametrize("strategy", ["resident", "stream", "macro"])
def test_fields_through_every_loader_strategy(strategy):
    import memfit
    ref = CompactDataset.from_arrays(FIELDS, LABELS[:120], device="cpu")
    ld = memfit.loader((FIELDS, LABELS[:120]), 32, strategy=strategy, device="cpu", seed=3)
    order = ld.epoch_order(0)
    start = 0
    for xb, yb in ld:
        want_x, want_y = ref.batch(order[start:start + len(yb)])
        start += len(yb)
        assert torch.equal(yb, want_y) and all(torch.equal(xb[k], want_x[k]) for k in FIELDS)
    assert start == 120


@pytest.mark.parametrize("kwargs, match", [
    (dict(x={"a": np.zeros((3, 2)), "b": np.zeros((4, 2))}), r"one row per sample; found sample counts"),
    (dict(x={"a": np.zeros((3, 2))}, codec={"b": "q8"}), r"codec names fields \['b'\] that x does not have"),
    (dict(x={"a": np.full((3, 2), 0.5)}, dtype={"a": torch.long}), r"field 'a': dtype torch.int64 needs integer"),
    (dict(x={}), r"x is an empty dict"),
])
def test_bad_fields_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompactDataset.from_arrays(device="cpu", **kwargs)


@pytest.mark.parametrize("data", ["images", "fields", "no labels"])
def test_plain_dataloader_with_default_collate_gives_the_tensordataset_batches(data):
    """`DataLoader(ds, batch_size=32)` with nothing else: the same batches as a DataLoader over a
    TensorDataset of the decoded data, in the same shuffled order."""
    if data == "fields":
        ds = CompactDataset.from_arrays(FIELDS, LABELS[:120], device="cpu")
    else:
        ds = CompactDataset.from_arrays(IMAGES, None if data == "no labels" else LABELS, normalize="dataset",
                                        device="cpu")
    decoded, labels = ds.batch(slice(None))
    tensors = (decoded,) if labels is None else (decoded, labels)
    if data == "fields":
        ref = torch.utils.data.StackDataset(torch.utils.data.StackDataset(**decoded), labels)
    else:
        ref = torch.utils.data.TensorDataset(*tensors)
    for kw in ({}, {"shuffle": True}):
        got = list(torch.utils.data.DataLoader(ds, batch_size=32, generator=torch.Generator().manual_seed(1), **kw))
        want = list(torch.utils.data.DataLoader(ref, batch_size=32, generator=torch.Generator().manual_seed(1), **kw))
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            if data == "fields":
                (xa, ya), (xb, yb) = a, b
                assert all(torch.equal(xa[k], xb[k]) for k in FIELDS) and torch.equal(ya, yb)
            elif data == "no labels":
                assert torch.equal(a, b[0])
            else:
                assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_token_ids_from_a_memmapped_file_stream_as_int64(tmp_path):
    import memfit
    from memfit.readers import load_array
    np.save(tmp_path / "ids.npy", TOKENS)
    ld = memfit.loader((load_array(tmp_path / "ids.npy"), LABELS[:120]), 32, strategy="stream", device="cpu",
                       shuffle=False)
    got = torch.cat([x for x, _ in ld])
    assert got.dtype == torch.int64 and torch.equal(got, torch.from_numpy(TOKENS))
    assert "stored as int16 (lossless), decoded to int64" in ld.explain()


def test_one_progress_keyword_across_the_public_api():
    """A progress bar is asked for as `progress=` everywhere (from_arrays as evaluate), never `progress_bar=`."""
    import inspect

    import memfit
    params = {}
    for name in memfit.__all__:
        obj = getattr(memfit, name)
        members = vars(obj).items() if inspect.isclass(obj) else [(name, obj)]
        for member, fn in members:
            fn = fn.__func__ if isinstance(fn, (classmethod, staticmethod)) else fn
            if inspect.isfunction(fn):
                params[f"{name}.{member}"] = set(inspect.signature(fn).parameters)
    assert not [k for k, p in params.items() if "progress_bar" in p]
    assert "progress" in params["CompactDataset.from_arrays"] and "progress" in params["evaluate.evaluate"]
    ds = CompactDataset.from_arrays({"a": IMAGES}, LABELS, device="cpu", progress=False)   # fields pass it on
    assert len(ds) == len(IMAGES)


# ---- the file source and from_arrays share one set-up ---------------------------------------------
FILE_CASES = {     # name: (x, codecs to try, output dtypes to try)
    "images": (IMAGES[:40], ["auto", "uint8", "q8", "q4", "fp16"], [None, torch.float16, torch.float64]),
    "floats": (FLOATS[:40], ["auto", "q8", "q4", "fp16", "bf16", "float32"], [None, torch.bfloat16]),
    "halves": (np.round(FLOATS[:40] * 4) / 4, ["auto"], [None]),                         # auto picks fp16
    "tokens": (RNG.integers(-300, 30000, (40, 7)), ["auto", "int16", "int32"], [None, torch.int32, torch.float32]),
    "binary": (RNG.random((40, 2, 9)) < 0.3, ["auto", "bits1"], [None, torch.float16]),
    "wide": (FLOATS[:40].astype(np.float64) / 3, ["auto", "float32"], [None, torch.float64]),
    "nan": (np.where(FLOATS[:40] > 40, np.nan, FLOATS[:40]).astype(np.float64), ["auto", "q8"], [None]),  # refused
}
NORMALIZE = [None, "dataset", (2.0, 7.0)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor: bit-for-bit comparison (-0.0 and NaN included)."""
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_a_memory_mapped_file_source_stores_and_decodes_as_from_arrays(case, tmp_path, monkeypatch):
    """The loaders' file source reads a .npy block by block; from_arrays encodes the array whole. For the
    same data both must store the same codes, decode them to the same bits and explain() the same
    (a lossy codec's bound included): small reads make the file source fit q8/q4 over many chunks."""
    from memfit.loading import sources
    monkeypatch.setattr(sources, "READ_BYTES", 256)
    monkeypatch.setattr(arrays_mod, "CHUNK_BYTES", 1000)        # several chunks for the statistics too
    x, codecs, dtypes = FILE_CASES[case]
    np.save(tmp_path / "x.npy", x)
    mm = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = RNG.integers(0, 5, len(x))
    idx = torch.from_numpy(RNG.permutation(len(x))[:23])
    tried = 0
    for codec in codecs:
        for dtype in dtypes:
            for normalize in NORMALIZE:
                kw = dict(codec=codec, normalize=normalize, dtype=dtype)
                try:
                    ds = CompactDataset.from_arrays(x, y, device="cpu", **kw)
                except ValueError as e:                     # refused in memory: refused from the file alike
                    with pytest.raises(ValueError, match="^" + re.escape(str(e)) + "$"):
                        sources.make_source((mm, y), **kw)
                    continue
                src = sources.make_source((mm, y), **kw)
                assert isinstance(src, sources.FileSource)
                what = f"{codec}, {normalize}, {dtype}"
                assert src.template.explain_sample() == ds.explain_sample(), what
                assert (src.template.num_classes, src.y_dtype) == (ds.num_classes, ds.y.dtype), what
                whole = src.dataset(torch.device("cpu"))                   # every row, read in blocks
                assert torch.equal(_bits(whole.x), _bits(ds.x)) and torch.equal(whole.y, ds.y), what
                rows = torch.empty((len(idx), *src.stored_shape), dtype=src.stored_dtype)
                labels = torch.empty(len(idx), dtype=src.y_dtype)
                src.fill(idx, rows, labels)                                # a shuffled block
                ref_x, ref_y = ds.batch(idx)
                got = src.template.decode(rows)
                assert got.dtype == ref_x.dtype and torch.equal(_bits(got), _bits(ref_x)), what
                assert torch.equal(labels.long(), ref_y), what
                tried += 1
    assert tried >= len(codecs) or case == "nan"    # most combinations are valid: the comparison did run


def test_a_file_source_refuses_a_value_its_codec_cannot_hold_before_any_batch(tmp_path):
    from memfit.loading.sources import make_source
    x = np.zeros((30, 4), np.float32)
    x[17, 2] = 300.0
    np.save(tmp_path / "x.npy", x)
    with pytest.raises(ValueError, match=r"codec 'uint8' needs values in \[0, 255\], found 300 at sample 17"):
        make_source((np.load(tmp_path / "x.npy", mmap_mode="r"), None), codec="uint8")


def test_normalize_none_is_spelled_as_on_the_command_line():
    a = CompactDataset.from_arrays(IMAGES[:20], LABELS[:20], normalize="none", device="cpu")
    b = CompactDataset.from_arrays(IMAGES[:20], LABELS[:20], normalize=None, device="cpu")
    assert a.mean is None and torch.equal(a.batch(slice(None))[0], b.batch(slice(None))[0])
    ids = CompactDataset.from_arrays(IMAGES[:20].astype(np.int64) * 100, normalize="none", device="cpu")
    assert ids.dtype == torch.int64            # integer outputs accept 'none' as they accept None


F64 = RNG.normal(size=(61, 3, 2)) * 1e3                    # float64 that float32 cannot hold


def test_float64_data_is_stored_and_decoded_as_float64_by_default():
    ds = CompactDataset.from_arrays(F64, device="cpu")
    xb = ds.batch(slice(None))[0]
    assert ds.x.dtype == xb.dtype == torch.float64 and torch.equal(xb, torch.from_numpy(F64))
    assert "float64 (lossless)" in ds.explain() and ds.x.nbytes == ds.dense_nbytes      # as plain float64
    norm = CompactDataset.from_arrays(F64, normalize="dataset", device="cpu").batch(slice(None))[0]
    mean, std = F64.mean(axis=(0, 2), keepdims=True), F64.std(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(norm.numpy(), (F64 - mean) / std, rtol=0, atol=1e-13)


@pytest.mark.parametrize("source", ["arrays", "file"])
def test_float32_asked_for_float64_data_is_stored_as_float32_with_its_bound(source, tmp_path):
    from memfit import loader
    from memfit.readers import load_array
    x = F64
    if source == "file":
        np.save(tmp_path / "x.npy", F64)
        x = load_array(str(tmp_path / "x.npy"))
    macro = {"strategy": "macro", "macro_batch": 32} if source == "file" else {"strategy": "resident"}
    ld = loader((x, None), 16, dtype=torch.float32, device="cpu", shuffle=False, **macro)
    got = torch.cat([xb for xb, _ in ld])
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(F64.astype(np.float32)))
    err = float(np.abs(F64.astype(np.float32).astype(np.float64) - F64).max())
    codec = ld.dataset.codec
    assert codec.stored_dtype == torch.float32 and codec.max_abs_error == err > 0
    assert f"LOSSY: |decoded - x| <= {err:.4g}" in ld.explain()
    ds = CompactDataset.from_arrays(F64, dtype=torch.float32, device="cpu")
    assert ds.x.dtype == torch.float32 and ds.nbytes < F64.nbytes / 2 + 64

"""Tests for memfit.readers: round trips through files written in the real formats, and every bad input.

Run: python -m pytest -q tests/test_readers.py
"""

from __future__ import annotations

import gzip
import io
import pickle
import shutil
import struct
import sys
import tarfile
import tracemalloc

import numpy as np
import pytest
import torch

from memfit import readers
from memfit.readers import cifar10, digits, load_array, load_idx, mnist, synthetic, write_idx

IDX_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]
SHAPES = [(7,), (3, 5), (4, 3, 2), (2, 3, 2, 5)]


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 1e3).astype(dtype)


# ------------------------------------------------------------------------------------------ IDX
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", IDX_DTYPES)
def test_idx_round_trip(tmp_path, dtype, shape, gz):
    a = _random(shape, dtype)
    path = write_idx(tmp_path / ("a.idx.gz" if gz else "a.idx"), a)
    b = load_idx(path)
    assert b.dtype == np.dtype(dtype) and b.dtype.isnative and b.flags.writeable
    np.testing.assert_array_equal(a, b)


def test_idx_reads_a_hand_built_file_big_endian(tmp_path):
    # Header built by hand from the spec, independent of write_idx: int16 (0x0B), rank 2, dims 2x2.
    raw = bytes([0, 0, 0x0B, 2]) + struct.pack(">II", 2, 2) + struct.pack(">4h", 1, -2, 300, -32768)
    (tmp_path / "h.idx").write_bytes(raw)
    np.testing.assert_array_equal(load_idx(tmp_path / "h.idx"), [[1, -2], [300, -32768]])
    write_idx(tmp_path / "w.idx", np.array([[1, -2], [300, -32768]], dtype="<i2"))  # little-endian in
    assert (tmp_path / "w.idx").read_bytes() == raw


def test_idx_big_endian_input_round_trips(tmp_path):
    a = np.array([[1, -70000], [2**31 - 1, -(2**31)]], dtype=">i4")
    b = load_idx(write_idx(tmp_path / "be.idx", a))
    assert b.dtype == np.int32 and b.dtype.isnative
    np.testing.assert_array_equal(a, b)


def test_idx_gzip_detected_by_magic_not_suffix(tmp_path):
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    shutil.move(write_idx(tmp_path / "a.gz", a), tmp_path / "compressed-no-suffix")
    shutil.move(write_idx(tmp_path / "b", a), tmp_path / "plain-misnamed.gz")
    np.testing.assert_array_equal(load_idx(tmp_path / "compressed-no-suffix"), a)
    np.testing.assert_array_equal(load_idx(tmp_path / "plain-misnamed.gz"), a)


def test_idx_empty_and_rank_zero(tmp_path):
    assert load_idx(write_idx(tmp_path / "e", np.zeros((0, 28, 28), np.uint8))).shape == (0, 28, 28)
    assert load_idx(write_idx(tmp_path / "s", np.array(2.5))).tolist() == 2.5


HEADER = bytes([0, 0, 0x08, 1]) + struct.pack(">I", 4)


@pytest.mark.parametrize("raw, match", [
    (b"\x1a\x2b\x08\x01" + b"\0" * 8, r"bad\.idx: expected an IDX magic number .* found 0x1A2B0801"),
    (b"", r"expected an IDX magic number .* found an empty file"),
    (bytes([0, 0, 0x0A, 1]) + struct.pack(">I", 1) + b"\0", r"expected an IDX type code among .* found 0x0A"),
    (bytes([0, 0, 0x08, 3]) + struct.pack(">I", 4), r"expected a 16-byte header for rank 3, found 8 bytes"),
    (HEADER + b"\1\2\3", r"expected 4 bytes of uint8 data for shape \(4,\), found 3; the file is truncated"),
    (HEADER + b"\1\2\3\4\5", r"expected 4 bytes .* found 5; trailing bytes"),
    (bytes([0, 0, 0x0C, 1]) + struct.pack(">I", 2) + b"\0" * 7, r"expected 8 bytes of int32 data .* found 7"),
])
def test_idx_bad_files(tmp_path, raw, match):
    (tmp_path / "bad.idx").write_bytes(raw)
    with pytest.raises(ValueError, match=match):
        load_idx(tmp_path / "bad.idx")


def test_idx_damaged_gzip(tmp_path):
    good = gzip.compress(HEADER + bytes(range(4)) * 1000)
    (tmp_path / "cut.gz").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match=r"cut\.gz: expected a readable gzip stream, found a damaged one"):
        load_idx(tmp_path / "cut.gz")


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.float16, np.uint16])
def test_write_idx_rejects_other_dtypes(tmp_path, dtype):
    with pytest.raises(TypeError, match=rf"expected an array with an IDX dtype .* found {np.dtype(dtype)}"):
        write_idx(tmp_path / "x", np.zeros(3, dtype))


# ---------------------------------------------------------------------------------------- MNIST
def _mnist_folder(tmp_path, n_train=5, n_test=3, names=None):
    rng = np.random.default_rng(0)
    data = {
        "train-images-idx3-ubyte.gz": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
        "t10k-images.idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),  # dotted variant
        "t10k-labels.idx1-ubyte.gz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    for name, a in data.items():
        write_idx(tmp_path / (names or {}).get(name, name), a)
    return list(data.values())


def test_mnist_round_trip(tmp_path):
    expected = _mnist_folder(tmp_path)
    out = mnist(tmp_path)
    assert [a.shape for a in out] == [(5, 1, 28, 28), (5,), (3, 1, 28, 28), (3,)]
    assert [a.dtype for a in out] == [np.uint8, np.int64, np.uint8, np.int64]
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_mnist_missing_files_lists_names(tmp_path):
    _mnist_folder(tmp_path)
    (tmp_path / "t10k-labels.idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing test labels \(t10k-labels-idx1-ubyte / "
                                                r"t10k-labels-idx1-ubyte.gz / t10k-labels.idx1-ubyte"):
        mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing train images .*train labels .*test images"):
        mnist(tmp_path / "nowhere")


def test_mnist_count_mismatch(tmp_path):
    _mnist_folder(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match=r"train split .* found 5 images and 4 labels"):
        mnist(tmp_path)


def test_mnist_wrong_rank(tmp_path):
    _mnist_folder(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((5, 784), np.uint8))
    with pytest.raises(ValueError, match=r"expected uint8 images of rank 3 \(N, H, W\), found uint8 of sha"):
        mnist(tmp_path)


# ------------------------------------------------------------------------------------- CIFAR-10
class _Py2Pickler(pickle._Pickler):
    """Writes pickles as Python 2's cPickle did: str as BINSTRING, numpy under numpy.core.multiarray."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        data = obj if isinstance(obj, bytes) else obj.encode("latin-1")
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = dispatch[str] = _save_py2_str

    def save_global(self, obj, name=None):
        module = obj.__module__.replace("numpy._core", "numpy.core")  # the name py2-era files carry
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__name__}\n".encode())
        self.memoize(obj)


def _py2_pickle(obj) -> bytes:
    buf = io.BytesIO()
    _Py2Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


def _cifar_folder(root, n=4):
    """Writes cifar-10-batches-py/ under root like the official archive; returns the expected arrays."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    xs, ys = {}, {}
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        xs[name] = rng.integers(0, 256, (n + i, 3072), dtype=np.uint8)
        ys[name] = rng.integers(0, 10, n + i).tolist()
        batch = {b"batch_label": b"training batch %d of 5" % i, b"labels": ys[name], b"data": xs[name],
                 b"filenames": [b"img_%d.png" % j for j in range(n + i)]}
        (folder / name).write_bytes(_py2_pickle(batch))
    train = [f"data_batch_{i}" for i in range(1, 6)]
    x_train = np.concatenate([xs[b] for b in train]).reshape(-1, 3, 32, 32)
    y_train = np.concatenate([ys[b] for b in train])
    return x_train, y_train, xs["test_batch"].reshape(-1, 3, 32, 32), np.array(ys["test_batch"])


def _check_cifar(out, expected):
    assert [a.dtype for a in out] == [np.uint8, np.int64, np.uint8, np.int64]
    assert out[0].shape == (4 + 5 + 6 + 7 + 8, 3, 32, 32) and out[2].shape == (9, 3, 32, 32)
    for got, want in zip(out, expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_py2_pickle_helper_writes_py2_format():
    raw = _py2_pickle({b"data": np.zeros((1, 3072), np.uint8)})
    assert b"cnumpy.core.multiarray\n_reconstruct\n" in raw and b"_codecs" not in raw
    assert b"U\x04data" in raw  # SHORT_BINSTRING, as cPickle wrote py2 str


def test_cifar_folder_and_parent(tmp_path):
    expected = _cifar_folder(tmp_path)
    _check_cifar(cifar10(tmp_path / "cifar-10-batches-py"), expected)
    _check_cifar(cifar10(tmp_path), expected)


def test_cifar_tar_gz_read_without_extracting(tmp_path):
    expected = _cifar_folder(tmp_path / "src")
    tar_path = tmp_path / "dl" / "cifar-10-python.tar.gz"
    tar_path.parent.mkdir()
    with tarfile.open(tar_path, "w:gz") as tar:
        tar.add(tmp_path / "src" / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    shutil.rmtree(tmp_path / "src")
    _check_cifar(cifar10(tar_path), expected)
    _check_cifar(cifar10(tar_path.parent), expected)  # folder holding the archive
    assert [p.name for p in tar_path.parent.iterdir()] == ["cifar-10-python.tar.gz"]  # nothing extracted


def test_cifar_missing_batches(tmp_path):
    _cifar_folder(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing data_batch_3, test_batch$"):
        cifar10(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"missing data_batch_1, .*data_batch_5, test_batch$"):
        cifar10(tmp_path / "empty")
    with tarfile.open(tmp_path / "part.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    with pytest.raises(FileNotFoundError, match=r"in the archive, missing data_batch_3, test_batch"):
        cifar10(tmp_path / "part.tar.gz")
    with pytest.raises(FileNotFoundError, match=r"found nothing at"):
        cifar10(tmp_path / "nowhere")


def test_cifar_refuses_code_in_pickles(tmp_path):
    _cifar_folder(tmp_path)
    # GLOBAL os.getcwd, EMPTY_TUPLE, REDUCE: a real pickle would call os.getcwd(); ours must refuse.
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(b"cos\ngetcwd\n)R.")
    with pytest.raises(ValueError, match=r"data_batch_2: expected a CIFAR-10 batch pickle .*refusing to load "
                                         r"global os\.getcwd"):
        cifar10(tmp_path)


def test_cifar_bad_batch_contents(tmp_path):
    _cifar_folder(tmp_path)
    batch = tmp_path / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(_py2_pickle({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"test_batch: expected data uint8 of shape \(N, 3072\), "
                                         r"found uint8 \(2, 100\)"):
        cifar10(tmp_path)
    batch.write_bytes(_py2_pickle({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}))
    with pytest.raises(ValueError, match=r"expected 2 labels, one per image"):
        cifar10(tmp_path)
    (tmp_path / "not-a-tar.gz").write_bytes(b"hello")
    with pytest.raises(ValueError, match=r"found a file that is not a tar archive"):
        cifar10(tmp_path / "not-a-tar.gz")


# ---------------------------------------------------------------------------------- numpy files
def test_load_array_npy_is_memmap(tmp_path):
    a = _random((50, 3, 4), np.float32)
    np.save(tmp_path / "a.npy", a)
    m = load_array(tmp_path / "a.npy")
    assert isinstance(m, np.memmap) and not m.flags.writeable
    np.testing.assert_array_equal(m, a)
    with open(tmp_path / "f.NPY", "wb") as f:  # np.save(path) would append .npy
        np.save(f, np.asfortranarray(a))  # suffix case and Fortran order
    np.testing.assert_array_equal(load_array(tmp_path / "f.NPY"), a)


def test_load_array_npz(tmp_path):
    a, b = _random((3, 4), np.int16), _random((5,), np.float64)
    np.savez_compressed(tmp_path / "ab.npz", a=a, b=b)
    out = load_array(tmp_path / "ab.npz")
    assert sorted(out) == ["a", "b"]
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)


def test_load_array_errors(tmp_path):
    (tmp_path / "a.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"expected one of the suffixes \.npy, \.npz, found \.csv"):
        load_array(tmp_path / "a.csv")
    with pytest.raises(ValueError, match=r"found none"):
        load_array(tmp_path / "noext")
    np.save(tmp_path / "o.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"o\.npy: holds pickled Python objects.*does not load"):
        load_array(tmp_path / "o.npy")
    np.savez(tmp_path / "o.npz", o=np.array([None], dtype=object))
    with pytest.raises(ValueError, match=r"o\.npz: holds pickled Python objects.*does not load"):
        load_array(tmp_path / "o.npz")
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"junk\.npy: expected a valid \.npy file"):
        load_array(tmp_path / "junk.npy")
    with pytest.raises(FileNotFoundError, match=r"found nothing at"):
        load_array(tmp_path / "missing.npy")


# --------------------------------------------------------------------------------------- digits
def test_digits_matches_sklearn():
    sk = pytest.importorskip("sklearn.datasets").load_digits()
    x, y = digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.uint8 and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 255
    np.testing.assert_array_equal(y, sk.target)
    np.testing.assert_array_equal(x[:, 0], np.floor(sk.images * 255 / 16 + 0.5))  # round half up; 8 -> 128


def test_digits_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'memfit\[demo\]'"):
        digits()


# ------------------------------------------------------------------------------------ synthetic
def test_synthetic_shape_dtype_determinism():
    x, y = synthetic(5000, shape=(1, 12, 12), num_classes=7, seed=3)  # > one 4096-sample chunk
    assert x.shape == (5000, 1, 12, 12) and x.dtype == np.uint8 and y.dtype == np.int64 and y.shape == (5000,)
    x2, y2 = synthetic(5000, shape=(1, 12, 12), num_classes=7, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, y3 = synthetic(5000, shape=(1, 12, 12), num_classes=7, seed=4)
    assert not np.array_equal(x, x3) and not np.array_equal(y, y3)
    counts = np.bincount(y, minlength=7)
    assert counts.max() - counts.min() <= 1
    assert 0 < (y[1:] != y[:-1]).mean()  # shuffled, not sorted by class
    assert x.min() == 0 and x.max() == 255 and 60 < x.mean() < 190


def _split(shape, n_train=1000, n_test=500, seed=1):
    x, y = synthetic(n_train + n_test, shape=shape, num_classes=10, seed=seed)
    xt, yt = torch.from_numpy(x.reshape(len(x), -1)).float(), torch.from_numpy(y)
    xt = (xt - xt.mean(0)) / (xt.std(0) + 1e-6)  # standardized, so plain gradient descent is stable
    return xt[:n_train], yt[:n_train], xt[n_train:], yt[n_train:]


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32), (1, 8, 8)])
def test_synthetic_nearest_class_mean_beats_chance(shape):
    x_train, y_train, x_test, y_test = _split(shape)
    means = torch.stack([x_train[y_train == k].mean(0) for k in range(10)])  # (10, D)
    accuracy = (torch.cdist(x_test, means).argmin(1) == y_test).float().mean().item()
    assert accuracy > 0.8, f"accuracy {accuracy:.3f} on {shape}; chance is 0.1"


def test_synthetic_logistic_regression_learns():
    x_train, y_train, x_test, y_test = _split((1, 28, 28))
    # Full-batch gradient descent by hand: torch.optim's first use costs ~1.5 s of imports.
    w = torch.zeros(x_train.shape[1], 10, requires_grad=True)
    b = torch.zeros(10, requires_grad=True)
    for _ in range(15):
        torch.nn.functional.cross_entropy(x_train @ w + b, y_train).backward()
        with torch.no_grad():
            for p in (w, b):
                p -= 0.5 * p.grad
                p.grad = None
    accuracy = ((x_test @ w + b).argmax(1) == y_test).float().mean().item()
    assert accuracy > 0.8, f"accuracy {accuracy:.3f}; chance is 0.1"


def test_synthetic_is_generated_in_chunks():
    # Whole-set float32 temporaries would be 4x the uint8 output; chunking keeps the extra ~20 MB.
    tracemalloc.start()
    try:
        x, _ = synthetic(50_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < x.nbytes + 40 * 2**20, f"peak {peak / 2**20:.0f} MiB for {x.nbytes / 2**20:.0f} MiB out"


@pytest.mark.parametrize("kwargs, error, match", [
    ({"n": 0}, ValueError, r"expected n to be an int >= 1; found 0"),
    ({"n": 2.5}, TypeError, r"expected n to be an int >= 1; found float 2\.5"),
    ({"n": True}, TypeError, r"expected n to be an int"),
    ({"n": 10, "num_classes": 1}, ValueError, r"expected num_classes to be an int >= 2; found 1"),
    ({"n": 10, "shape": (1, 0, 28)}, ValueError, r"expected every dimension of shape to be an int >= 1; found 0"),
    ({"n": 10, "shape": (1, -28)}, ValueError, r"expected every dimension of shape to be an int >= 1; found -28"),
    ({"n": 10, "shape": 28}, TypeError, r"expected shape as a non-empty tuple of ints"),
    ({"n": 10, "shape": ()}, TypeError, r"expected shape as a non-empty tuple of ints"),
    ({"n": 10, "seed": -1}, ValueError, r"expected seed to be an int >= 0; found -1"),
])
def test_synthetic_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        synthetic(**kwargs)


# ---------------------------------------------------------------------------------------- API
def test_public_names_documented():
    for name in readers.__all__:
        doc = getattr(readers, name).__doc__
        assert doc and "Example:" in doc, name


def test_a_non_zip_npz_is_named_and_never_told_to_unpickle(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip archive at all" * 4)
    with pytest.raises(ValueError, match=r"bad\.npz: expected a \.npz file \(a zip archive") as e:
        load_array(tmp_path / "bad.npz")
    assert "allow_pickle" not in str(e.value)
    np.save(tmp_path / "renamed.npy", np.arange(3))
    (tmp_path / "renamed.npy").rename(tmp_path / "renamed.npz")
    with pytest.raises(ValueError, match=r"renamed\.npz: .*found a \.npy file"):
        load_array(tmp_path / "renamed.npz")


def test_a_truncated_cifar_archive_names_the_file(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            blob = pickle.dumps({b"data": np.random.default_rng(0).integers(0, 256, (20, 3072), dtype=np.uint8),
                                 b"labels": [0] * 20})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    raw = buf.getvalue()
    (tmp_path / "c.tar.gz").write_bytes(raw[:len(raw) * 2 // 3])
    with pytest.raises(ValueError, match=r"c\.tar\.gz.*truncated or corrupt.*download it again"):
        cifar10(tmp_path / "c.tar.gz")

"""Tests for memfit.readers.idx: IDX files and the MNIST layout, round trips and every bad input.

Run: python -m pytest -q tests/readers/test_idx.py
"""

from __future__ import annotations

import gzip
import shutil
import struct

import numpy as np
import pytest

from memfit.readers import load_idx, mnist, write_idx

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

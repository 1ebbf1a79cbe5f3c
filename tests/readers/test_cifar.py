"""Tests for memfit.readers.cifar: CIFAR-10 batches in a folder or a .tar.gz, and every bad input.

Run: python -m pytest -q tests/readers/test_cifar.py
"""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import tarfile

import numpy as np
import pytest

from memfit.readers import cifar10


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

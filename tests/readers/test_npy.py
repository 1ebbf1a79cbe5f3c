"""Tests for memfit.readers.npy: .npy opened memory-mapped, .npz read, and every bad input.

Run: python -m pytest -q tests/readers/test_npy.py
"""

from __future__ import annotations

import numpy as np
import pytest

from memfit.readers import load_array


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 1e3).astype(dtype)


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


def test_a_non_zip_npz_is_named_and_never_told_to_unpickle(tmp_path):
    (tmp_path / "bad.npz").write_bytes(b"not a zip archive at all" * 4)
    with pytest.raises(ValueError, match=r"bad\.npz: expected a \.npz file \(a zip archive") as e:
        load_array(tmp_path / "bad.npz")
    assert "allow_pickle" not in str(e.value)
    np.save(tmp_path / "renamed.npy", np.arange(3))
    (tmp_path / "renamed.npy").rename(tmp_path / "renamed.npz")
    with pytest.raises(ValueError, match=r"renamed\.npz: .*found a \.npy file"):
        load_array(tmp_path / "renamed.npz")

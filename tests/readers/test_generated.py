"""Tests for memfit.readers.generated: digits against scikit-learn, synthetic data's structure.

Run: python -m pytest -q tests/readers/test_generated.py
"""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import pytest
import torch

from memfit.readers import digits, synthetic


def test_digits_matches_sklearn():
    sk = pytest.importorskip("sklearn.datasets").load_digits()
    x, y = digits()
    assert x.shape == (1797, 1, 8, 8) and x.dtype == np.uint8 and y.dtype == np.int64
    assert x.min() == 0 and x.max() == 255
    np.testing.assert_array_equal(y, sk.target)
    np.testing.assert_array_equal(x[:, 0], np.floor(sk.images * 255 / 16 + 0.5))  # round half up; 8 -> 128


def test_digits_are_read_without_importing_sklearn_and_from_load_digits_where_the_file_moved(monkeypatch, tmp_path):
    """The bundled file is read directly (importing scikit-learn costs a process about 1 s); where a scikit-learn
    release moved it, `load_digits` gives the same arrays."""
    import importlib.util
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "sklearn.datasets", None)                # an import of it would raise
        x, y = digits()
    assert x.shape == (1797, 1, 8, 8)
    spec = importlib.util.find_spec("sklearn")
    moved = type(spec)(spec.name, spec.loader, is_package=True)
    moved.submodule_search_locations = [str(tmp_path)]             # no datasets/data/digits.csv.gz there
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: moved if name == "sklearn" else None)
    x2, y2 = digits()
    np.testing.assert_array_equal(x2, x)
    np.testing.assert_array_equal(y2, y)


def test_digits_without_sklearn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # find_spec gives None, an import raises ImportError
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

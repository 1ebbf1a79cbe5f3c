"""Data that needs no file: `digits` (scikit-learn's bundled 8x8 digits as uint8 images) and `synthetic`
(a labelled image set with learnable class structure, generated from a seed in bounded chunks).
"""

from __future__ import annotations

import numpy as np

from memfit.budget import check_count

__all__ = ["digits", "synthetic"]

_CHUNK = 4096  # synthetic samples per chunk: float32 temporaries stay ~13 MB for MNIST shapes
_NOISE_LEVELS = 256  # uniform noise +-127.5; a power of two keeps integers() on its fast masked path


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 handwritten digits (1797 samples), as uint8 images.

    Returns:
        ``(x, y)``: x uint8 ``(1797, 1, 8, 8)`` with the 0..16 gray levels scaled to 0..255
        (``round(v * 255 / 16)``), y int64 ``(1797,)``.

    Raises:
        ImportError: scikit-learn is not installed.

    Example:
        >>> x, y = digits()
        >>> x.shape, int(x.max()), y[:5].tolist()
        ((1797, 1, 8, 8), 255, [0, 1, 2, 3, 4])
    """
    table = _digits_table()
    x = np.rint(table[:, :-1].reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8)[:, None]  # -> (1797, 1, 8, 8)
    return x, table[:, -1].astype(np.int64)


def _digits_table() -> np.ndarray:
    """The (1797, 65) table scikit-learn ships (64 gray levels 0..16, then the label), read from its file without
    importing scikit-learn (about 1 s of CPU a process: scipy comes with it); `load_digits` where the file moved."""
    import gzip
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise ImportError("digits() needs scikit-learn, which is not installed; "
                          "pip install 'memfit[demo]' (or pip install scikit-learn)")
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    if path.is_file():
        with gzip.open(path, "rt") as f:
            return np.loadtxt(f, delimiter=",")
    from sklearn.datasets import load_digits
    d = load_digits()
    return np.column_stack([d.data, d.target])


# ----------------------------------------------------------------------------------- synthetic
def _interp_matrix(size: int, low: int) -> np.ndarray:
    """(size, low) linear-interpolation weights stretching `low` control points over `size` pixels."""
    t = np.linspace(0, low - 1, size)
    return np.stack([np.interp(t, np.arange(low), e) for e in np.eye(low)], axis=1)


def synthetic(n: int, shape: tuple[int, ...] = (1, 28, 28), num_classes: int = 10,
              seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Generate a labelled image set with learnable class structure, without any download.

    Each class has a fixed smooth random prototype (random control points, linearly interpolated);
    a sample is its class prototype times a random brightness in [0.6, 1.2], plus uniform noise of
    +-127.5 gray levels, clipped to 0..255. Labels are balanced (counts differ by at most one) and
    shuffled. Generation is chunked, so a million MNIST-shaped samples need only the uint8 output.

    Args:
        n: number of samples, > 0.
        shape: per-sample shape, e.g. ``(1, 28, 28)`` or ``(3, 32, 32)``; all positive ints.
        num_classes: number of classes, >= 2.
        seed: the same seed gives the same data.

    Returns:
        ``(x, y)``: x uint8 ``(n, *shape)``, y int64 ``(n,)`` in ``[0, num_classes)``.

    Raises:
        ValueError: n < 1, a non-positive dimension, or num_classes < 2.
        TypeError: an argument that is not an int (or a tuple of ints for `shape`).

    Example:
        >>> x, y = synthetic(1000, shape=(3, 32, 32), num_classes=10, seed=1)
        >>> x.shape, x.dtype.name, np.bincount(y).tolist()
        ((1000, 3, 32, 32), 'uint8', [100, 100, 100, 100, 100, 100, 100, 100, 100, 100])
    """
    n = check_count("n", n, 1)
    num_classes = check_count("num_classes", num_classes, 2)
    seed = check_count("seed", seed, 0)
    if isinstance(shape, (int, np.integer)) or not isinstance(shape, (tuple, list)) or not shape:
        raise TypeError(f"expected shape as a non-empty tuple of ints such as (1, 28, 28), found {shape!r}")
    shape = tuple(check_count("every dimension of shape", d, 1) for d in shape)

    proto_rng, label_rng, noise_rng = map(np.random.default_rng, np.random.SeedSequence(seed).spawn(3))
    # Prototypes: random control points on a coarse grid (full resolution for axes of <= 8, such as
    # channels or 8x8 images, so small shapes still give distinct classes), stretched to `shape`
    # axis by axis, then contrast-stretched to 0..255 per class.
    coarse = tuple(d if d <= 8 else max(8, d // 4) for d in shape)
    proto = proto_rng.random((num_classes, *coarse))
    for axis, (d, c) in enumerate(zip(shape, coarse, strict=True)):
        proto = np.moveaxis(np.tensordot(proto, _interp_matrix(d, c), axes=([axis + 1], [1])), -1, axis + 1)
    proto = proto.reshape(num_classes, -1)
    lo, hi = proto.min(axis=1, keepdims=True), proto.max(axis=1, keepdims=True)
    proto = ((proto - lo) / np.maximum(hi - lo, 1e-12) * 255).astype(np.float32)  # (K, D)

    y = label_rng.permutation(np.arange(n, dtype=np.int64) % num_classes)
    brightness = label_rng.uniform(0.6, 1.2, size=n).astype(np.float32)
    x = np.empty((n, proto.shape[1]), np.uint8)
    for start in range(0, n, _CHUNK):
        stop = min(start + _CHUNK, n)
        # uint8 uniform noise: ~6x faster to draw than float32 normals, the hot cost here.
        noise = noise_rng.integers(0, _NOISE_LEVELS, size=(stop - start, proto.shape[1]), dtype=np.uint8)
        chunk = proto[y[start:stop]]  # (B, D) float32
        chunk *= brightness[start:stop, None]
        chunk += noise
        chunk -= (_NOISE_LEVELS - 1) / 2
        np.clip(chunk, 0, 255, out=chunk)
        x[start:stop] = chunk  # float -> uint8 truncates; fine for noise-dominated pixels
    return x.reshape(n, *shape), y

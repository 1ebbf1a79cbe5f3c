"""What `--data` means on the command line: a built-in set or the user's own files, as train/test arrays.

Specs:
    digits              scikit-learn's bundled 8x8 digits (the default; needs scikit-learn)
    synthetic[:N]       generated MNIST-shaped images (N samples, default 10,000)
    mnist:FOLDER        the four MNIST IDX files (gzip or not) in FOLDER
    cifar10:FOLDER      the CIFAR-10 python pickles (folder or .tar.gz)
    FILE.npz            arrays x_train, y_train, x_test, y_test, or x, y (split here)
    FILE.npy            images only is not enough: give an .npz with labels

Example:
    >>> from memfit.cli.data import open_data
    >>> d = open_data("synthetic:1000", seed=0)
    >>> d.x_train.shape, d.x_test.shape
    ((800, 1, 28, 28), (200, 1, 28, 28))
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memfit import readers

__all__ = ["Data", "check_spec", "open_data"]

SPECS = "digits, synthetic[:N], mnist:FOLDER, cifar10:FOLDER or FILE.npz"


@dataclass
class Data:
    """Train and test arrays of one source; images (N, C, H, W), labels int64 (N,)."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(initial=0), self.y_test.max(initial=0))) + 1


def split(x: np.ndarray, y: np.ndarray, test_fraction: float = 0.2, seed: int = 0):
    """A seeded random split into (x_train, y_train, x_test, y_test)."""
    if len(x) != len(y):
        raise ValueError(f"expected as many labels as images; found {len(x)} images and {len(y)} labels")
    if len(x) < 2:
        raise ValueError(f"expected at least 2 samples to split into train and test; found {len(x)}")
    order = np.random.default_rng(seed).permutation(len(x))
    k = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:k], order[k:]
    return x[train], y[train], x[test], y[test]


def _images(x: np.ndarray, where: str) -> np.ndarray:
    """(N, H, W) -> (N, 1, H, W); (N, H, W, C) with C in 1/3/4 -> (N, C, H, W)."""
    x = np.asarray(x)
    if x.ndim == 2:                                     # (N, features): a flat vector per sample
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if x.ndim == 4:
        return x
    raise ValueError(f"{where}: expected images (N, H, W), (N, C, H, W) or (N, H, W, C); found shape {x.shape}")


def _npz(path: str, seed: int):
    arrays = readers.load_array(path)
    if not isinstance(arrays, dict):
        raise ValueError(f"{path}: a .npy file holds images only; save images and labels together with "
                         "np.savez(path, x=images, y=labels) (or x_train, y_train, x_test, y_test)")
    keys = set(arrays)
    if {"x_train", "y_train", "x_test", "y_test"} <= keys:
        parts = arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]
    elif {"x", "y"} <= keys:
        parts = split(arrays["x"], arrays["y"], seed=seed)
    else:
        raise ValueError(f"{path}: expected arrays named x, y (or x_train, y_train, x_test, y_test); found "
                         f"{', '.join(sorted(keys)) or 'none'}; save with np.savez(path, x=images, y=labels)")
    return parts


def check_spec(spec: str) -> str:
    """Check `spec` without reading data: its form, and that the file or folder it names exists.

    Returns the spec with `~` expanded in its path. Raises ValueError naming the accepted forms; the
    command line reports it as bad usage (exit 2), for a malformed spec and a missing path alike.

    Example:
        >>> check_spec("synthetic:500")
        'synthetic:500'
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"expected one of {SPECS}; found {spec!r}")
    kind, colon, arg = spec.partition(":")
    if spec == "digits":
        return spec
    if kind == "synthetic":
        if colon and not (arg.isdigit() and int(arg) >= 2):
            raise ValueError(f"expected synthetic:N with N a whole number of samples >= 2; found {spec!r}")
        return spec
    if kind in ("mnist", "cifar10"):
        what = "folder of the four IDX files" if kind == "mnist" else "folder or .tar.gz of the python pickles"
        if not arg:
            raise ValueError(f"expected {kind}:FOLDER with FOLDER the {what}; found {spec!r}")
        path = Path(arg).expanduser()
        if not path.exists():
            raise ValueError(f"{spec}: {str(path)!r} does not exist; expected {kind}:FOLDER with FOLDER the {what}")
        return f"{kind}:{path}"
    if spec.lower().endswith((".npz", ".npy")):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"{spec}: no such file; expected an .npz holding x, y (or x_train, y_train, x_test, "
                             "y_test)")
        return str(path)
    raise ValueError(f"unknown data {spec!r}; expected one of {SPECS}")


def open_data(spec: str = "digits", seed: int = 0) -> Data:
    """Open `spec` (see the module docstring) as train/test arrays; a clear ValueError otherwise."""
    name = spec
    spec = check_spec(spec)
    kind, _, arg = spec.partition(":")
    if spec == "digits":
        parts = split(*readers.digits(), seed=seed)
    elif kind == "synthetic":
        parts = split(*readers.synthetic(int(arg) if arg else 10_000, seed=seed), seed=seed)
    elif kind == "mnist":
        parts = readers.mnist(arg)
    elif kind == "cifar10":
        parts = readers.cifar10(arg)
    else:
        parts = _npz(spec, seed)
    xtr, ytr, xte, yte = parts
    return Data(name, _images(xtr, spec), np.asarray(ytr).astype(np.int64),
                _images(xte, spec), np.asarray(yte).astype(np.int64))

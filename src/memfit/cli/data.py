"""What `--data` means on the command line: a built-in set or the user's own files, as train/test arrays.

Specs:
    digits              scikit-learn's bundled 8x8 digits (the default; needs scikit-learn)
    synthetic[:N]       generated MNIST-shaped images (N samples, default 10,000)
    mnist:FOLDER        the four MNIST IDX files (gzip or not) in FOLDER
    cifar10:FOLDER      the CIFAR-10 python pickles (folder or .tar.gz)
    FILE.npz            arrays x_train, y_train, x_test, y_test (the test set is x_test, y_test), or x, y: the
                        whole of x, y is the test set unless a split is asked for (`test_fraction`); y may be
                        class ids (N,), dense labels (N, ...) or float targets
    FILE.npy            images only is not enough: give an .npz with targets

Example:
    >>> from memfit.cli.data import open_data
    >>> d = open_data("synthetic:1000", seed=0)
    >>> d.x_train.shape, d.x_test.shape, d.test_name
    ((800, 1, 28, 28), (200, 1, 28, 28), 'synthetic:1000: a seeded 20% test split (200 of 1000 samples)')
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
    """Train and test arrays of one source; images (N, C, H, W) (or features (N, D)); targets as the source
    holds them: integers as int64 (class ids (N,), dense labels (N, ...)), floats unchanged.

    `test_name` says which samples the test set is and how many; `own_train` is False when the source has no
    training samples apart from the test set (an .npz of x, y evaluated whole: x_train is x_test)."""
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    test_name: str = ""
    own_train: bool = True

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


def _npz(path: str, seed: int, test_fraction: float | None):
    """(x_train, y_train, x_test, y_test, test set's name, whether there are training samples of their own)."""
    arrays = readers.load_array(path)
    if not isinstance(arrays, dict):
        raise ValueError(f"{path}: a .npy file holds images only; save images and labels together with "
                         "np.savez(path, x=images, y=labels) (or x_train, y_train, x_test, y_test)")
    keys = set(arrays)
    if {"x_test", "y_test"} <= keys:
        xte, yte = arrays["x_test"], arrays["y_test"]
        own = {"x_train", "y_train"} <= keys
        xtr, ytr = (arrays["x_train"], arrays["y_train"]) if own else (xte, yte)
        return xtr, ytr, xte, yte, f"{path}: x_test, y_test ({len(xte)} samples)", own
    if {"x", "y"} <= keys:
        x, y = arrays["x"], arrays["y"]
        if test_fraction is None:
            return x, y, x, y, f"{path}: all {len(x)} samples of x, y", False
        xtr, ytr, xte, yte = split(x, y, test_fraction, seed=seed)
        return xtr, ytr, xte, yte, f"{path}: {_split_name(test_fraction, len(xte), len(x))} of x, y", True
    else:
        raise ValueError(f"{path}: expected arrays named x, y (or x_train, y_train, x_test, y_test); found "
                         f"{', '.join(sorted(keys)) or 'none'}; save with np.savez(path, x=images, y=labels)")


def _split_name(test_fraction: float, k: int, n: int) -> str:
    return f"a seeded {test_fraction:.0%} test split ({k} of {n} samples)"


def _targets(y: np.ndarray) -> np.ndarray:
    """Integer (and bool) targets as int64; float targets unchanged: never made class ids here."""
    y = np.asarray(y)
    return y.astype(np.int64) if y.dtype.kind in "iub" else y


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


def open_data(spec: str = "digits", seed: int = 0, test_fraction: float | None = None) -> Data:
    """Open `spec` (see the module docstring) as train/test arrays; a clear ValueError otherwise.

    `test_fraction`: an .npz of x, y only is split into a seeded random test set of this fraction (the
    rest trains); None evaluates all of it. Files with x_test, y_test and the built-in sets keep their own
    test set (digits and synthetic: a seeded 20% split)."""
    name = spec
    spec = check_spec(spec)
    if test_fraction is not None and not 0 < test_fraction < 1:
        raise ValueError(f"expected a test fraction between 0 and 1 (e.g. 0.2); found {test_fraction!r}")
    kind, _, arg = spec.partition(":")
    own = True
    if spec == "digits" or kind == "synthetic":
        x, y = readers.digits() if spec == "digits" else readers.synthetic(int(arg) if arg else 10_000, seed=seed)
        xtr, ytr, xte, yte = split(x, y, seed=seed)
        test_name = f"{name}: {_split_name(0.2, len(xte), len(x))}"
    elif kind in ("mnist", "cifar10"):
        xtr, ytr, xte, yte = readers.mnist(arg) if kind == "mnist" else readers.cifar10(arg)
        test_name = f"{name}: the test set ({len(xte)} samples)"
    else:
        xtr, ytr, xte, yte, test_name, own = _npz(spec, seed, test_fraction)
    if len(xte) != len(yte):
        raise ValueError(f"{name}: expected one target per test sample; found {len(xte)} samples and {len(yte)} "
                         "targets")
    xtr_img = _images(xtr, spec)
    xte_img = xtr_img if xte is xtr else _images(xte, spec)
    return Data(name, xtr_img, _targets(ytr), xte_img, _targets(yte), test_name, own)

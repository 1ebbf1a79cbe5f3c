"""Readers for the data users already have: IDX (MNIST), CIFAR-10 pickles, .npy/.npz, digits, synthetic.

Nothing here downloads anything: every reader takes a path to files on disk (or, for `digits`,
data scikit-learn ships) and returns plain numpy arrays, images as uint8 `(N, C, H, W)` and labels
as int64 `(N,)`, ready for `torch.from_numpy`. Each public function's docstring has an example.
A file is never trusted for its sizes: what a header or a pickle claims is checked against the bytes
the file holds before memory is taken for it (`memfit.bounded`), and a MemoryError is raised again
with the file named.
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import pickle
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np

from memfit import bounded
from memfit.bounded import DEFLATE_MAX_RATIO
from memfit.budget import check_count

__all__ = ["cifar10", "digits", "load_array", "load_idx", "mnist", "synthetic", "write_idx"]

# IDX type code -> big-endian dtype on disk (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_IDX_CODES = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}
_IDX_KNOWN = ", ".join(f"0x{c:02X} {dt.name}" for c, dt in _IDX_DTYPES.items())
_GZIP_MAGIC = b"\x1f\x8b"

_MNIST_FILES = {  # role -> stem, with the dotted variant some mirrors use
    "train images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}

_CIFAR_DIR, _CIFAR_TAR = "cifar-10-batches-py", "cifar-10-python.tar.gz"
_CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)

_ARRAY_SUFFIXES = (".npy", ".npz")
_CHUNK = 4096  # synthetic samples per chunk: float32 temporaries stay ~13 MB for MNIST shapes
_NOISE_LEVELS = 256  # uniform noise +-127.5; a power of two keeps integers() on its fast masked path


# ----------------------------------------------------------------------------------------- IDX
def load_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (MNIST, Fashion-MNIST, ...), plain or gzip-compressed.

    Gzip is detected from the file's magic bytes, so a misnamed file still reads. Every IDX type
    (uint8, int8, int16, int32, float32, float64) and rank is supported; the big-endian data on
    disk comes back as a native-endian, writable array.

    Args:
        path: the IDX file, e.g. ``train-images-idx3-ubyte`` or ``train-images-idx3-ubyte.gz``.

    Returns:
        An array with the shape and dtype the header declares.

    Raises:
        ValueError: bad magic number, unknown type code, or a size that does not match the header.

    Example:
        >>> import tempfile, numpy as np
        >>> path = write_idx(tempfile.mkdtemp() + "/labels-idx1-ubyte", np.array([3, 1, 4], np.uint8))
        >>> load_idx(path)
        array([3, 1, 4], dtype=uint8)
    """
    path = Path(path)
    with open(path, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        gz = raw.read(2) == _GZIP_MAGIC             # by content, not suffix: misnamed files still read
        raw.seek(0)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") if gz else contextlib.nullcontext(raw) as f:
                return _read_idx(f, path, size, gz)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise ValueError(f"{path}: expected a readable gzip stream, found a damaged one ({e}); "
                             f"download the file again") from e


def _read_idx(f: IO[bytes], path: Path, size: int, gz: bool) -> np.ndarray:
    """The IDX array in `f` (the file, or its gzip stream), read no further than its header promises
    plus one byte: a 1 MB gzip file that inflates to 1 GiB is refused after ~8 KB, not inflated."""
    head = f.read(4)
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        magic = f"0x{head.hex().upper()}" if head else "an empty file"
        raise ValueError(f"{path}: expected an IDX magic number 0x0000TTRR (two zero bytes, a type code, "
                         f"the rank), found {magic}; is this an IDX file (MNIST *-ubyte)?")
    code, rank = head[2], head[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: expected an IDX type code among {_IDX_KNOWN}, found 0x{code:02X}")
    header = 4 + 4 * rank
    dims = f.read(4 * rank)
    if len(dims) < 4 * rank:
        raise ValueError(f"{path}: expected a {header}-byte header for rank {rank}, found {4 + len(dims)} bytes; "
                         f"the file is truncated, download it again")
    shape = tuple(int(d) for d in np.frombuffer(dims, ">u4"))
    dtype = _IDX_DTYPES[code]
    need = math.prod(shape) * dtype.itemsize
    what = f"{need} bytes of {dtype.name} data for shape {shape}"
    if not gz and size - header != need:          # a plain file's data size is known before reading it
        fix = "the file is truncated, download it again" if size - header < need else "trailing bytes after the data"
        raise ValueError(f"{path}: expected {what}, found {size - header}; {fix}")
    if gz and need > DEFLATE_MAX_RATIO * size:
        raise bounded.refuse(str(path), f"{what} in its header",
                             f"at most {DEFLATE_MAX_RATIO * size} bytes from a {size}-byte gzip file "
                             f"(deflate expands at most {DEFLATE_MAX_RATIO}:1)")
    try:
        out = np.empty(shape, dtype)               # big-endian, as on disk; swapped in place below
    except MemoryError as e:
        raise bounded.out_of_memory(str(path), what, e) from e
    found = bounded.read_into(f, out)
    if found < need:
        raise ValueError(f"{path}: expected {what}, found {found}; the file is truncated, download it again")
    if f.read(1):                                  # one byte past the promise: not inflated any further
        raise ValueError(f"{path}: expected {what}, found more: the data goes on past the shape its header "
                         f"declares; trailing bytes after the data (the file is damaged or not an IDX file)")
    return out.byteswap(inplace=True).view(dtype.newbyteorder("=")) if not dtype.isnative else out


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write `array` as an IDX file, gzip-compressed when `path` ends in ``.gz``; inverse of `load_idx`.

    Args:
        path: where to write; parent folders must exist.
        array: uint8, int8, int16, int32, float32 or float64 data of any rank up to 255.

    Returns:
        The path written.

    Raises:
        TypeError: the dtype has no IDX type code.
        ValueError: a dimension too large for the IDX header (>= 2**32) or rank above 255.

    Example:
        >>> import tempfile, numpy as np
        >>> path = write_idx(tempfile.mkdtemp() + "/w.idx.gz", np.eye(2, dtype=np.float32))
        >>> load_idx(path).tolist()
        [[1.0, 0.0], [0.0, 1.0]]
    """
    path, array = Path(path), np.asarray(array)
    code = _IDX_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise TypeError(f"expected an array with an IDX dtype ({_IDX_KNOWN}), found {array.dtype}; "
                        f"cast it first, e.g. array.astype(np.int32)")
    if array.ndim > 255 or any(d >= 2**32 for d in array.shape):
        raise ValueError(f"expected rank <= 255 and dimensions < 2**32 for IDX, found shape {array.shape}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    # Big-endian, C-ordered copy viewed as bytes: written as one buffer without a second .tobytes() copy.
    body = np.ascontiguousarray(array, _IDX_DTYPES[code]).reshape(-1).view(np.uint8)
    with open(path, "wb") as raw:  # mtime=0: the same array always gives the same .gz bytes
        gz = path.name.endswith(".gz")
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if gz else contextlib.nullcontext(raw) as f:
            f.write(header)
            f.write(body.data)
    return path


def mnist(folder: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read MNIST (or Fashion-MNIST, or any dataset in its four-file IDX layout) from `folder`.

    Each file may be plain or ``.gz``, and named ``train-images-idx3-ubyte`` or the dotted
    ``train-images.idx3-ubyte`` variant (likewise for the other three).

    Args:
        folder: the folder holding the four files.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images uint8 ``(N, 1, H, W)``, labels int64 ``(N,)``.

    Raises:
        FileNotFoundError: a file is missing; the message lists every name looked for.
        ValueError: a file is not IDX, has the wrong rank or dtype, or images and labels disagree in count.

    Example:
        >>> import tempfile, numpy as np
        >>> d = tempfile.mkdtemp()
        >>> for split, n in (("train", 3), ("t10k", 2)):
        ...     _ = write_idx(f"{d}/{split}-images-idx3-ubyte.gz", np.zeros((n, 28, 28), np.uint8))
        ...     _ = write_idx(f"{d}/{split}-labels-idx1-ubyte.gz", np.arange(n, dtype=np.uint8))
        >>> [a.shape for a in mnist(d)]
        [(3, 1, 28, 28), (3,), (2, 1, 28, 28), (2,)]
    """
    folder = Path(folder)
    found, missing = {}, []
    for role, stems in _MNIST_FILES.items():
        names = [stem + gz for stem in stems for gz in ("", ".gz")]
        hit = next((folder / n for n in names if (folder / n).is_file()), None)
        if hit is None:
            missing.append(f"{role} ({' / '.join(names)})")
        found[role] = hit
    if missing:
        raise FileNotFoundError(f"{folder}: expected the four MNIST IDX files, missing "
                                f"{'; '.join(missing)}; put the files there (plain or .gz)")
    out = []
    for split in ("train", "test"):
        images, labels = load_idx(found[f"{split} images"]), load_idx(found[f"{split} labels"])
        if images.ndim != 3 or images.dtype != np.uint8:
            raise ValueError(f"{found[f'{split} images']}: expected uint8 images of rank 3 (N, H, W), found "
                             f"{images.dtype} of shape {images.shape}; use load_idx for other layouts")
        if labels.ndim != 1:
            raise ValueError(f"{found[f'{split} labels']}: expected labels of rank 1 (N,), "
                             f"found shape {labels.shape}")
        if len(images) != len(labels):
            raise ValueError(f"{split} split of {folder}: expected as many labels as images, found "
                             f"{len(images)} images and {len(labels)} labels; these files are not one set")
        out += [images[:, None], labels.astype(np.int64)]  # (N, H, W) -> (N, 1, H, W)
    return tuple(out)


# ------------------------------------------------------------------------------------- CIFAR-10
def _read_batch(f: IO[bytes], size: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch pickle of `size` bytes -> images uint8 (N, 3, 32, 32), labels int64 (N,).

    No value the pickle claims is allocated beyond the `size` bytes the batch holds (`bounded`); a
    MemoryError all the same is raised again with the batch named."""
    try:   # Python 2 pickles: str -> bytes
        batch = bounded.BatchUnpickler(f, size, where, encoding="bytes").load()
    except MemoryError as e:
        raise bounded.out_of_memory(where, f"a CIFAR-10 batch of {size} bytes", e) from e
    except (EOFError, zlib.error, gzip.BadGzipFile, tarfile.ReadError) as e:   # the bytes stop early
        raise ValueError(f"{where}: the file is truncated or corrupt (it ends before this batch does: {e}); "
                         "download it again (a complete cifar-10-python.tar.gz is 170,498,071 bytes)") from e
    except (pickle.UnpicklingError, TypeError, AttributeError, KeyError, IndexError, struct.error) as e:
        raise ValueError(f"{where}: expected a CIFAR-10 batch pickle (a dict of numpy data and "
                         f"labels), found one that does not load: {e}") from e
    except bounded.Refused:                        # names the batch already
        raise
    except ValueError as e:
        raise ValueError(f"{where}: expected a CIFAR-10 batch pickle (a dict of numpy data and "
                         f"labels), found one that does not load: {e}") from e
    if not isinstance(batch, dict):
        raise ValueError(f"{where}: expected a dict with data and labels, found {type(batch).__name__}")
    get = lambda key: batch.get(key.encode(), batch.get(key))  # bytes keys (py2), str keys (py3)
    data, labels = get("data"), get("labels")
    if data is None or labels is None:
        raise ValueError(f"{where}: expected keys b'data' and b'labels', found {sorted(batch)}")
    data, labels = np.asarray(data), np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{where}: expected data uint8 of shape (N, 3072), found {data.dtype} {data.shape}")
    if labels.shape != (len(data),):
        raise ValueError(f"{where}: expected {len(data)} labels, one per image, found shape {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels  # rows are 1024 R, 1024 G, 1024 B, each row-major


def _check_batches(path: Path, present, where: str) -> None:
    missing = [b for b in _CIFAR_BATCHES if b not in present]
    if missing:
        raise FileNotFoundError(f"{path}: expected the CIFAR-10 batches {', '.join(_CIFAR_BATCHES)} {where}, "
                                f"missing {', '.join(missing)}")


def cifar10(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read CIFAR-10 from its python pickle batches, without extracting anything to disk.

    Args:
        path: the ``cifar-10-batches-py`` folder, a folder containing it (or containing
            ``cifar-10-python.tar.gz``), or the path of the official ``cifar-10-python.tar.gz``.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images uint8 ``(N, 3, 32, 32)``, labels int64 ``(N,)``.

    Raises:
        FileNotFoundError: `path` does not exist or batches are missing; the message names them.
        ValueError: a batch is not a CIFAR-10 pickle, or `path` is a file that is not a tar archive.

    Example:
        >>> x_train, y_train, x_test, y_test = cifar10("data/cifar-10-python.tar.gz")  # doctest: +SKIP
        >>> x_train.shape, x_test.shape  # doctest: +SKIP
        ((50000, 3, 32, 32), (10000, 3, 32, 32))
    """
    path = Path(path)
    if path.is_dir() and not any((path / b).is_file() for b in _CIFAR_BATCHES):
        path = next((p for p in (path / _CIFAR_DIR, path / _CIFAR_TAR) if p.exists()), path)
    batches: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if path.is_dir():
        _check_batches(path, [b for b in _CIFAR_BATCHES if (path / b).is_file()],
                       f"(here, in {_CIFAR_DIR}/, or as {_CIFAR_TAR})")  # before reading ~180 MB
        for b in _CIFAR_BATCHES:
            with open(path / b, "rb") as f:
                batches[b] = _read_batch(f, os.fstat(f.fileno()).st_size, str(path / b))
    elif path.is_file():
        if not tarfile.is_tarfile(path):
            raise ValueError(f"{path}: expected a folder of CIFAR-10 batches or {_CIFAR_TAR}, "
                             f"found a file that is not a tar archive")
        # Members are read as the stream reaches them: no backward seeks through the gzip stream.
        try:
            with tarfile.open(path, "r:*") as tar:
                for member in tar:
                    name = member.name.rsplit("/", 1)[-1]
                    if member.isfile() and name in _CIFAR_BATCHES and name not in batches:
                        batches[name] = _read_batch(tar.extractfile(member), member.size, f"{path}:{member.name}")
        except bounded.FileMemoryError:
            raise
        except MemoryError as e:                 # tarfile's own reads (a long-name member is read whole)
            raise bounded.out_of_memory(str(path), "the archive's tar headers", e) from e
        except (EOFError, zlib.error, gzip.BadGzipFile, tarfile.ReadError) as e:
            raise ValueError(f"{path}: the archive is truncated or corrupt ({e}); download it again "
                             "(a complete cifar-10-python.tar.gz is 170,498,071 bytes)") from e
        _check_batches(path, batches, "in the archive")
    else:
        raise FileNotFoundError(f"expected a CIFAR-10 folder or {_CIFAR_TAR}, found nothing at {path}")
    x_train = np.concatenate([batches[b][0] for b in _CIFAR_BATCHES[:5]])
    y_train = np.concatenate([batches[b][1] for b in _CIFAR_BATCHES[:5]])
    return x_train, y_train, *batches["test_batch"]


# --------------------------------------------------------------------------------- numpy files
def load_array(path: str | os.PathLike) -> np.ndarray | dict[str, np.ndarray]:
    """Open a ``.npy`` file memory-mapped (read-only), or read a ``.npz`` archive into a dict.

    A ``.npy`` file is never read whole: pages load as they are touched, so files larger than RAM
    work. ``.npz`` members cannot be memory-mapped and are read into memory. Pickled (object)
    arrays are refused in both.

    Args:
        path: a ``.npy`` or ``.npz`` file.

    Returns:
        A read-only ``np.memmap`` for ``.npy``; a dict ``name -> array`` for ``.npz``.

    Raises:
        ValueError: another suffix, or a file that is not a valid, pickle-free numpy file.

    Example:
        >>> import tempfile, numpy as np
        >>> path = tempfile.mkdtemp() + "/a.npy"
        >>> np.save(path, np.arange(3))
        >>> load_array(path).tolist()
        [0, 1, 2]
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _ARRAY_SUFFIXES:
        raise ValueError(f"{path}: expected one of the suffixes {', '.join(_ARRAY_SUFFIXES)}, found "
                         f"{suffix or 'none'}; save arrays with np.save / np.savez")
    if not path.is_file():
        raise FileNotFoundError(f"expected a {suffix} file, found nothing at {path}")
    if suffix == ".npz":
        _check_zip(path)
    try:
        if suffix == ".npy":
            with open(path, "rb") as f:
                bounded.check_npy(f, os.fstat(f.fileno()).st_size, str(path))
            return np.lib.format.open_memmap(path, mode="r")
        with zipfile.ZipFile(path) as archive:      # every member's header against its size, before any is read
            for info in archive.infolist():
                with archive.open(info) as f:
                    bounded.check_npy(f, info.file_size, f"{path}: member {info.filename}")
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except bounded.Refused:
        raise
    except MemoryError as e:                    # a member whose header's size is real but does not fit
        raise bounded.out_of_memory(str(path), "its arrays (a .npz is read whole; a .npy is memory-mapped)", e) from e
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:  # bad magic, object dtype, broken zip
        text = str(e)
        if "pickle" in text or "object" in text.lower():      # numpy's advice (allow_pickle) would be unsafe
            raise ValueError(f"{path}: holds pickled Python objects (an object array), which memfit does not "
                             "load: unpickling can run code. Save plain numeric arrays: np.savez(path, x=images, "
                             "y=labels) with numeric dtypes") from None
        raise ValueError(f"{path}: expected a valid {suffix} file, found one that does not load "
                         f"({type(e).__name__}: {text}); it may be truncated: write it again") from None


def _check_zip(path: Path) -> None:
    """A .npz is a zip archive (np.savez writes one): say what the file is when it is not."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return
    found = ("a .npy file (save it as .npy, or write an archive with np.savez)" if head.startswith(b"\x93NUMPY")
             else "an empty file" if not head else f"a file starting with {head[:4]!r}")
    raise ValueError(f"{path}: expected a .npz file (a zip archive, as np.savez writes), found {found}; "
                     "the file is not a numpy archive or is damaged")


# -------------------------------------------------------------------------------------- digits
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
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise ImportError("digits() needs scikit-learn, which is not installed; "
                          "pip install 'memfit[demo]' (or pip install scikit-learn)") from e
    d = load_digits()
    x = np.rint(d.images * (255 / 16)).astype(np.uint8)[:, None]  # (1797, 8, 8) -> (1797, 1, 8, 8)
    return x, d.target.astype(np.int64)


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

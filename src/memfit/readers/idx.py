"""MNIST's IDX files: `load_idx` and `write_idx` for one file (plain or gzipped, every IDX type and rank),
`mnist` for the four-file layout of MNIST and Fashion-MNIST. A header's sizes are checked against the bytes the
file holds before memory is taken for them (`memfit.bounded`).
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
import zlib
from pathlib import Path
from typing import IO

import numpy as np

from memfit import bounded
from memfit.bounded import DEFLATE_MAX_RATIO

__all__ = ["load_idx", "mnist", "write_idx"]

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

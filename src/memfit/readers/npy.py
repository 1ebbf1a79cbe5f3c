"""numpy's own files: `load_array` opens a .npy memory-mapped (never read whole) or reads a .npz archive;
pickled (object) arrays are refused in both.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from memfit import bounded

__all__ = ["load_array"]

_ARRAY_SUFFIXES = (".npy", ".npz")


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

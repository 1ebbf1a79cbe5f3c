"""CIFAR-10 from its python pickle batches (a folder, or the official .tar.gz read as a stream without
extracting): `cifar10`. A pickle's claimed sizes are checked against the bytes it holds (`memfit.bounded`).
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import tarfile
import zlib
from pathlib import Path
from typing import IO

import numpy as np

from memfit import bounded

__all__ = ["cifar10"]

_CIFAR_DIR, _CIFAR_TAR = "cifar-10-batches-py", "cifar-10-python.tar.gz"
_CIFAR_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


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

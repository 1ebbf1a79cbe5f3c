"""Reading files that may lie about their sizes: nothing is allocated for more than the file can hold.

A header or a pickle says how many bytes come next (an IDX shape, a `.npy` shape, a pickle's
BINBYTES8 length, an array shape handed to numpy); a damaged or hostile file says more than it has.
Trusted, such a claim allocates first and reads after: a 528-byte archive asked for 1 TiB and a
1 MB gzip inflated to 1 GiB. Here every claim is checked against the bytes the file holds before
any buffer is made, reads are cut into chunks (memory follows the bytes that arrive, never the claim),
and a compressed stream is read no further than its header promises (plus one byte, to see that
nothing follows). `memfit.readers` uses these for every format it reads.

Known limitations: `tarfile` reads a GNU long-name or pax header member whole, as large as its tar
header says (bounded by the bytes really in the archive, not by anything memfit checks first).

Example:
    >>> import io
    >>> r = Within(io.BytesIO(b"abc"), 3, "x.bin")
    >>> r.read(2), r.left
    (b'ab', 1)
    >>> try:
    ...     r.read(5)
    ... except Refused as e:
    ...     print(str(e).split(";")[0])
    x.bin: expected at most the 1 bytes left of its 3, found a claim of 5 bytes
"""

from __future__ import annotations

import math
import pickle
from typing import IO

import numpy as np

# zlib's limit: deflate never expands more than 1032:1 (https://zlib.net/zlib_tech.html, "Maximum
# Compression Factor"); a gzip file of S bytes cannot hold more than 1032 * S bytes of data.
DEFLATE_MAX_RATIO = 1032
CHUNK = 16 * 2**20      # bytes per read: a claim beyond the data fails at the end of the data, not at malloc
LINE_LIMIT = 2**16      # a pickle's text lines (GLOBAL module/name, protocol-0 numbers) are short


class Refused(ValueError):
    """A size a file claims and cannot hold, refused before anything was allocated for it."""


class FileMemoryError(MemoryError):
    """A MemoryError while reading a file, raised again with the file and what it needed named."""


def refuse(where: str, claim: str, holds: str) -> Refused:
    """The error for a size a file claims and cannot hold."""
    return Refused(f"{where}: expected {holds}, found a claim of {claim}; the file is damaged or not what it "
                      "is named: download it again")


def out_of_memory(where: str, need: str, e: MemoryError) -> FileMemoryError:
    """A MemoryError while reading a file, with the file and what it needed named (never a bare one)."""
    why = f" ({e})" if str(e) else ""
    return FileMemoryError(f"{where}: expected to find memory for {need}, found none left in this process "
                       f"(MemoryError{why}); free memory (or raise the limit) and try again, or check the file")


def read_into(f: IO[bytes], out: np.ndarray) -> int:
    """Fill `out`'s bytes from `f` in chunks; returns the bytes read (fewer at the end of the stream)."""
    view = memoryview(out.reshape(-1).view(np.uint8))     # (nbytes,) over out's own memory: no copy
    got = 0
    while got < len(view):
        n = f.readinto(view[got:got + CHUNK])
        if not n:
            break
        got += n
    return got


class Within:
    """`f`'s read and readline, refusing any read past the `size` bytes the file holds.

    Large reads are made in chunks of `CHUNK`: even a claim within `size` (a tar header can say
    anything) takes memory only as the bytes arrive. A read that the file ends in raises EOFError.
    """

    def __init__(self, f: IO[bytes], size: int, where: str):
        self._f, self.size, self.left, self.where = f, size, size, where

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else n
        if n > self.left:
            raise refuse(self.where, f"{n} bytes", f"at most the {self.left} bytes left of its {self.size}")
        if n <= CHUNK:
            data = self._f.read(n)
        else:
            parts = []
            todo = n
            while todo > 0 and (part := self._f.read(min(todo, CHUNK))):
                parts.append(part)
                todo -= len(part)
            data = b"".join(parts)
        self.left -= len(data)
        if data and len(data) < n:      # b'' is the end of the pickle (the unpickler's own EOFError)
            raise EOFError(f"the file ends {len(data)} bytes into a value of {n} bytes")
        return data

    def readline(self, limit: int = -1) -> bytes:
        line = self._f.readline(min(self.left, LINE_LIMIT))
        self.left -= len(line)
        if len(line) == LINE_LIMIT and not line.endswith(b"\n"):
            raise refuse(self.where, f"a text line longer than {LINE_LIMIT} bytes", "a pickle's short text lines")
        return line


# ------------------------------------------------------------------------------------- pickles
# The only globals a CIFAR batch pickle needs (numpy array + dtype reconstruction); anything else,
# e.g. os.system in a tampered file, is refused instead of executed.
_SAFE_GLOBALS = {(f"numpy.{core}.{mod}", name) for core in ("core", "_core")
                 for mod, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"),
                                   ("numeric", "_frombuffer"))}
_SAFE_GLOBALS |= {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class _NdarrayName:
    """Stands for numpy.ndarray in a pickle: numpy's own pickles name it only as `_reconstruct`'s first
    argument; calling it (REDUCE, NEWOBJ) would allocate whatever shape the file claims, so it is refused."""

    def __new__(cls, *args, **kwargs):
        raise pickle.UnpicklingError("refusing to call numpy.ndarray (numpy's pickles name it only for _reconstruct)")


class BatchUnpickler(pickle._Unpickler):
    """Unpickler for numpy data pickles (CIFAR batches) from a file of `size` bytes.

    Only numpy's array and dtype globals resolve. The pure-Python unpickler is used (as fast here: a
    batch is a few large strings): it reads a length-prefixed value before it allocates it, so with a
    `Within` file a claim beyond the file is refused, where the C unpickler allocates the claim first.
    The two places that allocate from a claim before reading are checked against `size` too: BYTEARRAY8
    and numpy's `_reconstruct` shape.
    """

    dispatch = pickle._Unpickler.dispatch.copy()

    def __init__(self, f: Within, **kwargs):
        super().__init__(f, **kwargs)
        self.size, self.where = f.size, f.where

    def find_class(self, module: str, name: str):
        if (module, name) not in _SAFE_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        if name == "ndarray":
            return _NdarrayName
        found = super().find_class(module, name)
        if name != "_reconstruct":
            return found

        def reconstruct(subtype, shape, dtype):      # numpy writes (ndarray, (0,), b'b'); setstate fills it
            nbytes = math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
            if nbytes > self.size:
                raise refuse(self.where, f"an array of shape {tuple(shape)} ({nbytes} bytes)",
                             f"arrays within the file's {self.size} bytes")
            return found(np.ndarray if subtype is _NdarrayName else subtype, shape, dtype)
        return reconstruct

    def _load_bytearray8(self):
        n = int.from_bytes(self.read(8), "little")
        if n > self.size:
            raise refuse(self.where, f"a bytearray of {n} bytes", f"values within the file's {self.size} bytes")
        b = bytearray(n)
        self.readinto(b)
        self.append(b)

    dispatch[pickle.BYTEARRAY8[0]] = _load_bytearray8


# --------------------------------------------------------------------------------- numpy files
def npy_claim(f: IO[bytes]) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, data bytes) a `.npy` header declares, read from `f` (at the file's start) without the data."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _, dtype = np.lib.format.read_array_header_1_0(f)
    else:                                      # 2.0 and 3.0 share the layout (3.0: utf-8 field names)
        shape, _, dtype = np.lib.format.read_array_header_2_0(f)
    return shape, dtype, math.prod(shape) * dtype.itemsize


def check_npy(f: IO[bytes], size: int, where: str) -> None:
    """Refuse a .npy (or .npz member) whose header declares other than the `size` bytes it holds."""
    try:
        shape, dtype, need = npy_claim(f)
    except ValueError as e:
        raise Refused(f"{where}: expected a valid .npy file (np.save writes one, np.savez one per member), "
                      f"found something else ({e}); the file is damaged or not a numpy file") from e
    if dtype.hasobject:                         # a pickle: refused by the reader with its own message
        return
    found = size - f.tell()
    if found != need:
        what = "the file is truncated, write it again" if found < need else "trailing bytes after the data"
        raise Refused(f"{where}: expected {need} bytes of {dtype} data for shape {shape} (its header), "
                      f"found {found}; {what}")

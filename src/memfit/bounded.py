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
    >>> raw = b"\\x80\\x04\\x8e" + (2**40).to_bytes(8, "little") + b"."   # BINBYTES8 of 1 TiB, 12 bytes
    >>> try:
    ...     BatchUnpickler(io.BytesIO(raw), len(raw), "x.pkl").load()
    ... except Refused as e:
    ...     print(str(e).split(";")[0])
    x.pkl: expected values within the file's 12 bytes, found a claim of 1099511627776 bytes
"""

from __future__ import annotations

import math
import pickle
import struct
from typing import IO

import numpy as np

__all__ = ["BatchUnpickler", "CHUNK", "DEFLATE_MAX_RATIO", "FileMemoryError", "LINE_LIMIT", "Refused", "check_npy",
           "npy_claim", "out_of_memory", "read_chunked", "read_into", "refuse"]

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


def read_chunked(f: IO[bytes], n: int) -> bytes:
    """`n` bytes of `f`, read `CHUNK` at a time: memory follows the bytes that arrive, never the claim `n`
    (one `f.read(n)` would allocate all of `n` first). Fewer at the end of the stream."""
    parts = []
    while n > 0 and (part := f.read(min(n, CHUNK))):
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


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


def _counted(fmt: str, make):
    """A loader for an opcode that gives a length (struct `fmt`) and then that many bytes."""
    width = struct.calcsize(fmt)

    def load(self: BatchUnpickler) -> None:
        (n,) = struct.unpack(fmt, self.read(width))
        self.append(make(self, self.claimed(n)))
    return load


def _utf8(self, b: bytes) -> str:
    return str(b, "utf-8", "surrogatepass")


class BatchUnpickler(pickle._Unpickler):
    """Unpickler for numpy data pickles (CIFAR batches) from `f`, a file of `size` bytes named `where`.

    Only numpy's array and dtype globals resolve. It is the pure-Python unpickler (as fast here: a
    batch is a few large strings) with every opcode that gives a length checked against `size` before
    anything is allocated, and read in chunks (the C unpickler allocates a BINBYTES8 claim first);
    numpy's `_reconstruct` shape is checked too, numpy.ndarray is never called, and text lines are
    cut at `LINE_LIMIT`. A value the file ends in raises EOFError.
    """

    dispatch = pickle._Unpickler.dispatch.copy()

    def __init__(self, f: IO[bytes], size: int, where: str, **kwargs):
        super().__init__(f, **kwargs)
        self._f, self.size, self.where = f, size, where
        self._file_readline = self._readline

    def claimed(self, n: int) -> bytes:
        """The next `n` bytes, a length the file gave: refused beyond the file's size, never allocated whole."""
        if not 0 <= n <= self.size:
            raise refuse(self.where, f"{n} bytes", f"values within the file's {self.size} bytes")
        in_frame = self._unframer.current_frame is not None       # a frame is in memory already
        data = self.read(n) if n <= CHUNK or in_frame else read_chunked(self._f, n)
        if len(data) != n:
            raise EOFError(f"the file ends {len(data)} bytes into a value of {n} bytes")
        return data

    def _readline(self) -> bytes:
        line = self._f.readline(LINE_LIMIT)
        if len(line) == LINE_LIMIT and not line.endswith(b"\n"):
            raise refuse(self.where, f"a text line longer than {LINE_LIMIT} bytes", "a pickle's short text lines")
        return line

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

    def _load_frame(self) -> None:
        (n,) = struct.unpack("<Q", self.read(8))
        if n > self.size:
            raise refuse(self.where, f"a frame of {n} bytes", f"frames within the file's {self.size} bytes")
        self._unframer.load_frame(n)

    dispatch[pickle.BINSTRING[0]] = _counted("<i", lambda self, b: self._decode_string(b))
    dispatch[pickle.BINBYTES[0]] = _counted("<I", lambda self, b: b)
    dispatch[pickle.BINBYTES8[0]] = _counted("<Q", lambda self, b: b)
    dispatch[pickle.BYTEARRAY8[0]] = _counted("<Q", lambda self, b: bytearray(b))
    dispatch[pickle.BINUNICODE[0]] = _counted("<I", _utf8)
    dispatch[pickle.BINUNICODE8[0]] = _counted("<Q", _utf8)
    dispatch[pickle.LONG4[0]] = _counted("<i", lambda self, b: pickle.decode_long(b))
    dispatch[pickle.FRAME[0]] = _load_frame


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

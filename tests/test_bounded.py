"""Memory bombs: files whose headers or pickles claim far more than they hold, read under a memory limit.

Each bomb is read in one child process whose address space is capped a few hundred MiB above what its
imports take (RLIMIT_AS), so a reader that trusts a claim fails there with a MemoryError instead of
eating the machine. Every case must end in an error that names the file, and the child's peak resident
memory must stay near its baseline. Run: python -m pytest -q tests/test_bounded.py
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

import memfit
from memfit import bounded
from memfit.readers import load_array, load_idx, write_idx

HEADROOM = 384 * 2**20       # address space the child may add to what its imports took
ZEROS = gzip.compress(bytes(16 * 2**20), 9)      # one 16 MiB gzip member of zeros, ~16 KB


def _idx_bomb(path: Path, inflated_mib: int, claim: tuple[int, ...] = (10, 28, 28)) -> Path:
    """A gzip IDX file whose header declares `claim` uint8 and whose stream inflates to `inflated_mib` more
    MiB of zeros (gzip members, as `cat a.gz b.gz` makes: one valid stream to gzip and to Python)."""
    header = bytes([0, 0, 0x08, len(claim)]) + struct.pack(f">{len(claim)}I", *claim)
    first = gzip.compress(header + bytes(min(int(np.prod(claim)), 2**20)))
    path.write_bytes(first + ZEROS * (inflated_mib // 16))
    return path


def _tar(path: Path, blob: bytes, name: str = "data_batch_1") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
        info.size = len(blob)
        tar.addfile(info, io.BytesIO(blob))
    return path


# BINBYTES8 claiming 2**40 bytes, then 10 bytes and STOP; numpy's _reconstruct asked for a (2**40,) array
CLAIM_BYTES = b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"x" * 10 + b"."
CLAIM_ARRAY = (b"\x80\x02cnumpy.core.multiarray\n_reconstruct\nq\x00cnumpy\nndarray\nq\x01"
               b"\x8a\x06" + (2**40).to_bytes(6, "little") + b"\x85C\x01b\x87R.")


def _npy_header(shape) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    return buf.getvalue()


CHILD = r"""
import contextlib, io, json, re, resource, sys
from memfit import readers
from memfit.cli import main

def kib(key):
    return int(re.search(key + r":\s+(\d+) kB", open("/proc/self/status").read()).group(1))

cases, out = json.loads(sys.argv[1]), {}
resource.setrlimit(resource.RLIMIT_AS, (kib("VmSize") * 1024 + int(sys.argv[2]), resource.RLIM_INFINITY))
rss0 = kib("VmRSS")
for name, (fn, arg) in cases.items():
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            result = main(arg) if fn == "cli" else getattr(readers, fn)(arg)
        out[name] = ["returned", f"{result} {err.getvalue()}"]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e)]
out["peak_growth_mib"] = (kib("VmHWM") - rss0) / 1024   # this process's peak (ru_maxrss may hold the parent's)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    """Every bomb read in one memory-capped child: {case: [exception type, message]}, and the paths."""
    d = tmp_path_factory.mktemp("bombs")
    paths = {
        # the file: a header of 7,840 bytes, 512 MiB more in the stream (~0.5 MB on disk)
        "idx_bomb": _idx_bomb(d / "bomb-idx3-ubyte.gz", 512),
        # a claim the stream really holds, larger than the cap: the memory is named, not a bare MemoryError
        "idx_real": _idx_bomb(d / "real-idx1-ubyte.gz", 640, claim=(640 * 2**20 - 2**20,)),
        "cifar_bytes": _tar(d / "bytes.tar.gz", CLAIM_BYTES),
        "cifar_array": _tar(d / "array.tar.gz", CLAIM_ARRAY),
        "npz_claim": d / "claim.npz",
    }
    (d / "folder" / "cifar-10-batches-py").mkdir(parents=True)
    for b in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (d / "folder" / "cifar-10-batches-py" / b).write_bytes(CLAIM_BYTES)
    paths["cifar_folder"] = d / "folder"
    with zipfile.ZipFile(paths["npz_claim"], "w") as z:
        z.writestr("x.npy", _npy_header((2**40,)) + bytes(16))
    mnist = d / "mnist"                    # the four files, the train images a bomb
    mnist.mkdir()
    _idx_bomb(mnist / "train-images-idx3-ubyte.gz", 512)
    write_idx(mnist / "train-labels-idx1-ubyte", np.zeros(10, np.uint8))
    write_idx(mnist / "t10k-images-idx3-ubyte", np.zeros((2, 28, 28), np.uint8))
    write_idx(mnist / "t10k-labels-idx1-ubyte", np.zeros(2, np.uint8))
    cases = {"idx_bomb": ["load_idx", str(paths["idx_bomb"])], "idx_real": ["load_idx", str(paths["idx_real"])],
             "cifar_bytes": ["cifar10", str(paths["cifar_bytes"])],
             "cifar_array": ["cifar10", str(paths["cifar_array"])],
             "cifar_folder": ["cifar10", str(paths["cifar_folder"])],
             "npz_claim": ["load_array", str(paths["npz_claim"])],
             "cli_cifar": ["cli", ["demo", "--data", f"cifar10:{paths['cifar_bytes']}", "--no-plot"]],
             "cli_mnist": ["cli", ["demo", "--data", f"mnist:{mnist}", "--no-plot"]]}
    paths["cli_cifar"], paths["cli_mnist"] = paths["cifar_bytes"], mnist / "train-images-idx3-ubyte.gz"
    src = str(Path(memfit.__file__).parents[1])
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases), str(HEADROOM)], capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": src, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1]), paths


@pytest.mark.parametrize("case, kind, match", [
    ("idx_bomb", "ValueError", r"expected 7840 bytes of uint8 data for shape \(10, 28, 28\), found more"),
    ("idx_real", "FileMemoryError", r"expected to find memory for 670040064 bytes of uint8 data .*found none left"),
    ("cifar_bytes", "Refused", r"data_batch_1: expected values within the file's 22 bytes, found a claim of "
                                r"1099511627776 bytes"),
    ("cifar_array", "Refused", r"data_batch_1: expected arrays within the file's \d+ bytes, .*shape "
                                  r"\(1099511627776,\)"),
    ("cifar_folder", "Refused", r"data_batch_1: expected values within .* a claim of 1099511627776 bytes"),
    ("npz_claim", "Refused", r"member x\.npy: expected 1099511627776 bytes .* found 16; the file is truncated"),
])
def test_a_bomb_is_refused_with_the_file_named(bombs, case, kind, match):
    out, paths = bombs
    found, message = out[case]
    assert found == kind, (found, message)          # Refused is a ValueError, FileMemoryError a MemoryError
    assert message.startswith(str(paths[case])), message          # the file, first
    assert __import__("re").search(match, message), message


@pytest.mark.parametrize("case", ["cli_cifar", "cli_mnist"])
def test_the_command_line_names_the_file_not_a_memory_error(bombs, case):
    out, paths = bombs
    found, stderr = out[case]
    assert found == "returned" and stderr.startswith("1 memfit: error: "), (found, stderr)
    assert str(paths[case]) in stderr and "MemoryError" not in stderr, stderr


def test_the_bombs_took_no_memory(bombs):
    assert bombs[0]["peak_growth_mib"] < 64, bombs[0]       # the IDX file peaked at 2.3 GB


# ------------------------------------------------------------------------- in-process, no bombs
def test_a_gzip_idx_header_beyond_deflate_s_ratio_is_refused_unread(tmp_path):
    path = _idx_bomb(tmp_path / "x.gz", 0, claim=(2**31,))       # 2 GiB claimed by a ~60-byte file
    with pytest.raises(bounded.Refused, match=r"x\.gz: expected at most \d+ bytes from a \d+-byte gzip file "
                                             r"\(deflate expands at most 1032:1\), found a claim of 2147483648"):
        load_idx(path)


def test_a_gzip_idx_with_trailing_data_names_it_and_the_plain_one_counts_it(tmp_path):
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    write_idx(tmp_path / "a.gz", a)
    raw = gzip.decompress((tmp_path / "a.gz").read_bytes())
    (tmp_path / "t.gz").write_bytes(gzip.compress(raw + b"\0"))
    with pytest.raises(ValueError, match=r"t\.gz: expected 48 bytes of int32 .* found more.*trailing bytes"):
        load_idx(tmp_path / "t.gz")
    np.testing.assert_array_equal(load_idx(tmp_path / "a.gz"), a)  # exactly the promise: read, CRC checked


def test_a_claim_within_the_file_is_read_in_chunks_and_one_the_file_ends_in_is_eof(monkeypatch):
    monkeypatch.setattr(bounded, "CHUNK", 4)
    calls = []

    class Spy(io.BytesIO):
        def read(self, n=-1):
            calls.append(n)
            return super().read(n)

    raw = b"\x80\x03B" + struct.pack("<I", 9) + b"012345678."        # BINBYTES of 9 bytes
    assert bounded.BatchUnpickler(Spy(raw), len(raw), "f").load() == b"012345678"
    assert calls == [1, 1, 1, 4, 4, 4, 1, 1]     # PROTO 3, B, its length, the 9 bytes as 4 + 4 + 1, STOP
    cut = raw[:10]                                                      # the file ends 3 bytes into the value
    with pytest.raises(EOFError, match=r"ends 3 bytes into a value of 9 bytes"):
        bounded.BatchUnpickler(io.BytesIO(cut), 100, "g").load()         # a size that says more than it has
    with pytest.raises(bounded.Refused, match=r"h: expected values within the file's 8 bytes, found a claim of 9"):
        bounded.BatchUnpickler(io.BytesIO(raw), 8, "h").load()


def test_a_long_text_line_is_refused(monkeypatch):
    monkeypatch.setattr(bounded, "LINE_LIMIT", 64)
    raw = b"c" + b"a" * 1000                               # GLOBAL with a module name that never ends
    with pytest.raises(bounded.Refused, match=r"l: expected a pickle's short text lines, found a claim of a text line"):
        bounded.BatchUnpickler(io.BytesIO(raw), len(raw), "l").load()


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_the_batch_unpickler_reads_numpy_s_pickles(protocol):
    batch = {b"data": np.arange(3072 * 2, dtype=np.uint8).reshape(2, 3072) % 251, b"labels": [3, 1]}
    raw = pickle.dumps(batch, protocol=protocol)        # 5: the array in-band as a BYTEARRAY8
    got = bounded.BatchUnpickler(io.BytesIO(raw), len(raw), "b", encoding="bytes").load()
    np.testing.assert_array_equal(got[b"data"], batch[b"data"])
    assert got[b"labels"] == [3, 1]


def test_the_batch_unpickler_never_calls_ndarray():
    # REDUCE numpy.ndarray((2**40,)): an allocation of the claim; numpy's own pickles never call it
    raw = b"\x80\x02cnumpy\nndarray\n\x8a\x06" + (2**40).to_bytes(6, "little") + b"\x85R."
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to call numpy\.ndarray"):
        bounded.BatchUnpickler(io.BytesIO(raw), len(raw), "b", encoding="bytes").load()


def test_npy_and_npz_headers_must_match_their_sizes(tmp_path):
    (tmp_path / "claim.npy").write_bytes(_npy_header((2**40,)) + bytes(16))
    with pytest.raises(bounded.Refused, match=r"claim\.npy: expected 1099511627776 bytes .* found 16"):
        load_array(tmp_path / "claim.npy")
    (tmp_path / "long.npy").write_bytes(_npy_header((4,)) + bytes(5))
    with pytest.raises(bounded.Refused, match=r"long\.npy: expected 4 bytes .* found 5; trailing bytes"):
        load_array(tmp_path / "long.npy")
    with zipfile.ZipFile(tmp_path / "blob.npz", "w", zipfile.ZIP_DEFLATED) as z:  # np.load would return it whole
        z.writestr("x.npy", _npy_header((4,)) + bytes(4))
        z.writestr("blob", bytes(2**20))
    with pytest.raises(bounded.Refused, match=r"blob\.npz: member blob: expected a valid \.npy file"):
        load_array(tmp_path / "blob.npz")

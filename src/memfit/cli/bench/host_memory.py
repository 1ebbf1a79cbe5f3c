"""Host memory over epochs: a memory-mapped `.npy` streamed through `loader(budget=...)` on the CPU.

The consumer keeps what an evaluation loop keeps (every batch's labels and a small model's outputs).
After each epoch the process's anonymous memory (RssAnon: the heap and anonymous maps; the file's
page cache is file-backed and not counted) is read. The promise checked: growth stops after the
first epoch (beyond what the consumer keeps), and what memfit holds beyond that stays within the budget.

`measure` runs in the calling process; `run_child` runs it in a fresh interpreter, so that nothing
allocated before (imports, the file's writing) hides or adds growth. `memfit bench loaders` prints the
verdict at full size (a 502 MB file, as in issue 26); `tests/test_loading.py` runs a smaller one.

Example:
    >>> r = {"strategy": "macro", "anon": [10 * 2**20, 11 * 2**20], "kept": [2**20, 2 * 2**20], "tensors": [2, 4],
    ...      "budget": 16 * 2**20}
    >>> verdict(r)[:2]                  # 1 MiB more after epoch 2, all of it kept: flat, 9 MiB <= 16 MiB
    (True, True)
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from memfit.budget import format_bytes

# What a kept tensor costs beyond its data (torch's TensorImpl and storage, the Python object, malloc's
# headers): ~450 bytes measured with torch 2.13 on x86-64 glibc; twice that is allowed.
TENSOR_OVERHEAD = 1024
FLAT = 2 * 2**20         # growth after the first epoch beyond what is kept: none, up to this much noise


def _anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))


def write_images(path: str | Path, n: int, seed: int = 0) -> Path:
    """A CIFAR-shaped uint8 `.npy` (n, 3, 32, 32) of random pixels, written in chunks through a memmap."""
    x = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint8, shape=(n, 3, 32, 32))
    rng = np.random.default_rng(seed)
    for a in range(0, n, 8192):
        x[a:a + 8192] = rng.integers(0, 256, x[a:a + 8192].shape, dtype=np.uint8)
    x.flush()
    return Path(path)


def measure(path: str, budget: str, epochs: int = 5, batch_size: int = 256) -> dict:
    """Stream the `.npy` at `path` for `epochs` epochs keeping labels and outputs; anonymous memory (bytes
    above the level before the loader was built) and the bytes kept, after each epoch."""
    from memfit import loader
    from memfit.readers import load_array
    x = load_array(path)
    torch.manual_seed(0)
    model = torch.nn.Linear(math.prod(x.shape[1:]), 10)
    y = np.arange(len(x)) % 10
    a0 = _anon()
    ld = loader((x, y), batch_size, budget=budget, device="cpu", seed=0)
    kept, anon, kept_bytes, tensors = [], [], [], []
    with torch.no_grad():
        for _ in range(epochs):
            for xb, yb in ld:
                kept.append((yb, model(xb.flatten(1))))          # (B,) int64, (B, 10) float32
            anon.append(_anon() - a0)
            kept_bytes.append(sum(a.nbytes + b.nbytes for a, b in kept))
            tensors.append(2 * len(kept))
    return {"strategy": ld.strategy, "macro": ld.macro_batch, "nbytes": ld.nbytes, "budget": ld.budget,
            "anon": anon, "kept": kept_bytes, "tensors": tensors}


def run_child(path: str, budget: str, epochs: int = 5, batch_size: int = 256, timeout: float = 600) -> dict:
    """`measure` in a fresh interpreter (this one's sys.path), its result."""
    code = ("import json, sys; from memfit.cli.bench.host_memory import measure; "
            "print(json.dumps(measure(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")
    out = subprocess.run([sys.executable, "-c", code, str(path), budget, str(epochs), str(batch_size)],
                         capture_output=True, text=True, timeout=timeout, env={"PYTHONPATH": ":".join(sys.path)})
    if out.returncode:
        raise RuntimeError(f"the host-memory run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def verdict(r: dict) -> tuple[bool, bool, str]:
    """(flat after the first epoch, within the budget, a PASS/MISS line) for a `measure` result."""
    beyond = [a - k - TENSOR_OVERHEAD * t for a, k, t in zip(r["anon"], r["kept"], r["tensors"], strict=True)]
    later = beyond[-1] - beyond[0]                   # growth after epoch 1, beyond what was kept
    flat, within = later <= FLAT, beyond[-1] <= r["budget"]
    per = ", ".join(f"+{(b - a) / 2**20:.1f}" for a, b in zip([0, *r["anon"]], r["anon"], strict=False))
    line = (f"{'PASS' if flat and within else 'MISS'}  host memory over {len(r['anon'])} epochs ({r['strategy']}, "
            f"budget {format_bytes(r['budget'])}): anonymous MiB per epoch {per}; kept {format_bytes(r['kept'][-1])}; "
            f"beyond it {format_bytes(beyond[-1])} (target <= budget), after epoch 1 {later / 2**20:+.1f} MiB "
            f"(target <= {FLAT / 2**20:.0f} MiB)")
    return flat, within, line

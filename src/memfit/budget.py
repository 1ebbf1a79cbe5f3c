"""Byte sizes and the budget every memfit component plans against.

memfit declares memory before it uses it: a component lists the buffers it will allocate
(`Ledger.add`), the ledger compares their sum with the budget, and `BudgetExceeded` names what
needed how much when it does not fit. Sizes are parsed and printed here too, and `largest_fitting`
finds the largest count whose predicted peak fits.

Example:
    >>> parse_bytes("1.5 GiB")
    1610612736
    >>> format_bytes(1610612736)
    '1.50 GiB'
"""

from __future__ import annotations

import functools
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from memfit.device.machine import device_memory

__all__ = ["BudgetExceeded", "Ledger", "OOM_MESSAGES", "SAFETY_FRACTION", "SAFETY_MIN", "check_count",
           "default_budget", "format_bytes", "halve_after_oom", "is_oom", "largest_fitting", "model_device",
           "parse_bytes", "release_cached", "resolve_budget"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
# '1G' means 10**9 to some tools and 2**30 to others: refused, with both spellings offered.
_AMBIGUOUS = {"k": ("KiB", "2**10", "KB", "10**3"), "m": ("MiB", "2**20", "MB", "10**6"),
              "g": ("GiB", "2**30", "GB", "10**9"), "t": ("TiB", "2**40", "TB", "10**12")}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_FORMS = ("a whole number of bytes, or a string such as '512', '64MB', '1.5 GiB' "
          "(units B, KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary, case insensitive)")

# Fraction of free device memory memfit leaves alone when no budget is given: the CUDA context,
# cuDNN workspaces and the user's own model need room too.
SAFETY_FRACTION = 0.10
SAFETY_MIN = 64 * 2**20


def parse_bytes(size: int | float | str) -> int:
    """Parse a byte count: an integral number passes through, a string may carry a unit.

    Rules (a budget must never be larger than the user wrote, nor silently smaller by much):
    - an int (numpy ints too) or an integral float (`1e9`) is that many bytes;
    - a fractional count of bytes (`1.5`, `"1.5"`, `"1.5 B"`) is refused: round it yourself;
    - a fraction of a larger unit is rounded down to whole bytes (`"1.3 KiB"` -> 1331);
    - `K`, `M`, `G`, `T` alone are refused as ambiguous (write `GiB` for 2**30 or `GB` for 10**9).

    Example:
        >>> parse_bytes("64MiB"), parse_bytes("2 kb"), parse_bytes(1000), parse_bytes(1e9)
        (67108864, 2000, 1000, 1000000000)
    """
    if isinstance(size, bool):
        raise TypeError(f"expected a size as {_FORMS}; found the bool {size!r}")
    if isinstance(size, float):
        if not math.isfinite(size) or size < 0:
            raise ValueError(f"expected a finite size >= 0 as {_FORMS}; found {size}")
        if not size.is_integer():
            raise ValueError(f"expected a whole number of bytes; found {size!r}: round it yourself "
                             f"(int({size!r}) = {int(size)}) or give a unit, e.g. '{size:g} KiB'")
        return int(size)
    if not isinstance(size, str):
        try:
            n = operator.index(size)                  # int, numpy integers, 0-d integer tensors
        except TypeError:
            raise TypeError(f"expected a size as {_FORMS}; found {type(size).__name__} {size!r}") from None
        if n < 0:
            raise ValueError(f"expected a size >= 0 as {_FORMS}; found {n}")
        return n
    return _parse_text(size)


@functools.lru_cache(maxsize=256)
def _parse_text(size: str) -> int:
    """parse_bytes for a string (cached: a budget string is parsed again at every training step)."""
    m = _SIZE_RE.match(size)
    if m is None:
        hint = " (sizes cannot be negative)" if size.strip().startswith("-") else ""
        raise ValueError(f"expected a size as {_FORMS}; found {size!r}{hint}")
    number, unit = m.groups()
    if unit.lower() in _AMBIGUOUS:
        binary, two, decimal, ten = _AMBIGUOUS[unit.lower()]
        raise ValueError(f"ambiguous unit {unit!r} in {size!r}: write '{number}{binary}' ({number} x {two} bytes) "
                         f"or '{number}{decimal}' ({number} x {ten}); expected a size as {_FORMS}")
    if unit.lower() not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} in {size!r}; expected a size as {_FORMS}")
    scale = _UNITS[unit.lower()]
    value = Fraction(number) * scale                  # exact: no float rounding of '1.1 TB'
    if scale == 1 and value.denominator != 1:
        raise ValueError(f"expected a whole number of bytes; found {size!r}: round it or give a larger unit "
                         f"such as '{number} KiB'")
    return math.floor(value)


def check_count(name: str, value: object, low: int = 1) -> int:
    """`value` as a Python int >= `low`: the one check for every count memfit takes (batch sizes,
    chunk sizes, seeds, epochs, ...). Any integral type passes (`operator.index`: numpy ints,
    0-d integer tensors); floats and bools do not, even when whole.

    Raises:
        TypeError: `value` is not an integral number.
        ValueError: `value` is below `low`.

    Example:
        >>> import numpy as np
        >>> check_count("batch_size", np.int64(32))
        32
    """
    if isinstance(value, bool):                       # True is an int to Python, never a count to a user
        raise TypeError(f"expected {name} to be an int >= {low}; found the bool {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"expected {name} to be an int >= {low}; found {type(value).__name__} {value!r}") from None
    if n < low:
        raise ValueError(f"expected {name} to be an int >= {low}; found {n}")
    return n


def format_bytes(n: int | float) -> str:
    """Human-readable binary size: '512 B', '1.50 KiB', '3.00 GiB'.

    Example:
        >>> format_bytes(512), format_bytes(1536), format_bytes(-2048)
        ('512 B', '1.50 KiB', '-2.00 KiB')
    """
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")


class BudgetExceeded(MemoryError):
    """A plan needs more memory than its budget. `.items` lists (name, bytes) of what it needed."""

    def __init__(self, message: str, needed: int = 0, budget: int = 0, items=()):
        super().__init__(message)
        self.needed, self.budget, self.items = needed, budget, list(items)


_CPU = torch.device("cpu")


def model_device(model: torch.nn.Module, default: torch.device | None = _CPU) -> torch.device | None:
    """The device of the model's first parameter, else of its first buffer; `default` for a model with neither."""
    t = next(iter(model.parameters()), None)
    if t is None:
        t = next(iter(model.buffers()), None)
    return t.device if t is not None else default


def largest_fitting(peak: Callable[[int], int], budget: int, upper: int, *,
                    below: Callable[[int], int] | None = None) -> int:
    """Largest n in [1, upper] with peak(n) <= budget (peak non-decreasing), 0 when none fits.

    Doubling from 1, then bisection: O(log n) calls of peak. The one search behind every "what fits"
    (a chunk, a micro-batch, a batch size).

    `below`, where given, is a cheaper function never above `peak` (a memory model without what it measures by
    running real kernels at each size asked about): no n above its answer fits, so `peak` is asked there first, then
    from a guess below it (what `below` leaves out taken to grow in proportion to n) up or down (galloping, then
    bisection): near the answer, never at the large sizes the doubling would try.

    Example:
        >>> largest_fitting(lambda n: 100 + 7 * n, 1000, 10**6)
        128
        >>> largest_fitting(lambda n: 100 + 7 * n + (50 if n > 100 else 0), 1000, 10**6, below=lambda n: 100 + 7 * n)
        121
    """
    if below is not None:
        upper = largest_fitting(below, budget, upper)
        top = peak(upper) if upper >= 1 else 0
        if upper < 1 or top <= budget:
            return upper
        # peak(upper) is over: what `below` leaves out, taken to grow in proportion to n, guesses the answer (the
        # demo's CNN at 64 MiB: scratch a third of its bytes; 20 calls of peak galloping down from upper, 3 here)
        gap = top - below(upper)
        guess = largest_fitting(lambda n: below(n) + gap * n / upper, budget, upper - 1)
        return _largest_fitting_from(peak, budget, max(guess, 1), upper)
    if upper < 1 or peak(1) > budget:
        return 0
    lo = 1
    while lo < upper and peak(min(2 * lo, upper)) <= budget:
        lo = min(2 * lo, upper)
    hi = min(2 * lo, upper)
    return _bisect(peak, budget, lo, hi)


def _largest_fitting_from(peak: Callable[[int], int], budget: int, guess: int, over: int) -> int:
    """The largest n below `over` (peak(over) > budget) with peak(n) <= budget, searched from `guess`: up from it
    (guess + 1, + 3, + 7, ...) where it fits, else down, then bisection; O(log |answer - guess|) calls of peak."""
    if guess >= over:
        return _largest_fitting_down(peak, budget, over - 1)
    if peak(guess) > budget:
        return _largest_fitting_down(peak, budget, guess, over=True)
    fits, step = guess, 1
    while fits + step < over and peak(fits + step) <= budget:
        fits, step = fits + step, 2 * step
    return _bisect(peak, budget, fits, min(fits + step, over) - 1)


def _largest_fitting_down(peak: Callable[[int], int], budget: int, upper: int, over: bool = False) -> int:
    """`largest_fitting` searched from `upper` down: upper, upper - 1, upper - 3, ... until one fits, then bisection
    (`over`: peak(upper) is known to be above the budget)."""
    if upper < 1:
        return 0
    if not over and peak(upper) <= budget:
        return upper
    over, step = upper, 1                    # peak(over) > budget
    while True:
        n = max(over - step, 1)
        if peak(n) <= budget:
            return _bisect(peak, budget, n, over - 1)
        if n == 1:
            return 0
        over, step = n, 2 * step


def _bisect(peak: Callable[[int], int], budget: int, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with peak(n) <= budget, peak(lo) fitting."""
    while lo < hi:                           # peak(lo) fits; the answer is below hi + 1
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid - 1)
    return lo


def release_cached(device: torch.device) -> None:
    """Free what an out-of-memory error left behind before a retry: unreachable tensors (gc) and, on CUDA,
    the caching allocator's unused blocks."""
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def halve_after_oom(n: int, error: str, device: torch.device, sizes: list[int], *, single: str, fix: str) -> int:
    """The size to retry with after work on n samples ran out of memory: n // 2, once what the failure left
    behind is freed and n is recorded in `sizes`. At n == 1 nothing smaller exists: OutOfMemoryError, with
    `single` saying what did not fit and `fix` how to make room. (evaluate's chunks and accumulate's micro-batches
    back off through this one rule.)

    Example:
        >>> sizes = []
        >>> halve_after_oom(9, "out of memory", torch.device("cpu"), sizes, single="a sample", fix="free memory"), sizes
        (4, [9])
    """
    release_cached(device)
    sizes.append(n)
    if n == 1:
        raise torch.OutOfMemoryError(f"{single} does not fit in memory ({error}); {fix}")
    return n // 2


def default_budget(device: str | torch.device | None = None) -> int:
    """Free memory of `device` minus a safety margin (10%, at least 64 MiB)."""
    free = device_memory(device).free
    return max(0, free - max(SAFETY_MIN, int(free * SAFETY_FRACTION)))


def resolve_budget(budget: int | str | None, device: str | torch.device | None = None) -> int:
    return default_budget(device) if budget is None else parse_bytes(budget)


@dataclass
class Ledger:
    """The buffers a component will allocate, checked against a budget before anything is allocated.

    Example:
        >>> led = Ledger(budget=1000, what="loader")
        >>> led.add("dataset", 600).add("batches", 300).total
        900
        >>> led.fits
        True
    """
    budget: int
    what: str = "plan"
    items: list[tuple[str, int]] = field(default_factory=list)

    def add(self, name: str, nbytes: int) -> Ledger:
        self.items.append((name, int(nbytes)))
        return self

    @property
    def total(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def table(self) -> str:
        rows = [f"  {name:<44} {format_bytes(n):>12}" for name, n in self.items]
        rows.append(f"  {'total':<44} {format_bytes(self.total):>12}  of budget {format_bytes(self.budget)}")
        return "\n".join(rows)

    def check(self, hint: str = "") -> Ledger:
        """Raise `BudgetExceeded` listing every item when the total is over the budget."""
        if not self.fits:
            raise BudgetExceeded(
                f"{self.what} needs {format_bytes(self.total)} but the budget is {format_bytes(self.budget)} "
                f"({format_bytes(self.total - self.budget)} short):\n{self.table()}" + (f"\n{hint}" if hint else ""),
                needed=self.total, budget=self.budget, items=self.items)
        return self


OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "CUBLAS_STATUS_ALLOC_FAILED",
                "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input")


def is_oom(e: BaseException) -> bool:
    """True for torch.OutOfMemoryError and the allocator errors of CUDA, HIP, MPS and the CPU."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)) and not isinstance(e, BudgetExceeded):
        return True
    return isinstance(e, RuntimeError) and any(m.lower() in str(e).lower() for m in OOM_MESSAGES)

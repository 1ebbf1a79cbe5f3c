"""Strategy choice by budget: byte ledgers for `resident`, `stream` and `macro`, and the reason.

Everything here is arithmetic on a `Needs` (what the data and the batches take, in bytes); nothing is
allocated. The loader calls `choose` before it allocates anything, so a plan that does not fit fails
with `BudgetExceeded` naming each buffer and its bytes.

Example:
    >>> needs = Needs(n=60_000, batch_size=512, row_nbytes=785, batch_nbytes=512 * (784 * 4 + 8),
    ...               device_type="cpu")
    >>> choose(needs, budget=2**30).strategy
    'resident'
    >>> p = choose(needs, budget=32 * 2**20)
    >>> p.strategy, p.macro_batch
    ('macro', 18944)
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.budget import Ledger, check_count, format_bytes
from memfit.loading.order import index_dtype

STRATEGIES = ("auto", "resident", "stream", "macro")


@dataclass(frozen=True)
class Needs:
    """What a loader's data and batches take, in bytes: the input of the plan."""
    n: int                     # samples this loader iterates (this rank's shard when distributed)
    batch_size: int
    row_nbytes: int            # stored (compact) bytes of one sample, its label included
    batch_nbytes: int          # one decoded batch: x in the output dtype, y as int64
    device_type: str           # 'cpu' (host and device are one memory) or 'cuda'
    read_nbytes: int = 0       # host temporaries of one read from a file (raw chunk + encoded chunk)
    slots: int = 2             # buffers in flight: 2 with prefetch (double buffering), 1 without
    order_name: str = ""       # the epoch order's ledger line ('' = one permutation of the n samples)
    order_nbytes: int = -1     # host bytes of the epoch order at its peak (-1 = n indices), see order_bytes
    order_row_nbytes: int = 0  # more host bytes per row of a block (the 'blocks' order holds one block)
    scratch_nbytes: int = 0    # one batch of decode intermediates (unpacked codes, float32 for half types)

    def order_item(self, rows: int) -> tuple[str, int]:
        """(name, host bytes) of the epoch order when blocks hold `rows` samples."""
        if self.order_nbytes < 0:
            size = index_dtype(self.n).itemsize
            return f"epoch order (one permutation, int{8 * size})", self.n * size
        return self.order_name, self.order_nbytes + rows * self.order_row_nbytes


def order_bytes(kind: str, n_total: int, n_local: int, batch_size: int, distributed: bool) -> dict:
    """The `Needs` fields (order_name, order_nbytes, order_row_nbytes) of an epoch order, at its peak.

    'global': the permutation of all n_total samples; distributed, also a mask and a temporary over all
    of them (the shard selection) and this rank's positions. 'blocks': the blocks' order (int64, at
    most one block per batch) and a few block-sized temporaries (a block, its selection, a joined run).

    Example:
        >>> order_bytes("global", 1000, 500, 10, True)["order_nbytes"]    # 4 B x 1000 x 2 + 1000 + 4 B x 500
        11000
    """
    size = index_dtype(n_total).itemsize
    bits = 8 * size
    if kind == "global" and not distributed:
        return {"order_name": f"epoch order (one permutation, int{bits})", "order_nbytes": n_total * size}
    if kind == "global":
        return {"order_name": f"epoch order (permutation of all {n_total} samples, shard selection, int{bits})",
                "order_nbytes": n_total * (2 * size + 1) + n_local * size}
    return {"order_name": f"epoch order (shuffled blocks, one at a time, int{bits})",
            "order_nbytes": 8 * -(-n_total // batch_size), "order_row_nbytes": 5 * size + 2}


@dataclass(frozen=True)
class Plan:
    """The chosen strategy, the bytes it holds on the device (`items`) and why it was chosen."""
    strategy: str                          # 'resident' | 'stream' | 'macro'
    requested: str                         # what the user asked for ('auto' or a strategy)
    macro_batch: int | None                # samples per macro-batch (macro only)
    budget: int                            # bytes the device items must fit in
    items: tuple[tuple[str, int], ...]     # (buffer, bytes) held on the device, counted against the budget
    host_items: tuple[tuple[str, int], ...]  # (buffer, bytes) in host memory outside the budget (CUDA only)
    reason: str

    @property
    def nbytes(self) -> int:
        """Bytes held on the device at the peak of an epoch."""
        return sum(b for _, b in self.items)

    def explain(self) -> str:
        """The reason, then every buffer with its bytes."""
        led = Ledger(self.budget, "device", list(self.items))
        text = f"{self.reason}\ndevice buffers:\n{led.table()}"
        if self.host_items:
            host = "\n".join(f"  {name:<34} {format_bytes(b):>12}" for name, b in self.host_items)
            text += f"\nhost buffers (outside the device budget):\n{host}"
        return text


def _add_decode(led: Ledger, needs: Needs) -> None:
    led.add("decoded batches (2: yours, the next)", 2 * needs.batch_nbytes)    # held by you, being decoded
    if needs.scratch_nbytes:
        led.add("decode scratch (1 batch: unpacked codes, float32 for half types)", needs.scratch_nbytes)


def resident_ledger(needs: Needs, budget: int) -> tuple[Ledger, list[tuple[str, int]]]:
    """The whole compact dataset on the device, the epoch order (copied there on CUDA), one gathered batch."""
    led = Ledger(budget, "resident loader")
    led.add(f"compact dataset ({needs.n} rows x {needs.row_nbytes} B)", needs.n * needs.row_nbytes)
    order = needs.order_item(0)
    host = []
    if needs.device_type == "cuda":          # made on the host, copied to the device once per epoch
        size = index_dtype(needs.n).itemsize
        led.add(f"epoch order on the device (int{8 * size})", needs.n * size)
        host.append(order)
    else:                                    # host and device are one memory
        led.add(*order)
    led.add("gathered compact rows (1 batch)", needs.batch_size * needs.row_nbytes)
    _add_decode(led, needs)
    return led, host


def block_ledger(needs: Needs, rows: int, budget: int, what: str) -> tuple[Ledger, list[tuple[str, int]]]:
    """`slots` device buffers of `rows` compact rows (stream: rows = batch, macro: rows = macro-batch)."""
    led = Ledger(budget, f"{what} loader")
    host: list[tuple[str, int]] = []
    buf = f"compact {'macro-batch' if what == 'macro' else 'batch'} buffers ({needs.slots} x {rows} rows)"
    led.add(buf, needs.slots * rows * needs.row_nbytes)
    _add_decode(led, needs)
    # the epoch order and file reads live in host memory: on a CPU device that is the budget's memory
    host_side = [needs.order_item(rows)]
    if needs.read_nbytes:
        host_side.append(("file read chunk (raw + encoded, host)", needs.read_nbytes))
    if needs.device_type == "cuda":
        host.append((f"pinned staging ({needs.slots} x {rows} rows)", needs.slots * rows * needs.row_nbytes))
        host.extend(host_side)
    else:
        for name, b in host_side:
            led.add(name, b)
    return led, host


def largest_macro(needs: Needs, budget: int) -> int:
    """The largest macro-batch (a multiple of the batch size, at most the data) that fits the budget."""
    fixed = block_ledger(needs, 0, budget, "macro")[0].total
    per_row = needs.slots * needs.row_nbytes + (needs.order_row_nbytes if needs.device_type != "cuda" else 0)
    rows = max(0, budget - fixed) // max(1, per_row)
    whole = -(-needs.n // needs.batch_size) * needs.batch_size
    return min(rows // needs.batch_size * needs.batch_size, whole)


def _check_macro(macro_batch: object, needs: Needs) -> int:
    b = needs.batch_size
    try:
        m = check_count("macro_batch", macro_batch, 1)   # numpy ints too
    except (TypeError, ValueError):
        m = 0
    if m < b or m % b:
        lo = max(b, (m // b) * b)
        raise ValueError(f"expected macro_batch to be a multiple of batch_size={b} (a macro-batch holds whole "
                         f"micro-batches); found {macro_batch!r}; use e.g. macro_batch={lo} or None (the largest "
                         "that fits the budget)")
    return min(m, -(-needs.n // b) * b)


def _plan(needs, budget, strategy, requested, macro, ledger_host, reason) -> Plan:
    led, host = ledger_host
    return Plan(strategy, requested, macro, budget, tuple(led.items), tuple(host), reason)


def choose(needs: Needs, budget: int, strategy: str = "auto", macro_batch: int | None = None) -> Plan:
    """Pick the strategy (or check a forced one) and return its `Plan`.

    `auto`: `resident` if the compact dataset fits the budget with its batches, else `macro` with the
    largest macro-batch that fits (at least two micro-batches), else `stream`.

    Raises:
        ValueError: an unknown strategy, or a macro_batch that is not a multiple of the batch size.
        BudgetExceeded: a forced strategy (or, for `auto`, even `stream`) does not fit the budget.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))} "
                         "('resident': all the compact data on the device; 'stream': batch by batch from the host; "
                         "'macro': macro-batches from the host, micro-batches decoded from them)")
    if macro_batch is not None:
        macro_batch = _check_macro(macro_batch, needs)
    b, budget = needs.batch_size, int(budget)
    res = resident_ledger(needs, budget)
    if strategy == "resident":
        res[0].check("fix: a larger budget, strategy='macro' or 'stream' (the data stays on the host), "
                     "or a more compact codec")
        return _plan(needs, budget, "resident", strategy, None, res,
                     f"strategy 'resident' (forced): {_fits(res[0])}")
    if strategy == "stream":
        st = block_ledger(needs, b, budget, "stream")
        st[0].check("fix: a larger budget or a smaller batch_size")
        return _plan(needs, budget, "stream", strategy, None, st, f"strategy 'stream' (forced): {_fits(st[0])}")
    if strategy == "macro":
        m = macro_batch if macro_batch is not None else largest_macro(needs, budget)
        if m < b:
            m, why = b, "not even one micro-batch per macro-batch fits"
        else:
            why = "the given macro_batch" if macro_batch is not None else "the largest multiple of batch_size that fits"
        mc = block_ledger(needs, m, budget, "macro")
        mc[0].check(f"({why}); fix: a larger budget, a smaller macro_batch or batch_size, or strategy='stream'")
        return _plan(needs, budget, "macro", strategy, m, mc,
                     f"strategy 'macro' (forced): macro-batches of {m} samples ({why}); {_fits(mc[0])}")
    # auto
    if res[0].fits:
        note = f"; macro_batch={macro_batch} unused" if macro_batch is not None else ""
        return _plan(needs, budget, "resident", strategy, None, res,
                     f"strategy 'resident' (auto): the compact dataset and its batches fit: {_fits(res[0])}{note}")
    miss = (f"resident would need {format_bytes(res[0].total)} > budget {format_bytes(budget)} "
            f"(compact dataset {format_bytes(needs.n * needs.row_nbytes)})")
    m = macro_batch if macro_batch is not None else largest_macro(needs, budget)
    mc = block_ledger(needs, m, budget, "macro")
    if m >= 2 * b and mc[0].fits:
        how = "as given" if macro_batch is not None else "the largest multiple of batch_size that fits"
        return _plan(needs, budget, "macro", strategy, m, mc,
                     f"strategy 'macro' (auto): {miss}; macro-batches of {m} samples ({m // b} micro-batches, "
                     f"{how}, double-buffered): {_fits(mc[0])}")
    st = block_ledger(needs, b, budget, "stream")
    st[0].check(f"no strategy fits: {miss}, and not even 2 micro-batches fit per macro-batch; "
                "fix: a larger budget or a smaller batch_size")
    return _plan(needs, budget, "stream", strategy, None, st,
                 f"strategy 'stream' (auto): {miss}, and fewer than 2 micro-batches of {b} fit a "
                 f"double-buffered macro-batch; each batch is copied compact: {_fits(st[0])}")


def _fits(led: Ledger) -> str:
    return f"{format_bytes(led.total)} of the {format_bytes(led.budget)} budget"


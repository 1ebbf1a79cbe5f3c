"""Strategy choice by budget: byte ledgers for `resident`, `stream` and `macro`, and the reason.

Everything here is arithmetic on a `Needs` (what the data and the batches take, in bytes); nothing is
allocated. The loader calls `choose` before it allocates anything, so a choice that does not fit fails
with `BudgetExceeded` naming each buffer and its bytes. `choose` returns a `StrategyChoice`: the
strategy, its macro-batch, its ledger and why, as fields (`requested`, `tried`, `given_macro`, ...);
`StrategyChoice.reason` renders them as one sentence.

Example:
    >>> needs = Needs(n=60_000, batch_size=512, row_nbytes=785, batch_nbytes=512 * (784 * 4 + 8),
    ...               device_type="cpu")
    >>> choose(needs, budget=2**30).strategy
    'resident'
    >>> c = choose(needs, budget=32 * 2**20)
    >>> c.strategy, c.macro_batch, [(t.strategy, t.nbytes > c.budget) for t in c.tried]
    ('macro', 18944, [('resident', True)])
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from memfit.budget import Ledger, check_count, format_bytes
from memfit.loading.order import index_dtype

__all__ = ["Needs", "ORDERS", "STRATEGIES", "StrategyChoice", "Tried", "block_ledger", "check_names", "choose",
           "largest_macro", "order_bytes", "resident_ledger"]

STRATEGIES = ("auto", "resident", "stream", "macro")
ORDERS = ("auto", "global", "blocks")


def check_names(strategy: str, order: str) -> None:
    """Raise ValueError naming the choices when `strategy` or `order` is not one memfit knows."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {', '.join(map(repr, STRATEGIES))} "
                         "('resident': all the compact data on the device; 'stream': batch by batch from the host; "
                         "'macro': macro-batches from the host, micro-batches decoded from them)")
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {', '.join(map(repr, ORDERS))} ('global': one "
                         "permutation of all samples; 'blocks': shuffled macro-batches, shuffled within, host "
                         "memory proportional to the macro-batch)")


@dataclass(frozen=True)
class Needs:
    """What a loader's data and batches take, in bytes, and where they are: the input of `choose`."""
    n: int                     # samples this loader iterates (this rank's shard when distributed)
    batch_size: int
    row_nbytes: int            # stored (compact) bytes of one sample, its label included
    batch_nbytes: int          # one decoded batch: x in the output dtype, y as int64
    device_type: str           # 'cpu' (host and device are one memory) or 'cuda'
    read_nbytes: int = 0       # host temporaries of one read from a file (raw chunk + encoded chunk)
    slots: int = 2             # buffers in flight: 2 with background copies (double buffering), 1 inline
    scratch_nbytes: int = 0    # one batch of decode intermediates (unpacked codes, float32 for half types)
    order: str = "global"      # the epoch order counted: 'global' or 'blocks' (`choose` sets it)
    n_total: int = 0           # samples of the whole data when distributed (0: n, not distributed)
    distributed: bool = False  # every rank draws the order of all n_total samples and keeps its shard's
    sequential: bool = False   # rows are read from a file: 'blocks' is the default order for macro-batches
    on_device: bool = False    # the compact data already lives on the device
    prefetch: bool = True      # background copies were asked for (they run where slots == 2)
    augment_items: tuple[tuple[str, int], ...] = ()   # augmentation's buffers for one batch, (name, bytes)
    augment_table: int = 0     # one epoch's augmentation parameters (device: resident; host: stream, macro)
    epoch_targets: int = 0     # resident: one epoch's targets decoded at once in its order (0: decoded per batch)

    def order_bytes(self) -> tuple[str, int, int]:
        """(ledger name, host bytes, more host bytes per row of a block) of this epoch order (`order_bytes`)."""
        return order_bytes(self.order, self.n_total or self.n, self.n, self.batch_size, self.distributed)

    def order_item(self, rows: int) -> tuple[str, int]:
        """(name, host bytes) of the epoch order when blocks hold `rows` samples."""
        name, nbytes, per_row = self.order_bytes()
        return name, nbytes + rows * per_row


def order_bytes(kind: str, n_total: int, n_local: int, batch_size: int, distributed: bool) -> tuple[str, int, int]:
    """(ledger name, host bytes, more host bytes per row of a block) of an epoch order, at its peak.

    'global': the permutation of all n_total samples; distributed, also a mask and a temporary over all
    of them (the shard selection) and this rank's positions. 'blocks': the blocks' order (int64, at
    most one block per batch) and a few block-sized temporaries (a block, its selection, a joined run).

    Example:
        >>> order_bytes("global", 1000, 500, 10, True)[1]    # 4 B x 1000 x 2 + 1000 + 4 B x 500
        11000
    """
    size = index_dtype(n_total).itemsize
    bits = 8 * size
    if kind == "global" and not distributed:
        return f"epoch order (one permutation, int{bits})", n_total * size, 0
    if kind == "global":
        return (f"epoch order (permutation of all {n_total} samples, shard selection, int{bits})",
                n_total * (2 * size + 1) + n_local * size, 0)
    return f"epoch order (shuffled blocks, one at a time, int{bits})", 8 * -(-n_total // batch_size), 5 * size + 2


@dataclass(frozen=True)
class Tried:
    """A strategy `auto` ruled out before the one it chose, and the device bytes it would need.

    Ruled out because `nbytes` is over the budget, or (macro) because the given macro_batch, or all the
    data, holds fewer than 2 micro-batches: one micro-batch per macro-batch is `stream` with more copies.
    """
    strategy: str               # 'resident' or 'macro'
    macro_batch: int | None     # macro: the given macro_batch, else 2 micro-batches (the smallest auto takes)
    nbytes: int                 # the device bytes of its ledger at that size


@dataclass(frozen=True)
class StrategyChoice:
    """The chosen strategy, the bytes it holds on the device (`items`) and why, as fields (`reason` renders them)."""
    strategy: str                            # 'resident' | 'stream' | 'macro'
    requested: str                           # what the caller asked for ('auto' or a strategy)
    macro_batch: int | None                  # samples per macro-batch (macro only)
    budget: int                              # bytes the device items must fit in
    items: tuple[tuple[str, int], ...]       # (buffer, bytes) held on the device, counted against the budget
    host_items: tuple[tuple[str, int], ...]  # (buffer, bytes) in host memory outside the budget (CUDA only)
    needs: Needs                             # what it was chosen for, its epoch order (`needs.order`) decided
    given_macro: int | None = None           # the caller's macro_batch (checked); None: the largest that fits
    tried: tuple[Tried, ...] = ()            # auto: the strategies ruled out first, each over the budget or too small
    already_on_device: bool = False          # auto: resident because the compact data is already on the device

    @property
    def nbytes(self) -> int:
        """Bytes held on the device at the peak of an epoch."""
        return sum(b for _, b in self.items)

    @property
    def order(self) -> str:
        """The epoch order: 'global' or 'blocks'."""
        return self.needs.order

    @property
    def copies_inline(self) -> bool:
        """Background copies were asked for, but the blocks are copied in the consumer's thread."""
        return self.needs.prefetch and self.needs.slots == 1 and self.strategy != "resident"

    @property
    def reason(self) -> str:
        """Why this strategy, in one line: the rule that chose it, its bytes, the epoch order, the copies."""
        return _reason(self)

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
    for name, nbytes in needs.augment_items:
        led.add(name, nbytes)


def _augment_table(needs: Needs) -> tuple[str, int] | None:
    """The ledger item of one epoch's augmentation parameters (None without augmentation)."""
    if not needs.augment_table:
        return None
    return f"augmentation parameters ({needs.n_total or needs.n} samples)", needs.augment_table


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
    if needs.epoch_targets:
        led.add("targets of the epoch (decoded once, in its order)", needs.epoch_targets)
    _add_decode(led, needs)
    table = _augment_table(needs)              # drawn on the host, looked up on the device
    if table:
        led.add(*table)
        if needs.device_type == "cuda":
            host.append(table)
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
    if _augment_table(needs):                  # looked up on the host beside the order, per batch
        host_side.append(_augment_table(needs))
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
    per_row = needs.slots * needs.row_nbytes
    if needs.device_type != "cuda":          # the order's per-row bytes are host memory, the budget's on a CPU
        per_row += needs.order_bytes()[2]
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


def choose(needs: Needs, budget: int, strategy: str = "auto", macro_batch: int | None = None,
           order: str = "global") -> StrategyChoice:
    """Pick the strategy (or check a forced one) and the epoch order, and return the `StrategyChoice`.

    `auto`: `resident` if the compact dataset fits the budget with its batches (or, on CUDA, is already
    there), else `macro` with the largest macro-batch that fits (at least two micro-batches), else
    `stream`. The epoch order: 'global' for resident and stream; for macro, 'blocks' when asked, or
    when `order` is 'auto' and the rows are read from a file (`needs.sequential`: one sequential read
    per block). The choice's `needs.order` is the order decided; its ledger counts that order's bytes.

    Raises:
        ValueError: an unknown strategy or order, a macro_batch that is not a multiple of the batch size,
            or order 'blocks' with a strategy other than 'macro'.
        BudgetExceeded: a forced strategy (or, for `auto`, even `stream`) does not fit the budget.
    """
    check_names(strategy, order)
    if order == "blocks" and strategy in ("resident", "stream"):
        _blocks_need_macro(strategy)
    given = None if macro_batch is None else _check_macro(macro_batch, needs)
    # the epoch order belongs to the strategy: 'blocks' shuffles macro-batches (one sequential read each
    # from a file); resident and stream take one permutation. Each ledger counts its own order's bytes.
    macro_order = "blocks" if order == "blocks" or (order == "auto" and needs.sequential) else "global"
    choice = _choose(needs, int(budget), strategy, given, macro_order)
    if order == "blocks" and choice.strategy != "macro":
        _blocks_need_macro(choice.strategy)
    return choice


def _blocks_need_macro(strategy: str) -> None:
    raise ValueError(f"order='blocks' shuffles macro-batches, but the strategy is '{strategy}'; pass "
                     "strategy='macro' (and a macro_batch or a budget) or order='global'")


def _choose(needs: Needs, budget: int, requested: str, given: int | None, macro_order: str) -> StrategyChoice:
    """`choose` once the order of macro-batches is known ('global' for the other strategies)."""
    b = needs.batch_size
    one, blocks = replace(needs, order="global"), replace(needs, order=macro_order)

    def chosen(strategy, ledger_host, macro=None, **why) -> StrategyChoice:
        led, host = ledger_host
        used = blocks if strategy == "macro" else one
        return StrategyChoice(strategy, requested, macro, budget, tuple(led.items), tuple(host), used, given, **why)

    # already on the (CUDA) device: copying it back to the host to stream it makes no sense
    on_device = requested == "auto" and needs.on_device and needs.device_type == "cuda"
    res = resident_ledger(one, budget)
    if requested == "resident" or on_device:
        res[0].check("fix: a larger budget, strategy='macro' or 'stream' (the data stays on the host), "
                     "or a more compact codec")
        return chosen("resident", res, already_on_device=on_device)
    if requested == "stream":
        st = block_ledger(one, b, budget, "stream")
        st[0].check("fix: a larger budget or a smaller batch_size")
        return chosen("stream", st)
    if requested == "macro":
        m = given if given is not None else largest_macro(blocks, budget)
        mc = block_ledger(blocks, max(m, b), budget, "macro")
        if given is not None:
            why = "the given macro_batch"
        elif m >= b:
            why = "the largest multiple of batch_size that fits"
        else:
            why = "not even one micro-batch per macro-batch fits"
        mc[0].check(f"({why}); fix: a larger budget, a smaller macro_batch or batch_size, or strategy='stream'")
        return chosen("macro", mc, max(m, b))
    # auto: the first of resident, macro (at least 2 micro-batches), stream that fits
    if res[0].fits:
        return chosen("resident", res)
    tried = [Tried("resident", None, res[0].total)]
    m = given if given is not None else largest_macro(blocks, budget)
    if m >= 2 * b:
        mc = block_ledger(blocks, m, budget, "macro")
        if mc[0].fits:
            return chosen("macro", mc, m, tried=tuple(tried))
    elif given is None:
        m = 2 * b                            # the smallest macro-batch auto takes: what it would need
    tried.append(Tried("macro", m, block_ledger(blocks, m, budget, "macro")[0].total))
    st = block_ledger(one, b, budget, "stream")
    st[0].check(f"no strategy fits: {_ruled_out(tried, needs, budget, given)}; fix: a larger budget or a smaller "
                "batch_size")
    return chosen("stream", st, tried=tuple(tried))


# ---- the reason, rendered from the fields -------------------------------------------------------------
def _reason(c: StrategyChoice) -> str:
    """strategy 'S' (auto|forced): why; device bytes of the budget; epoch order; copies."""
    b, needs = c.needs.batch_size, c.needs
    why = []
    if c.already_on_device:
        why.append(f"the compact dataset is already on the {needs.device_type} device (no copy back to the host)")
    elif c.requested == "auto" and c.strategy == "resident":
        why.append("the compact dataset and its batches fit")
    if c.tried:
        why.append(_ruled_out(c.tried, needs, c.budget, c.given_macro))
    if c.strategy == "macro":
        how = "the given macro_batch" if c.given_macro is not None else "the largest multiple of batch_size that fits"
        why.append(f"macro-batches of {c.macro_batch} samples ({c.macro_batch // b} micro-batches of {b}, {how}, "
                   f"{_buffers(needs)})")
    elif c.strategy == "stream" and c.requested == "auto":
        why.append("each batch is copied compact")
    if c.given_macro is not None and c.strategy == "resident":
        why.append(f"macro_batch={c.given_macro} unused")
    why.append(f"{format_bytes(c.nbytes)} of the {format_bytes(c.budget)} budget on the device")
    if c.order == "global":
        why.append("epoch order 'global': one permutation of all samples")
    else:
        why.append(f"epoch order 'blocks': shuffled blocks of {c.macro_batch} consecutive samples, shuffled within "
                   "(host memory proportional to the macro-batch, not to the data)")
    if c.copies_inline:
        why.append("copies run inline (prefetch needs a CUDA device or a file to overlap with: on the CPU a copy "
                   "thread only competes for cores)")
    mode = "auto" if c.requested == "auto" else "forced"
    return f"strategy '{c.strategy}' ({mode}): " + "; ".join(why)


def _ruled_out(tried, needs: Needs, budget: int, given: int | None) -> str:
    """What `auto` ruled out, and why: over the budget (how much over) or too few micro-batches."""
    b, out = needs.batch_size, []
    for t in tried:
        if t.strategy == "resident":
            out.append(f"resident would need {format_bytes(t.nbytes)} > budget {format_bytes(budget)} "
                       f"(compact dataset {format_bytes(needs.n * needs.row_nbytes)})")
        elif given is not None and given < 2 * b:
            out.append(f"macro_batch={given} holds fewer than 2 micro-batches of {b}")
        elif needs.n <= b:
            out.append(f"the {needs.n} samples fill fewer than 2 micro-batches of {b}")
        else:
            how = "the given macro_batch" if given is not None else "the fewest auto takes"
            out.append(f"macro-batches of {t.macro_batch} samples ({t.macro_batch // b} micro-batches of {b}, {how}, "
                       f"{_buffers(needs)}) would need {format_bytes(t.nbytes)} > budget")
    return ", and ".join(out)


def _buffers(needs: Needs) -> str:
    return "double-buffered" if needs.slots == 2 else "one buffer"

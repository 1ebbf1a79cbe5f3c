"""How the fake run of one FSDP2 rank (`memfit.memory.fsdp_run`) logs its storages: each with the kind of memory it
is and, where its size depends on the world size, how (`RankLog`); FSDP2's collectives tagged (`tagging`); the
bytes CPU kernels and gloo hold inside them, which no op outputs (`chunk_cat_scratch`, `gloo_copies`).

Kinds: storages allocated by `fully_shard` are sharded parameters; inside FSDP's all-gather, communication
buffers; inside its copy-out and by storage resizes, unsharded parameters; inside its reduction, communication
buffers, except the gradients it is handed (unsharded) and leaves (sharded), which are gradients; the optimizer's
tensors are optimizer state; the rest by phase (activations in the forward, transients in backward and step).

World sizes (`memfit.memory.world_scaling`): a storage allocated inside FSDP2's all-gather or reduction is its
unit's shards (the all-gather input in the compute dtype, the reduce-scatter output) or W of them (the all-gather
output, the reduce-scatter input); one allocated in the optimizer's step is the shard of the parameter whose
shard, gradient or state the op reads, or a scalar; the sharded parameters, the all-gather outputs FSDP2 keeps per
parameter (its unsharded parameters) and the optimizer state are read off FSDP2 and the optimizer
(`RankLog.read_off`). Whatever must scale and fits none of these is said in `RankLog.unscalable`, and then no other
world size is computed from the run.

The functions wrapped (FSDP2's collectives, gloo's, `UntypedStorage.resize_`) and DTensor's sharding lock are
replaced per thread (`memfit.device.replacements`): the thread inside `tagging` (`gloo_copies`) logs to its own
`RankLog`, every other thread runs torch's own, and torch's are put back when the last thread leaves.

Known limitations: torch's FSDP2 internals (the module-level names `foreach_all_gather`,
`foreach_all_gather_copy_out`, `foreach_reduce` of `_fsdp_param_group`, `foreach_reduce_scatter_copy_in` of
`_fsdp_collectives`, an `FSDPParam`'s `_orig_size`, `padded_sharded_param_size`, `_sharded_param_data`,
`all_gather_outputs`, `sharded_param`, and DTensor's `ShardingPropagator._fake_mode_lock`) are read or wrapped;
a torch that renames them raises here rather than mislabel. They are replaced on their modules, where FSDP2 looks
them up at each call; a caller that imported one by name before (`from ... import foreach_reduce`) is not seen.
Only what runs in the thread inside is logged: FSDP2 work in another thread (autograd's device threads on CUDA)
would go unlogged; the run is CPU-only, where backward runs in the thread that calls it.
"""

from __future__ import annotations

import math
import threading
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist

from memfit.device.replacements import ScopedReplacement
from memfit.device.torch_private import (
    fsdp_collectives,
    fsdp_param_group,
    fsdp_param_shard,
    fsdp_param_size,
    local_tensor,
    sharding_fake_mode_lock_scoped,
    storage_key,
    tree_flatten,
)
from memfit.memory.kinds import MemoryKind
from memfit.memory.storage_log import StorageLog
from memfit.memory.world_scaling import Scaled

__all__ = ["RankLog", "chunk_cat_scratch", "gloo_copies", "tagging"]

K = MemoryKind


def _rows(fsdp_param) -> tuple[int, int]:
    """(rows, elements per row) of a parameter FSDP2 shards on dim 0."""
    size = fsdp_param_size(fsdp_param)
    return size[0], math.prod(size[1:])


class RankLog(StorageLog):
    """A `StorageLog` that also logs storage resizes and gives every allocation an id, a tag and, where its size
    depends on the world size, its `Scaled` (see the module docstring)."""

    def __init__(self, device, world: int):
        super().__init__(device, scratch=True)        # a bf16 MixedPrecisionPolicy runs bf16 kernels
        self.world = world
        self.tag: K | None = None
        self.alloc_of: dict[int, int] = {}           # storage key -> the id of its live allocation
        self.kind: list[K | None] = []               # allocation id -> tag at allocation (None: by phase)
        self.first_op: list[int] = []                # allocation id -> op index it was allocated at
        self.events: list[tuple[int, int, int]] = []  # (op, allocation id, +-bytes)
        self.race_bytes = 0                          # the largest buffer a collective's work holds (gloo's race)
        self.race: list[Scaled] = []                 # each such buffer at any world size
        self.transients: list[tuple[int, object]] = []   # (allocation id, its bytes_at) of pseudo-ops
        self.group: tuple[str, tuple] | None = None  # (which collective, (rows, inner) of its unit) running now
        self.stepping = False                        # the logged step's optimizer step is running
        self.paused = False                          # DTensor's sharding propagation is running (`tagging`)
        self.scaled: dict[int, Scaled] = {}          # allocation id -> its bytes at any world size
        self.must_scale: dict[int, str] = {}         # allocation id -> what it is, where no `Scaled` was found
        self.unscalable: list[str] = []              # what keeps the run from giving other world sizes
        self.shard_at: dict[int, dict[int, tuple[int, int]]] = {}   # storage key -> offset -> (rows, inner) of
        #                                              the parameter whose rank-0 shard (or its like) starts there
        self._seen = 0

    def _sync(self) -> None:
        for op, key, delta in self.log[self._seen:]:
            aid = self.alloc_of.get(key)
            if aid is None:
                aid = self.alloc_of[key] = len(self.kind)
                self.kind.append(self.tag)
                self.first_op.append(op)
            self.events.append((op, aid, delta))
            if key not in self.live:                  # the storage died
                del self.alloc_of[key]
                self.shard_at.pop(key, None)
        self._seen = len(self.log)

    def record(self, func, out, args, kwargs) -> None:
        if self.paused:
            return
        noted, logged = len(self.scratch_ops), len(self.log)
        super().record(func, out, args, kwargs)
        if len(self.scratch_ops) > noted:
            if func.namespace != "aten":
                # a kernel whose scratch would be measured by running it for real: never a collective (c10d) nor
                # FSDP's own copy ops (fsdp.*, which allocate only their outputs)
                self.scratch_ops.pop()
            elif self.group or self.stepping:
                self.unscalable.append(f"the scratch of {func} on shards, measured at {self.world} ranks' shapes")
        new = [(key, nbytes) for _, key, nbytes in self.log[logged:] if nbytes > 0]
        self._sync()
        if new and (self.group or self.stepping):
            self._scale(func, new, out, args, kwargs)

    def _scale(self, func, new, out, args, kwargs) -> None:
        """The `Scaled` of storages `func` allocated inside a collective or in the optimizer's step."""
        outs = tree_flatten(out)[0]
        made = {storage_key(t.untyped_storage()): (i, t) for i, t in enumerate(outs) if isinstance(t, torch.Tensor)}
        for key, nbytes in new:
            aid, (i, t) = self.alloc_of.get(key), made.get(key, (None, None))
            if aid is None or t is None:
                self.unscalable.append(f"{nbytes} bytes {func} allocates inside its kernel, in "
                                       f"{self.group[0] if self.group else 'the optimizer step'}")
                continue
            numel = nbytes // t.element_size()
            s = self._in_group(numel, t.element_size()) if self.group else \
                self._in_step(numel, t.element_size(), i, len(outs), args, kwargs)
            if s is not None:
                self.scaled[aid] = s
                if not self.group:
                    self.shard_at.setdefault(key, {})[t.storage_offset()] = s.terms[0]
            elif numel > 1:                          # a 0-d tensor is one element at every world size
                self.must_scale[aid] = (f"{nbytes} bytes {func} allocates in "
                                        f"{self.group[0] if self.group else 'the optimizer step'}")

    def _in_group(self, numel: int, itemsize: int) -> Scaled | None:
        what, terms = self.group
        if what == "foreach_all_gather_copy_out":        # one parameter's all-gather output (its first step)
            hits = {r for r in terms if self.world * -(-r[0] // self.world) * r[1] == numel}
            return Scaled(itemsize, True, (hits.pop(),)) if len(hits) == 1 else None
        shards = sum(-(-r // self.world) * inner for r, inner in terms)
        return Scaled(itemsize, numel != shards, terms) if numel in (shards, self.world * shards) else None

    def _in_step(self, numel: int, itemsize: int, i: int, n_out: int, args, kwargs) -> Scaled | None:
        """The shard of the one parameter whose tensors the op reads with `numel` elements (for a foreach op, the
        i-th of each list), else None."""
        leaves = [a[i] if isinstance(a, (list, tuple)) and len(a) == n_out > 1 else a
                  for a in (*args, *kwargs.values())]
        found = set()
        for a in tree_flatten(leaves)[0]:
            if isinstance(a, torch.Tensor) and a.numel() == numel:
                rows = self.shard_at.get(storage_key(a.untyped_storage()), {}).get(a.storage_offset())
                if rows is not None:
                    found.add(rows)
        return Scaled(itemsize, False, (found.pop(),)) if len(found) == 1 else None

    def note_shards(self, tensors_and_params) -> None:
        """Tensors that are (or are like) rank 0's shard of a parameter: (tensor, FSDPParam) pairs."""
        for t, fp in tensors_and_params:
            t = local_tensor(t)
            rows, inner = _rows(fp)
            if isinstance(t, torch.Tensor) and t.numel() == -(-rows // self.world) * inner:
                self.shard_at.setdefault(storage_key(t.untyped_storage()), {})[t.storage_offset()] = (rows, inner)

    def read_off(self, fsdp_params, optimizer) -> None:
        """The `Scaled` of what FSDP2 keeps per parameter (the padded shard, the all-gather outputs that hold the
        unsharded parameter) and of the optimizer's state, read off them after the run."""
        state = optimizer.state if optimizer is not None else {}
        for fp in fsdp_params:
            rows = _rows(fp)
            if fp.padded_sharded_param_size.numel() != -(-rows[0] // self.world) * rows[1]:
                self.unscalable.append(f"a parameter of {tuple(fsdp_param_size(fp))} sharded other than on dim 0")
            for t, whole in ((fsdp_param_shard(fp), False), *((o, True) for o in fp.all_gather_outputs)):
                if (aid := self.alloc_of.get(storage_key(t.untyped_storage()))) is not None:
                    self.scaled[aid] = Scaled(t.element_size(), whole, (rows,))
            for name, v in state.get(fp.sharded_param, {}).items():
                v = local_tensor(v)
                if not isinstance(v, torch.Tensor) or \
                        (aid := self.alloc_of.get(storage_key(v.untyped_storage()))) is None:
                    continue
                if v.numel() == local_tensor(fp.sharded_param).numel():
                    self.scaled[aid] = Scaled(v.element_size(), False, (rows,))
                elif v.numel() > 1:
                    self.must_scale[aid] = f"optimizer state {name!r} of {tuple(v.shape)}, not the shard's shape"

    def _freed(self, ref) -> None:
        super()._freed(ref)
        self._sync()

    def resized(self, storage, old: int, new: int) -> None:
        key = storage_key(storage)
        if key not in self.live:                      # a storage made before (or emptied before) the log saw it
            self.live[key] = old
            self._watch(storage, key)
            if old:
                self.log.append((len(self.ops), key, old))
        self.live[key] += new - old
        self.log.append((len(self.ops), key, new - old))
        self._sync()

    def retag(self, tensors, kind: K) -> None:
        for t in tensors:
            t = local_tensor(t)                       # a DTensor's local shard
            if isinstance(t, torch.Tensor) and (aid := self.alloc_of.get(storage_key(t.untyped_storage()))) is not None:
                self.kind[aid] = kind

    def transient(self, nbytes: int, what: str, at=None) -> None:
        """Log `nbytes` allocated at one pseudo-op and freed at the next: a buffer a collective holds inside;
        `at(world)` its bytes at any world size."""
        aid = len(self.kind)
        self.kind.append(K.COMMUNICATION)
        self.first_op.append(len(self.ops))
        self.events.append((len(self.ops), aid, nbytes))
        self.ops.append(f"<{what}: {nbytes} bytes>")
        self.events.append((len(self.ops), aid, -nbytes))
        self.ops.append(f"<{what} freed>")
        if at is None or at(self.world) != nbytes:
            self.unscalable.append(f"{what}, {nbytes} bytes")
        else:
            self.transients.append((aid, at))


_HERE = threading.local()          # .log: the `RankLog` of the thread's `tagging` or `gloo_copies`


@contextmanager
def _logging_to(log: RankLog, *replacements: ScopedReplacement):
    """Inside, this thread's calls of the replaced functions log to `log` (every other thread's run torch's own)."""
    before, _HERE.log = getattr(_HERE, "log", None), log
    try:
        with ExitStack() as inside:
            for r in replacements:
                inside.enter_context(r.active())
            yield
    finally:
        _HERE.log = before


_GLOO_WHOLE = {"all_gather_single": (0, "output_tensor"), "reduce_scatter_single": (1, "input")}   # the whole buffer


def _gloo_logged(name: str):
    """What `name` logs in a thread inside `gloo_copies`: the buffer gloo copies or clones while it runs."""
    i, key = _GLOO_WHOLE[name]
    what = "copy" if name.startswith("all_gather") else "clone"

    def run(fn, *args, **kwargs):
        log = _HERE.log
        out = fn(*args, **kwargs)
        whole = args[i] if len(args) > i else kwargs[key]
        scaled = Scaled(whole.element_size(), True, log.group[1]) if log.group else None   # W shards of the unit
        log.transient(whole.nbytes, f"gloo's {what} in {name}", scaled and scaled.bytes_at)
        log.race_bytes = max(log.race_bytes, whole.nbytes)
        log.race += [scaled] if scaled else []
        return out
    return run


_GLOO = [ScopedReplacement(lambda: dist, name, _gloo_logged(name)) for name in _GLOO_WHOLE]


def gloo_copies(log: RankLog):
    """What gloo's all-gather and reduce-scatter of one tensor (`all_gather_single`, `reduce_scatter_single`:
    what FSDP2 calls) hold beyond NCCL, logged (in this thread): the all-gather copies the whole output into a
    buffer of its own while it runs, the reduce-scatter clones its whole input; both freed by the time the call
    returns (the schedule `memfit.testing.ranks.settled_gloo` makes deterministic).

    gloo's race: each call's work object keeps the tensors it was given (and the clone) until the gloo worker
    thread that ran it drops it, after the call has returned: usually before the rank drops them (the bytes
    then go with the rank's tensors, as this run sees them), but on a busy machine after, and then for as long
    as the OS leaves that thread asleep. Seen on the allocator of 2 gloo ranks of a 2-block encoder (tests'
    width 32, 8 samples; settled it peaks at 396,152 bytes in every run): one block's all-gather output (34,176
    bytes) kept by the worker past FSDP2's drop, either through the next all-gather (+27,520 at the peak) or
    into the block's backward (+34,176); on the bench's encoder (width 64) a block's reduce-scatter clone kept
    through the next block's all-gather copy-out; never two at once. `log.race` holds the buffer one work
    holds (an all-gather output, a reduce-scatter clone) of each call: `rank_memory_model(gloo_race=True)`
    adds the largest at the peak, a bound of every run seen (not of every schedule: two sleeping workers could
    keep two). NCCL works in place and keeps nothing after the call."""
    return _logging_to(log, *_GLOO)


def _resize_logged(resize_, storage, size):
    """`UntypedStorage.resize_` in a thread inside `tagging`: FSDP2 frees and makes its unsharded parameters' storages
    by resizing them, which no op's output shows; each logged to the thread's `RankLog`."""
    log, old = _HERE.log, storage.nbytes()
    out = resize_(storage, size)
    if isinstance(storage_key(storage), int):       # every storage here is the run's (a fake one is on meta)
        before, log.tag = log.tag, log.tag or K.UNSHARDED_PARAMETERS
        log.resized(storage, old, storage.nbytes())
        log.tag = before
    return out


_TAGS = {"foreach_all_gather": (K.COMMUNICATION, 0), "foreach_all_gather_copy_out": (K.UNSHARDED_PARAMETERS, 1),
         "foreach_reduce": (K.COMMUNICATION, 0)}          # the tag, and where the FSDPParams are in the call


def _tagged(name: str):
    """FSDP2's `name` in a thread inside `tagging`: what it allocates tagged, the unit it works on said."""
    tag, at = _TAGS[name]

    def run(fn, *args, **kwargs):
        log, params = _HERE.log, args[at]
        before = log.tag, log.group
        log.tag, log.group = tag, (name, tuple(_rows(p) for p in params))
        if name == "foreach_reduce":
            log.retag(args[1], K.GRADIENTS)       # the unsharded gradients it is handed
        try:
            return fn(*args, **kwargs)
        finally:
            log.tag, log.group = before
            if name == "foreach_reduce":          # the sharded gradients it leaves, for the optimizer's step
                log.note_shards((p.sharded_param.grad, p) for p in params if p.sharded_param.grad is not None)
    return run


def _copy_in_logged(copy_in, unsharded_grads, reduce_scatter_input, world_size):
    """FSDP2's reduce-scatter copy-in in a thread inside `tagging`: the copies its kernel makes inside logged."""
    log = _HERE.log
    shapes = [_grad_rows(g) for g in unsharded_grads]
    converted = bool(unsharded_grads) and unsharded_grads[0].dtype != reduce_scatter_input.dtype
    out = copy_in(unsharded_grads, reduce_scatter_input, world_size)
    # logged at every world size, 0 bytes or not, so the ops are the same at each
    log.transient(_chunk_cat_bytes(shapes, converted, world_size),
                  "fsdp.chunk_cat's padded and converted copies of the gradients",
                  lambda w: _chunk_cat_bytes(shapes, converted, w))
    return out


@contextmanager
def _unlogged(lock):
    """DTensor's sharding propagation (on a cache miss: the first time an op sees these shardings, as SGD's
    momentum update in its second step) runs the op on empty tensors of the global shapes to read the output's
    metadata, under the fake mode it finds active: in this run, the logging one, where a real step uses a fresh
    fake mode and allocates nothing. It enters its lock around that; in a thread inside `tagging` this pauses the
    thread's log meanwhile (before, SGD with momentum logged a whole unsharded parameter per update, 65,536 bytes on
    the tests' MLP, that no real step allocates)."""
    log = _HERE.log
    with lock:
        before, log.paused = log.paused, True
        try:
            yield
        finally:
            log.paused = before


_RESIZE = ScopedReplacement(lambda: torch.UntypedStorage, "resize_", _resize_logged)
_FSDP = [*(ScopedReplacement(fsdp_param_group, name, _tagged(name)) for name in _TAGS),
         ScopedReplacement(fsdp_collectives, "foreach_reduce_scatter_copy_in", _copy_in_logged),
         sharding_fake_mode_lock_scoped(_unlogged), _RESIZE]


def tagging(log: RankLog):
    """In this thread, FSDP2's all-gather, copy-out and reduction tag what they allocate and say which unit's
    parameters they work on (`RankLog.group`), and storage resizes are logged."""
    group = fsdp_param_group()
    missing = [n for n in _TAGS if not hasattr(group, n)]
    if missing:
        raise RuntimeError(f"expected torch's FSDP2 to call {missing} in _fsdp_param_group (torch 2.13 does); "
                           f"found torch {torch.__version__} without them: the per-rank model needs updating")
    return _logging_to(log, *_FSDP)


def _grad_rows(g: torch.Tensor) -> tuple[int, int, int, bool]:
    """(rows, elements per row, bytes per element, whether it has a dim 0) of a gradient."""
    rows = g.shape[0] if g.dim() else 1
    return rows, g.numel() // max(rows, 1), g.element_size(), g.dim() > 0


def _chunk_cat_bytes(shapes, converted: bool, world_size: int) -> int:
    """`chunk_cat_scratch` of gradients of these `_grad_rows` at `world_size` ranks."""
    padded = [-(-rows // world_size) * world_size * inner * size for rows, inner, size, _ in shapes]
    pads = sum(p for p, (rows, _, _, dim) in zip(padded, shapes, strict=True) if dim and rows % world_size)
    return pads + (max(padded, default=0) if converted else 0)


def chunk_cat_scratch(grads, out_dtype: torch.dtype, world_size: int) -> int:
    """Bytes the CPU kernel of `fsdp.chunk_cat(grads, 0, world_size, out=...)` (FSDP2's reduce-scatter copy-in)
    allocates inside, all freed before it returns; no op outputs them, so a fake run cannot see them (the
    allocator can). It copies every gradient whose rows do not split evenly into a padded copy of its own (rows
    rounded up to a multiple of world_size, in the gradients' dtype), all alive while it concatenates; and where
    the output's dtype is not the gradients' (a `MixedPrecisionPolicy` whose reduce_dtype differs from its
    param_dtype), `cat` copies each (padded) gradient once more in the gradients' dtype before converting it,
    one at a time: the largest of those on top. Checked against the real kernel's allocator events
    (`memfit.device.kernel_probe.inside_bytes`) in tests/memory/test_ranks.py."""
    return _chunk_cat_bytes([_grad_rows(g) for g in grads], bool(grads) and grads[0].dtype != out_dtype, world_size)

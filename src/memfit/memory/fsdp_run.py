"""One training step of an FSDP2 (`fully_shard`) model, as one rank runs it, on fake tensors in one process.

`fsdp_fake_run` copies the model onto fake tensors, applies `fully_shard` under a fake process group of
`world_size` ranks (torch's "fake" backend: collectives return at once and move no data), builds the same
optimizer over the sharded parameters, runs one step unlogged (optimizer state and FSDP's lazy init exist
after it, as in a running loop) and logs every storage of a second step, as `memfit.memory.fake_run` does,
plus the storage resizes FSDP2 uses to free and re-allocate the unsharded parameters between uses
(`_fsdp_param.free_storage` / `alloc_storage`). Everything is logged from before `fully_shard` runs, so the
bytes at the step's start (sharded parameters, optimizer state, whatever FSDP keeps) are counted as held.
Nothing is allocated and the model is not touched; it is the real FSDP2 code that runs, so its all-gathers,
prefetches, reduce-scatter buffers and resharding are counted as they happen.

Kinds: storages allocated by `fully_shard` are sharded parameters; inside FSDP's all-gather, communication
buffers; inside its copy-out and by storage resizes, unsharded parameters; inside its reduction,
communication buffers, except the gradients it is handed (unsharded) and leaves (sharded), which are
gradients; the optimizer's tensors are optimizer state; the rest by phase (activations in the forward,
transients in backward and step).

Known limitations: torch's FSDP2 internals (the module-level names `foreach_all_gather`,
`foreach_all_gather_copy_out`, `foreach_reduce` of `_fsdp_param_group`) are wrapped to tag storages; a torch
that renames them raises here rather than mislabel. Only CPU is modelled (the fake mesh is a CPU mesh).
"""

from __future__ import annotations

import copy
import gc
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from memfit.device.measure import optimizer_state
from memfit.memory.kinds import MemoryKind
from memfit.memory.step import ExampleBatch, training_step
from memfit.memory.storage_log import LoggingFakeMode, StorageLog

__all__ = ["RANK_KINDS", "RankRun", "chunk_cat_scratch", "default_units", "fsdp_fake_run"]

K = MemoryKind
# the columns of a rank's run, in order
RANK_KINDS = (K.SHARDED_PARAMETERS, K.PARAMETERS, K.INPUTS, K.OPTIMIZER_STATE, K.UNSHARDED_PARAMETERS,
              K.ACTIVATIONS, K.GRADIENTS, K.COMMUNICATION, K.BACKWARD_TRANSIENT, K.STEP_TRANSIENT)
_COL = {k: i for i, k in enumerate(RANK_KINDS)}


@dataclass
class RankRun:
    ops: list                  # the logged step's ops in order (OpOverloads, phase markers)
    live: np.ndarray           # (ops, kinds): bytes live after each op of the logged step, held bytes included
    phase_ends: dict[str, int]
    race_bytes: int = 0        # with backend="gloo": the largest buffer a collective's work holds (gloo's race)
    scratch: list = field(default_factory=list)   # (op, OpOverload, ArgSpec) of the ops on half-precision
    #                                               arguments whose kernels' scratch is measured (`kernel_scratch`)


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `fully_shard` is applied to by default, besides the root: every child of an `nn.ModuleList`
    or `nn.Sequential` that holds parameters (a transformer's blocks, a Sequential's layers), innermost first
    (`fully_shard` must wrap the inner units before the outer)."""
    units = [c for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
             for c in m.children() if any(True for _ in c.parameters())]
    depth = {m: i for i, m in enumerate(model.modules())}       # pre-order: an ancestor comes before
    return sorted(set(units), key=lambda m: -depth[m])


class _RankLog(StorageLog):
    """A `StorageLog` that also logs storage resizes and gives every allocation an id and a tag."""

    def __init__(self, device):
        super().__init__(device, scratch=True)        # a bf16 MixedPrecisionPolicy runs bf16 kernels
        self.tag: K | None = None
        self.alloc_of: dict[int, int] = {}           # storage key -> the id of its live allocation
        self.kind: list[K | None] = []               # allocation id -> tag at allocation (None: by phase)
        self.first_op: list[int] = []                # allocation id -> op index it was allocated at
        self.events: list[tuple[int, int, int]] = []  # (op, allocation id, +-bytes)
        self.race_bytes = 0                          # the largest buffer a collective's work holds
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
        self._seen = len(self.log)

    def record(self, func, out, args, kwargs) -> None:
        noted = len(self.scratch_ops)
        super().record(func, out, args, kwargs)
        if len(self.scratch_ops) > noted and func.namespace != "aten":
            # a kernel whose scratch would be measured by running it for real: never a collective (c10d) nor
            # FSDP's own copy ops (fsdp.*, which allocate only their outputs)
            self.scratch_ops.pop()
        self._sync()

    def _freed(self, ref) -> None:
        super()._freed(ref)
        self._sync()

    def resized(self, storage, old: int, new: int) -> None:
        key = storage._cdata
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
            t = getattr(t, "_local_tensor", t)        # a DTensor's local shard
            if isinstance(t, torch.Tensor) and (aid := self.alloc_of.get(t.untyped_storage()._cdata)) is not None:
                self.kind[aid] = kind


@contextmanager
def _fake_group(world_size: int, rank: int):
    """A default process group of torch's fake backend for the `with` block, and a CPU mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("a per-rank memory model of FSDP2 runs under a fake process group of its own, but a "
                           "process group is already initialised here; build the memory model before "
                           "dist.init_process_group (or in a process without one)")
    hook = sys.excepthook      # init_process_group wraps it to prefix "[rank0]: " to every later traceback
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _transient(log: _RankLog, nbytes: int, what: str) -> None:
    """Log `nbytes` allocated at one pseudo-op and freed at the next: a buffer a collective holds inside."""
    aid = len(log.kind)
    log.kind.append(K.COMMUNICATION)
    log.first_op.append(len(log.ops))
    log.events.append((len(log.ops), aid, nbytes))
    log.ops.append(f"<{what}: {nbytes} bytes>")
    log.events.append((len(log.ops), aid, -nbytes))
    log.ops.append(f"<{what} freed>")


@contextmanager
def _gloo_copies(log: _RankLog):
    """What gloo's all-gather and reduce-scatter of one tensor (`all_gather_single`, `reduce_scatter_single`:
    what FSDP2 calls) hold beyond NCCL, logged: the all-gather copies the whole output into a buffer of its own
    while it runs, the reduce-scatter clones its whole input; both freed by the time the call returns (the
    schedule `memfit.testing.ranks.settled_gloo` makes deterministic).

    gloo's race: each call's work object keeps the tensors it was given (and the clone) until the gloo worker
    thread that ran it drops it, after the call has returned: usually before the rank drops them (the bytes
    then go with the rank's tensors, as this run sees them), but on a busy machine after, and then for as long
    as the OS leaves that thread asleep. Seen on the allocator of 2 gloo ranks of a 2-block encoder (tests'
    width 32, 8 samples; settled it peaks at 396,152 bytes in every run): one block's all-gather output (34,176
    bytes) kept by the worker past FSDP2's drop, either through the next all-gather (+27,520 at the peak) or
    into the block's backward (+34,176); on the bench's encoder (width 64) a block's reduce-scatter clone kept
    through the next block's all-gather copy-out; never two at once. `log.race_bytes` records the largest
    buffer one work holds (an all-gather output, a reduce-scatter clone): `rank_memory_model(gloo_race=True)`
    adds it at the peak, a bound of every run seen (not of every schedule: two sleeping workers could keep
    two). NCCL works in place and keeps nothing after the call."""
    names = {"all_gather_single": (0, "output_tensor"), "reduce_scatter_single": (1, "input")}   # the whole buffer
    originals = {k: getattr(dist, k) for k in names}

    def copying(name, fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            i, key = names[name]
            whole = args[i] if len(args) > i else kwargs[key]
            if name.startswith("all_gather"):
                _transient(log, whole.nbytes, f"gloo's copy in {name}")
            else:
                _transient(log, whole.nbytes, f"gloo's clone in {name}")
            log.race_bytes = max(log.race_bytes, whole.nbytes)
            return out
        return run

    for k, fn in originals.items():
        setattr(dist, k, copying(k, fn))
    try:
        yield
    finally:
        for k, fn in originals.items():
            setattr(dist, k, fn)


@contextmanager
def _tagging(log: _RankLog):
    """Wrap FSDP2's all-gather, copy-out and reduction to tag what they allocate, and log storage resizes."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group
    names = {"foreach_all_gather": K.COMMUNICATION, "foreach_all_gather_copy_out": K.UNSHARDED_PARAMETERS,
             "foreach_reduce": K.COMMUNICATION}
    missing = [n for n in names if not hasattr(group, n)]
    if missing:
        raise RuntimeError(f"expected torch's FSDP2 to call {missing} in _fsdp_param_group (torch 2.13 does); "
                           f"found torch {torch.__version__} without them: the per-rank model needs updating")
    originals = {n: getattr(group, n) for n in names}

    def tagged(name, fn):
        def run(*args, **kwargs):
            before, log.tag = log.tag, names[name]
            if name == "foreach_reduce":
                log.retag(args[1], K.GRADIENTS)       # the unsharded gradients it is handed
            try:
                return fn(*args, **kwargs)
            finally:
                log.tag = before
        return run

    def resize(storage, size):
        old = storage.nbytes()
        out = torch._C.StorageBase.resize_(storage, size)
        if isinstance(storage._cdata, int):       # every storage here is the run's (a fake one is on meta)
            before, log.tag = log.tag, log.tag or K.UNSHARDED_PARAMETERS
            log.resized(storage, old, storage.nbytes())
            log.tag = before
        return out

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    copy_in = collectives.foreach_reduce_scatter_copy_in

    def padded_copy_in(unsharded_grads, reduce_scatter_input, world_size):
        scratch = chunk_cat_scratch(unsharded_grads, reduce_scatter_input.dtype, world_size)
        out = copy_in(unsharded_grads, reduce_scatter_input, world_size)
        if scratch:
            _transient(log, scratch, "fsdp.chunk_cat's padded and converted copies of the gradients")
        return out

    for n, fn in originals.items():
        setattr(group, n, tagged(n, fn))
    collectives.foreach_reduce_scatter_copy_in = padded_copy_in
    torch.UntypedStorage.resize_ = resize
    try:
        yield
    finally:
        del torch.UntypedStorage.resize_
        collectives.foreach_reduce_scatter_copy_in = copy_in
        for n, fn in originals.items():
            setattr(group, n, fn)


def chunk_cat_scratch(grads, out_dtype: torch.dtype, world_size: int) -> int:
    """Bytes the CPU kernel of `fsdp.chunk_cat(grads, 0, world_size, out=...)` (FSDP2's reduce-scatter copy-in)
    allocates inside, all freed before it returns; no op outputs them, so a fake run cannot see them (the
    allocator can). It copies every gradient whose rows do not split evenly into a padded copy of its own (rows
    rounded up to a multiple of world_size, in the gradients' dtype), all alive while it concatenates; and where
    the output's dtype is not the gradients' (a `MixedPrecisionPolicy` whose reduce_dtype differs from its
    param_dtype), `cat` copies each (padded) gradient once more in the gradients' dtype before converting it,
    one at a time: the largest of those on top. Checked against the real kernel's allocator events
    (`memfit.memory.fake_kernels.inside_bytes`) in tests/memory/test_ranks.py."""
    def padded(g) -> int:
        rows = g.shape[0] if g.dim() else 1
        return -(-rows // world_size) * world_size * (g.numel() // max(rows, 1)) * g.element_size()
    pads = sum(padded(g) for g in grads if g.dim() and g.shape[0] % world_size)
    converted = max((padded(g) for g in grads), default=0) if grads and grads[0].dtype != out_dtype else 0
    return pads + converted


def _fake_copy(model: torch.nn.Module, mode) -> torch.nn.Module:
    """A deep copy of `model` whose parameters and buffers are fake tensors (tied ones stay tied)."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            f = mode.from_tensor(t)
            memo[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
    return copy.deepcopy(model, memo)


def _same_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module, wrapped: torch.nn.Module):
    """An optimizer of the same class and groups (hyper-parameters) over `wrapped`'s parameters, matched by
    name to `model`'s."""
    names = {id(p): k for k, p in model.named_parameters()}
    now = dict(wrapped.named_parameters())
    groups = []
    for g in optimizer.param_groups:
        missing = [p for p in g["params"] if id(p) not in names]
        if missing:
            raise ValueError(f"expected the optimizer's parameters to be the model's; found {len(missing)} that are "
                             "not (an optimizer over another model?)")
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [now[names[id(p)]] for p in g["params"]]})
    return type(optimizer)(groups)


def fsdp_fake_run(model: torch.nn.Module, batch: ExampleBatch, n: int, *, world_size: int, rank: int,
                  optimizer, loss_fn: Callable | None, target: ExampleBatch | None,
                  units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None,
                  reshard_after_forward: bool = True, mp_policy=None, autocast=None,
                  backend: str = "nccl") -> RankRun:
    """One rank's logged training step (see the module docstring) at a per-rank batch of n. With
    backend="gloo", the buffers gloo's collectives copy into while they run (`_gloo_copies`) are counted, and
    the largest buffer a collective's work holds is recorded (`RankRun.race_bytes`, what gloo's race may
    keep)."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device = torch.device("cpu")
    mode = LoggingFakeMode(allow_non_fake_inputs=False)
    log = _RankLog(device)
    marks: dict[str, int] = {}
    enabled = gc.isenabled()
    with _fake_group(world_size, rank) as mesh, _tagging(log), \
            _gloo_copies(log) if backend == "gloo" else nullcontext():
        fake = _fake_copy(model, mode)
        opt = None
        try:
            with mode, mode.logging_to(log):
                kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                      "mp_policy": mp_policy or MixedPrecisionPolicy()}
                log.tag = K.SHARDED_PARAMETERS
                chosen = (units or default_units)(fake)
                for m in chosen:
                    fully_shard(m, **kw)
                fully_shard(fake, **kw)
                meshes = sum(1 for m in [*chosen, fake] if m._get_fsdp_state()._fsdp_param_groups)
                log.tag = None
                if not fake.training:
                    fake.train()
                opt = _same_optimizer(optimizer, model, fake) if optimizer is not None else None
                log.tag = K.INPUTS
                x = batch.at(n, device)
                y = target.at(n, device) if target is not None else None
                log.tag = None
                training_step(fake, x, opt, loss_fn, y, autocast)     # unlogged in effect: before `start`
                log.retag(optimizer_state(opt), K.OPTIMIZER_STATE)
                gc.collect()
                gc.disable()
                start = len(log.ops)

                def mark(phase, fake=fake):
                    log.ops.append(f"<end of {phase}>")
                    marks[phase] = len(log.ops) - start
                    if phase == "backward":
                        log.retag([p.grad for p in fake.parameters() if p.grad is not None], K.GRADIENTS)
                training_step(fake, x, opt, loss_fn, y, autocast, mark)
                del x, y
        finally:
            if enabled:
                gc.enable()
            del opt, fake
            gc.collect()
    # `fully_shard(m)` without a mesh makes one per call (`init_device_mesh`), whose rank tensor (world_size
    # int32, on the CPU) the unit keeps while it holds parameters; this run passes one mesh made unlogged
    mesh_bytes = meshes * world_size * torch.empty((), dtype=torch.int32).element_size()
    return RankRun(log.ops[start:], _timeline(log, start, marks, model, mesh_bytes), marks, log.race_bytes,
                   [(op - start, func, spec) for op, func, spec in log.scratch_ops if op >= start])


def _timeline(log: _RankLog, start: int, marks: dict[str, int], model, mesh_bytes: int = 0) -> np.ndarray:
    """(ops, kinds) bytes live after each op from `start` on: everything logged before counts as held, plus
    what was never logged (the fake copies of buffers and of parameters `fully_shard` did not take, and the
    device meshes' rank tensors, `mesh_bytes`, as communication buffers)."""
    n_ops = len(log.ops) - start
    ends = (marks.get("forward", n_ops), marks.get("backward", n_ops))

    def column(aid: int) -> int:
        tag = log.kind[aid]
        if tag is not None:
            return _COL[tag]
        op = log.first_op[aid] - start
        if op < 0:                                    # made before the logged step and kept through it
            return _COL[K.PARAMETERS]
        return _COL[K.ACTIVATIONS if op < ends[0] else K.BACKWARD_TRANSIENT if op < ends[1] else K.STEP_TRANSIENT]

    delta = np.zeros((n_ops + 1, len(RANK_KINDS)), dtype=np.int64)
    for op, aid, d in log.events:
        delta[min(max(op - start, 0), n_ops), column(aid)] += d
    live = np.cumsum(delta, axis=0)[:n_ops]
    live[:, _COL[K.PARAMETERS]] += sum(b.nbytes for b in model.buffers())   # buffers are not sharded
    live[:, _COL[K.COMMUNICATION]] += mesh_bytes
    return live

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

How each storage is tagged with its kind of memory, and with how its size depends on the world size, is
`memfit.memory.fsdp_log`; the run's bytes at any other world size are computed from those
(`RankRun.scaling`, `memfit.memory.world_scaling`), since FSDP2's own sharding of every parameter into W chunks
on fake tensors costs time in W (56 s at 1,024 ranks).

Known limitations: torch's FSDP2 internals are read and wrapped (`memfit.memory.fsdp_log`). Only CPU is
modelled (the fake mesh is a CPU mesh).
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
from memfit.device.torch_private import fake_store, fsdp_param_groups, tree_flatten
from memfit.memory.fsdp_log import RankLog, gloo_copies, tagging
from memfit.memory.kinds import MemoryKind
from memfit.memory.step import ExampleBatch, garbage_since, training_step
from memfit.memory.storage_log import LoggingFakeMode
from memfit.memory.world_scaling import WorldScaling

__all__ = ["RANK_KINDS", "RankRun", "default_units", "fsdp_fake_run"]

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
    scaling: WorldScaling | None = None   # this rank's bytes at other world sizes, where they follow from the run
    unscalable: str = ""                  # else why not


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules `fully_shard` is applied to by default, besides the root: every child of an `nn.ModuleList`
    or `nn.Sequential` that holds parameters (a transformer's blocks, a Sequential's layers), innermost first
    (`fully_shard` must wrap the inner units before the outer)."""
    units = [c for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
             for c in m.children() if any(True for _ in c.parameters())]
    depth = {m: i for i, m in enumerate(model.modules())}       # pre-order: an ancestor comes before
    return sorted(set(units), key=lambda m: -depth[m])


@contextmanager
def _fake_group(world_size: int, rank: int):
    """A default process group of torch's fake backend for the `with` block, and a CPU mesh over it."""
    from torch.distributed.device_mesh import init_device_mesh
    if dist.is_initialized():
        raise RuntimeError("a per-rank memory model of FSDP2 runs under a fake process group of its own, but a "
                           "process group is already initialised here; build the memory model before "
                           "dist.init_process_group (or in a process without one)")
    hook = sys.excepthook      # init_process_group wraps it to prefix "[rank0]: " to every later traceback
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


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


def _units_of(units, model: torch.nn.Module, fake: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `fake` (the structural copy of `model` the run wraps) that `units` names: `units(fake)`, or
    a list. A module of `model` itself (a `units=lambda m: [model.layers[0]]` that closes over the original) is
    the copy's module of the same qualified name; anything else raises, saying what it is."""
    if units is None:
        return default_units(fake)
    chosen = units(fake) if callable(units) else units
    if isinstance(chosen, torch.nn.Module) or not hasattr(chosen, "__iter__"):
        raise TypeError(f"expected units(model) to give a list of the model's modules; found {type(chosen).__name__}"
                        ": return a list, e.g. units=lambda m: list(m.layers)")
    copied = {id(m) for m in fake.modules()}
    names = {id(m): k for k, m in model.named_modules()}
    out: list[torch.nn.Module] = []
    for m in chosen:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"expected units to be modules of the model; found a {type(m).__name__}: {m!r:.80}")
        if id(m) not in copied:
            if id(m) not in names:
                raise ValueError(f"expected units to be modules of the model being predicted; found "
                                 f"{type(m).__name__} ({sum(p.numel() for p in m.parameters()):,} parameters), which "
                                 "is not one of them (fully_shard would wrap, and the prediction count, a module the "
                                 "model never runs): name the model's own modules, e.g. units=lambda m: "
                                 "[m.layers[0], m.layers[1]]")
            m = fake.get_submodule(names[id(m)])   # the original's module: the copy's at the same name
        if m is fake:
            raise ValueError("expected units besides the root; found the model itself: leave it out (fully_shard "
                             "wraps the root after the units)")
        if any(u is m for u in out):
            raise ValueError(f"expected each unit once; found {type(m).__name__} twice in units")
        out.append(m)
    at = {id(m): k for k, m in fake.named_modules()}
    for i, u in enumerate(out):      # fully_shard takes a unit's parameters but those of units wrapped before it
        inner = next((v for v in out[i + 1:] if at[id(v)].startswith(at[id(u)] + ".")), None)
        if inner is not None:
            raise ValueError(f"expected units innermost first (fully_shard wraps a module's inner units before it); "
                             f"found {at[id(u)]!r} before its submodule {at[id(inner)]!r}: list {at[id(inner)]!r} "
                             "first")
    return out


def fsdp_fake_run(model: torch.nn.Module, batch: ExampleBatch, n: int, *, world_size: int, rank: int,
                  optimizer, loss_fn: Callable | None, target: ExampleBatch | None,
                  units: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None,
                  reshard_after_forward: bool = True, mp_policy=None, autocast=None,
                  backend: str = "nccl", reads: list[tuple] | None = None, answers: bool = True) -> RankRun:
    """One rank's logged training step (see the module docstring) at a per-rank batch of n. With
    backend="gloo", the buffers gloo's collectives copy into while they run (`fsdp_log.gloo_copies`) are counted,
    and the largest buffer a collective's work holds is recorded (`RankRun.race_bytes`, what gloo's race may
    keep). `units`: the modules `fully_shard` wraps besides the root, innermost first, as `units(model)` or a
    list (`_units_of`; default `default_units`). `reads`: shared by the runs of one prediction, where a value read
    must be made alike at every size (`LoggingFakeMode`); answers=False: no value read answered, transformers' mask
    questions left unasked (`StepSpec.answers`)."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    device = torch.device("cpu")
    mode = LoggingFakeMode(allow_non_fake_inputs=False, first_reads=reads)
    log = RankLog(device, world_size)
    marks: dict[str, int] = {}
    enabled = gc.isenabled()
    # the unlogged step's garbage is all made in the run: the collect before the logged step walks the run's own
    # objects only (a full one took 0.18 s of the tests' MLP's 0.29 s run)
    with garbage_since() as collect, _fake_group(world_size, rank) as mesh, tagging(log), \
            gloo_copies(log) if backend == "gloo" else nullcontext():
        fake = _fake_copy(model, mode)
        opt = groups = sharded = None
        try:
            with mode, mode.logging_to(log, reads_values=answers, answers=answers):
                kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                      "mp_policy": mp_policy or MixedPrecisionPolicy()}
                log.tag = K.SHARDED_PARAMETERS
                chosen = _units_of(units, model, fake)
                for m in chosen:
                    fully_shard(m, **kw)
                fully_shard(fake, **kw)
                groups = [g for m in [*chosen, fake] for g in fsdp_param_groups(m)]
                meshes = sum(1 for m in [*chosen, fake] if fsdp_param_groups(m))
                sharded = [fp for g in groups for fp in g.fsdp_params]
                log.tag = None
                if not fake.training:
                    fake.train()
                opt = _same_optimizer(optimizer, model, fake) if optimizer is not None else None
                log.tag = K.INPUTS
                x = batch.at(n, device)
                y = target.at(n, device, x) if target is not None else None
                mode.known_values.unknown(tree_flatten((x, y))[0])   # the user's values, not these zeros
                log.tag = None
                # unlogged: before `start`
                training_step(fake, x, opt, loss_fn, y, autocast, step_reads=mode.step_reads)
                log.retag(optimizer_state(opt), K.OPTIMIZER_STATE)
                log.note_shards([(fp.sharded_param, fp) for fp in sharded] + [
                    (v, fp) for fp in sharded for v in (opt.state.get(fp.sharded_param, {}) if opt else {}).values()])
                collect()
                gc.disable()
                start = len(log.ops)

                def mark(phase, fake=fake):
                    log.ops.append(f"<end of {phase}>")
                    marks[phase] = len(log.ops) - start
                    log.stepping = phase == "backward"      # the optimizer's step runs until "step"
                    if phase == "backward":
                        log.retag([p.grad for p in fake.parameters() if p.grad is not None], K.GRADIENTS)
                training_step(fake, x, opt, loss_fn, y, autocast, mark, step_reads=mode.step_reads)
                log.stepping = False
                del x, y
                log.read_off(sharded, opt)
        finally:
            if enabled:
                gc.enable()
            del opt, fake, groups, sharded       # their cycles left to the collector: a full collect here cost 0.7 s
    # `fully_shard(m)` without a mesh makes one per call (`init_device_mesh`), whose rank tensor (world_size
    # int32, on the CPU) the unit keeps while it holds parameters; this run passes one mesh made unlogged
    mesh_bytes = meshes * world_size * torch.empty((), dtype=torch.int32).element_size()
    column = _column(log, start, marks)
    scaling, why = _scaling(log, start, column, meshes) if rank == 0 else \
        (None, f"rank {rank}'s shards are not the first chunks")
    return RankRun(log.ops[start:], _timeline(log, start, column, model, mesh_bytes), marks, log.race_bytes,
                   [(op - start, func, spec) for op, func, spec in log.scratch_ops if op >= start], scaling, why)


def _scaling(log: RankLog, start: int, column, meshes: int) -> tuple[WorldScaling | None, str]:
    """The run's bytes at any world size (`WorldScaling`) where every storage whose size depends on the world
    size has its `Scaled`: those allocated in FSDP2's collectives, kept as its shards and unsharded parameters,
    and made in the optimizer's step (`memfit.memory.fsdp_log`); else (None, why not)."""
    held: dict[int, int] = {}
    later = set()
    for op, aid, d in log.events:
        if op < start:
            held[aid] = held.get(aid, 0) + d
        elif d:
            later.add(aid)
    transient = {aid: at for aid, at in log.transients}
    by_fsdp = {K.SHARDED_PARAMETERS, K.UNSHARDED_PARAMETERS, K.COMMUNICATION}
    missing = [log.must_scale.get(aid) or f"{log.kind[aid].value}, allocated at op {log.first_op[aid] - start}"
               for aid in sorted(later | {a for a, v in held.items() if v}) if aid not in log.scaled
               and aid not in transient and (aid in log.must_scale or log.kind[aid] in by_fsdp)]
    reasons = log.unscalable + missing
    if reasons:
        return None, f"{reasons[0]}" + (f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else "")
    n_ops = len(log.ops) - start
    pseudo = [(log.first_op[aid] - start, column(aid), at) for aid, at in log.transients if log.first_op[aid] >= start]
    try:
        return WorldScaling.from_events(log.events, start, n_ops, len(RANK_KINDS), column, log.scaled, log.world,
                                        transients=pseudo, meshes=meshes, mesh_column=_COL[K.COMMUNICATION],
                                        race=log.race), ""
    except ValueError as e:
        return None, str(e)


def _column(log: RankLog, start: int, marks: dict[str, int]):
    """The kind column of an allocation: its tag, else by the phase it was made in."""
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
    return column


def _timeline(log: RankLog, start: int, column, model, mesh_bytes: int = 0) -> np.ndarray:
    """(ops, kinds) bytes live after each op from `start` on: everything logged before counts as held, plus
    what was never logged (the fake copies of buffers and of parameters `fully_shard` did not take, and the
    device meshes' rank tensors, `mesh_bytes`, as communication buffers)."""
    n_ops = len(log.ops) - start
    delta = np.zeros((n_ops + 1, len(RANK_KINDS)), dtype=np.int64)
    for op, aid, d in log.events:
        delta[min(max(op - start, 0), n_ops), column(aid)] += d
    live = np.cumsum(delta, axis=0)[:n_ops]
    live[:, _COL[K.PARAMETERS]] += sum(b.nbytes for b in model.buffers())   # buffers are not sharded
    live[:, _COL[K.COMMUNICATION]] += mesh_bytes
    return live

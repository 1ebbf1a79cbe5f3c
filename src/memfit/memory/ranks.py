"""The bytes one rank holds at the peak of a DDP or FSDP2 training step, predicted in one process.

`rank_memory_model(model, example, optimizer=opt, parallel="ddp" | "fsdp", world_size=N)` (what
`memfit.memory_model(..., train=True, parallel=..., world_size=N)` returns) answers per rank, at any batch
size per rank n:
- DDP: every rank holds the whole model, its gradients and optimizer state: the single-process step of
  `memfit.memory.step_model` at n, plus DDP's gradient buckets, one flat buffer per bucket that every
  gradient is copied into for the all-reduce (`gradient_as_bucket_view=False`, torch's default: the buckets
  hold the trainable parameters' bytes once more, whatever `bucket_cap_mb`, and live as long as the model).
  With `gradient_as_bucket_view=True` the gradients are views into the buckets: the buckets are held from
  the start and backward's gradients are copied into them and freed, which is the single-process step with
  every gradient held before it (`step_memory_model(grads_held=True)`), its held gradients being the buckets.
- FSDP2: the real `fully_shard` code runs on fake tensors under a fake process group of `BASE_WORLD` ranks
  (`memfit.memory.fsdp_run`; 1 for world_size=1), for rank 0, which holds the largest shards (`torch.chunk` on
  dim 0 gives the first ranks the padded rows). Runs at n = 2 and 4 give each op's bytes by kind as
  `a + b * n`, checked exactly at n = 8; where the check fails, each n asked for is its own run (`method` says
  which). Any other world size is computed from those runs (`RankMemoryModel.at_world`,
  `memfit.memory.world_scaling`: rank 0's shards are ceil(rows / W) rows of each parameter, the collectives'
  buffers W such shards), in the same few seconds at 10,000 ranks as at 2, exactly: where a run holds a
  storage whose size that does not give, each world size is run for itself, up to `DIRECT_MAX` ranks.
  The runs are kept per model until it changes (`memfit.memory.cache.ModelCache`): asked again (max_batch_size
  after memory_model, the other `gloo_race`), the model runs no step again.
`memfit.memory.fewest_ranks.ranks_needed(...)` is the fewest FSDP2 ranks whose per-rank peak fits a budget.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> ddp = rank_memory_model(model, (32,), optimizer=opt, parallel="ddp", world_size=2)
    >>> ddp.breakdown(8)["gradient buckets (DDP)"] == ddp.param_bytes
    True
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from memfit.budget import check_count, format_bytes
from memfit.device.torch_private import fsdp_param_groups, is_hsdp
from memfit.memory.cache import ModelCache
from memfit.memory.cuda_held import ddp_buckets
from memfit.memory.fsdp_run import RANK_KINDS, RankRun, fsdp_fake_run
from memfit.memory.kernel_scratch import scratch_ops
from memfit.memory.kinds import MemoryKind, summary
from memfit.memory.probes import answered_or_again
from memfit.memory.rank_checks import check_ddp_wrapping, check_not_offloaded
from memfit.memory.step import ExampleBatch, forward_state
from memfit.memory.step_model import StepMemoryModel, _callable_key, _optimizer_key, _signature, step_memory_model
from memfit.memory.world_scaling import WorldScaling

__all__ = ["BASE_WORLD", "DIRECT_MAX", "RankMemoryModel", "check_ddp_wrapping", "ddp_bucket_bytes",
           "rank_memory_model"]

PARALLEL = ("ddp", "fsdp")
BASE_WORLD = 2      # FSDP2 runs at this many ranks; every other world size above 1 is computed from those runs
DIRECT_MAX = 64     # where it cannot be (`RankMemoryModel.at_world`), runs at the world size itself, up to this


def ddp_bucket_bytes(model: torch.nn.Module) -> int:
    """Bytes of DDP's gradient buckets for `model`: every trainable parameter's bytes once (each storage once).

    Example:
        >>> ddp_bucket_bytes(torch.nn.Linear(8, 4))      # (32 + 4) float32
        144
    """
    seen = {id(p): p for p in model.parameters() if p.requires_grad}
    return sum(p.numel() * p.element_size() for p in seen.values())


@dataclass
class RankMemoryModel:
    """Bytes one rank holds at the peak of a DDP or FSDP2 training step, at any per-rank batch n.

    Attributes:
        method: how the figures are computed.
        param_bytes: the parameters (and buffers) one rank holds between steps: all of them under DDP, its
            shards (padded) and the buffers under FSDP2.
        parallel: "ddp" or "fsdp". world_size: the ranks.
    """
    method: str
    param_bytes: int
    device: torch.device
    train: bool
    parallel: str
    world_size: int
    _single: StepMemoryModel | None = None            # DDP: the single-process step
    _buckets: int = 0
    _bucket_view: bool = False                        # DDP: the gradients are views into the buckets
    _a: np.ndarray | None = None                      # FSDP: (ops, kinds) bytes a + b*n after each op
    _b: np.ndarray | None = None
    _exact: dict[int, np.ndarray] = field(default_factory=dict)   # n -> (ops, kinds) of a run at n
    _run_at: Callable[[int], RankRun] | None = None   # a run at n, where the line is not exact
    _race: int = 0                                    # FSDP on gloo: bytes gloo's race may keep, added at the peak
    _scratch: dict = field(default_factory=dict)      # FSDP: n -> `kernel_scratch.ScratchOp`s of its own run;
    #                                                   with the line, 4 -> those of every n (batch dims read off 2)
    _scratch_at: dict = field(default_factory=dict, repr=False)    # n -> (ops, kinds) of their bytes
    # FSDP at other world sizes: the runs are made at `_run_world` ranks (1, or BASE_WORLD for any other)
    _run_world: int = 1
    _runs_at: Callable[[int], RankMemoryModel] | None = None   # the model of runs at another world size
    _scalings: dict = field(default_factory=dict)     # n (a run's) or "line" -> its `WorldScaling`
    _unscalable: str = ""                             # why the runs give no other world size, where they do not
    _shift_at: dict = field(default_factory=dict, repr=False)      # n -> (ops, kinds) bytes added at world_size
    _how: str = ""                                    # FSDP: the wrapping and backend, for `method`
    _fit: str = ""                                    # FSDP: a line in n or a run per n, for `method`
    _gloo_race: bool = False                          # FSDP on gloo with gloo_race=True

    def __repr__(self) -> str:
        return summary(self, f"one of {self.world_size} ranks' {self.parallel.upper()} training step")

    def _live(self, n: int) -> np.ndarray:
        if n not in self._exact and self._a is None:
            run = self._run_at(n)
            self._exact[n], self._scratch[n] = run.live, _scratch_of(run, n)
            if run.scaling is not None:
                self._scalings[n] = run.scaling
        live = self._exact[n] if n in self._exact else self._a + self._b * n
        if self.world_size != self._run_world:
            live = live + self._shift(n)
        ops = self._scratch.get(4 if self._a is not None else n)
        if not ops:
            return live
        if n not in self._scratch_at:
            # what kernels on half-precision arguments (a bf16 MixedPrecisionPolicy) or matmuls copying an argument
            # BLAS cannot read allocate inside, measured by the real kernels at batch n's shapes (not a line in n),
            # at each op's row
            extra = np.zeros(live.shape)
            for op in ops:
                extra[op.row, op.column] += op.bytes_at(n)
            self._scratch_at[n] = extra
        return live + self._scratch_at[n]

    def _shift(self, n: int) -> np.ndarray:
        """(ops, kinds) bytes of `world_size` ranks beyond those of the runs' (`memfit.memory.world_scaling`)."""
        if n not in self._shift_at:
            scaling = self._scalings.get(n, self._scalings.get("line"))
            if scaling is None:
                raise ValueError(f"expected the run at a batch of {n} per rank to give other world sizes, as the first "
                                 f"runs did; found {self._unscalable or 'it does not'}: predict at world_size="
                                 f"{self._run_world}, or at a batch size of the first runs ({sorted(self._exact)})")
            self._shift_at[n] = scaling.shift(self.world_size)
        return self._shift_at[n]

    @property
    def unscalable(self) -> str:
        """FSDP2: why each other world size needs runs of its own (`at_world`); "" where it follows from these."""
        return "" if self._scalings or self.parallel == "ddp" else self._unscalable

    def at_world(self, world_size: int) -> RankMemoryModel:
        """The same step on `world_size` ranks. FSDP2: computed from the runs, rank 0's shards and the collectives'
        buffers being sums of ceil(rows / W) rows (`memfit.memory.world_scaling`); where the runs do not give it
        (`method` says why), run at that world size itself, up to `DIRECT_MAX` ranks (a fake run of FSDP2 costs
        time in W), else ValueError. World size 1 always runs (FSDP2 takes other paths there)."""
        world_size = check_count("world_size", world_size, 1)
        if self.parallel == "ddp":
            return replace(self, world_size=world_size)
        if world_size == self._run_world:
            return self if self.world_size == world_size else self._at(world_size)
        if 1 in (world_size, self._run_world):
            return self._runs_at(1 if world_size == 1 else BASE_WORLD).at_world(world_size)
        if self._scalings:
            return self._at(world_size)
        if world_size <= DIRECT_MAX:
            direct = self._runs_at(world_size)
            direct.method += (f"; run at {world_size} ranks, not computed from {self._run_world}: "
                              f"{self._unscalable}")
            return direct
        raise ValueError(f"expected FSDP2's bytes at {world_size} ranks to follow from the run at {self._run_world} "
                         f"(rank 0's shards of ceil(rows / W) rows); found what does not: {self._unscalable}. A run "
                         f"at the world size itself costs time in it and is made up to {DIRECT_MAX} ranks: predict "
                         f"at most {DIRECT_MAX}, or without what the reason names")

    def _at(self, world_size: int, run: RankRun | None = None) -> RankMemoryModel:
        """This FSDP2 model at `world_size` ranks (its runs' own, or one their scaling gives), with its held
        parameters, gloo's race and `method` for it. `run`: the first run, when the model is new."""
        mm = self if run is not None else replace(self, world_size=world_size, _shift_at={})
        scaling = next(iter(mm._scalings.values()), None)
        race = 0 if not mm._gloo_race else run.race_bytes if run is not None else scaling.race_at(world_size)
        mm._race = race
        held = mm._live(min(mm._exact))[0]
        mm.param_bytes = int(held[RANK_KINDS.index(MemoryKind.SHARDED_PARAMETERS)]
                             + held[RANK_KINDS.index(MemoryKind.PARAMETERS)])
        how = (f"fully_shard run on fake tensors under a fake process group of {mm._run_world} ranks (rank 0, the "
               f"largest shards; {mm._how}"
               + (f", plus {race} bytes at the peak: the largest collective buffer, which gloo's race may keep"
                  if race else "") + f"), {mm._fit}")
        if world_size != mm._run_world:
            how += (f"; at {world_size} ranks computed from those runs: rank 0's shard of each parameter is ceil(rows "
                    f"/ {world_size}) of its rows, the all-gather and reduce-scatter buffers {world_size} such shards "
                    "(memfit.memory.world_scaling; exact against the fake run at the world size itself)")
        mm.method = how
        return mm

    def breakdown(self, n: int) -> dict[str, int]:
        """Bytes at this rank's peak for a per-rank batch of n, by kind (they sum to `total_bytes(n)`)."""
        n = check_count("the batch size per rank", n, 1)
        if self._single is not None and self._single._cuda is not None:   # the buckets are blocks in its replay
            return self._single.breakdown(n)
        if self._single is not None:
            parts = self._single.breakdown(n)
            if self._bucket_view:                     # the held gradients are the buckets
                return {**parts, MemoryKind.GRADIENTS.value: 0,
                        MemoryKind.GRADIENT_BUCKETS.value: parts[MemoryKind.GRADIENTS.value]}
            return {**parts, MemoryKind.GRADIENT_BUCKETS.value: self._buckets}
        live = self._live(n)
        k = int(np.argmax(live.sum(axis=1)))
        parts = {kind.value: int(v) for kind, v in zip(RANK_KINDS, np.ceil(live[k]).tolist(), strict=True)}
        parts[MemoryKind.COMMUNICATION.value] += self._race
        return parts

    def total_bytes(self, n: int) -> int:
        """Bytes at this rank's peak for a per-rank batch of n."""
        return sum(self.breakdown(n).values())

    def serves(self, n: int, budget: int) -> bool:
        """Whether a per-rank batch of n fits `budget` (on CUDA: the caching allocator serves it, `StepMemoryModel`)."""
        return self._single.serves(n, budget) if self._single is not None else self.total_bytes(n) <= budget

    def explain(self, n: int = 1) -> str:
        """What the figure is, how it was computed, and the bytes by kind at a per-rank batch of n."""
        lines = [f"per-rank memory of one {self.parallel.upper()} training step on {self.world_size} ranks, by "
                 f"{self.method}.", f"batch {n} per rank: {format_bytes(self.total_bytes(n))} at the peak:"]
        lines += [f"  {k:<34} {format_bytes(v):>12}" for k, v in self.breakdown(n).items() if v]
        cuda = self._single._cuda if self._single is not None else None
        lines.append(cuda.explain(n) if cuda is not None else
                     "CPU: bytes the allocator holds for tensors (memfit.memory.measure_rank_step counts the same).")
        return "\n".join(lines)


def rank_memory_model(model: torch.nn.Module, example, *, optimizer=None, loss_fn=None, target=None,
                      parallel: str = "fsdp", world_size: int = 2, units=None,
                      reshard_after_forward: bool | None = None, mp_policy=None, autocast: torch.dtype | None = None,
                      dtype: torch.dtype = torch.float32, backend: str = "nccl",
                      gradient_as_bucket_view: bool | None = None, offload_policy=None,
                      gloo_race: bool = True, probes: tuple[int, ...] = (2, 4, 8), device=None,
                      gpu=None) -> RankMemoryModel:
    """The per-rank memory of a DDP or FSDP2 training step of `model` (see the module docstring).

    Args:
        model: the model on the CPU, before wrapping; or, with parallel="ddp", its `DistributedDataParallel`
            (whose `gradient_as_bucket_view` is read). A plain model with parallel="ddp" is predicted for
            `DistributedDataParallel(model)` with DDP's defaults: no `mixed_precision=`, no comm hook; a DDP module
            with either raises (not modelled: `check_ddp_wrapping`).
        example: a sample shape or an example batch (its leading dimension is the per-rank batch).
        parallel: "ddp" (`DistributedDataParallel` with its defaults) or "fsdp" (`fully_shard`).
        world_size: the number of ranks. FSDP2 runs at `BASE_WORLD` ranks (1 for 1) and computes any other world
            size from those runs (`RankMemoryModel.at_world`); `method` says so.
        units: FSDP2 only: `units(model)` -> the modules `fully_shard` wraps besides the root, innermost first,
            or a list of them (default `memfit.memory.fsdp_run.default_units`: the children of every ModuleList and
            Sequential). The model's own modules stand for those of the copy the run wraps (by qualified name);
            anything else raises.
        reshard_after_forward, mp_policy: FSDP2 only, passed to every `fully_shard` call. reshard_after_forward=None
            is `fully_shard`'s own default: every unit reshards after forward but the root, which keeps its
            parameters gathered for backward (torch's heuristic); True or False apply to the root as well.
        backend: "nccl" (collectives in place) or "gloo" (its all-gather and reduce-scatter copy the whole
            buffer while they run; DDP's all-reduce is in place on both).
        gloo_race: FSDP2 on gloo: gloo's worker thread may keep a collective's tensors after the call returns
            (`memfit.memory.fsdp_log.gloo_copies`), a race whose outcome varies run to run. True: add the
            largest buffer one collective holds (an all-gather output, a reduce-scatter input) at the peak, a
            bound of every run seen; False: the schedule where each
            collective's tensors are dropped as its call returns (what `memfit.testing.ranks.settled_gloo` makes
            the ranks run, and the common case on an idle machine).
        gradient_as_bucket_view: DDP only: the gradients are views into the buckets (default: the DDP
            module's flag, or torch's default False).
        probes: FSDP2 only: the per-rank batch sizes run on fake tensors first. (2, 4, 8): each op's bytes per
            kind as a line a + b*n through 2 and 4, used where it is exact at 8 (every n from three runs); one size
            (`ranks_needed`): exact there, any other size runs again.
        device, gpu: DDP only: "cuda" predicts the rank's CUDA step (`memfit.memory.cuda_step`, from any machine;
            `gpu` as `memfit.memory_model`'s), DDP's buckets as blocks of the allocator (`cuda_step.ddp_buckets`).
        offload_policy: FSDP2's `CPUOffloadPolicy` is not modelled: anything but None or a plain
            `OffloadPolicy()` raises. HSDP (a 2-D mesh) is not modelled either: a model already wrapped by
            `fully_shard` raises, saying which.
    """
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"expected backend 'nccl' or 'gloo'; found {backend!r}")
    if parallel not in PARALLEL:
        raise ValueError(f"expected parallel in {PARALLEL}; found {parallel!r}")
    world_size = check_count("world_size", world_size, 1)
    model, gradient_as_bucket_view = _unwrapped(model, parallel, gradient_as_bucket_view)
    check_not_offloaded(offload_policy)
    dev = torch.device("cpu")
    if parallel == "fsdp" and (device is not None and torch.device(device).type == "cuda" or gpu is not None):
        raise ValueError("expected parallel='ddp' for a per-rank CUDA prediction; found parallel='fsdp': FSDP2's "
                         "runs are not replayed through the CUDA caching allocator yet (its per-rank model is the "
                         "CPU's bytes): predict DDP, or measure with memfit.memory.measure_rank_step")
    if any(t.device.type != "cpu" for t in model.parameters()):
        raise ValueError("the per-rank memory model runs for a model on the CPU (its fake mesh is a CPU mesh); "
                         "found parameters elsewhere: predict with model.cpu()")
    if parallel == "ddp":
        if units is not None or mp_policy is not None or reshard_after_forward is not None or \
                offload_policy is not None:
            raise ValueError("units, reshard_after_forward, mp_policy and offload_policy are FSDP2 options; found "
                             "them with parallel='ddp'")
        single = step_memory_model(model, example, train=True, optimizer=optimizer, loss_fn=loss_fn,
                                   target=target, autocast=autocast, dtype=dtype,
                                   grads_held=gradient_as_bucket_view, device=device, gpu=gpu)
        if single._cuda is not None:
            single = ddp_buckets(single, model, gradient_as_bucket_view)
            dev = single.device
        if gradient_as_bucket_view:
            return RankMemoryModel(f"the single-process step ({single.method}), its held gradients being DDP's "
                                   "buckets (gradient_as_bucket_view=True: the gradients are views into them)",
                                   single.param_bytes, dev, True, "ddp", world_size, single, _bucket_view=True)
        buckets = ddp_bucket_bytes(model)
        return RankMemoryModel(f"the single-process step ({single.method}) plus DDP's gradient buckets (every "
                               "trainable parameter's bytes once, gradient_as_bucket_view=False)",
                               single.param_bytes, dev, True, "ddp", world_size, single, buckets)
    if gradient_as_bucket_view is not None:
        raise ValueError("gradient_as_bucket_view is a DDP option; found it with parallel='fsdp'")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"expected reshard_after_forward None, True or False; found {reshard_after_forward!r}: "
                         "resharding to a smaller mesh after forward (an int) is not modelled; predict True or "
                         "False and check the int's step with memfit.memory.measure_rank_step")
    if not probes:
        raise ValueError("expected probes, the per-rank batch sizes to run first, to hold at least one size; found ()")
    probes = tuple(check_count("each of probes", p, 1) for p in probes)
    batch = ExampleBatch(example, dtype)
    tgt = ExampleBatch(target, dtype, beside=batch) if target is not None else None
    key = (_signature(batch.template), _signature(tgt.template if tgt else None), batch.repeats, tgt and tgt.repeats,
           _optimizer_key(optimizer),
           _callable_key(loss_fn), None if units is None else _callable_key(units) if callable(units)
           else tuple(map(id, units)) if isinstance(units, (list, tuple)) else id(units),
           reshard_after_forward, mp_policy, autocast, backend, forward_state(),
           torch.get_num_threads())             # kernels' workspaces are per thread

    reads: list[tuple] = []                     # the values read in this prediction's first run (`LoggingFakeMode`)
    answering = [True]                          # False once a value read depended on the batch size

    def runs_at(w: int) -> RankMemoryModel:
        how = (f"reshard_after_forward={reshard_after_forward}"
               + (" (fully_shard's default: every unit but the root)" if reshard_after_forward is None else "")
               + f", {backend}")

        def make(answers: bool) -> RankMemoryModel:
            answering[0] = answers
            if not answers:                     # the runs made again: their reads are the first
                reads.clear()
            # kept per model (`_RUNS`): a prediction asked again runs no step again
            run = lambda n: _RUNS.get(model, (key, answers, w, n), lambda: fsdp_fake_run(
                model, batch, n, world_size=w, rank=0, optimizer=optimizer, loss_fn=loss_fn, target=tgt,
                units=units, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, autocast=autocast,
                backend=backend, reads=reads, answers=answers))
            said = how if answers else f"{how}; values not read (a value read depends on the batch size)"
            return _fsdp_model(run, w, probes, said, backend == "gloo" and gloo_race, runs_at)
        return answered_or_again(make, answering[0])[0]
    return runs_at(1 if world_size == 1 else BASE_WORLD).at_world(world_size)


# model -> {(the run's arguments, world size, batch): RankRun}: the fake runs of FSDP2, kept for the model's next
# predictions (memory_model then max_batch_size, gloo_race either way, another world size from the same runs)
# until anything a forward could depend on changes (`ModelCache`)
_RUNS = ModelCache()


def _fsdp_model(run, world: int, probes: tuple[int, ...], how: str, race: bool, runs_at) -> RankMemoryModel:
    """The FSDP2 model of the runs `run(n)` at `world` ranks, at each of `probes` (see the module docstring)."""
    runs = {n: run(n) for n in probes}
    first = runs[probes[0]]
    mm = RankMemoryModel("", 0, torch.device("cpu"), True, "fsdp", world, _exact={n: r.live for n, r in runs.items()},
                         _run_at=run, _run_world=world, _runs_at=runs_at, _how=how, _gloo_race=race)
    mm._unscalable = next((r.unscalable for r in runs.values() if r.scaling is None), "")
    mm._scalings = {} if mm._unscalable else {n: r.scaling for n, r in runs.items()}
    if any(r.scratch for r in runs.values()):
        mm._how += (f", what {max(len(r.scratch) for r in runs.values())} kernels allocate inside (half-precision "
                    "scratch, matmuls' copies BLAS cannot read) measured from the real kernels at each batch size "
                    "asked about")
    if {2, 4, 8} <= set(runs) and all(r.ops == runs[2].ops for r in runs.values()):
        a = 2 * runs[2].live - runs[4].live
        b = (runs[4].live - runs[2].live) / 2
        if np.array_equal(a + 8 * b, runs[8].live):
            mm._a, mm._b = a.astype(np.float64), b
            mm._scratch = {4: _scratch_of(runs[4], 4, runs[2], 2)}
            mm._fit = "per op and kind a + b*n from n = 2 and 4, exact at 8"
            scalings = list(mm._scalings.values())
            if scalings and all(_same(s, scalings[0]) for s in scalings):
                mm._scalings["line"] = scalings[0]
            elif scalings:
                mm._scalings, mm._unscalable = {}, "the runs at n = 2, 4 and 8 scale with the world size differently"
            return mm._at(world, first)
    mm._scratch = {n: _scratch_of(r, n) for n, r in runs.items()}
    mm._fit = "one run per batch size (the bytes are not a line in n)"
    return mm._at(world, first)


def _same(s: WorldScaling, t: WorldScaling) -> bool:
    """Whether two runs' `WorldScaling`s give the same bytes at every world size."""
    return s.atoms.keys() == t.atoms.keys() and all(np.array_equal(s.atoms[k], t.atoms[k]) for k in s.atoms) \
        and [(r, c) for r, c, _ in s.transients] == [(r, c) for r, c, _ in t.transients] and s.meshes == t.meshes


def _scratch_of(run: RankRun, n: int, other: RankRun | None = None, m: int | None = None) -> list:
    """The ops of an FSDP2 run at batch n whose kernels' scratch is measured (`memfit.memory.kernel_scratch`),
    which dimensions carry the batch read off the same ops of `other` (at batch m); without it, exact at n."""
    ends = run.phase_ends

    def column(row: int) -> int:
        kind = MemoryKind.ACTIVATIONS if row < ends.get("forward", len(run.ops)) else \
            MemoryKind.BACKWARD_TRANSIENT if row < ends.get("backward", len(run.ops)) else MemoryKind.STEP_TRANSIENT
        return RANK_KINDS.index(kind)
    return scratch_ops(run, n, other, m, column)


def _unwrapped(model: torch.nn.Module, parallel: str, bucket_view: bool | None):
    """(the model to predict for, gradient_as_bucket_view): a DDP module gives its module and its flag; a model
    that `fully_shard` has wrapped raises (it cannot be copied onto fake tensors), naming what is not modelled."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        if parallel != "ddp":
            raise ValueError(f"expected a model before wrapping with parallel={parallel!r}; found a "
                             "DistributedDataParallel module: pass its .module")
        if bucket_view is not None and bucket_view != model.gradient_as_bucket_view:
            raise ValueError(f"expected gradient_as_bucket_view to be the DDP module's "
                             f"({model.gradient_as_bucket_view}); found {bucket_view}: leave it out")
        check_ddp_wrapping(model)
        return model.module, model.gradient_as_bucket_view
    from torch.distributed.fsdp import FSDPModule
    wrapped = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if wrapped:
        groups = [g for m in wrapped for g in fsdp_param_groups(m)]
        offload = any(p.offload_to_cpu for g in groups for p in g.fsdp_params)
        hsdp = any(is_hsdp(g) for g in groups)
        what = ("CPU offload (CPUOffloadPolicy), which is not modelled" if offload else
                "HSDP (a 2-D mesh: replicate x shard), which is not modelled" if hsdp
                else "the wrapping already applied")
        raise ValueError(f"expected the model before fully_shard (the per-rank model applies it to a fake copy); "
                         f"found a model fully_shard has wrapped, with {what}: predict with the unwrapped model "
                         "(units= for your wrapping); offload and HSDP have no per-rank model yet")
    return model, (bool(bucket_view) if parallel == "ddp" else bucket_view)

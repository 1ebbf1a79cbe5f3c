"""The memory of a forward, or of a whole training step, from running it on fake tensors: nothing is allocated.

`step_memory_model(model, example, train=True, optimizer=opt, loss_fn=...)` runs the real code (forward,
loss, backward, `optimizer.step()`, `zero_grad()`) on fake tensors at small batch sizes
(`memfit.memory.fake_run.fake_run`), logging every storage allocated and freed (the live bytes
`memfit.device.measure` counts). Each op's live bytes, per kind (activations, gradients, optimizer state,
transients), is then `a + b * n`, and the peak at any n is the largest over the ops. A fake run costs
Python work per op whatever the tensors' sizes, so a prediction runs as few as it can:
- batch 4 and batch 1. When both allocate and free the same storages at the same ops, each the same size
  in both or 4 times as large, every size is constant or proportional to the batch and the line through
  the two runs is exact: two runs.
- otherwise batch 2 as well: the line through 2 and 4 under the same check, and batch 1 its own exact run
  where it runs other ops (broadcast parameters need no reduction over a batch of one). Where sizes are not
  proportional, the line through 2 and 4 is checked at a third size; where that fails (an n x n similarity
  matrix) a quadratic per op is fit at 2, 4, 8 and checked at a fourth; where even that fails, or the ops
  change with the batch, a line above the runs is used and `method` says APPROXIMATE (with a warning): an
  estimate beyond the sizes run, not a bound; `max_batch_size` checks its answer by a run at it
  (`memfit.memory.recheck`).
- the optimizer step runs once, at batch 4: it reads and writes parameters, gradients and its state, none
  of which depends on the batch, so what it adds above the end of backward is the same at every size and
  is put into the other runs, which skip it; in `memfit.fit`, once over all its settings (`probes.StepProbes`).
No `torch.export`, so any model that runs eagerly works; data-dependent Python control flow does not
(`FakeRunError` says so). The model, its buffers, `.grad` and the optimizer are left exactly as they were.

The figure is the steady state of a training loop: what the step keeps (optimizer state created
lazily on the first step, gradients when `zero_grad` keeps them) is counted as held from the start.
The output and loss are held until the step ends, as locals of a training-step function are.

Example:
    >>> import torch
    >>> from memfit.memory.step import measure_step
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> mm = step_memory_model(model, (32,), train=True, optimizer=opt)
    >>> b = mm.breakdown(64)
    >>> b["optimizer state"] == 2 * b["parameters"] + 4 * 4        # exp_avg, exp_avg_sq, a 4-byte step per tensor
    True
    >>> mm.total_bytes(64) - measure_step(model, torch.randn(64, 32), opt)   # the CPU's margin for a wrapped number
    16
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from memfit.budget import check_count, format_bytes, model_device
from memfit.device.allocators import cpu_margin
from memfit.device.torch_private import tree_flatten
from memfit.memory.cache import ModelCache, Same
from memfit.memory.cuda_step import CudaPeak, CudaStep, cuda_step
from memfit.memory.cuda_target import CudaDevice, cuda_device_for, sdp_backends
from memfit.memory.example_target import example_target, loss_target
from memfit.memory.fake_run import FakeRunError, StepSpec, _Run
from memfit.memory.fit import gradient_line
from memfit.memory.isolation import predicting
from memfit.memory.kinds import STEP_KINDS, MemoryKind, summary
from memfit.memory.known_values import DataDependentOnBatchSize
from memfit.memory.probes import optimizer_groups, probed, step_how
from memfit.memory.recheck import Recheck, run_scratch
from memfit.memory.step import ExampleBatch, forward_state, predicted_module, surrounding_autocast

__all__ = ["PHASES", "StepMemoryModel", "step_memory_model"]

PHASES = ("forward", "backward", "step", "zero_grad")     # a training step's phases, in order



@dataclass
class StepMemoryModel:
    """Bytes of one training step (or a forward) at any batch size n, from fake-tensor runs at small sizes.

    Attributes:
        method: how the sizes at other batch sizes are computed.
        param_bytes: parameters and buffers.
        device: the device the figures are for (on CUDA: the caching allocator's reserved bytes and the fixed
            costs, `memfit.memory.cuda_step`; `cuda(n)` gives the allocator's figures).
    """
    method: str
    param_bytes: int
    device: torch.device
    train: bool
    _held: dict[str, tuple[int, int]]                 # kind -> (a, b): bytes a + b*n there before the step
    _a: np.ndarray                                    # (ops, kinds): live bytes a + b*n after each op
    _b: np.ndarray
    _ops: list[str]
    _ends: dict[str, int]
    _measured: dict[int, np.ndarray] = field(default_factory=dict)   # n -> (ops, kinds) where probed exactly
    _c: np.ndarray | None = None                      # (ops, kinds): + c*n^2 where sizes grow faster than n
    _grads: tuple[float, float] = (0.0, 0.0)          # (a, b): bytes a + b*n of the gradients' storages
    _grads_probed: dict[int, int] = field(default_factory=dict)     # n -> the gradients' storages where probed
    why: str = ""                                     # why this model and not the planner's (as the caller said)
    _scratch: dict = field(default_factory=dict)      # 4, and each n in _measured -> `kernel_scratch.ScratchOp`s
    #                                                   of that run: measured at each n asked about
    _scratch_at: dict = field(default_factory=dict, repr=False)     # n -> (ops, kinds) of their bytes
    _measured_ends: dict = field(default_factory=dict)                # n in _measured -> its run's phase ends
    _cuda: CudaStep | None = None                     # on CUDA: the allocator replayed, the fixed costs
    _recheck: Recheck | None = field(default=None, repr=False)      # APPROXIMATE on the CPU: a run at another size
    held_runs: str = ""                               # grads_held: whether its runs were derived from the plain
    #                                                   step's ("derived ...") or its own ("own runs: " and why)

    def __repr__(self) -> str:
        return summary(self, "one training step" if self.train else "one eager forward")

    def gradient_bytes(self, n: int) -> int:
        """Bytes of the storages the gradients of a step on n samples sit in (with `grads_held`, the gradients
        held before the step). More than the parameters' bytes where a gradient is a view of a larger buffer:
        backward of `torch.cat` leaves each input's gradient as a slice of one buffer of the whole, which may
        hold frozen rows, or the batch's own rows (then it grows with n)."""
        n = _batch(n)
        if n in self._grads_probed:
            return self._grads_probed[n]
        a, b = self._grads
        return int(np.ceil(a + b * n))

    def _peak(self, n: int, inside: bool = True, phases: tuple[str, ...] | None = None) -> tuple[int, np.ndarray]:
        live = self._a + self._b * n + (self._c * n * n if self._c is not None else 0)
        if n in self._measured:       # a size run on its own (batch 1) is exact there: a kernel may take another
            live = self._measured[n]  # path at it (oneDNN's convolution backward: 192 B inside, 22 KiB from batch 2)
        if self._scratch and inside:
            live = live + self._scratch_bytes(n, live)
        totals = live.sum(axis=1)
        if phases is not None:
            totals = np.where(self._in_phases(n, live.shape[0], phases), totals, -np.inf)
        k = int(np.argmax(totals))
        return k, np.ceil(live[k]).astype(np.int64)

    def _in_phases(self, n: int, rows: int, phases: tuple[str, ...]) -> np.ndarray:
        """(rows,) bool: the ops of the step run in those phases (PHASES), for batch n's rows (its own exact run's
        where it ran other ops). A fit with one row (the line above the peaks) cannot tell phases apart: every
        phase then has that row, never below."""
        unknown = set(phases) - set(PHASES)
        if unknown:
            raise ValueError(f"phases must be among {PHASES}; found {sorted(unknown)}")
        if rows == 1:
            return np.ones(1, dtype=bool)
        ends = self._measured_ends.get(n, self._ends) if n in self._measured else self._ends
        mask, start = np.zeros(rows, dtype=bool), 0
        for phase in PHASES:           # each phase's ops run up to its end marker (included); zero_grad to the last
            end = rows if phase == "zero_grad" else max(start, ends.get(phase, start))
            mask[start:end] = phase in phases
            start = end
        return mask

    def _scratch_bytes(self, n: int, live: np.ndarray) -> np.ndarray:
        """(ops, kinds) like `live`: what kernels allocate inside at batch n (oneDNN's workspaces, the scratch of
        kernels on half-precision arguments, matmuls' copies of arguments BLAS cannot read), measured by the real
        kernels at that batch's shapes (`memfit.memory.kernel_scratch`; not a line in the batch: oneDNN
        picks its algorithm by size), at its op's row: batch 4's ops, or batch n's own where it ran other ops (its
        own exact run); where the rows are one line above the peaks, the largest."""
        if n not in self._scratch_at:
            ops = self._scratch.get(n, self._scratch[4]) if n in self._measured else self._scratch[4]
            extra = np.zeros(live.shape)
            for s in ops:
                if extra.shape[0] == 1:
                    extra[0, 0] = max(extra[0, 0], s.bytes_at(n))
                else:
                    extra[s.row, s.column] += s.bytes_at(n)
            self._scratch_at[n] = extra
        return self._scratch_at[n]

    def breakdown(self, n: int, *, inside: bool = True, phases: tuple[str, ...] | None = None) -> dict[str, int]:
        """Bytes at the step's peak for a batch of n, by kind (they sum to `total_bytes(n)`); inside=False leaves
        out what kernels allocate inside that is measured by running them at each size asked about (see
        `lower_bytes`); `phases` (some of PHASES): the peak over the ops of those phases only (accumulate holds
        the gradients of the step before through its micro-batches' forward and backward, not its optimizer step)."""
        n = _batch(n)
        if self._cuda is not None and phases is None:       # reserved at the peak, the fixed costs
            return self._cuda.breakdown(n)
        out = self._allocated(n, inside, phases)
        if self._cuda is not None:           # some phases: their allocated bytes, the allocator's and fixed costs
            return self._cuda.around(n, out)
        out[MemoryKind.ALLOCATOR_MARGIN.value] = cpu_margin()         # the CPU (a model on meta runs there too)
        return out

    def _allocated(self, n: int, inside: bool = True, phases: tuple[str, ...] | None = None) -> dict[str, int]:
        """The fitted live bytes by kind at the peak (on CUDA each storage rounded up to its block)."""
        _, parts = self._peak(n, inside, phases)
        out = {"parameters": self.param_bytes, "inputs": 0}
        for kind, (a, b) in self._held.items():
            out[kind] = out.get(kind, 0) + a + b * n
        for kind, v in zip((k.value for k in STEP_KINDS), parts.tolist(), strict=True):     # the same keys at every n
            if v or (kind == "activations") or (self.train and kind != "kept by the model"):
                out[kind] = out.get(kind, 0) + v
        return out

    def cuda(self, n: int) -> CudaPeak:
        """On CUDA, the caching allocator's figures at a batch of n: peak reserved and allocated
        (`torch.cuda.max_memory_reserved` / `max_memory_allocated` of a training loop), the fixed costs outside it,
        the segments and the largest free block when reserved peaked."""
        if self._cuda is None:
            raise ValueError(f"cuda(n) gives the caching allocator's figures of a CUDA model; this one is for "
                             f"{self.device}: predict with device='cuda'")
        return self._cuda.peak(_batch(n))

    def serves(self, n: int, budget: int | None, **replay) -> bool:
        """Whether a batch of n fits `budget` bytes of device memory: on CUDA, whether the caching allocator
        serves every request of the step (after freeing its cache and retrying, as c10 does) in what the fixed
        costs outside it leave (`replay`: `memory_fraction` and `device_total`, as under
        `torch.cuda.set_per_process_memory_fraction`; budget None: no other limit); elsewhere, whether
        `total_bytes(n) <= budget`."""
        n = _batch(n)
        return self._cuda.serves(n, budget, **replay) if self._cuda is not None else self.total_bytes(n) <= budget

    def saved_activation_bytes(self, n: int) -> int:
        """Bytes the forward (and loss) leave alive for backward, for a batch of n (at the forward's end)."""
        k = self._ends.get("forward", len(self._ops)) - 1
        if self._a.shape[0] <= k or k < 0:              # the line-through-peaks fallback keeps no per-op rows
            return self.breakdown(n)["activations"]
        n = _batch(n)
        return int(np.ceil(self._a[k, 0] + self._b[k, 0] * n + (self._c[k, 0] * n * n if self._c is not None else 0)))

    def total_bytes(self, n: int) -> int:
        """Bytes held at the peak of the step (or forward) for a batch of n."""
        return sum(self.breakdown(n).values())

    def lower_bytes(self, n: int) -> int:
        """`total_bytes(n)` without what kernels allocate inside that is measured by running them at batch n
        (oneDNN's workspaces, half-precision scratch): never above `total_bytes(n)`, and free at any n. Searches
        for the largest batch that fits start below its answer (`memfit.budget.largest_fitting(below=...)`), so
        the real kernels run only near the answer."""
        return sum(self.breakdown(n, inside=False).values())

    def peak_phase(self, n: int) -> str:
        """Where the peak falls for a batch of n: 'forward', 'backward', 'step' or 'zero_grad'."""
        k, _ = self._peak(_batch(n))
        for phase in ("forward", "backward", "step"):
            if phase in self._ends and k < self._ends[phase]:
                return phase
        return "zero_grad" if self.train else "forward"

    def explain(self, n: int = 1) -> str:
        """What the figure is, how it was computed, and the bytes by kind at a batch of n."""
        what = "one training step (forward, loss, backward, optimizer step, zero_grad)" if self.train \
            else "one eager forward, model(x) under torch.no_grad() (what you run; memfit.plan's planned forward is " \
            "memory_model(..., planned=True))"
        lines = [f"memory of {what} on {self.device}, by {self.method}.",
                 f"batch {n}: {format_bytes(self.total_bytes(n))} at the peak, during the {self.peak_phase(n)}:"]
        lines += [f"  {k:<20} {format_bytes(v):>12}" for k, v in self.breakdown(n).items()]
        if self.train:
            saved = format_bytes(self.saved_activation_bytes(n))
            lines.append(f"saved for backward at the end of the forward: {saved}. Steady state of a training loop: "
                         "what the step keeps (optimizer state, gradients that "
                         "zero_grad keeps) is counted from the start; the output and loss live until the step ends.")
        if self._cuda is not None:
            lines.append(self._cuda.explain(_batch(n)))
        else:
            lines.append("CPU: live tensor bytes, as memfit.device.measure counts them.")
        return "\n".join(lines)


def _batch(n) -> int:
    return check_count("the batch size", n, 1)


@predicting()          # one prediction at a time; every RNG as found
def step_memory_model(model: torch.nn.Module, example, *, train: bool = True, optimizer=None,
                      loss_fn: Callable | None = None, target=None, autocast: torch.dtype | None = None,
                      dtype: torch.dtype = torch.float32, device=None, why: str = "",
                      grads_held: bool = False, keep_output: bool = True, gpu=None,
                      plain_runs: dict | None = None, steps: dict | None = None) -> StepMemoryModel:
    """The bytes of one training step (train=True) or forward (train=False) at any batch size, from fake runs.

    Args:
        example: a sample shape without the batch dimension, or an example batch (tensor, tuple or dict of
            tensors; the leading dimension is the batch and is rescaled).
        optimizer: its step and state are counted (a copy runs; the optimizer itself is not touched).
        loss_fn: `loss_fn(output, target)` (or `loss_fn(output)` without a target); by default the
            output's `.loss` (transformers) or the sum of the outputs.
        target: an example target batch (or its sample shape) for loss_fn. None with a common loss
            (cross-entropy, NLL, MSE, L1, smooth L1, BCE with logits): built from the output
            (`memfit.memory.example_target`), and `method` says which target was assumed.
        autocast: run forward and loss under `torch.autocast` with this dtype (default: the dtype of the
            `torch.autocast` the call runs inside, if any).
        dtype: the input dtype when `example` is a shape.
        device: the device to predict for (default: the model's); "cuda" on a machine without a GPU predicts the
            CUDA step from here (`memfit.memory.cuda_target`): the figures are then the caching allocator's
            reserved bytes and the fixed costs, as for any CUDA device (`memfit.memory.cuda_step`).
        gpu: on CUDA, the GPU whose stated defaults of fixed costs (and attention kernels) to use: a name ("H100",
            "A100-40GB", "RTX 4090"), a compute capability such as (8, 6), or its memory ("24GiB"); default: the
            GPU here, measured, else compute capability 9.0's defaults.
        why: a reason added to `method` (e.g. why the planner was not used).
        grads_held: every trainable parameter has its gradient before the step (a later micro-batch of an
            accumulation, which adds into it) instead of getting it in backward.
        keep_output: the output lives until the step ends (a training loop's local); False: it is dropped once
            the loss is computed (`loss_fn(model(x), y)` in one expression, as `memfit.accumulate` runs it).
        plain_runs: a dict of the caller's (kept by it, not by the model: the runs reference the model): a plain
            step's fake runs are put there when made; with grads_held, the runs are derived from those there where
            they show it is the same (`memfit.memory.held_grads`; `held_runs` says whether), and let go.
        steps: a dict of the caller's, kept across the memory models of one `memfit.fit` (its checkpoint settings and
            precisions): the first training step's run at 4 goes there, and the later ones take its optimizer step
            in place of running their own where their runs show the same parameters, optimizer state and gradient
            bytes (`memfit.memory.probes.StepProbes`; `method` says where the step came from). CPU steps only.
    """
    from memfit.device.machine import resolve_device
    model, compiled = predicted_module(model)       # a torch.compile'd module: the module it wraps, said in why
    if compiled and compiled not in why:
        why = f"{why}; {compiled}" if why else compiled
    cuda = cuda_device_for(model_device(model), device, gpu)
    dev = cuda.device if cuda is not None else resolve_device(device) if device is not None else model_device(model)
    fakes = cuda.fakes if cuda is not None else dev
    autocast = autocast if autocast is not None else surrounding_autocast(dev.type)
    batch = ExampleBatch(example, dtype)
    tgt = ExampleBatch(target, dtype, beside=batch) if target is not None else None
    key = (_signature(batch.template), _signature(tgt.template if tgt else None), batch.repeats, tgt and tgt.repeats,
           train, _optimizer_key(optimizer), _callable_key(loss_fn), autocast, dev, why, bool(compiled), grads_held,
           keep_output,
           forward_state(), torch.get_num_threads() if dev.type == "cpu" else None,  # scratch is per thread
           cuda.key + sdp_backends() if cuda is not None else None)
    def fit() -> StepMemoryModel:
        derived, declined = _held_from(plain_runs) if grads_held and plain_runs is not None else (None, "")
        if derived is not None:
            return derived
        target, note = tgt, why
        if train and target is None and loss_target(loss_fn) is not None:     # F.cross_entropy and no target
            target, built = example_target(model, batch, loss_fn, fakes)
            note = f"{note}; {built}" if note else built
        spec = StepSpec(model, batch, fakes, train=train, optimizer=optimizer, loss_fn=loss_fn, target=target,
                        autocast=autocast, grads_held=grads_held, keep_output=keep_output,
                        cuda=cuda.target if cuda is not None else None, compiled=bool(compiled))
        mm = _fit(spec, why=note, cuda=cuda, runs_to=plain_runs if not grads_held else None,
                  steps=steps if cuda is None else None)
        mm.held_runs = f"own runs ({declined})" if declined else "own runs" if grads_held else ""
        return mm

    # kept per model: predicting again for the same batch layout and optimizer (each evaluation) costs nothing;
    # a new or reshaped parameter, a changed flag or attribute (checkpointing, dropout p) predicts again
    return _STEP_MODELS.get(model, key, fit)


def _held_from(plain_runs: dict) -> tuple[StepMemoryModel | None, str]:
    """(the held step's model derived from the plain step's runs in `plain_runs`, or None; why not)."""
    from memfit.memory.held_grads import Declined, held_probes
    probes, why = plain_runs.pop("plain", (None, ""))     # let go: the held model is kept in their stead
    try:
        made = held_probes(probes)
        # a size the plain runs did not make runs here (derived alike); one that fails there (a value read the
        # sizes answer otherwise) leaves it to the held step's own runs, which make every run again without reading
        mm = _fit(made[0].spec, why, made=made)
    except (Declined, FakeRunError, DataDependentOnBatchSize) as e:
        _log.info("memory model with the gradients held: its own fake runs (%s)", e)
        return None, str(e)
    mm.held_runs = "derived from the plain step's runs (the gradients added in place where it stole them)"
    return mm, ""


_STEP_MODELS = ModelCache()
_log = logging.getLogger("memfit.memory")



def forget_step_model(model: torch.nn.Module) -> None:
    """Drop the memory models kept for `model`, so that the next prediction runs (and can be timed)."""
    _STEP_MODELS.forget(model)


def _callable_key(f) -> object:
    """The same key for closures made again from the same code over the same objects (a loss wrapper built
    per call, its defaults too), else the object itself (`Same`: no later object at its id equals it)."""
    code = getattr(f, "__code__", None)
    if code is None:
        return Same(f)
    return code, tuple(map(_cell_id, f.__closure__ or ())), Same(getattr(f, "__self__", None)), \
        tuple(map(Same, getattr(f, "__defaults__", None) or ()))


def _optimizer_key(optimizer) -> tuple:
    """The optimizer as a prediction's key: itself, its class and each group's parameters and hyper-parameters
    (a group added, a learning rate changed: another key)."""
    return id(optimizer), optimizer_groups(optimizer)


def _cell_id(cell) -> object:
    """What a closure's cell holds, by identity; the cell itself while it holds nothing yet (a name the closure
    reads that is assigned after it was made, such as the plan a loss_fn made for memfit.fit refers to)."""
    try:
        return Same(cell.cell_contents)
    except ValueError:
        return "unfilled", id(cell)


def _signature(template) -> object:
    """The batch layout without the batch size: shapes after the leading dimension and dtypes."""
    return tuple((tuple(x.shape[1:]), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in tree_flatten(template)[0]) + (str(tree_flatten(template)[1]),)


def _fit(spec: StepSpec, why: str, cuda: CudaDevice | None = None, made: tuple | None = None,
         runs_to: dict | None = None, steps: dict | None = None) -> StepMemoryModel:
    """Fake runs at the fewest batch sizes the ladder of fitters needs (`memfit.memory.fit_ladder`), and what
    they say: the memory model, its `method` in words (with a warning where it is approximate). `made`: (runs, fit)
    made already (`held_grads.held_probes`); `runs_to`: a plain training step's runs and `why` go there ("plain");
    `steps`: the optimizer step's source across one fit's models (`step_memory_model`)."""
    probes, fit, spec, why = (*made, spec, why) if made is not None else probed(spec, why, steps)
    train, autocast, tgt = spec.train, spec.autocast, spec.target
    runs = probes.runs
    how = fit.how + probes.single + step_how(probes)
    held = {"inputs": (0, spec.batch.bytes_per_sample() + (tgt.bytes_per_sample() if tgt else 0))}
    if train:
        held["optimizer state"] = (runs[4].held["optimizer state"], 0)
    if spec.grads_held:
        held["gradients"] = (runs[4].held["gradients"], 0)
    what = ("one training step" if train else "one forward") + \
        (" with every gradient held before it (backward adds into them)" if spec.grads_held else "") + \
        (f" (forward under torch.autocast({str(autocast).removeprefix('torch.')}))" if autocast is not None else "") + \
        (" (no optimizer: no step)" if train and spec.optimizer is None else "")
    scratch = _scratch_ops(runs, fit.measured)
    if scratch[4]:
        how += (f"; what {len(scratch[4])} kernels allocate inside (oneDNN's workspaces, half-precision scratch, "
                "matmuls' copies BLAS cannot read) measured from the real kernels at each batch size asked about")
        if any(s.lines is None for s in scratch[4]):
            how += ("; APPROXIMATE: the scratch of ops whose argument sizes are not affine in the batch scaled up "
                    "from batch 4")
    method = f"fake-tensor run of {what} at batch sizes {sorted(runs)}, {how}" + (f" ({why})" if why else "")
    mm = StepMemoryModel(method, runs[4].held["parameters"], spec.device, train, held, fit.a, fit.b, runs[4].ops,
                         runs[4].phase_ends, fit.measured, fit.c, gradient_line(runs),
                         {k: r.grad_bytes for k, r in runs.items()}, why=why,
                         _scratch=scratch if scratch[4] else {},
                         _measured_ends={n: runs[n].phase_ends for n in fit.measured})
    if cuda is not None:                       # the caching allocator replayed over the runs' events
        mm.device = cuda.device
        mm._cuda = cuda_step(runs, spec, cuda.costs, cuda.config, mm._allocated)
        mm.method += f"; on CUDA ({cuda.source}): {mm._cuda.how}"
    if "APPROXIMATE" in how and cuda is None:  # its answers can be checked by a run at them (`memory.recheck`)
        mm._recheck = Recheck.of(spec, runs[4])
    if runs_to is not None and spec.train and cuda is None:     # for a held step's model derived from them
        runs_to["plain"] = probes, why
    if "APPROXIMATE" in mm.method:             # the runs' lines, or the CUDA replay's fitted events
        warnings.warn(f"the memory of {type(spec.model).__name__} is estimated, not exact: {mm.method}. Check the "
                      "size you pick with memfit.measure_step", stacklevel=4)
    return mm


def _scratch_ops(runs: dict[int, _Run], measured) -> dict[int, list]:
    """The measured ops of the run at 4, which dimensions carry the batch read off the run at 2 (else 1); and of
    each size that is its own exact run (`Fit.measured`) where it runs other ops, at their own arguments."""
    def ops(n: int, other: int | None) -> list:
        return run_scratch(runs[n], n, runs.get(other), other)
    out = {4: ops(4, next((k for k in (2, 1, 8) if k in runs), None))}
    for n in measured:
        if runs[n].ops != runs[4].ops:
            out[n] = [s for s in ops(n, None) if s.row < runs[n].phase_ends.get("backward", len(runs[n].ops))]
    return out

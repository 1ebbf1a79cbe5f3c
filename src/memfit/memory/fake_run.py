"""One training step (or forward) run on fake tensors, with every storage it allocates and frees logged per op
(`fake_run`): what the memory model counts.

`fake_run` runs the real code (forward, loss, backward, `optimizer.step()`, `zero_grad()`) under
`torch._subclasses.fake_tensor.FakeTensorMode` at one batch size: nothing is allocated. The run works on a
`memfit.memory.fake_model.FakeModel` (a structural copy of the module tree whose parameters and buffers are swapped
for fake copies, `torch.func.functional_call`'s mechanism: the set-up every fake run shares), and the optimizer is a
shallow copy holding fake state, so the model (as any thread sees it, during the run too), its buffers (BatchNorm
running statistics), `.grad`, the optimizer and every RNG are left exactly as they were. `memfit.memory.step_model`
fits the runs at a few batch sizes into bytes at any size.
"""

from __future__ import annotations

import copy
import gc
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from memfit.batches import forward
from memfit.device.allocators import rounder
from memfit.device.fake_cuda import SavedTensors, SdpaRouting, backward_by_nodes
from memfit.device.measure import _storage_key, optimizer_state, unique_bytes
from memfit.device.torch_private import (
    FakeTensorMode,
    foreach_by_default,
    grad_hooks,
    storage_key,
    storage_use_count,
)
from memfit.memory.fake_kernels import (
    host_tensors_logged,
)
from memfit.memory.fake_model import FakeModel
from memfit.memory.global_caches import cache_misses, clear_filled
from memfit.memory.isolation import predicting
from memfit.memory.kinds import STEP_KINDS
from memfit.memory.step import ExampleBatch, forward_autocast, training_step
from memfit.memory.storage_log import StorageLog

__all__ = ["CudaTarget", "FakeRunError", "StepSpec", "fake_run"]
COLUMN = {k.value: i for i, k in enumerate(STEP_KINDS)}     # a kind's value -> its column in a run's arrays


class FakeRunError(RuntimeError):
    """The step or forward could not run on fake tensors (data-dependent Python control flow, say)."""


@dataclass
class _Run:
    ops: list                         # the ops in order (OpOverloads, and a marker at each phase's end)
    live: np.ndarray                  # (ops, kinds) bytes live after each op, kept bytes counted from the start
    phase_ends: dict[str, int]        # op index where forward / backward / step ended
    held: dict[str, int]              # bytes there before the step: parameters, inputs, optimizer state
    events: np.ndarray | None = None  # (events, 5) op, +1/-1, its allocation's event (frees), kind, kept: outside
    sizes: np.ndarray | None = None   # (events,) bytes of each        the optimizer step, to compare runs
    step_kept: np.ndarray | None = None   # (kinds,) bytes the optimizer step allocates and keeps (its state)
    grad_bytes: int = 0               # the storages of the gradients backward leaves (a gradient that is a view
    #                                   of a larger buffer, a slice of torch.cat's, keeps all of it), or held
    scratch: list = field(default_factory=list)   # (op index, op, ArgSpec) of ops whose scratch is measured
    step_events: np.ndarray | None = None   # (events, 5) the optimizer step's, as `events` (a free's column 2:
    step_sizes: np.ndarray | None = None    # its allocation's index among these; -3 - i: event i of `events`)
    step_at: int = 0                  # the index in `events` where the optimizer step's events go
    sdpa: list = field(default_factory=list)      # the attention kernel each call was routed to (a CUDA target)
    source: RunLog | None = None      # a plain training step's log and where backward stored each gradient
    stood_in: int = 0                 # values the optimizer step read that no fake run knows, stood in
    #                                   (`memfit.memory.known_values.stand_in`)


@dataclass
class RunLog:
    """What a plain training step's timeline is made from (`_timeline`'s arguments), and each gradient as
    AccumulateGrad stored it: the run with every gradient held is derived from these (`memfit.memory.held_grads`)."""
    log: list                         # StorageLog.log: (op index, storage key, +bytes or -bytes)
    marks: dict                       # phase -> (op index, log position) at its end
    samples: dict                     # "gradients" / "optimizer state" -> storage keys
    live_at_end: set
    pad: int
    stored: list                      # per AccumulateGrad call: `_GradStored`
    trainable: dict                   # id -> bytes (rounded) of each trainable parameter: what a held run holds


@dataclass(frozen=True)
class _GradStored:
    """A parameter's gradient as AccumulateGrad left it (its post-accumulate-grad hook): where in the run, and
    what the gradient's storage is."""
    ops: int                          # ops logged so far (the last: what AccumulateGrad ran)
    at: int                           # the log's length then
    param: int                        # id of the fake parameter
    key: int                          # storage key of its .grad
    refs: int                         # references to that storage (`storage_use_count`): 2 = .grad's and ours
    whole: bool                       # dense, same strides as the parameter, offset 0, the storage all its own bytes
    hooks: int                        # other hooks on the parameter's gradient (`grad_hooks`), which run around it


def _fake_optimizer(optimizer, fake: Callable, mode: FakeTensorMode, cuda: bool = False):
    """A shallow copy of `optimizer` over the fake parameters, with fake copies of its state (`cuda`: with the
    defaults torch picks for CUDA parameters, for a CUDA step predicted from parameters elsewhere).

    A one-element CPU state tensor (Adam's `step`, read with .item()) becomes a fake tensor that keeps a
    copy of its value, as `torch.tensor(0.0)` made under the fake mode does; the real one is never written.
    """
    def state(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu" and not v.requires_grad:
            return mode.fake_tensor_converter.from_real_tensor(mode, v.detach().clone(), make_constant=True)
        return fake(v) if isinstance(v, torch.Tensor) else copy.copy(v)

    opt = copy.copy(optimizer)
    opt.param_groups = []
    for g in optimizer.param_groups:
        group = {**g, "params": [fake(p) for p in g["params"]]}
        if group.get("foreach") is None and not group.get("fused"):
            # the default picks the multi-tensor kernels for real CUDA tensors, never for fake ones: say it
            group["foreach"] = cuda or foreach_by_default(g["params"])
        opt.param_groups.append(group)
    opt.state = defaultdict(dict, {fake(p): {k: state(v) for k, v in st.items()} for p, st in optimizer.state.items()})
    return opt


@dataclass(frozen=True)
class CudaTarget:
    """A CUDA step predicted without its GPU: the fakes live on `StepSpec.device` (CUDA on a CUDA build of torch,
    else the CPU) and the bytes logged are CUDA's kernels' (`memfit.memory.storage_log.StorageLog(kernels=)`),
    attention routed as that GPU would run it, the optimizer's CUDA defaults (foreach; `step` counters on the host
    unless fused or capturable)."""
    capability: tuple[int, int]       # the GPU's compute capability: which attention kernel torch picks
    nodes: bool                       # backward node by node (fake CUDA tensors without a GPU: autograd's engine
    #                                   refuses them, `memfit.device.fake_cuda`)


@dataclass(frozen=True, eq=False)
class StepSpec:
    """What a fake run runs: the same in every run of one prediction (only the batch size changes)."""
    model: torch.nn.Module                # left untouched: the run works on a structural copy over fake tensors
    batch: ExampleBatch                   # the input, rebuilt at each batch size
    device: torch.device                  # the device the run is for (fakes are made there)
    train: bool = True                    # a training step (forward, loss, backward, step, zero_grad), else a
    #                                       forward under no_grad
    optimizer: torch.optim.Optimizer | None = None   # its step and state count (a shallow copy with fake state)
    loss_fn: Callable | None = None       # `loss_fn(output, target)`; None: `training_step`'s default
    target: ExampleBatch | None = None    # the target, rebuilt at each batch size
    autocast: torch.dtype | None = None   # forward and loss under `torch.autocast` with this dtype
    grads_held: bool = False              # every trainable parameter has a gradient before the step (a later
    #                                       micro-batch of an accumulation): backward adds into it, held from the start
    keep_output: bool = True              # False: the output is dropped once the loss is computed
    #                                       (`memfit.accumulate`'s step)
    cuda: CudaTarget | None = None        # the step is for a CUDA device this machine does not have
    compiled: bool = False                # the model given was `torch.compile`d (`model` is the module it wraps):
    #                                       transformers' mask questions are left unasked, as under dynamo
    answers: bool = True                  # False: no value read is answered from `KnownValues` and transformers'
    #                                       mask questions are left unasked (a read that depends on the batch size)


def fake_run(spec: StepSpec, n: int, *, mode: FakeTensorMode, fakes: dict, optimizer_step: bool = True) -> _Run:
    """One fake run of `spec` at batch n (with optimizer_step=False the optimizer step is skipped:
    `memfit.memory.fit.with_step` puts it in).
    `mode` and `fakes` (id of a real tensor -> its fake) are shared by the runs of one prediction: the fake
    mode's op cache then serves the ops whose shapes do not depend on the batch."""
    model, batch, target, optimizer, device = spec.model, spec.batch, spec.target, spec.optimizer, spec.device
    train, grads_held = spec.train, spec.grads_held
    kernels = torch.device("cuda") if spec.cuda is not None else device      # whose kernels the bytes are for
    held = {"parameters": unique_bytes({**dict(model.named_parameters(remove_duplicate=False)),
                                        **dict(model.named_buffers(remove_duplicate=False))}.values()),
            "inputs": batch.bytes_per_sample() * n + (target.bytes_per_sample() * n if target else 0),
            "optimizer state": unique_bytes(device_state(optimizer, kernels))}
    caches = cache_misses(model)
    tracker = StorageLog(device, scratch=True, kernels=kernels.type)
    log = tracker.log
    marks: dict[str, tuple[int, int]] = {}              # phase -> (op index, log position) at its end
    samples: dict[str, set] = {}                        # storages that are gradients / optimizer state
    rounded = rounder(kernels)  # blocks
    sdpa: list = []
    grad_bytes = 0                                      # `_Run.grad_bytes`
    try:
        with predicting():
            fm = FakeModel(model, mode, device, fakes, train=train)      # the user's module is untouched
            fake_named = fm.named
            opt = _fake_optimizer(optimizer, fm.fake, mode, kernels.type == "cuda") if optimizer is not None else None
            with fm.running() as run_model:
                trainable = {id(p): p for p in fake_named.values()
                             if isinstance(p, torch.nn.Parameter) and p.requires_grad}
                if grads_held:                 # made before the log starts: held, as the parameters are
                    for p in trainable.values():
                        p.grad = torch.zeros_like(p)
                    held["gradients"] = grad_bytes = sum(rounded(p.grad.nbytes) for p in trainable.values())
                # a plain step on the CPU notes where backward stores each gradient (`RunLog`)
                noting = train and not grads_held and spec.cuda is None and kernels.type == "cpu"
                x = batch.at(n, device)
                y = target.at(n, device, x) if target is not None else None

                def mark(phase):
                    nonlocal grad_bytes
                    if phase == "backward":
                        tracker.free_saved_scalars()
                    tracker.ops.append(f"<end of {phase}>")   # what is freed before the mark is freed in it
                    marks[phase] = (len(tracker.ops), len(log))
                    if phase == "backward":
                        samples["gradients"] = {_storage_key(p.grad)[0] for p in fake_named.values()
                                                if isinstance(p, torch.Tensor) and p.grad is not None}
                        if not grads_held:     # the storages, which may be larger than the gradients on them
                            grad_bytes = sum(rounded(tracker.live.get(k, 0)) for k in samples["gradients"])
                    if phase == "step":
                        samples["optimizer state"] = {k[0] for t in optimizer_state(opt) if (k := _storage_key(t))}
                        if kernels.type != device.type:     # CPU fakes for CUDA: what CUDA keeps on the host
                            samples["host"] = {k[0] for t in optimizer_state(opt) if (k := _storage_key(t))} - \
                                {k[0] for t in device_state(opt, kernels) if (k := _storage_key(t))}

                # the RNG states torch.utils.checkpoint keeps are made through no op: logged as one
                host = host_tensors_logged(lambda name, t: tracker.record(name, t, (), {}))
                with mode.logging_to(tracker, reads_values=spec.answers and not spec.compiled, answers=spec.answers,
                                     cpu_autocast=spec.autocast if kernels.type == "cpu" else None), \
                        _no_cycle_collection(), host, \
                        _noting_grads(trainable.values() if noting else (), tracker) as stored, ExitStack() as cuda:
                    backward = None
                    if spec.cuda is not None:      # attention as the GPU runs it; backward node by node on CUDA fakes
                        cuda.enter_context(SdpaRouting("auto", _Choices(sdpa), spec.cuda.capability,
                                                       None if device.type == "cuda" else device.type))
                        if spec.cuda.nodes and train:
                            saved = SavedTensors()
                            cuda.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack))
                            backward = lambda loss: backward_by_nodes(loss, saved)     # noqa: E731
                    if train:
                        training_step(run_model, x, opt, spec.loss_fn, y, spec.autocast, mark, optimizer_step,
                                      spec.keep_output, backward, mode.step_reads)
                    else:
                        with torch.no_grad(), forward_autocast(device.type, spec.autocast):
                            out = forward(run_model, x)
                        mark("forward")
                        del out
                del x, y
                # what the step keeps: optimizer state, gradients zero_grad did not drop, tensors cached on a
                # module; anything else still alive is garbage in a reference cycle, freed by the next collection
                kept = [*optimizer_state(opt), *(p.grad for p in fake_named.values() if p.grad is not None),
                        *(v for m in run_model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
                live_at_end = {k[0] for t in kept if (k := _storage_key(t)) and k[0] in tracker.live}
    finally:
        clear_filled(caches)
        for f in fakes.values():                       # gradients kept by zero_grad must not reach the next run
            f.grad = None
    pad = rounded(1) - 1
    if samples.get("host"):
        log, marks = _without(log, marks, samples.pop("host"))
    live, events, sizes, step_kept, step = _timeline(log, len(tracker.ops), marks, samples, live_at_end, pad)
    source = RunLog(list(log), marks, samples, live_at_end, pad, stored,   # frees after the run: not in it
                    {k: rounded(p.nbytes) for k, p in trainable.items()}) if noting else None
    return _Run(tracker.ops, live, {k: v[0] for k, v in marks.items()}, held, events, sizes, step_kept, grad_bytes,
                tracker.scratch_ops, *step, sdpa=sdpa, source=source,
                stood_in=mode.stood_in if train and optimizer_step and optimizer is not None else 0)


@contextmanager
def _noting_grads(params, tracker: StorageLog):
    """A list of `_GradStored`, one per AccumulateGrad call on `params` inside (post-accumulate-grad hooks, which
    leave AccumulateGrad's choice to steal or copy the incoming gradient as it is)."""
    stored: list[_GradStored] = []

    def note(p):
        g = p.grad
        try:
            s = g.untyped_storage()
            key, refs = storage_key(s), storage_use_count(s)
            whole = g.layout == torch.strided and g.storage_offset() == 0 and g.stride() == p.stride() \
                and s.nbytes() == g.nbytes
        except (RuntimeError, NotImplementedError):     # sparse or wrapper tensors own no plain storage
            key, refs, whole = None, 0, False
        others = sum(len(h or ()) for h in grad_hooks(p)) - 1       # ours is one of them
        stored.append(_GradStored(len(tracker.ops), len(tracker.log), id(p), key, refs, whole, others))
    handles = [p.register_post_accumulate_grad_hook(note) for p in params]
    try:
        yield stored
    finally:
        for h in handles:
            h.remove()


class _Choices:
    """Where `SdpaRouting` notes the kernel of each attention call."""

    def __init__(self, sdpa: list):
        self.sdpa = sdpa


def device_state(optimizer, device: torch.device) -> list[torch.Tensor]:
    """The optimizer's state tensors that live on `device` when its parameters do: on CUDA, torch.optim keeps each
    parameter's `step` counter on the host unless the group is fused or capturable (torch/optim/adam.py)."""
    if optimizer is None or device.type != "cuda":
        return optimizer_state(optimizer)
    out = []
    for group in optimizer.param_groups:
        on_host = not (group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            out += [v for k, v in optimizer.state.get(p, {}).items()
                    if isinstance(v, torch.Tensor) and not (on_host and k == "step" and v.dim() == 0)]
    return out


def _without(log: list, marks: dict, keys: set) -> tuple[list, dict]:
    """The log without the allocations of `keys` live at its end (and the marks' log positions moved with it)."""
    last = {}
    for i, (_, key, delta) in enumerate(log):
        if delta > 0:
            last[key] = i
    drop = sorted(last[k] for k in keys if k in last)
    kept = [e for i, e in enumerate(log) if i not in set(drop)]
    moved = {p: (op, pos - np.searchsorted(drop, pos)) for p, (op, pos) in marks.items()}
    return kept, {p: (op, int(pos)) for p, (op, pos) in moved.items()}


@contextmanager
def _no_cycle_collection():
    """Garbage in reference cycles stays counted until the run ends, rather than until a collection that may
    or may not come (and at another op in each run): the same in every run, and never below the real step."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _timeline(log, n_ops: int, marks, samples, live_at_end, pad: int):
    """(ops, kinds) live bytes from the allocation log (storages alive at the end count from the start), the
    events outside the optimizer step as `_Run.events` / `_Run.sizes`, the bytes the step keeps by kind, and the
    step's own events (`_Run.step_events`, `step_sizes`, `step_at`)."""
    tag_at: dict[int, list[str]] = defaultdict(list)  # log position -> phases that ended there
    for phase, (_, pos) in marks.items():
        tag_at[pos].append(phase)
    sampled = {"backward": "gradients", "step": "optimizer state"}
    kind_of_entry: dict[int, int] = {}                # free's log position -> its allocation's log position
    alloc_of: dict[int, int] = {}                     # storage key -> log position of its live allocation
    tags: dict[int, str] = {}
    for i, (_, key, delta) in enumerate([*log, (n_ops, None, 0)]):
        for phase in tag_at.get(i, ()):
            name = sampled.get(phase)
            for k in samples.get(name, ()) if name else ():
                if k in alloc_of:
                    tags[alloc_of[k]] = name
        if key is None:
            break
        if delta > 0:
            alloc_of[key] = i
        elif key in alloc_of:
            kind_of_entry[i] = alloc_of.pop(key)
    kept = {alloc_of[k] for k in live_at_end if k in alloc_of}
    ends = {p: marks[p][0] for p in marks}

    def kind(i: int, op: int) -> int:
        if i in kept:
            return COLUMN[tags.get(i, "kept by the model")]
        if tags.get(i) == "gradients":
            return COLUMN["gradients"]
        if op < ends.get("forward", n_ops):
            return COLUMN["activations"]
        return COLUMN["backward transient" if op < ends.get("backward", n_ops) else "step transient"]

    # the optimizer step's events (log positions and ops between the ends of backward and step) are left out of
    # the events, and the later ops renumbered as if it had not run
    step_log = (marks["backward"][1], marks["step"][1]) if "step" in marks else (len(log), len(log))
    step_ops = (marks["backward"][0], marks["step"][0] - 1) if "step" in marks else (n_ops, n_ops)
    live = np.zeros((n_ops + 1, len(STEP_KINDS)), dtype=np.int64)
    constant = np.zeros(len(STEP_KINDS), dtype=np.int64)
    step_kept = np.zeros(len(STEP_KINDS), dtype=np.int64)
    events, sizes, position = [], [], {}
    step_events, step_sizes, step_position = [], [], {}      # the optimizer step's, apart
    for i, (op, _, delta) in enumerate(log):
        a = i if delta > 0 else kind_of_entry.get(i)
        k = kind(a, log[a][0]) if a is not None else -1
        if not step_log[0] <= i < step_log[1]:
            position[i] = len(events)
            shifted = op - (step_ops[1] - step_ops[0]) if op >= step_ops[1] else op
            ref = -1 if a is None else position[a] if a in position else -3 - step_position.get(a, -1)
            events.append((shifted, 1 if delta > 0 else -1, ref, k, a in kept))
            sizes.append(abs(delta))
        else:
            step_position[i] = len(step_events)
            ref = -1 if a is None else step_position[a] if a in step_position else -3 - position.get(a, -1)
            step_events.append((op - step_ops[0], 1 if delta > 0 else -1, ref, k, a in kept))
            step_sizes.append(abs(delta))
        if a is None:
            continue
        size = delta + (pad if delta > 0 else -pad)
        if a in kept:
            constant[k] += size if delta > 0 else 0
            if delta > 0 and step_log[0] <= a < step_log[1]:
                step_kept[k] += size
        else:
            live[min(op, n_ops), k] += size
    step = (np.array(step_events, dtype=np.int64).reshape(-1, 5), np.array(step_sizes, dtype=np.int64),
            step_log[0]) if "step" in marks else (None, None, len(events))
    return (np.cumsum(live, axis=0)[:n_ops] + constant, np.array(events, dtype=np.int64).reshape(-1, 5),
            np.array(sizes, dtype=np.int64), step_kept, step)

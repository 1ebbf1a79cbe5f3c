"""The memory of a forward, or of a whole training step, from running it on fake tensors: nothing is allocated.

`step_memory_model(model, example, train=True, optimizer=opt, loss_fn=...)` runs the real code (forward,
loss, backward, `optimizer.step()`, `zero_grad()`) under `torch._subclasses.fake_tensor.FakeTensorMode`
at small batch sizes, logging every storage allocated and freed (the live bytes `memfit.measure` counts).
Each op's live bytes, per kind (activations, gradients, optimizer state, transients), is then
`a + b * n`, and the peak at any n is the largest over the ops. A fake run costs Python work per op
whatever the tensors' sizes, so a prediction runs as few as it can:
- batch 4 and batch 1. When both allocate and free the same storages at the same ops, each the same size
  in both or 4 times as large, every size is constant or proportional to the batch and the line through
  the two runs is exact: two runs.
- otherwise batch 2 as well: the line through 2 and 4 under the same check, and batch 1 its own exact run
  where it runs other ops (broadcast parameters need no reduction over a batch of one). Where sizes are not
  proportional, the line through 2 and 4 is checked at a third size; where that fails (an n x n similarity
  matrix) a quadratic per op is fit at 2, 4, 8 and checked at a fourth; where even that fails, or the ops
  change with the batch, an upper line is used and `method` says APPROXIMATE (with a warning).
- the optimizer step runs once, at batch 4: it reads and writes parameters, gradients and its state, none
  of which depends on the batch, so what it adds above the end of backward is the same at every size and
  is put into the other runs, which skip it.
No `torch.export`, so any model that runs eagerly works; data-dependent Python control flow does not
(`FakeRunError` says so).

Parameters and buffers are swapped for fake copies for the run (`torch.func.functional_call`'s
mechanism) and the optimizer is a shallow copy holding fake state, so the model, its buffers
(BatchNorm running statistics), `.grad` and the optimizer are left exactly as they were.

The figure is the steady state of a training loop: what the step keeps (optimizer state created
lazily on the first step, gradients when `zero_grad` keeps them) is counted as held from the start.
The output and loss are held until the step ends, as locals of a training-step function are.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> mm = step_memory_model(model, (32,), train=True, optimizer=opt)
    >>> b = mm.breakdown(64)
    >>> b["optimizer state"] == 2 * b["parameters"] + 4 * 4        # exp_avg, exp_avg_sq, a 4-byte step per tensor
    True
    >>> mm.total_bytes(64) == measure_step(model, torch.randn(64, 32), opt)
    True
"""
from __future__ import annotations

import copy
import gc
import operator
import threading
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from memfit.batches import forward
from memfit.budget import check_count, format_bytes, model_device
from memfit.measure import _storage_key, optimizer_state, unique_bytes
from memfit.messages import first_line, whole_words

__all__ = ["Batch", "FakeRunError", "StepMemoryModel", "check_prediction", "measure_step", "step_memory_model",
           "training_step"]

KINDS = ("activations", "gradients", "optimizer state", "backward transient", "step transient", "kept by the model")
CUDA_BLOCK = 512            # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
CUDA_MARGIN = 0.05          # stated head-room for fragmentation of the allocator's segments on CUDA
CUDA_SEGMENT = 2 << 20      # ... and one partly used 2 MiB small-allocation segment


class FakeRunError(RuntimeError):
    """The step or forward could not run on fake tensors (data-dependent Python control flow, say)."""


# ---- the batch at any size -----------------------------------------------------------------------
@dataclass
class Batch:
    """An example batch (a sample shape, a tensor, a tuple or a dict of tensors) rebuilt at any batch size.

    Tensors are scaled along their leading (batch) dimension; other dict values pass through.
    """
    template: object
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        t = self.template
        if _integral(t):
            t = self.template = (operator.index(t),)
        if _is_shape(t):
            t = tuple(operator.index(s) for s in t)          # numpy ints too
            if any(s < 1 for s in t):
                raise ValueError(f"expected a sample shape of positive ints without the batch dimension, e.g. "
                                 f"(3, 32, 32); found {t!r}")
            self.template = torch.empty((1, *t), dtype=self.dtype, device="meta")
        leaves = [x for x in tree_flatten(self.template)[0] if isinstance(x, torch.Tensor)]
        if not leaves or not isinstance(self.template, (torch.Tensor, tuple, list, dict)):
            raise TypeError(f"expected a sample shape (tuple of ints) or an example batch (a tensor, a tuple or a "
                            f"dict of tensors); found {type(self.template).__name__}")
        sizes = {x.shape[0] if x.dim() else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every tensor of the example batch needs the same leading (batch) dimension; found "
                             f"leading sizes {sorted(map(str, sizes))}")

    def bytes_per_sample(self) -> int:
        return sum(x[0].nbytes for x in tree_flatten(self.template)[0] if isinstance(x, torch.Tensor))

    def at(self, n: int, device: torch.device):
        """The batch at size n as zeros (call it under FakeTensorMode to allocate nothing)."""
        scale = lambda x: torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=device) \
            if isinstance(x, torch.Tensor) else x
        return tree_map(scale, self.template)


def _loss(out, target, loss_fn: Callable | None) -> torch.Tensor:
    if loss_fn is not None and target is not None:
        return loss_fn(out, target)
    if loss_fn is not None:
        try:
            return loss_fn(out)
        except TypeError as e:
            if "argument" not in str(e):
                raise
            raise TypeError(f"loss_fn(output) failed ({e}); a loss_fn(output, target) needs target=, an example "
                            "target batch (e.g. target=y[:2])") from None
    if target is not None:
        raise ValueError("a target was given but no loss_fn; pass loss_fn=torch.nn.functional.cross_entropy or similar")
    loss = getattr(out, "loss", None)                 # transformers outputs when labels are in the batch
    if isinstance(loss, torch.Tensor):
        return loss
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs:
        raise ValueError(f"the model's output ({type(out).__name__}) has no tensor that requires grad; "
                         "pass loss_fn to say how the loss is computed")
    return sum(t.sum() for t in outs)                 # a stand-in loss: one scalar per output


def training_step(model, batch, optimizer, loss_fn=None, target=None, autocast: torch.dtype | None = None,
                  marks: Callable[[str], None] = lambda phase: None, step: bool = True) -> None:
    """One training step as `footprint` counts it: forward and loss (under autocast when given), backward,
    `optimizer.step()` (skipped with step=False), `optimizer.zero_grad()`. The output and loss live until the
    step returns."""
    dev = next((t.device.type for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)), "cpu")
    with torch.autocast(dev, dtype=autocast) if autocast is not None else nullcontext():
        out = forward(model, batch)
        loss = _loss(out, target, loss_fn)
    marks("forward")
    loss.backward()
    marks("backward")
    if optimizer is not None:
        if step:
            type(optimizer).step(optimizer)           # the class's step: a scheduler's wrapper may step the original
        marks("step")
        type(optimizer).zero_grad(optimizer)
    del out, loss


def measure_step(model, example, optimizer=None, loss_fn=None, target=None, *, autocast=None, device=None,
                 warmup: bool = True) -> int:
    """Live bytes at the peak of one real training step (parameters, inputs and optimizer state included).

    With `warmup` one untracked step runs first, so the optimizer state exists as in a running training
    loop. On CPU the bytes come from `memfit.measure`; on CUDA from the caching allocator. The model and
    optimizer are updated, as by any training step.
    """
    from memfit.measure import track_memory
    dev = torch.device(device) if device is not None else model_device(model)
    batch = example if isinstance(example, (torch.Tensor, tuple, list, dict)) and not _is_shape(example) \
        else Batch(example).at(1, dev)
    held = unique_bytes([*model.parameters(), *model.buffers(), *tree_flatten(batch)[0], *tree_flatten(target)[0]])
    model.train()
    if warmup and optimizer is not None:
        training_step(model, batch, optimizer, loss_fn, target, autocast)
    held += unique_bytes(optimizer_state(optimizer))
    with track_memory(dev) as mem:
        training_step(model, batch, optimizer, loss_fn, target, autocast)
    return held + mem.peak


def _overloads(*names: str) -> frozenset:
    """The ATen overloads of these names ("aten.mse_loss.default") that this torch has."""
    found = set()
    for name in names:
        _, packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return frozenset(found)


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers the storage's key (its address, reused once it is freed)."""
    __slots__ = ("key",)


def _fresh_outputs(func) -> bool:
    """Whether every output of `func` is a new storage: its schema aliases no input (not a view, not in place,
    not out=). `_unsafe_view` is a view whose schema says otherwise."""
    schema = getattr(func, "_schema", None)
    return schema is not None and func is not torch.ops.aten._unsafe_view.default \
        and not any(r.alias_info is not None for r in schema.returns)


class _StorageLog:
    """Logs every storage allocated and freed on `device` as (op index, storage key, +bytes or -bytes).

    The lean cousin of `memfit.measure`'s live-bytes mode for fake runs, where its Python work per op is most
    of the cost: one weak reference per storage rather than a finalizer per tensor (a storage's Python object
    lives as long as the storage, so the reference dies with the last tensor on it), ops kept as objects, and
    an op's inputs looked at only when its schema says an output may alias one (a view of, or a write to, a
    tensor made outside: parameters, the batch).
    """

    # batch norm on a half or bfloat16 input: the real kernels keep the saved mean and inverse std in float32
    # (the accumulation type); the meta kernels give them the input's dtype
    BATCH_NORM = _overloads("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
                            "aten._native_batch_norm_legit_functional.default",
                            "aten._native_batch_norm_legit.no_stats")
    # these CPU losses return the reduced scalar as a view of an input-sized buffer, which it keeps alive
    CPU_LOSS_VIEWS = _overloads("aten.mse_loss.default", "aten.smooth_l1_loss.default",
                                "aten.binary_cross_entropy.default", "aten.soft_margin_loss.default")
    FRESH: dict = {}                                  # op -> whether its outputs are always new storages

    def __init__(self, device: torch.device):
        self.device = device
        self.ops: list = []                           # the OpOverload of every op, in order
        self.log: list[tuple[int, int, int]] = []
        self.live: dict[int, int] = {}                # storage key -> bytes, for storages allocated here
        self.refs: dict[int, _StorageRef] = {}        # storage key -> its weak reference (kept so it calls back)

    def _freed(self, ref: _StorageRef) -> None:
        nbytes = self.live.pop(ref.key, None)
        self.refs.pop(ref.key, None)
        if nbytes is not None:
            self.log.append((len(self.ops), ref.key, -nbytes))

    def _watch(self, s, key: int) -> None:
        ref = self.refs[key] = _StorageRef(s, self._freed)
        ref.key = key

    def size_of(self, func, index: int, t: torch.Tensor, nbytes: int, args) -> int:
        """Bytes counted for output `index` of `func`: the few fake kernels whose outputs differ from the real."""
        if index in (1, 2) and func in self.BATCH_NORM and t.dtype in (torch.float16, torch.bfloat16):
            return nbytes * 2
        if index == 0 and func in self.CPU_LOSS_VIEWS and t.device.type == "cpu" and t.dim() == 0 and args:
            return max(nbytes, args[0].numel() * t.element_size())
        return nbytes

    def record(self, func, out, args, kwargs) -> None:
        """Note op `func` and the new storages among its outputs `out`."""
        op = len(self.ops)
        self.ops.append(func)
        if isinstance(out, torch.Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)) and all(isinstance(t, torch.Tensor) or t is None for t in out):
            outs = out
        else:
            outs = tree_flatten(out)[0]
        fresh = self.FRESH.get(func)
        if fresh is None:
            fresh = self.FRESH[func] = _fresh_outputs(func)
        inputs = None
        for i, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or t.device != self.device:
                continue
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):   # sparse or wrapper tensors own no plain storage
                continue
            key = s._cdata
            if key in self.refs:                          # allocated here, or known to be made outside
                continue
            nbytes = s.nbytes()
            if not nbytes:
                continue
            if not fresh:
                if inputs is None:
                    inputs = {k[0] for a in tree_flatten((args, kwargs))[0]
                              if isinstance(a, torch.Tensor) and (k := _storage_key(a))}
                if key in inputs:                         # a view of (or a write to) a tensor made outside
                    self._watch(s, key)
                    continue
            nbytes = self.size_of(func, i, t, nbytes, args)
            self.live[key] = nbytes
            self.log.append((op, key, nbytes))
            self._watch(s, key)


class _LoggingFakeMode(FakeTensorMode):
    """A fake mode that hands every op the program runs, with its outputs, to a `_StorageLog` while one is set:
    one dispatch layer instead of a logging mode on top of the fake one. The ops the fake mode runs to compute
    an op (its decompositions) are not logged: the real kernel does not allocate their outputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.storage_log: _StorageLog | None = None
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.storage_log is None or self._depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._depth -= 1
        self.storage_log.record(func, out, args, kwargs)
        return out

    @contextmanager
    def logging_to(self, storage_log: _StorageLog):
        self.storage_log = storage_log
        try:
            yield
        finally:
            self.storage_log = None


def check_prediction(model, example_at: Callable[[int], object], sizes=(8, 32), *, optimizer=None, loss_fn=None,
                     target_at: Callable[[int], object] | None = None, autocast=None) -> list[dict]:
    """Predicted vs measured bytes of one training step at each batch size (for benchmarks).

    `example_at(n)` / `target_at(n)` build a real batch of n. The prediction is `step_memory_model`'s
    (what `memfit.memory_model(train=True)` returns) from the batch at 2; each measurement runs `measure_step` on deep
    copies of the model and optimizer (the originals are not touched). Rows: n, predicted, measured,
    ratio (predicted / measured), predict_s (seconds to build the memory model), step_s (seconds of one
    real step at n, untracked).
    """
    import time

    _CACHE.pop(model, None)                                     # time the prediction itself, not a cache hit
    t0 = time.perf_counter()
    mm = step_memory_model(model, example_at(2), train=True, optimizer=optimizer, loss_fn=loss_fn,
                           target=target_at(2) if target_at else None, autocast=autocast)
    predict_s = time.perf_counter() - t0
    rows = []
    for n in sizes:
        m, opt = copy.deepcopy((model, optimizer))             # one deepcopy: opt stays on m's parameters
        x, y = example_at(n), target_at(n) if target_at else None
        measured = measure_step(m, x, opt, loss_fn, y, autocast=autocast)
        t0 = time.perf_counter()
        training_step(m, x, opt, loss_fn, y, autocast)
        step_s = time.perf_counter() - t0
        rows.append({"n": n, "predicted": mm.total_bytes(n), "measured": measured,
                     "ratio": mm.total_bytes(n) / measured, "predict_s": predict_s, "step_s": step_s})
    return rows


# ---- one fake run --------------------------------------------------------------------------------
@dataclass
class _Run:
    ops: list                         # the ops in order (OpOverloads, and a marker at each phase's end)
    live: np.ndarray                  # (ops, kinds) bytes live after each op, kept bytes counted from the start
    phase_ends: dict[str, int]        # op index where forward / backward / step ended
    held: dict[str, int]              # bytes there before the step: parameters, inputs, optimizer state
    events: np.ndarray | None = None  # (events, 5) op, +1/-1, its allocation's event (frees), kind, kept: outside
    sizes: np.ndarray | None = None   # (events,) bytes of each        the optimizer step, to compare runs
    step_kept: np.ndarray | None = None   # (kinds,) bytes the optimizer step allocates and keeps (its state)


def _integral(s) -> bool:
    """An int, numpy int or 0-d integer tensor, not a bool (operator.index accepts those)."""
    if isinstance(s, bool) or isinstance(s, torch.Tensor) and s.dim():
        return False
    try:
        operator.index(s)
    except TypeError:
        return False
    return True


def _is_shape(x) -> bool:
    """A sample shape (ints without the batch dimension) rather than an example batch."""
    return _integral(x) or (isinstance(x, (tuple, list)) and len(x) > 0 and all(_integral(s) for s in x))


def _snapshot(model):
    return [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _restore(snap) -> None:
    """Put back every module attribute, parameter and buffer (a forward may cache a fake tensor on a module)."""
    for m, attrs, params, buffers in snap:
        for k in [k for k in m.__dict__ if k not in attrs]:
            del m.__dict__[k]
        m.__dict__.update(attrs)
        m._parameters.clear(), m._parameters.update(params)
        m._buffers.clear(), m._buffers.update(buffers)


def _fake_optimizer(optimizer, fake: Callable, mode: FakeTensorMode):
    """A shallow copy of `optimizer` over the fake parameters, with fake copies of its state.

    A one-element CPU state tensor (Adam's `step`, read with .item()) becomes a fake tensor that keeps a
    copy of its value, as `torch.tensor(0.0)` made under the fake mode does; the real one is never written.
    """
    def state(v):
        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu" and not v.requires_grad:
            return mode.fake_tensor_converter.from_real_tensor(mode, v.detach().clone(), make_constant=True)
        return fake(v) if isinstance(v, torch.Tensor) else copy.copy(v)

    from torch.optim.optimizer import _default_to_fused_or_foreach
    opt = copy.copy(optimizer)
    opt.param_groups = []
    for g in optimizer.param_groups:
        group = {**g, "params": [fake(p) for p in g["params"]]}
        if group.get("foreach") is None and not group.get("fused"):
            # the default picks the multi-tensor kernels for real CUDA tensors, never for fake ones: say it
            group["foreach"] = _default_to_fused_or_foreach(g["params"], differentiable=False, use_fused=False)[1]
        opt.param_groups.append(group)
    opt.state = defaultdict(dict, {fake(p): {k: state(v) for k, v in st.items()} for p, st in optimizer.state.items()})
    return opt


def _run(model, batch: Batch, n: int, *, train: bool, optimizer, loss_fn, target: Batch | None,
         autocast, device: torch.device, mode: FakeTensorMode, fakes: dict, step: bool = True) -> _Run:
    """One fake run at batch n (with step=False the optimizer step is skipped: `_with_step` puts it in).
    `mode` and `fakes` (id of a real tensor -> its fake) are shared by the runs of one prediction: the fake
    mode's op cache then serves the ops whose shapes do not depend on the batch."""
    from torch.nn.utils.stateless import _reparametrize_module

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            f = mode.from_tensor(t)
            if t.device != device:
                with mode:
                    f = f.to(device)
            fakes[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return fakes[id(t)]

    named = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    held = {"parameters": unique_bytes(named.values()),
            "inputs": batch.bytes_per_sample() * n + (target.bytes_per_sample() * n if target else 0),
            "optimizer state": unique_bytes(optimizer_state(optimizer))}
    snap = _snapshot(model)
    tracker = _StorageLog(device)
    log = tracker.log
    marks: dict[str, tuple[int, int]] = {}              # phase -> (op index, log position) at its end
    samples: dict[str, set] = {}                        # storages that are gradients / optimizer state
    try:
        with torch.random.fork_rng(devices=[]):
            fake_named = {k: fake(v) for k, v in named.items()}
            opt = _fake_optimizer(optimizer, fake, mode) if optimizer is not None else None
            if train:
                model.train()                          # restored with the rest by _restore
            with mode, _reparametrize_module(model, fake_named, tie_weights=True, strict=False):
                x = batch.at(n, device)
                y = target.at(n, device) if target is not None else None

                def mark(phase):
                    tracker.ops.append(f"<end of {phase}>")   # what is freed before the mark is freed in it
                    marks[phase] = (len(tracker.ops), len(log))
                    if phase == "backward":
                        samples["gradients"] = {_storage_key(p.grad)[0] for p in fake_named.values()
                                                if isinstance(p, torch.Tensor) and p.grad is not None}
                    if phase == "step":
                        samples["optimizer state"] = {k[0] for t in optimizer_state(opt) if (k := _storage_key(t))}

                with mode.logging_to(tracker), _no_cycle_collection():
                    if train:
                        training_step(model, x, opt, loss_fn, y, autocast, mark, step)
                    else:
                        with torch.no_grad(), torch.autocast(device.type, dtype=autocast) \
                                if autocast is not None else nullcontext():
                            out = forward(model, x)
                        mark("forward")
                        del out
                del x, y
                # what the step keeps: optimizer state, gradients zero_grad did not drop, tensors cached on a
                # module; anything else still alive is garbage in a reference cycle, freed by the next collection
                kept = [*optimizer_state(opt), *(p.grad for p in fake_named.values() if p.grad is not None),
                        *(v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor))]
                live_at_end = {k[0] for t in kept if (k := _storage_key(t)) and k[0] in tracker.live}
    finally:
        _restore(snap)
        for f in fakes.values():                       # gradients kept by zero_grad must not reach the next run
            f.grad = None
    pad = CUDA_BLOCK - 1 if device.type == "cuda" else 0
    live, events, sizes, step_kept = _timeline(log, len(tracker.ops), marks, samples, live_at_end, pad)
    return _Run(tracker.ops, live, {k: v[0] for k, v in marks.items()}, held, events, sizes, step_kept)


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
    events outside the optimizer step as `_Run.events` / `_Run.sizes`, and the bytes the step keeps by kind."""
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
            return KINDS.index(tags.get(i, "kept by the model"))
        if tags.get(i) == "gradients":
            return KINDS.index("gradients")
        if op < ends.get("forward", n_ops):
            return KINDS.index("activations")
        return KINDS.index("backward transient" if op < ends.get("backward", n_ops) else "step transient")

    # the optimizer step's events (log positions and ops between the ends of backward and step) are left out of
    # the events, and the later ops renumbered as if it had not run
    step_log = (marks["backward"][1], marks["step"][1]) if "step" in marks else (len(log), len(log))
    step_ops = (marks["backward"][0], marks["step"][0] - 1) if "step" in marks else (n_ops, n_ops)
    live = np.zeros((n_ops + 1, len(KINDS)), dtype=np.int64)
    constant = np.zeros(len(KINDS), dtype=np.int64)
    step_kept = np.zeros(len(KINDS), dtype=np.int64)
    events, sizes, position = [], [], {}
    for i, (op, _, delta) in enumerate(log):
        a = i if delta > 0 else kind_of_entry.get(i)
        k = kind(a, log[a][0]) if a is not None else -1
        if not step_log[0] <= i < step_log[1]:
            position[i] = len(events)
            shifted = op - (step_ops[1] - step_ops[0]) if op >= step_ops[1] else op
            events.append((shifted, 1 if delta > 0 else -1, -1 if a is None else position.get(a, -2), k, a in kept))
            sizes.append(abs(delta))
        if a is None:
            continue
        size = delta + (pad if delta > 0 else -pad)
        if a in kept:
            constant[k] += size if delta > 0 else 0
            if delta > 0 and step_log[0] <= a < step_log[1]:
                step_kept[k] += size
        else:
            live[min(op, n_ops), k] += size
    return (np.cumsum(live, axis=0)[:n_ops] + constant, np.array(events, dtype=np.int64).reshape(-1, 5),
            np.array(sizes, dtype=np.int64), step_kept)


def _proportional(r1: _Run, n1: int, r2: _Run, n2: int) -> bool:
    """Whether the two runs (outside the optimizer step) allocate and free the same storages at the same ops,
    each either the same size in both or scaled with the batch (n2 / n1): then every op's live bytes are
    a + b*n, and the line through the two runs is exact."""
    skip = lambda r: r.ops[:r.phase_ends["backward"]] + r.ops[r.phase_ends["step"] - 1:] \
        if "step" in r.phase_ends else r.ops
    if skip(r1) != skip(r2) or r1.events.shape != r2.events.shape or not np.array_equal(r1.events, r2.events):
        return False
    return bool(np.all((r1.sizes == r2.sizes) | (r1.sizes * n2 == r2.sizes * n1)))


def _with_step(r: _Run, full: _Run) -> _Run:
    """Run `r` (forward, backward and zero_grad, the optimizer step skipped) with the step of `full` put in.

    The step reads and writes parameters, gradients and its state, none of which depends on the batch: what
    it adds above the bytes live when backward ends is the same at every batch size."""
    b, s = r.phase_ends["backward"], r.phase_ends["step"]            # s == b + 1: the step's marker alone
    fb, fs = full.phase_ends["backward"], full.phase_ends["step"]
    assert s == b + 1, "the step was not skipped"
    keep = full.step_kept
    rise = full.live[fb:fs - 1] - full.live[fb - 1]                  # the step's ops, above the end of backward
    left = full.live[fs - 1] - full.live[fb - 1]                    # what it leaves and does not keep: none
    live = np.concatenate([r.live[:b] + keep, r.live[b - 1] + keep + rise, r.live[b:] + keep + left])
    ops = r.ops[:b] + full.ops[fb:fs - 1] + r.ops[b:]
    ends = {**r.phase_ends, "step": s + fs - 1 - fb}
    return _Run(ops, live, ends, r.held, r.events, r.sizes, keep)


# ---- the model -----------------------------------------------------------------------------------
_PENDING_LOCK = threading.Lock()


@dataclass
class StepMemoryModel:
    """Bytes of one training step (or a forward) at any batch size n, from fake-tensor runs at small sizes.

    Attributes:
        method: how the sizes at other batch sizes are computed.
        param_bytes: parameters and buffers.
        device: the device the figures are for (CUDA adds the allocator's rounding and a margin).
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
    _pending_one: Callable[[], np.ndarray | None] | None = None   # batch 1's exact run, made on first use

    def _peak(self, n: int) -> tuple[int, np.ndarray]:
        if n == 1 and self._pending_one is not None:
            with _PENDING_LOCK:                       # two threads asking at once: one run
                if self._pending_one is not None:
                    exact = self._pending_one()
                    if exact is not None:
                        self._measured[1] = exact
                    self._pending_one = None
        live = self._a + self._b * n + (self._c * n * n if self._c is not None else 0)
        if n in self._measured and self._measured[n].shape == live.shape:
            live = np.maximum(live, self._measured[n])
        elif n in self._measured:                     # batch 1 runs other ops: its own run is exact
            live = self._measured[n]
        k = int(np.argmax(live.sum(axis=1)))
        return k, np.ceil(live[k]).astype(np.int64)

    def breakdown(self, n: int) -> dict[str, int]:
        """Bytes at the step's peak for a batch of n, by kind (they sum to `total_bytes(n)`)."""
        n = _batch(n)
        _, parts = self._peak(n)
        out = {"parameters": self.param_bytes, "inputs": 0}
        for kind, (a, b) in self._held.items():
            out[kind] = out.get(kind, 0) + a + b * n
        for kind, v in zip(KINDS, parts.tolist(), strict=True):     # the same keys at every n
            if v or (kind == "activations") or (self.train and kind != "kept by the model"):
                out[kind] = out.get(kind, 0) + v
        if self.device.type == "cuda":
            out["allocator margin"] = int(CUDA_MARGIN * sum(out.values())) + CUDA_SEGMENT
        return out

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
            else "one forward under no_grad"
        lines = [f"memory of {what} on {self.device}, by {self.method}.",
                 f"batch {n}: {format_bytes(self.total_bytes(n))} at the peak, during the {self.peak_phase(n)}:"]
        lines += [f"  {k:<20} {format_bytes(v):>12}" for k, v in self.breakdown(n).items()]
        if self.train:
            saved = format_bytes(self.saved_activation_bytes(n))
            lines.append(f"saved for backward at the end of the forward: {saved}. Steady state of a training loop: "
                         "what the step keeps (optimizer state, gradients that "
                         "zero_grad keeps) is counted from the start; the output and loss live until the step ends.")
        if self.device.type == "cuda":
            lines.append(f"CUDA: every block rounded up to {CUDA_BLOCK} bytes as the caching allocator does, plus a "
                         f"fragmentation margin of {CUDA_MARGIN:.0%} and one {format_bytes(CUDA_SEGMENT)} segment; "
                         "library workspaces (cuBLAS, cuDNN) are not included.")
        else:
            lines.append("CPU: live tensor bytes, as memfit.measure counts them.")
        return "\n".join(lines)


def _batch(n) -> int:
    return check_count("the batch size", n, 1)


def _affine(runs: dict[int, _Run], n1: int, n2: int):
    l1, l2 = runs[n1].live.astype(np.float64), runs[n2].live.astype(np.float64)
    b = (l2 - l1) / (n2 - n1)
    return l1 - b * n1, b


def _quadratic(runs: dict[int, _Run], n1: int, n2: int, n3: int):
    """a, b, c of a + b*n + c*n^2 through the live bytes at three sizes (per op and kind)."""
    l1, l2, l3 = (runs[n].live.astype(np.float64) for n in (n1, n2, n3))
    s12, s23 = (l2 - l1) / (n2 - n1), (l3 - l2) / (n3 - n2)
    c = (s23 - s12) / (n3 - n1)
    b = s12 - c * (n1 + n2)
    return l1 - b * n1 - c * n1 * n1, b, c


def _envelope(runs: dict[int, _Run], sizes: list[int]):
    """The steepest slope between probes and the smallest intercept above every probe: never below them."""
    lives = [runs[n].live.astype(np.float64) for n in sizes]
    b = np.max([(lives[i + 1] - lives[i]) / (sizes[i + 1] - sizes[i]) for i in range(len(sizes) - 1)], axis=0)
    b = np.maximum(b, 0)
    a = np.max([lv - b * n for lv, n in zip(lives, sizes, strict=True)], axis=0)
    return a, b


def step_memory_model(model: torch.nn.Module, example, *, train: bool = True, optimizer=None,
                      loss_fn: Callable | None = None, target=None, autocast: torch.dtype | None = None,
                      dtype: torch.dtype = torch.float32, device=None, why: str = "") -> StepMemoryModel:
    """The bytes of one training step (train=True) or forward (train=False) at any batch size, from fake runs.

    Args:
        example: a sample shape without the batch dimension, or an example batch (tensor, tuple or dict of
            tensors; the leading dimension is the batch and is rescaled).
        optimizer: its step and state are counted (a copy runs; the optimizer itself is not touched).
        loss_fn: `loss_fn(output, target)` (or `loss_fn(output)` without a target); by default the
            output's `.loss` (transformers) or the sum of the outputs.
        target: an example target batch (or its sample shape) for loss_fn.
        autocast: run forward and loss under `torch.autocast` with this dtype.
        dtype: the input dtype when `example` is a shape.
        device: the device to predict for (default: the model's).
        why: a reason added to `method` (e.g. why the planner was not used).
    """
    from memfit.budget import resolve_device
    dev = resolve_device(device) if device is not None else model_device(model)   # checks CUDA is there
    batch = Batch(example, dtype)
    tgt = Batch(target, dtype) if target is not None else None
    groups = tuple(tuple(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
                   for g in (optimizer.param_groups if optimizer is not None else ()))
    key = (_signature(batch.template), _signature(tgt.template if tgt else None), train, type(optimizer),
           id(optimizer), groups, _callable_key(loss_fn), autocast, dev, why)
    fingerprint = tuple((id(t), tuple(t.shape), t.dtype, t.requires_grad)
                        for t in [*model.parameters(), *model.buffers()]) \
        + tuple((id(m), m.training) for m in model.modules())
    entry = _CACHE.get(model)
    if entry is None or entry[0] != fingerprint:
        entry = _CACHE[model] = (fingerprint, {})
    if key not in entry[1]:
        entry[1][key] = _fit(model, batch, tgt, train=train, optimizer=optimizer, loss_fn=loss_fn, autocast=autocast,
                             device=dev, why=why)
    return entry[1][key]


# model -> (fingerprint, {key: model}): predicting again for the same model, batch layout and optimizer (each
# micro-batch of an accumulation, each evaluation) costs nothing; a new or reshaped parameter drops the entry
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _callable_key(f) -> object:
    """The same key for closures made again from the same code over the same objects (a loss wrapper built
    per call), else the object's id."""
    code = getattr(f, "__code__", None)
    if code is None:
        return id(f)
    return code, tuple(id(c.cell_contents) for c in (f.__closure__ or ())), id(getattr(f, "__self__", None))


def _signature(template) -> object:
    """The batch layout without the batch size: shapes after the leading dimension and dtypes."""
    return tuple((tuple(x.shape[1:]), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in tree_flatten(template)[0]) + (str(tree_flatten(template)[1]),)


def _fit(model, batch: Batch, tgt: Batch | None, *, train, optimizer, loss_fn, autocast, device, why):
    dev = device
    optimizer_note = " (no optimizer: no step)" if train and optimizer is None else ""
    mode = _LoggingFakeMode(allow_non_fake_inputs=True)    # plain tensors a forward makes are converted
    fakes: dict[int, torch.Tensor] = {}

    once = train and optimizer is not None            # the optimizer step runs at batch 4 only

    def run(n: int, model: torch.nn.Module) -> _Run:      # the model passed in: a later run holds no reference
        try:
            r = _run(model, batch, n, train=train, optimizer=optimizer, loss_fn=loss_fn, target=tgt,
                     autocast=autocast, device=dev, mode=mode, fakes=fakes, step=not once or n == 4)
        except (ValueError, TypeError):                # our own argument errors, and the user's
            raise
        except Exception as e:
            reason = whole_words(first_line(e), 300)
            raise FakeRunError(
                f"could not run {'one training step' if train else 'the forward'} of {type(model).__name__} on "
                f"fake tensors at batch {n} ({reason}). Fake tensors have shapes but no values: data-dependent "
                "Python control flow (`if x.sum() > 0`, `.item()`, `.tolist()`) cannot run on them; measure a real "
                "step instead with memfit.planner.footprint.measure_step, or make the branch independent of the "
                "values") from e
        return _with_step(r, runs[4]) if once and n != 4 else r

    runs = {4: run(4, model)}
    runs[2] = run(2, model)
    what = "one training step" if train else "one forward"
    measured = {}
    c = None
    pending = None
    proportional = _proportional(runs[2], 2, runs[4], 4)     # every storage the same size in both or 2x
    if not proportional:
        runs[1] = run(1, model)
    if proportional:
        a, b = _affine(runs, 2, 4)
        how = ("affine per op and kind from sizes 2 and 4 (every storage the same size in both, or twice as "
               "large); batch 1, where a broadcast over the batch may run other ops, has its own exact run, "
               "made when batch 1 is first asked for")
        pending = _batch_one(model, run, runs[2].ops, a + b, a + 2 * b)
    elif runs[2].ops == runs[4].ops:
        a, b = _affine(runs, 2, 4)
        check = 1 if runs[1].ops == runs[2].ops else 8
        if check == 8:
            runs[8] = run(8, model)
            measured[1] = runs[1].live
        same = runs[check].ops == runs[2].ops
        if same and np.array_equal(a + b * check, runs[check].live):
            how = f"affine per op and kind from sizes 2 and 4, exact at {check}"
        else:
            # some size grows faster than the batch (an n x n similarity matrix, say): a quadratic per op from
            # 2, 4 and 8, checked at a fourth size
            for n in (8, 16):
                runs[n] = runs[n] if n in runs else run(n, model)
            check = 1 if runs[1].ops == runs[2].ops else 16
            if all(runs[n].ops == runs[2].ops for n in (4, 8, check)):
                a, b, c = _quadratic(runs, 2, 4, 8)
            if c is not None and np.allclose(a + b * check + c * check * check, runs[check].live, rtol=0, atol=0.5):
                how = f"quadratic per op and kind from sizes 2, 4 and 8, exact at {check}"
            else:
                sizes = sorted(n for n in runs if runs[n].ops == runs[2].ops)
                a, b = _envelope(runs, sizes)
                c = None
                how = (f"APPROXIMATE: upper envelope of the sizes {sizes} (neither affine nor quadratic in the "
                       "batch: steepest slope per op)")
        if runs[1].ops != runs[2].ops:
            how += "; batch 1 runs other ops and is its own exact run"
    else:
        runs[8] = run(8, model)
        peaks = [(n, runs[n].live.sum(axis=1).max()) for n in sorted(runs)]
        slope = max(max((p2 - p1) / (n2 - n1) for (n1, p1), (n2, p2) in zip(peaks, peaks[1:], strict=False)), 0)
        top = max(p - slope * n for n, p in peaks)
        # the op sequence changes with the batch: one line through the measured peaks
        a = np.zeros((1, len(KINDS)))
        b = np.zeros((1, len(KINDS)))
        a[0, 0], b[0, 0] = top, slope
        how = ("APPROXIMATE: line above the peaks at sizes 1, 2, 4, 8 with the steepest slope (the ops change with "
               "the batch size)")
    if once:
        how += ("; the optimizer step ran once, at batch 4: it reads and writes parameters, gradients and its "
                "state, none of which depends on the batch")
    held = {"inputs": (0, batch.bytes_per_sample() + (tgt.bytes_per_sample() if tgt else 0))}
    if train:
        held["optimizer state"] = (runs[4].held["optimizer state"], 0)
    method = f"fake-tensor run of {what}{optimizer_note} at batch sizes {sorted(runs)}, {how}" + \
        (f" ({why})" if why else "")
    if "APPROXIMATE" in how:
        warnings.warn(f"the memory of {type(model).__name__} is estimated, not exact: {method}. Check the size you "
                      "pick with memfit.planner.footprint.measure_step", stacklevel=3)
    return StepMemoryModel(method, runs[4].held["parameters"], dev, train, held, a, b, runs[4].ops,
                           runs[4].phase_ends, measured, c, pending)


def _batch_one(model, run: Callable, ops: list, line_at_1: np.ndarray, at_2: np.ndarray) -> Callable:
    """A function giving batch 1's live bytes per op and kind where they are not the line's (None where the line
    is exact at 1), from a fake run made when it is called: batch 1 is rarely asked for, and running it costs
    as much as any probe. The model is held weakly and run in the train/eval modes it had here; when it is
    gone (or its modules changed) batch 2's bytes stand in for batch 1's, never below them."""
    ref = weakref.ref(model)
    flags = [m.training for m in model.modules()]
    name = type(model).__name__

    def exact() -> np.ndarray | None:
        m = ref()
        modules = list(m.modules()) if m is not None else []
        if m is None or len(modules) != len(flags):
            warnings.warn(f"the memory of {name} at batch 1 is an upper bound (its bytes at batch 2), not exact: the "
                          "model was deleted or changed before batch 1 was asked for, and batch 1 needs a fake run "
                          "of its own; keep the model alive to get the exact figure", stacklevel=4)
            return at_2
        now = [x.training for x in modules]
        try:
            for x, f in zip(modules, flags, strict=True):
                x.training = f
            r = run(1, m)
        finally:
            for x, f in zip(modules, now, strict=True):
                x.training = f
        return None if r.ops == ops and np.array_equal(line_at_1, r.live) else r.live
    return exact

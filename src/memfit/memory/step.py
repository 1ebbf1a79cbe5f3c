"""What one training step is, as the memory model runs it and as it is measured for real.

`ExampleBatch` rebuilds an example batch (a sample shape, a tensor, a tuple or a dict of tensors) at any batch
size; `training_step` is the step itself (forward and loss, backward, `optimizer.step()`, `zero_grad()`),
run on fake tensors by `memfit.memory.fake_run` and for real by `measure_step`, which returns the live
bytes at its peak (`memfit.device.measure` on the CPU, the caching allocator on CUDA), and by
`measure_rank_step`, the same on one rank of a running process group (DDP or FSDP2).

Example:
    >>> import torch
    >>> ExampleBatch((3, 8)).at(5, torch.device("meta")).shape
    torch.Size([5, 3, 8])
"""

from __future__ import annotations

import functools
import gc
import operator
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import InitVar, dataclass

import torch

from memfit.batches import forward, plain_batch
from memfit.budget import model_device
from memfit.device.measure import optimizer_state, unique_bytes
from memfit.device.torch_private import compiled_inner, storage_key, tree_flatten, tree_unflatten
from memfit.losses import call_loss
from memfit.own_loss import is_own, model_loss, no_target

__all__ = ["ExampleBatch", "autocast_entered_in_forward", "autocast_nesting", "forward_autocast", "forward_state",
           "garbage_since", "loss_name", "measure_rank_step", "measure_step", "missing_target", "predicted_module",
           "same_tensor_key", "surrounding_autocast", "training_step"]


def _integral(s) -> bool:
    """An int, numpy int or 0-d integer tensor, not a bool (operator.index accepts those)."""
    if isinstance(s, bool) or isinstance(s, torch.Tensor) and s.dim():
        return False
    try:
        operator.index(s)
    except TypeError:
        return False
    return True


def is_shape(x) -> bool:
    """A sample shape (ints without the batch dimension) rather than an example batch: the one test every
    entry point that takes either uses."""
    return _integral(x) or (isinstance(x, (tuple, list)) and len(x) > 0 and all(_integral(s) for s in x))


def sample_shape(x) -> tuple[int, ...]:
    """`x` (an int or a sequence of ints, numpy ints too) as a sample shape of positive ints, or a ValueError.

    Example:
        >>> sample_shape(3), sample_shape([3, 32, 32])
        ((3,), (3, 32, 32))
    """
    shape = (x,) if _integral(x) else x
    try:
        out = tuple(operator.index(s) for s in shape)
    except TypeError:
        out = ()
    if not out or any(s < 1 for s in out) or not is_shape(shape):
        raise ValueError(f"expected a sample shape of positive ints without the batch dimension, e.g. (3, 32, 32); "
                         f"found {x!r}")
    return out


def predicted_module(model) -> tuple[torch.nn.Module, str]:
    """(the module a prediction runs, a note for its `method`): the module itself, or for a `torch.compile`d one the
    module it wraps, since a compiled module cannot run on fake tensors (inductor compiles again for them, and
    crashed the process in torch 2.13) and its parameters are the wrapped module's. The figures are then the eager
    module's, which the note says: inductor's fused kernels usually hold less, never modelled here.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> predicted_module(lin) == (lin, ""), predicted_module(torch.compile(lin))[0] is lin
        (True, True)
    """
    inner = compiled_inner(model)
    if inner is None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module; found {type(model).__name__}")
        return model, ""
    return inner, (f"torch.compile'd: predicted for the {type(inner).__name__} it wraps, run eagerly (the compiled "
                   "module's fused kernels usually hold less; not modelled)")


def same_tensor_key(x: torch.Tensor) -> tuple:
    """What makes two tensors one (the same bytes, seen alike): one given twice, or the same view of one storage
    (two slices of it, as `memfit.batches.batch_slice` makes of each)."""
    try:
        where = storage_key(x.untyped_storage()), x.storage_offset()
    except (RuntimeError, NotImplementedError):          # sparse or wrapper tensors own no plain storage
        where = id(x), 0
    return *where, tuple(x.shape), x.stride() if x.layout == torch.strided else None, x.dtype


@dataclass
class ExampleBatch:
    """An example batch (a sample shape, a tensor, a tuple or a dict of tensors) rebuilt at any batch size.

    Tensors are scaled along their leading (batch) dimension; other dict values pass through. A tensor given twice
    (`(ids, ids)`, `labels=ids`), or in the batch a target is given `beside` (`target=ids` beside `ids`), is one
    tensor, as for the allocator: its bytes count once and it is rebuilt as one (`repeats`).
    """
    template: object
    dtype: torch.dtype = torch.float32
    beside: InitVar[ExampleBatch | None] = None   # the batch this one (a target) is given beside
    repeats: tuple | None = None  # ((tensor index in `tree_flatten` order, (True: of `beside`, else of this batch;
    #                               the index there) of the tensor it is), ...); computed when not given

    def __post_init__(self, beside: ExampleBatch | None):
        t = self.template = plain_batch(self.template)      # a BatchEncoding: the dict it holds
        if _integral(t):
            t = self.template = (operator.index(t),)
        if is_shape(t):
            t = sample_shape(t)
            self.template = torch.empty((1, *t), dtype=self.dtype, device="meta")
        leaves = [x for x in tree_flatten(self.template)[0] if isinstance(x, torch.Tensor)]
        if not leaves or not isinstance(self.template, (torch.Tensor, tuple, list, dict)):
            raise TypeError(f"expected a sample shape (tuple of ints) or an example batch (a tensor, a tuple or a "
                            f"dict of tensors); found {type(self.template).__name__}")
        sizes = {x.shape[0] if x.dim() else None for x in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every tensor of the example batch needs the same leading (batch) dimension; found "
                             f"leading sizes {sorted(map(str, sizes))}")
        if self.repeats is None:
            seen = {} if beside is None else {same_tensor_key(x): (True, i) for i, x in enumerate(tree_flatten(
                beside.template)[0]) if isinstance(x, torch.Tensor) and i not in dict(beside.repeats)}
            repeats = []
            for i, x in enumerate(tree_flatten(self.template)[0]):
                if isinstance(x, torch.Tensor):
                    first = seen.setdefault(same_tensor_key(x), (False, i))
                    if first != (False, i):
                        repeats.append((i, first))
            self.repeats = tuple(repeats)

    def per_sample(self) -> list[int]:
        """Bytes per sample of each tensor the batch holds, a tensor given twice once."""
        repeats = dict(self.repeats)
        return [x[0].nbytes for i, x in enumerate(tree_flatten(self.template)[0])
                if isinstance(x, torch.Tensor) and i not in repeats]

    def bytes_per_sample(self) -> int:
        return sum(self.per_sample())

    def at(self, n: int, device: torch.device, beside=None):
        """The batch at size n as zeros (call it under FakeTensorMode to allocate nothing); a tensor given twice is
        one, the one of `beside` (the batch this one was given beside, at n) where it is that batch's."""
        leaves, spec = tree_flatten(self.template)
        given = tree_flatten(beside)[0] if beside is not None else None
        out, repeats = [], dict(self.repeats)
        for i, x in enumerate(leaves):
            of_beside, j = repeats.get(i, (False, None))
            if of_beside and given is not None:
                out.append(given[j])
            elif j is not None and not of_beside:
                out.append(out[j])
            else:
                out.append(torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=device)
                           if isinstance(x, torch.Tensor) else x)
        return tree_unflatten(out, spec)


def loss_name(loss_fn) -> str:
    f = loss_fn.func if isinstance(loss_fn, functools.partial) else loss_fn
    return type(f).__name__ if isinstance(f, torch.nn.Module) else getattr(f, "__name__", type(f).__name__)


def missing_target(loss_fn, why: str = "") -> TypeError:
    """The error for a loss that needs a target none was given for: what to pass, with examples."""
    why = f" ({why})" if why else ""
    return TypeError(f"loss_fn {loss_name(loss_fn)} takes a target{why} and none was given; pass "
                     "target=, an example target batch (target=y[:2], its leading dimension is the batch) or one "
                     "target's shape for float targets (target=(10,)); class ids need a tensor: "
                     "target=torch.zeros(2, dtype=torch.long)")


def _loss(out, target, loss_fn: Callable | str | None) -> torch.Tensor:
    if isinstance(loss_fn, str) or loss_fn is model_loss:     # "model": the model's own loss, nothing else
        is_own(loss_fn)                                        # another string is refused
        no_target(target, "memory model")
        return model_loss(out)
    if loss_fn is not None and target is not None:
        return call_loss(loss_fn, out, target)      # (N, 1) outputs against (N,) targets: refused, as accumulate does
    if loss_fn is not None:
        try:
            return loss_fn(out)
        except TypeError as e:
            if "argument" not in str(e):
                raise
            raise missing_target(loss_fn, f"loss_fn(output) failed: {e}") from None
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


def surrounding_autocast(device_type: str) -> torch.dtype | None:
    """The dtype of the `torch.autocast` the caller runs inside for this device type (None: none, or a device
    without autocast, such as meta)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def forward_state() -> tuple:
    """What of torch's process state a forward here runs otherwise with: the surrounding autocast of every device
    type a model may run on, and whether nn.TransformerEncoderLayer's and MultiheadAttention's fused eval paths are
    on (`torch.backends.mha.set_fastpath_enabled`). Part of the key of anything kept that it would change (a plan,
    a memory model, a micro-batch size)."""
    return surrounding_autocast("cpu"), surrounding_autocast("cuda"), torch.backends.mha.get_fastpath_enabled()


def _autocast_off(device_type: str):
    """`torch.autocast(device_type, enabled=False)`, or nothing on a device without autocast."""
    if device_type == "cuda" and not torch.cuda.is_available():
        return _fake_cuda_autocast(None)
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) \
        else nullcontext()


@contextmanager
def _fake_cuda_autocast(dtype: torch.dtype | None):
    """CUDA's autocast (off with dtype None) for fake CUDA tensors on a machine without a GPU, where
    `torch.autocast("cuda")` disables itself: its state set as torch.autocast sets it, with the public calls."""
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", dtype is not None)
    if dtype is not None:
        torch.set_autocast_dtype("cuda", dtype)
    torch.autocast_increment_nesting()
    try:
        yield
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


@contextmanager
def forward_autocast(device_type: str, dtype: torch.dtype | None):
    """Exactly `torch.autocast(dtype)` (none when dtype is None) for a forward and its loss, whatever autocast
    surrounds the call. The weight casts it caches are dropped at the end, as when an outermost autocast
    ends: inside another one torch keeps them until that one ends, and the next run would find them there."""
    fake_cuda = device_type == "cuda" and not torch.cuda.is_available()    # fake CUDA tensors, no GPU here
    on = nullcontext() if dtype is None else _fake_cuda_autocast(dtype) if fake_cuda else \
        torch.autocast(device_type, dtype=dtype)
    with _autocast_off(device_type), on:
        before, _NESTING.forward = getattr(_NESTING, "forward", None), autocast_nesting()
        try:
            yield
        finally:
            _NESTING.forward = before
            if dtype is not None:
                torch.clear_autocast_cache()


_NESTING = threading.local()     # .forward: `autocast_nesting()` inside `forward_autocast`'s own contexts


def autocast_nesting() -> int:
    """How many `torch.autocast` contexts (on or off, any device) the calling thread is in: a count torch keeps
    apart from the dispatcher, so it reads the same inside a dispatch mode, where autocast itself reads off."""
    n = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return n


def autocast_entered_in_forward() -> bool:
    """Whether the forward running inside `forward_autocast` entered an autocast of its own (the user's forward
    around a layer)."""
    base = getattr(_NESTING, "forward", None)
    return base is not None and autocast_nesting() > base


def training_step(model, batch, optimizer, loss_fn=None, target=None, autocast: torch.dtype | None = None,
                  marks: Callable[[str], None] = lambda phase: None, step: bool = True,
                  keep_output: bool = True, backward: Callable[[torch.Tensor], None] | None = None,
                  step_reads: Callable[[object], AbstractContextManager] = nullcontext) -> None:
    """One training step as `footprint` counts it: forward and loss under `torch.autocast(autocast)` (none
    when None, whatever autocast surrounds the call: callers pass `surrounding_autocast`), then outside it
    backward, `optimizer.step()` (skipped with step=False), `optimizer.zero_grad()`. The loss, and the output
    unless keep_output=False (`loss_fn(model(x), y)` in one expression, as `memfit.accumulate` runs it), live
    until the step returns. `backward(loss)` replaces `loss.backward()` (fake CUDA tensors without a GPU:
    `memfit.device.fake_cuda.backward_by_nodes`); `step_reads(optimizer)`: around the optimizer's step (a fake run's
    value reads stood in there, `LoggingFakeMode.step_reads`)."""
    dev = next((t.device.type for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)), "cpu")
    with forward_autocast(dev, autocast):
        out = forward(model, batch)
        loss = _loss(out, target, loss_fn)
        if not keep_output:
            out = None
    marks("forward")
    with _autocast_off(dev):
        if backward is None:
            loss.backward()
        else:
            backward(loss)
        marks("backward")
        if optimizer is not None:
            if step:
                with step_reads(optimizer):
                    type(optimizer).step(optimizer)   # the class's step: a scheduler's wrapper may step the original
            marks("step")
            type(optimizer).zero_grad(optimizer)
    del out, loss


def measure_step(model, example, optimizer=None, loss_fn=None, target=None, *, autocast=None, device=None,
                 warmup: bool = True) -> int:
    """Live bytes at the peak of one real training step (parameters, inputs and optimizer state included).

    With `warmup` one untracked step runs first, so the optimizer state exists as in a running training
    loop. On CPU the bytes come from `memfit.device.measure`; on CUDA from the caching allocator. The model and
    optimizer are updated, as by any training step. A model in eval mode is put in training mode first.
    """
    from memfit.device.measure import track_memory
    dev = torch.device(device) if device is not None else model_device(model)
    batch = example if isinstance(example, (torch.Tensor, tuple, list, dict)) and not is_shape(example) \
        else ExampleBatch(example).at(1, dev)
    held = unique_bytes([*model.parameters(), *model.buffers(), *tree_flatten(batch)[0], *tree_flatten(target)[0]])
    autocast = autocast if autocast is not None else surrounding_autocast(dev.type)
    if not model.training:              # as the memory model: a model in eval mode trains whole, a training
        model.train()                   # model's modules keep their modes (a frozen BatchNorm stays in eval)
    if warmup and optimizer is not None:
        training_step(model, batch, optimizer, loss_fn, target, autocast)
    held += unique_bytes(optimizer_state(optimizer))
    with track_memory(dev) as mem:
        training_step(model, batch, optimizer, loss_fn, target, autocast)
    return held + mem.peak


_MARK = "memfit::measured_step"


@contextmanager
def garbage_since() -> Iterator[Callable[[], int]]:
    """`collect()` (what the block gets) frees the garbage cycles among the objects made since the block began,
    without walking the older ones: a full `gc.collect()` walks every object of the process (0.2-0.3 s once
    torch.distributed is imported, more than half of an FSDP2 fake run of a small model). The older objects are
    set aside with `gc.freeze()` and given back as the block ends; a cycle that ties one of them to the garbage
    waits for the collector's next full pass. Where the process has frozen objects of its own (`gc.freeze()`
    before forking workers, as a rank of `memfit.testing.ranks` does), nothing of theirs is touched and
    `collect()` is a full `gc.collect()` (which walks only what is not frozen).

    Example:
        >>> with garbage_since() as collect:
        ...     a = []; a.append(a); del a           # a cycle made in the block
        ...     collect() >= 1
        True
    """
    with _FREEZE_LOCK:                  # blocks on several threads: frozen by the first in, given back by the last out
        if _FREEZE["depth"] == 0:
            _FREEZE["ours"] = gc.get_freeze_count() == 0
            if _FREEZE["ours"]:
                gc.freeze()
        _FREEZE["depth"] += 1
    try:
        yield gc.collect
    finally:
        with _FREEZE_LOCK:
            _FREEZE["depth"] -= 1
            if _FREEZE["depth"] == 0 and _FREEZE["ours"]:
                gc.unfreeze()


# an overlapping block on another thread must not freeze what a block still running made (its collect would miss it)
_FREEZE_LOCK = threading.Lock()
_FREEZE = {"depth": 0, "ours": False}


def measure_rank_step(build: Callable[[], torch.nn.Module], example, make_optimizer: Callable,
                      loss_fn: Callable | None = None, target=None, *, n: int | None = None) -> int:
    """Bytes live at this rank's peak of one training step in a running process group (DDP or FSDP2), on the
    CPU, counted at the allocator from before `build()`: what `memfit.memory.ranks` is checked against.

    `build` makes the model and its wrapping (the `DistributedDataParallel` or `fully_shard`-ed module); one
    step runs unmeasured (optimizer state and the wrappers' lazy state exist after it: DDP rebuilds its
    buckets, FSDP2 initialises its root), then the peak of a second step is returned, with everything the rank
    holds at that moment (parameters, shards, optimizer state, DDP's buckets, FSDP's buffers): unlike
    `measure_step` the held bytes are not summed from tensors, since DDP's reducer keeps its buckets in C++.

    The bytes are `memfit.device.measure.track_memory(every_thread=True)`'s: the allocator's running total of
    every thread, since gloo's worker threads free tensors the rank's thread allocated (a collective's tensors,
    held by its work object). Op outputs are not enough: FSDP2 frees and re-allocates its unsharded parameters
    by resizing storages (no op output).

    Known limitations: the total is read at the rank thread's allocations and frees, so a peak reached inside
    gloo's threads between two of them is missed; gloo's own scratch buffers (not torch tensors) are not counted.

    Args:
        build: makes the model and wraps it (DDP, fully_shard), on the CPU.
        example: a batch (or a sample shape, with n).
        make_optimizer: `make_optimizer(params)` -> the optimizer.
        n: the batch size when `example` is a sample shape.
    """
    from torch.profiler import record_function

    from memfit.device.measure import track_memory
    gc.collect()
    with track_memory("cpu", every_thread=True) as mem:
        batch = ExampleBatch(example).at(n, torch.device("cpu")) if n is not None else example
        model = build()
        opt = make_optimizer(model.parameters())
        training_step(model, batch, opt, loss_fn, target)
        gc.collect()                           # garbage of the first step, as a running loop's collector would
        enabled = gc.isenabled()
        gc.disable()                           # as the prediction: cycles freed at the step's end, not mid-step
        try:
            with record_function(_MARK):
                training_step(model, batch, opt, loss_fn, target)
        finally:
            if enabled:
                gc.enable()
    return mem.peak_within(_MARK)

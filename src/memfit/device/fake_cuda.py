"""Fake CUDA tensors on a machine without a GPU: a training step's storages, allocated and freed in order, as CUDA
would run it (a prototype: `log_fake_cuda`).

What torch allows (found with torch 2.14.1+cu130, the CUDA build, and torch 2.13.0+cpu, on a CPU-only machine):

- **Forward.** `FakeTensorMode` makes CUDA fakes on both builds: entering it where no GPU is found calls
  `torch._C._ensureCUDADeviceGuardSet()`, which registers a fake device guard for CUDA. Without autograd the
  forward runs on both, the CUDA-only kernels' fake implementations included (flash and memory-efficient
  attention). But `F.scaled_dot_product_attention` picks the math kernel there (its backend choice reads the
  device's properties, which a fake device lacks), so the choice a GPU would make is made here (`sdpa=`).
- **Autograd on a CPU build aborts the process**: recording a node for a CUDA fake that requires grad asks CUDA's
  device guard for a stream (the node's input metadata), a CPU build has none, and the c10::Error escapes a
  noexcept function (std::terminate). So a CPU build runs the forward without grad only (`cuda_fakes()` says so).
- **Backward on a CUDA build stops in autograd's engine**, before any node runs: `Engine::execute` ->
  `compute_dependencies` -> `GraphTask::stash_current_streams()` loops over the CUDA guard's devices (the fake
  guard has 8) and asks `CUDAHooks::hasPrimaryContext(0)`, which checks the index against the real device count
  (0): "hasPrimaryContext expects a valid device index". Every public way to run a backward goes through it:
  `backward()`, `torch.autograd.grad`, `set_multithreading_enabled(False)`, compiled autograd, and AOT autograd's
  joint graph (make_fx traces `torch.autograd.grad`). Registering a PrivateUse1 backend (torch's accelerator
  then) skips the stash but trips `opt_ready_stream && opt_parent_stream` in the engine (pytorch#161129), and it
  cannot be undone in a process.
- **The way through: no engine.** Every autograd node is callable: `node(*grads)` runs its backward formula, and
  under the fake mode the CUDA kernels' fake implementations. `backward_by_nodes` runs the graph as
  `Engine::execute` does on one ready queue: the same dependency counts, nodes by sequence number (highest first,
  in a binary heap as std::priority_queue), grads validated against each input's metadata (summed to its shape,
  cast to its dtype), several grads for one input added out of place (what the engine does for tensor subclasses
  such as fake tensors), leaf grads stolen or added in place as AccumulateGrad does, each node's saved tensors
  released once it ran (through saved-tensor hooks installed for the forward). Checked against the engine itself on
  fake CPU tensors (tests/device/test_fake_cuda.py).

Not run by `backward_by_nodes`: tensor and node hooks (`register_hook`, module backward hooks, DDP's and FSDP's),
reentrant checkpointing, `create_graph`; non-reentrant checkpointing runs (its saved-tensor hooks replace the ones
here inside a block: the block's saved tensors go as torch.utils.checkpoint lets them go) but its bytes are not the
engine's: over them (1.21x on tests/device/test_fake_cuda.py's block), never under there; a node's saved tensors
are released once its call read them, so a node whose call reads some only on some paths (a custom Function reading
`ctx.saved_tensors` under a condition) keeps the others to the end of backward (1.07x the engine on one such);
a graph with nodes on the CPU and on CUDA runs on one queue (the engine interleaves two threads).
Optimizers: under a fake mode `torch.optim` picks its for-loop implementation (`_default_to_fused_or_foreach` takes
only `torch.Tensor` and `nn.Parameter`, not a fake tensor), a real GPU its `foreach` one; pass `foreach=True` or
`fused=True` to get the GPU's.

Example:
    >>> import torch
    >>> def attention():          # a forward without grad runs on every build (see cuda_fakes() for backward)
    ...     q = torch.randn(1, 8, 1024, 64, device="cuda", dtype=torch.float16)
    ...     return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    >>> run = log_fake_cuda(attention, backward=False)
    >>> run.sdpa, run.peak()      # q and the output (1 MiB each), the logsumexp (32 KiB): no 1024 x 1024 matrix
    (['flash'], 2129944)
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, redispatch_function

from memfit.device.torch_private import (
    FakeTensorMode,
    node_input_metadata,
    node_sequence_nr,
    read_saved_tensors,
    storage_key,
    tree_flatten,
)

__all__ = ["FakeCudaLog", "SavedTensors", "SdpaRouting", "Support", "backward_by_nodes", "cuda_fakes", "log_fake_cuda",
           "sdpa_kernel"]

_ACCUMULATE_GRAD = "AccumulateGrad"


class Support(NamedTuple):
    """What this torch can run on CUDA fakes: `forward` (with autograd recording), `backward`, and why not."""
    forward: bool
    backward: bool
    reason: str


def cuda_fakes() -> Support:
    """What this torch build can run on fake CUDA tensors (see the module's docstring)."""
    if torch.version.cuda is None:
        return Support(False, False, f"torch {torch.__version__} is a CPU build: autograd on a CUDA fake aborts the "
                       "process (no CUDA device guard); only a forward without grad runs")
    return Support(True, True, f"torch {torch.__version__} (CUDA {torch.version.cuda}): the forward under a fake "
                   "mode, the backward by `backward_by_nodes` (autograd's engine refuses fake CUDA without a GPU)")


@dataclass
class FakeCudaLog:
    """Every storage a fake CUDA run allocated and freed, per op: `log` holds (op index, storage key, +bytes or
    -bytes) as `memfit.memory.storage_log.StorageLog.log`; `ops` the op of each index; `phases` the op index where
    'forward' and 'backward' ended; `sdpa` the kernel each attention call was routed to."""
    ops: list = field(default_factory=list)
    log: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)
    sdpa: list = field(default_factory=list)

    def peak(self) -> int:
        """The most bytes live at once."""
        live = peak = 0
        for _, _, nbytes in self.log:
            live += nbytes
            peak = max(peak, live)
        return peak


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers its key (the address, reused once the storage is freed)."""
    __slots__ = ("key",)


class _LoggingFakeMode(FakeTensorMode):
    """A fake mode that notes each op and the new storages among its outputs (a storage seen before is a view)."""

    def __init__(self, run: FakeCudaLog, device_type: str):
        super().__init__(allow_non_fake_inputs=False)
        self.run, self.device_type, self.refs, self.depth = run, device_type, {}, 0

    def _freed(self, ref):
        nbytes = self.refs.pop(ref.key)[1]
        self.run.log.append((len(self.run.ops), ref.key, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth:                       # an op the fake mode ran to compute another: the kernel does not
            return out
        op = len(self.run.ops)
        self.run.ops.append(func)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key = storage_key(storage)
            if key in self.refs or not storage.nbytes():
                continue
            ref = _StorageRef(storage, self._freed)
            ref.key = key
            self.refs[key] = (ref, storage.nbytes())
            self.run.log.append((op, key, storage.nbytes()))
        return out


# torch functions that run attention inside them: `SdpaRouting` stays on for their inner calls
_AROUND_ATTENTION = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad,
                     F.multi_head_attention_forward)


class SdpaRouting(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to the kernel a GPU of compute `capability` would run (flash, then
    memory-efficient, then math, the order of torch's sdp_utils), or to the one asked for; `run.sdpa` (any object
    with a list `sdpa`) records each choice. Works on fake CPU tensors too: the CUDA kernels' fake implementations
    are device-independent (a CUDA step predicted on a CPU build of torch). Inside `Tensor.backward`,
    `torch.autograd.backward`/`grad` and `F.multi_head_attention_forward` it stays on (attention recomputed or called
    within them); those four calls are then hidden from a torch function mode entered outside it (its inner calls
    are seen instead: `torch.overrides.redispatch_function` skips the whole handler step)."""

    def __init__(self, choice: str, run, capability: tuple[int, int] = (9, 0), autocast: str | None = None):
        super().__init__()
        if choice not in ("auto", "flash", "efficient", "math"):
            raise ValueError(f"sdpa must be 'auto', 'flash', 'efficient' or 'math', found {choice!r}")
        self.choice, self.run, self.capability = choice, run, capability
        self.autocast = autocast       # the device type whose autocast stands for CUDA's (CPU fakes): CUDA's
        #                                autocast runs attention in its lower precision, the CPU's does not

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _AROUND_ATTENTION:
            # on the stack again inside the call (torch pops a mode while its handler runs): a backward's
            # checkpointed blocks recompute their attention inside `Tensor.backward`, and MultiheadAttention
            # calls its attention inside `F.multi_head_attention_forward`; both ran the CPU's own kernel
            # (BERT with a checkpointed layer: 31 tensors saved in forward, 29 in recomputation: CheckpointError)
            with self:
                return redispatch_function(func, types, args, kwargs)
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        a = dict(zip(names, args, strict=False), **kwargs)      # positional, then by name
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        if self.autocast is not None and torch.is_autocast_enabled(self.autocast) and q.is_floating_point():
            low = torch.get_autocast_dtype(self.autocast)      # CUDA autocast's cast of attention's inputs
            q, k, v = (t.to(low) for t in (q, k, v))
            mask = mask.to(low) if mask is not None and mask.is_floating_point() else mask
        kernel = self.choice if self.choice != "auto" else \
            sdpa_kernel(q, k, v, mask, a.get("enable_gqa", False), self.capability)
        self.run.sdpa.append(kernel)
        dropout, causal, scale = a.get("dropout_p", 0.0), a.get("is_causal", False), a.get("scale")
        if kernel == "math":                   # the composite itself: on CPU fakes the CPU's own choice would run
            return torch.ops.aten._scaled_dot_product_attention_math(
                q, k, v, mask, dropout, causal, scale=scale, enable_gqa=a.get("enable_gqa", False))[0]
        d = q.shape[-1]
        pad = -d % 8                           # the composite pads the head dim to a multiple of 8, slices after
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
            scale = d ** -0.5 if scale is None else scale
        if kernel == "flash":
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        else:
            grad = any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled()
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, grad, dropout, causal,
                                                                         scale=scale)[0]
        return out[..., :d] if pad else out


def sdpa_kernel(q, k, v, mask=None, enable_gqa=False, capability: tuple[int, int] = (9, 0)) -> str:
    """The kernel torch 2.14's sdp_utils picks on a GPU of compute `capability` for these inputs, in its order
    (a simplification: flash for fp16/bf16 without a mask and a head dim of at most 256 on compute capability 8.0
    or newer, memory-efficient for fp16/bf16/fp32 with a head dim of at most 256 (a mask allowed), else math;
    nested tensors and GQA go to math), among the backends enabled."""
    d = q.shape[-1]
    same = q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == v.dim() == 4
    if not same or enable_gqa or d > 256 or v.shape[-1] != d:
        return "math"
    # the backends `torch.nn.attention.sdpa_kernel` (or torch.backends.cuda.enable_*_sdp) leaves enabled
    if q.dtype in (torch.float16, torch.bfloat16) and mask is None and tuple(capability) >= (8, 0) \
            and torch.backends.cuda.flash_sdp_enabled():
        return "flash"
    if q.dtype in (torch.float16, torch.bfloat16, torch.float32) and torch.backends.cuda.mem_efficient_sdp_enabled():
        return "efficient"
    return "math"


class SavedTensors:
    """Saved-tensor hooks for the forward: autograd keeps a holder, not the tensor, so a node's saved tensors can be
    let go once the node ran (the engine's `release_variables`)."""

    def __init__(self):
        self.reading: list | None = None

    def pack(self, t):
        return [t]

    def unpack(self, holder):
        if self.reading is not None and not _recomputing():
            self.reading.append(holder)       # the node's own (not those a checkpoint's recomputation reads)
        if holder[0] is None:
            raise RuntimeError("a saved tensor was read after its node ran: backward_by_nodes runs a graph once")
        return holder[0]

    def of(self, node) -> list:
        """The holders of `node`'s saved tensors (each read once: the unpack hook sees it)."""
        self.reading = []
        try:
            read_saved_tensors(node)
            return self.reading
        finally:
            self.reading = None


def _call_reading(node, inputs, saved: SavedTensors | None) -> tuple[list, list]:
    """(the node's outputs, the holders of the saved tensors its call read)."""
    if saved is None:
        return _call(node, inputs), []
    saved.reading = []
    try:
        return _call(node, inputs), saved.reading
    finally:
        saved.reading = None


def _recomputing() -> bool:
    """Whether this unpack is torch.utils.checkpoint recomputing a block (reading the block's inputs, saved by
    another node, from inside the unpack of a node of the block): then the tensor read is not that node's."""
    import sys
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        frame = frame.f_back
    return False


class _Ready:
    """A node in the ready queue: std::priority_queue of CompareNodeTaskTime, the highest sequence number first."""
    __slots__ = ("seq", "node")

    def __init__(self, node):
        self.seq, self.node = node_sequence_nr(node), node

    def __lt__(self, other):               # heapq is a min-heap: the higher sequence number is the "smaller"
        return self.seq > other.seq


def _validate(grad, meta):
    """What validate_outputs does to a grad for the input it flows into: summed to its shape, cast to its dtype."""
    if grad is None:
        return None
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    if grad.dtype != meta.dtype:
        grad = grad.to(meta.dtype)
    return grad


def _accumulate(variable, grad, shared: bool):
    """AccumulateGrad (accumulateGrad): the first grad is stolen when nothing else holds it (`shared`: another
    buffer does) and it has the variable's layout, else copied into the variable's layout; later ones are added in
    place (grad mode is off)."""
    if variable.grad is not None:
        variable.grad += grad
        return
    dense = variable.is_contiguous() or variable.is_contiguous(memory_format=torch.channels_last)
    if dense:                              # utils::obeys_layout_contract, sizes of 1 aside
        fits = all(g == v or (n == 1 and g != 0)
                   for n, g, v in zip(grad.shape, grad.stride(), variable.stride(), strict=True))
    else:
        fits = grad.is_contiguous()
    if fits and not shared:
        variable.grad = grad.detach()
    elif dense:                            # utils::clone_obey_contract
        variable.grad = torch.empty_strided(variable.shape, variable.stride(), dtype=variable.dtype,
                                            device=variable.device).copy_(grad)
    else:
        variable.grad = grad.clone(memory_format=torch.contiguous_format)


def backward_by_nodes(loss: torch.Tensor, saved: SavedTensors | None = None) -> None:
    """`loss.backward()` without autograd's engine: each node of the graph called in the engine's order (see the
    module's docstring). `saved`: the hooks the forward ran under, to free saved tensors as the engine does."""
    if loss.grad_fn is None:
        raise ValueError("loss has no grad_fn: compute it from tensors that require grad, with grad enabled")
    root = loss.grad_fn
    dependencies, seen, stack = {}, {root}, [root]
    while stack:                           # compute_dependencies: edges into each node from the graph
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is not None:
                dependencies[nxt] = dependencies.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
    # autograd's _make_grads: held by torch.autograd.backward's frame until the engine returns
    grad_root = torch.ones_like(loss, memory_format=torch.preserve_format)
    buffers = {root: [grad_root]}
    ready = [_Ready(root)]
    del root, seen
    with torch.no_grad():
        while ready:
            node = heapq.heappop(ready).node
            inputs = buffers.pop(node)
            if type(node).__name__ == _ACCUMULATE_GRAD:
                grad = inputs.pop()
                if grad is not None:
                    shared = any(g is grad for buf in buffers.values() for g in buf)
                    _accumulate(node.variable, grad, shared)
                del grad
                continue
            # the holders of its saved tensors, as the call reads them (read before it, a checkpointed block's
            # would be recomputed twice: torch.utils.checkpoint recomputes on each read)
            outputs, held = _call_reading(node, inputs, saved)
            del inputs                     # call_function: the inputs go with the call
            outputs = [None if nxt is None else _validate(g, node_input_metadata(nxt)[slot])   # validate_outputs
                       for (nxt, slot), g in zip(node.next_functions, outputs, strict=True)]
            for holder in held:            # release_variables: the saved tensors go once the node ran
                holder[0] = None
            del held
            for i, (nxt, slot) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                buf = buffers.setdefault(nxt, [None] * len(node_input_metadata(nxt)))
                if buf[slot] is None:              # InputBuffer::add moves the grad in
                    buf[slot], outputs[i] = outputs[i], None
                elif outputs[i] is not None:       # accumulate: out of place for a tensor subclass (a fake
                    buf[slot] = buf[slot] + outputs[i]    # tensor); the grad added stays in `outputs` until the
                dependencies[nxt] -= 1                    # node is done, as evaluate_function's vector keeps it
                if dependencies[nxt] == 0:
                    heapq.heappush(ready, _Ready(nxt))
            del outputs, node


def _call(node, inputs: list) -> tuple:
    if hasattr(node, "apply") and not callable(node):     # a Python Function's node: PyNode materializes grads
        metas = node_input_metadata(node)
        inputs = [g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=m.device)
                  for g, m in zip(inputs, metas, strict=True)]
        out = node.apply(*inputs)
    else:
        out = node(*inputs)
    return out if isinstance(out, tuple) else (out,)


def log_fake_cuda(step: Callable[[], torch.Tensor], backward: bool = True, after: Callable[[], object] | None = None,
                  sdpa: str = "auto", device: str = "cuda", engine: str = "nodes") -> FakeCudaLog:
    """Run `step()` on fake tensors of `device` and log every storage allocated and freed there, in order.

    `step` builds what it needs on `device` (model, batch) and returns the loss; the loss's backward runs (by
    `backward_by_nodes`; `engine='torch'`: by autograd's engine, which refuses fake CUDA without a GPU: for
    checking the two against each other on the CPU), then `after()` (an optimizer step), all under one fake mode.
    """
    if engine not in ("nodes", "torch"):
        raise ValueError(f"engine must be 'nodes' or 'torch', found {engine!r}")
    support = cuda_fakes()
    if device == "cuda" and backward and not support.backward:
        raise RuntimeError(f"backward on fake CUDA tensors is not possible here: {support.reason}")
    run = FakeCudaLog()
    mode, saved = _LoggingFakeMode(run, torch.device(device).type), SavedTensors()
    with mode, SdpaRouting(sdpa, run):
        if backward:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                loss = step()
        else:
            with torch.no_grad():
                loss = step()
        run.phases["forward"] = len(run.ops)
        if backward:
            if engine == "nodes":
                backward_by_nodes(loss, saved)
            else:
                loss.backward()
            del loss
            run.phases["backward"] = len(run.ops)
        if after is not None:
            after()
            run.phases["after"] = len(run.ops)
    return run

"""Every private torch name memfit relies on, in one place: a torch upgrade that moves or changes one fails
tests/device/test_torch_private.py loudly, by name, instead of a prediction going silently wrong.

Each name is re-exported here, or reached through a small function, with a comment saying what memfit uses it for
and where torch defines it; no other module of memfit names a private torch API (tests/test_api.py scans for one).
What only `torch.export`, `torch.compile` or `torch.distributed` need is imported inside the function that needs it
(importing torch._dynamo costs about 0.5 s); what is imported at the top is loaded by `import torch` already.

The replacements of private torch functions memfit makes are here too (`aot_rng_not_saved`,
`tracer_patches_this_thread_only`, `cia_split_kept`, and DTensor's sharding lock `sharding_fake_mode_lock_scoped`,
through `memfit.device.replacements`): each is installed only while a thread is inside it, acts in that thread only
(every other thread gets torch's own), and is put back when the last thread leaves, on an exception too. The one
process-wide switch is c10's flag `caffe2_report_cpu_memory_usage` (`cpu_total_kept_for_every_thread`), which
changes what no thread computes.

Known limitations: `dict_version_reader`, the FSDP2 and DDP internals and the c10 flag may be missing from a torch
build; their callers say so (or fall back) instead of predicting wrong.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import operator
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch._guards
import torch._ops
import torch._subclasses.fake_tensor
import torch.nn.utils.stateless
import torch.utils._python_dispatch
import torch.utils._pytree

from memfit.device.replacements import ScopedContext, ScopedReplacement

# Re-exported as they are (each module is loaded by `import torch` already):
# fake tensors, the mode that makes them, and a section of real tensors inside one (torch/_subclasses/fake_tensor.py)
FakeTensor = torch._subclasses.fake_tensor.FakeTensor
FakeTensorMode = torch._subclasses.fake_tensor.FakeTensorMode
unset_fake_temporarily = torch._subclasses.fake_tensor.unset_fake_temporarily
# what a fake tensor raises when a value is read (`.item()`, `bool(t)`), and the op that reads it (`func` then)
DataDependentOutputException = torch._subclasses.fake_tensor.DataDependentOutputException
READ_VALUE = torch.ops.aten._local_scalar_dense.default
# the fake mode of a graph's fake tensors, for the planner's masks (torch/_guards.py)
detect_fake_mode = torch._guards.detect_fake_mode
# an ATen op with its overload chosen, what every dispatch mode is handed as `func` (torch/_ops.py)
OpOverload = torch._ops.OpOverload
# the base classes of every BatchNorm*d and InstanceNorm*d: modules whose output depends on the batch
# (torch/nn/modules/batchnorm.py, instancenorm.py)
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
InstanceNormBase = torch.nn.modules.instancenorm._InstanceNorm
# the base class of every Dropout module (Dropout, Dropout1d-3d, AlphaDropout, FeatureAlphaDropout): `p` is the
# probability each draws with (torch/nn/modules/dropout.py)
DropoutBase = torch.nn.modules.dropout._DropoutNd
# fake parameters swapped into a module for a run, tied weights kept tied; what torch.func.functional_call runs
# (torch/nn/utils/stateless.py)
reparametrized = torch.nn.utils.stateless._reparametrize_module
# dispatch modes: the base class, real kernels run inside one, the innermost, stepping it aside
# (torch/utils/_python_dispatch.py)
TorchDispatchMode = torch.utils._python_dispatch.TorchDispatchMode
disable_current_modes = torch.utils._python_dispatch._disable_current_modes
current_dispatch_mode = torch.utils._python_dispatch._get_current_dispatch_mode
pop_mode_temporarily = torch.utils._python_dispatch._pop_mode_temporarily
# nested arguments and outputs flattened to leaves and back (torch/utils/_pytree.py)
tree_flatten = torch.utils._pytree.tree_flatten
tree_unflatten = torch.utils._pytree.tree_unflatten
tree_flatten_with_path = torch.utils._pytree.tree_flatten_with_path
tree_leaves = torch.utils._pytree.tree_leaves
tree_map = torch.utils._pytree.tree_map
tree_map_only = torch.utils._pytree.tree_map_only
keystr = torch.utils._pytree.keystr

__all__ = ["MODULE_DICTS", "READ_VALUE", "BatchNormBase", "DataDependentOutputException", "DropoutBase", "FakeTensor",
           "FakeTensorMode", "InstanceNormBase", "OpOverload", "ProfilerEventType", "TorchDispatchMode",
           "aot_rng_not_saved", "cia_split_kept", "clear_cublas_workspaces", "compiled_inner",
           "cpu_total_kept_for_every_thread", "current_dispatch_mode", "ddp_comm_hook", "detect_fake_mode",
           "dict_version_reader", "disable_current_modes", "dynamo_reset", "fake_store", "foreach_by_default",
           "fsdp_collectives", "fsdp_mem_tracker", "fsdp_param_group", "fsdp_param_groups", "fsdp_param_shard",
           "fsdp_param_size", "grad_hooks", "has_kernel", "in_backward", "inductor_config", "is_hsdp", "keystr",
           "local_tensor", "mem_tracker", "nn_binding", "node_input_metadata", "node_sequence_nr", "op_kernel",
           "op_schema", "overload_name", "own_buffers", "own_children", "own_parameters", "pop_mode_temporarily",
           "profiler_running", "read_saved_tensors", "reparametrized", "sharding_fake_mode_lock_scoped",
           "storage_key", "storage_use_count", "tracer_patches_this_thread_only", "tree_flatten",
           "tree_flatten_with_path", "tree_leaves", "tree_map", "tree_map_only", "tree_unflatten",
           "unset_fake_temporarily", "version_counter"]

# ---- tensors, storages, modules -------------------------------------------------------------------------------------

# A storage's identity, the address of its C++ StorageImpl (torch/csrc/Storage.cpp `_cdata`): storage logs' keys (a
# fake storage has no data pointer to key by).
storage_key: Callable[[torch.UntypedStorage], int] = operator.attrgetter("_cdata")

# A tensor's version counter, bumped by every in-place write (torch/csrc/autograd/python_variable.cpp `_version`):
# which gradients a micro-step added to, whether a kept tensor was written; the hooks on a tensor's gradient, dicts or
# None (torch/_tensor.py: register_hook's, register_post_accumulate_grad_hook's): whose ops AccumulateGrad runs.
version_counter: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
grad_hooks: Callable[[torch.Tensor], tuple] = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")

# An nn.Module's own parameters, buffers and children, by name, None entries kept (torch/nn/modules/module.py
# `_parameters`, `_buffers`, `_modules`): fingerprints, module walks, structural copies.
MODULE_DICTS = ("_parameters", "_buffers", "_modules")
own_parameters: Callable[[torch.nn.Module], dict] = operator.attrgetter("_parameters")
own_buffers: Callable[[torch.nn.Module], dict] = operator.attrgetter("_buffers")
own_children: Callable[[torch.nn.Module], dict] = operator.attrgetter("_modules")



def storage_use_count(storage: torch.UntypedStorage) -> int:
    """References to `storage` (each tensor on it, each Python storage object): whether a decode buffer is free,
    when gloo let go of a collective's tensors (torch/csrc/Module.cpp `_storage_Use_Count`)."""
    return torch._C._storage_Use_Count(storage._cdata)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (torch/distributed/tensor/_api.py `_local_tensor`; `to_local()` makes a
    view when grad is enabled); any other tensor as it is. FSDP2's storages are logged by it."""
    return getattr(t, "_local_tensor", t)


def compiled_inner(model: object) -> torch.nn.Module | None:
    """The module a `torch.compile`d module wraps, or None when `model` is not one.

    `torch.compile(module)` returns a `torch._dynamo.eval_frame.OptimizedModule` holding the original as
    `_orig_mod` (torch/_dynamo/eval_frame.py); its parameters are the original's.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> compiled_inner(torch.compile(lin)) is lin, compiled_inner(lin)
        (True, None)
    """
    from torch._dynamo.eval_frame import OptimizedModule  # imported here: importing dynamo costs ~0.5 s
    if isinstance(model, OptimizedModule):
        return model._orig_mod
    return None


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS workspaces this process holds: one per cuBLAS handle and stream, made by a thread's first
    matmul and kept for the process's life, as blocks of the caching allocator (`memfit.device.cuda_costs`).
    `torch._C._cuda_clearCublasWorkspaces` (torch/csrc/cuda/Module.cpp; a CUDA build only). The GPU benchmark
    calls it between measurements so that each starts as a fresh process does (`memfit bench gpu`)."""
    torch._C._cuda_clearCublasWorkspaces()


def foreach_by_default(params: list[torch.Tensor]) -> bool:
    """Whether an optimizer left at `foreach=None` takes the foreach path for these parameters (what a fake
    optimizer must follow: its temporaries differ); torch/optim/optimizer.py `_default_to_fused_or_foreach`."""
    from torch.optim.optimizer import _default_to_fused_or_foreach
    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


# ---- ops and the dispatcher -----------------------------------------------------------------------------------------

def op_schema(op) -> torch._C.FunctionSchema | None:
    """An op's schema (arguments, returns, aliasing, mutability); None for what is no op (a getitem, a Python
    callable). torch/_ops.py `OpOverload._schema`."""
    return getattr(op, "_schema", None)


def overload_name(op: OpOverload) -> str:
    """The overload's own name ("default", "Tensor", "out"); torch/_ops.py `OpOverload._overloadname`."""
    return op._overloadname


def op_kernel(op) -> Callable:
    """The C++ operator handle an OpOverload calls (`OpOverload._op`, torch/_ops.py): a call through it skips
    OpOverload.__call__ (about 1 us, which counts in planned batch-1 forwards); anything else as it is."""
    return getattr(op, "_op", op)


def has_kernel(op: OpOverload, dispatch_key: str) -> bool:
    """Whether `op` has a kernel of its own for `dispatch_key` ("CPU", "CUDA"), not a generated composite
    (torch/csrc/utils/python_dispatch.cpp `_dispatch_has_kernel_for_dispatch_key`)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), dispatch_key)


def nn_binding(name: str) -> Callable:
    """The Python binding of an ATen op in `torch._C._nn` (gelu, silu, hardtanh, avg_pool2d...) that takes `out=`,
    for the planner's fast calls (torch/csrc/autograd/generated/python_nn_functions.cpp)."""
    return getattr(torch._C._nn, name)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (torch/csrc/autograd/init.cpp
    `_current_graph_task_id`, -1 outside one): an op counted in the backward phase."""
    return torch._C._current_graph_task_id() != -1


def profiler_running() -> bool:
    """Whether torch's autograd profiler runs on this thread (torch/csrc/autograd/init.cpp `_profiler_enabled`):
    track_memory refuses to start a second one."""
    return torch._C._autograd._profiler_enabled()


# The kind of a profiler event (Allocation, TorchOp, ...): track_memory reads the allocator's events
# (torch/csrc/profiler/python/init.cpp `_EventType`).
ProfilerEventType = torch._C._profiler._EventType


def dict_version_reader() -> Callable[[dict], int]:
    """torch.compile's guard reader of a dict's version (torch/csrc/dynamo/guards.cpp `dict_version`): a number that
    changes with every write; the fingerprint checks a model's dicts by it (and checks that it behaves so first).
    Raises ImportError or AttributeError where this torch has none."""
    from torch._C._dynamo.guards import dict_version
    return dict_version


def tensor_guards():
    """torch.compile's C++ check of tensors' dtype, device, shape, strides, requires_grad and dispatch keys
    (torch/csrc/dynamo/guards.cpp `TensorGuards`): the fingerprint's quick check of parameters and buffers."""
    from torch._C._dynamo.guards import TensorGuards
    return TensorGuards


# ---- autograd graph nodes -------------------------------------------------------------------------------------------

def node_sequence_nr(node) -> int:
    """The order autograd's engine runs a node in, highest first (torch/csrc/autograd/python_cpp_function.cpp
    `_sequence_nr`): the fake CUDA backward replays the engine's order."""
    return node._sequence_nr()


def node_input_metadata(node) -> list:
    """Shape, dtype and device of each input a node's gradients flow into (torch/csrc/autograd/
    python_cpp_function.cpp `_input_metadata`): the fake CUDA backward validates gradients as the engine does."""
    return node._input_metadata


def read_saved_tensors(node) -> None:
    """Read every tensor a node saved (a C++ node's `_saved_*` attributes, torch/csrc/autograd/generated/
    python_functions.cpp; a Python Function's `saved_tensors`), running the saved-tensor unpack hooks on each."""
    for name in dir(node):
        if name.startswith("_saved_") or name == "saved_tensors":
            getattr(node, name)


# ---- torch.distributed -----------------------------------------------------------------------------------------------

def fake_store():
    """A store for torch's fake process-group backend (torch/testing/_internal/distributed/fake_pg.py), under which
    FSDP2 and DDP run in one process as rank r of W."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


def fsdp_param_group():
    """FSDP2's module of parameter groups, whose all-gather, copy-out and reduce the per-rank model tags
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py)."""
    return importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")


def fsdp_collectives():
    """FSDP2's collectives module, whose reduce-scatter copy-in the per-rank model wraps (`_fsdp_collectives.py`)."""
    return importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")


def fsdp_param_size(fsdp_param) -> torch.Size:
    """A parameter's unsharded size (`FSDPParam._orig_size`, torch/distributed/fsdp/_fully_shard/_fsdp_param.py)."""
    return fsdp_param._orig_size


def fsdp_param_shard(fsdp_param) -> torch.Tensor:
    """The tensor holding a parameter's padded local shard (`FSDPParam._sharded_param_data`, `_fsdp_param.py`)."""
    return fsdp_param._sharded_param_data


def sharding_fake_mode_lock_scoped(inside) -> ScopedContext:
    """DTensor's sharding propagation enters `ShardingPropagator._fake_mode_lock` around running an op on fake tensors
    of the global shapes (torch/distributed/tensor/_sharding_prop.py): replaced by `inside(torch's lock)` for the
    threads inside `.active()` (the per-rank log pauses itself there), torch's for every other thread."""
    return ScopedContext(lambda: importlib.import_module("torch.distributed.tensor._sharding_prop").ShardingPropagator,
                         "_fake_mode_lock", inside)


def fsdp_param_groups(module: torch.nn.Module) -> list:
    """The parameter groups `fully_shard` gave `module` (torch/distributed/fsdp/_fully_shard/_fsdp_state.py
    `FSDPState._fsdp_param_groups`; empty when it holds none)."""
    return module._get_fsdp_state()._fsdp_param_groups


def is_hsdp(group) -> bool:
    """Whether an FSDP2 parameter group shards over a 2-D mesh (HSDP: replicate x shard), which is not modelled
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py `FSDPParamGroup._is_hsdp`)."""
    return group._is_hsdp


def ddp_comm_hook(ddp) -> str | None:
    """The comm hook a DistributedDataParallel module runs, by name, or None for its default all-reduce
    (torch/nn/parallel/distributed.py: `_get_ddp_logging_data()["comm_hook"]` for a built-in one, `_comm_hooks`
    for a Python one)."""
    hook = ddp._get_ddp_logging_data().get("comm_hook") if hasattr(ddp, "_get_ddp_logging_data") else None
    hooks = getattr(ddp, "_comm_hooks", None)
    if hook or hooks:
        return hook or getattr(hooks[0][0], "__qualname__", "a hook")
    return None


def mem_tracker():
    """PyTorch's `MemTracker` class, a contender in the benchmarks (torch/distributed/_tools/mem_tracker.py)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    return MemTracker


def fsdp_mem_tracker():
    """PyTorch's `FSDPMemTracker` class, a contender in the per-rank benchmark
    (torch/distributed/_tools/fsdp2_mem_tracker.py)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    return FSDPMemTracker


# ---- torch.compile ---------------------------------------------------------------------------------------------------

# every torch.optim.Optimizer imports it as it is made (1.1 s of CPU a fresh process): memfit.testing.ranks' server
# imports it once for every rank it forks
DYNAMO_MODULE = "torch._dynamo"


def dynamo_reset() -> None:
    """Drop every graph torch.compile has cached (torch/_dynamo/__init__.py `reset`): the benchmark compiles fresh."""
    import torch._dynamo
    torch._dynamo.reset()


def inductor_config():
    """Inductor's config module (torch/_inductor/config.py), whose `patch(...)` the benchmark compiles under."""
    return importlib.import_module("torch._inductor.config")


# ---- replacements of torch functions, scoped to the threads inside them (memfit.device.replacements) ----------------

# torch.export's AOT tracing saves torch's global generators and restores them afterwards
# (torch/_functorch/aot_autograd.py calls `preserve_rng_state`, from torch/_dynamo/utils.py), which rewinds what other
# threads drew meanwhile; a prediction draws from generators of its own (memory/isolation.own_rng), so in its thread
# the save and restore is skipped.
_AOT_RNG = ScopedReplacement(lambda: importlib.import_module("torch._functorch.aot_autograd"), "preserve_rng_state",
                             lambda original: nullcontext())


def aot_rng_not_saved():
    """Inside (this thread only), AOT tracing neither saves nor restores torch's global generators; every other
    thread's AOT tracing does, as torch does it."""
    return _AOT_RNG.active()


def _patch_for_this_thread(original, patcher, cls, name, new_fn, deduplicate: bool = True):
    owner, before = threading.get_ident(), getattr(cls, name)

    @functools.wraps(new_fn)
    def this_thread_only(*args, **kwargs):
        return (new_fn if threading.get_ident() == owner else before)(*args, **kwargs)
    return original(patcher, cls, name, this_thread_only, deduplicate)


# torch's fx tracer (under torch.export) patches methods on classes while it traces (`torch.nn.Module.__call__`,
# `__getattr__`) through `_Patcher.patch_method` (torch/fx/_symbolic_trace.py): for the whole process, which would
# route another thread's plain forward into the trace. Each method it patches from a thread inside keeps its
# original behaviour in every other thread.
_FX_PATCHES = ScopedReplacement(lambda: importlib.import_module("torch.fx._symbolic_trace")._Patcher, "patch_method",
                                _patch_for_this_thread)


def tracer_patches_this_thread_only():
    """Around `torch.export` (and any fx trace) in this thread: a method torch's fx tracer patches on a class
    (`torch.nn.Module.__call__`, `__getattr__`) keeps its original behaviour in every other thread, whose plain
    forwards then neither go into the trace nor break it."""
    return _FX_PATCHES.active()


_CIA_SPLIT: dict = {}           # the last (table, registrations) -> (CIA op -> callable, the other decompositions)


def _split_kept(original, decomp_table: dict):
    """torch's split of a decomposition table (CompositeImplicitAutograd ops apart), kept while the table and the
    ops registered are the same: `run_decompositions` walks every op of every namespace of `torch.ops` for it at each
    call (torch/export/exported_program.py; 0.11 s a capture in a test process, 28 namespaces). It changes with a
    namespace or a C++ CIA registration (the key); not seen: a CIA kernel given in Python only (`py_impl`) to a
    non-aten op after the first call (torch computes aten's once). The table is left as torch leaves it."""
    try:
        key = (frozenset(decomp_table.items()), tuple(torch.ops._dir),
               tuple(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")))
        found = _CIA_SPLIT.get(key)
    except (TypeError, AttributeError):  # a table torch cannot hash, or a torch without these names: torch's own
        return original(decomp_table)
    if found is None:
        found = original(dict(decomp_table))
        _CIA_SPLIT.clear()              # the last only: the registrations grow, they do not come back
        _CIA_SPLIT[key] = found
    cia, rest = found
    for op in [op for op in decomp_table if op not in rest]:
        del decomp_table[op]
    return dict(cia), decomp_table


_CIA = ScopedReplacement(lambda: importlib.import_module("torch.export.exported_program"),
                         "_split_decomp_table_to_cia_and_python_decomp", _split_kept)


def cia_split_kept():
    """Inside (this thread only), `ExportedProgram.run_decompositions` reuses its last split of the table
    (`_split_kept`); other threads split it anew, as does a torch without the function (tests fail there)."""
    owner = importlib.import_module("torch.export.exported_program")
    return _CIA.active() if _CIA.name in vars(owner) else nullcontext()


# ---- c10's flag: the CPU allocator's running total for every thread ------------------------------------------------

_C10_LIBRARY = {"darwin": "libc10.dylib", "win32": "c10.dll"}        # elsewhere (Linux, the BSDs): libc10.so
_C10_FLAG = {"users": 0, "before": False, "flag": None}
_C10_LOCK = threading.Lock()


def _c10_flag() -> ctypes.c_bool:
    """c10's gflag-style bool `FLAGS_caffe2_report_cpu_memory_usage` (c10/core/CPUAllocator.cpp), read through
    ctypes from torch's own c10 library: torch has no Python setter for c10 flags."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", _C10_LIBRARY.get(sys.platform, "libc10.so"))
    try:
        return ctypes.c_bool.in_dll(ctypes.CDLL(path), "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError) as e:
        raise RuntimeError(
            f"track_memory(every_thread=True) needs c10's flag caffe2_report_cpu_memory_usage, set through ctypes "
            f"in {path}; that failed on {sys.platform} with torch {torch.__version__} ({e}). Measure with "
            "every_thread=False (this thread's allocations and frees only), or with a torch whose c10 library "
            "exports the flag (Linux builds do)") from e


@contextmanager
def cpu_total_kept_for_every_thread() -> Iterator[None]:
    """c10's CPU allocator keeps its running total (the one a memory profiler reads) for every thread's allocations
    and frees, not only a profiled thread's, while any thread is inside (reference-counted; the flag's value before
    the first is put back after the last, on an exception too). Process-wide, as c10's flag is: it changes no
    thread's results, only makes every CPU allocation take c10's size-table lock. Raises RuntimeError (what failed,
    what to do) where the flag cannot be reached."""
    with _C10_LOCK:
        if _C10_FLAG["users"] == 0:
            flag = _C10_FLAG["flag"] = _C10_FLAG["flag"] or _c10_flag()
            _C10_FLAG["before"], flag.value = flag.value, True
        _C10_FLAG["users"] += 1
    try:
        yield
    finally:
        with _C10_LOCK:
            _C10_FLAG["users"] -= 1
            if _C10_FLAG["users"] == 0:
                _C10_FLAG["flag"].value = _C10_FLAG["before"]

"""Each private torch name memfit uses (`memfit.device.torch_private`), checked against the torch installed: a torch
upgrade that moves or changes one fails here, by name, before any prediction goes wrong. Each test checks that the
name is there and that it still behaves as memfit relies on; the replacements of torch functions are checked to act
in the entering thread only and to be put back (on an exception too)."""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from device.threads import in_thread
from memfit.device import torch_private as tp


def profiled_events(prof) -> list:
    """Every event of a profiler's result, its tree walked depth first."""
    out, stack = [], list(prof.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        out.append(e)
        stack.extend(e.children)
    return sorted(out, key=lambda e: e.start_time_ns)


# ---- tensors, storages, modules -------------------------------------------------------------------------------------

def test_storage_key_is_one_per_storage_for_real_and_fake_tensors():
    t = torch.ones(4)
    assert tp.storage_key(t.untyped_storage()) == tp.storage_key(t[1:].untyped_storage())      # a view: the same
    assert tp.storage_key(t.untyped_storage()) != tp.storage_key(t.clone().untyped_storage())
    with tp.FakeTensorMode():
        a, b = torch.empty(4), torch.empty(4)
        assert isinstance(tp.storage_key(a.untyped_storage()), int)                 # no data pointer, still a key
        assert tp.storage_key(a.untyped_storage()) != tp.storage_key(b.untyped_storage())


def test_version_counter_moves_with_every_in_place_write_only():
    t = torch.zeros(3)
    v = tp.version_counter(t)
    _ = t + 1
    assert tp.version_counter(t) == v
    t.add_(1)
    t[0] = 5
    assert tp.version_counter(t) == v + 2


def test_a_modules_own_dicts_hold_its_parameters_buffers_and_children_none_entries_kept():
    m = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.BatchNorm1d(2))
    lin, bn = m[0], m[1]
    assert tp.own_parameters(lin) == {"weight": lin.weight, "bias": None}         # bias=False registers None
    assert tp.own_buffers(bn).keys() == {"running_mean", "running_var", "num_batches_tracked"}
    assert list(tp.own_children(m).values()) == [lin, bn]
    assert [vars(lin)[k] for k in tp.MODULE_DICTS] == [tp.own_parameters(lin), tp.own_buffers(lin),
                                                       tp.own_children(lin)]
    tp.own_children(m)["0"] = torch.nn.Identity()                                   # a child swapped in place
    assert isinstance(m[0], torch.nn.Identity)


def test_storage_use_count_counts_each_tensor_on_the_storage():
    t = torch.ones(4)
    before = tp.storage_use_count(t.untyped_storage())
    v = t.view(2, 2)
    assert tp.storage_use_count(t.untyped_storage()) == before + 1
    del v
    assert tp.storage_use_count(t.untyped_storage()) == before


def test_grad_hooks_counts_both_kinds_of_hook_on_a_gradient():
    w = torch.nn.Parameter(torch.ones(2))
    count = lambda: sum(len(h or ()) for h in tp.grad_hooks(w))       # noqa: E731
    assert count() == 0
    pre = w.register_hook(lambda g: g * 2)
    post = w.register_post_accumulate_grad_hook(lambda p: None)
    assert count() == 2
    w.sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 2.0))     # the hook it counts is the one that runs
    pre.remove()
    post.remove()
    assert count() == 0


def test_a_compiled_module_is_seen_and_its_inner_module_is_the_original():
    lin = torch.nn.Linear(3, 2)
    compiled = torch.compile(lin)
    assert tp.compiled_inner(compiled) is lin           # OptimizedModule._orig_mod
    assert tp.compiled_inner(lin) is None
    assert tp.compiled_inner(torch.nn.Sequential(compiled)) is None     # only the outermost is unwrapped
    assert [p for p in compiled.parameters()] == [p for p in lin.parameters()]


def test_foreach_by_default_follows_torchs_rule():
    assert tp.foreach_by_default([torch.nn.Parameter(torch.ones(2))]) is False      # a CPU parameter: the loop
    assert tp.foreach_by_default([]) is True                                        # nothing rules foreach out


@pytest.mark.cuda
def test_foreach_by_default_is_taken_for_cuda_parameters():
    assert tp.foreach_by_default([torch.nn.Parameter(torch.ones(2, device="cuda"))]) is True


def test_reparametrized_swaps_parameters_for_the_block_and_keeps_tied_weights_tied():
    emb = torch.nn.Embedding(3, 2)
    model = torch.nn.Sequential(emb, torch.nn.Linear(2, 3, bias=False))
    model[1].weight = emb.weight
    other = torch.full((3, 2), 7.0)
    with tp.reparametrized(model, {"0.weight": other}, tie_weights=True, strict=False):
        assert model[0].weight is other and model[1].weight is other              # the tied one follows
    assert model[0].weight is emb.weight and model[1].weight is emb.weight


def test_batch_and_instance_norm_bases_cover_every_such_module_and_no_other():
    for cls in (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
                torch.nn.LazyBatchNorm2d):
        assert issubclass(cls, tp.BatchNormBase), cls
    for cls in (torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d):
        assert issubclass(cls, tp.InstanceNormBase), cls
    assert not issubclass(torch.nn.LayerNorm, (tp.BatchNormBase, tp.InstanceNormBase))
    assert not issubclass(torch.nn.GroupNorm, (tp.BatchNormBase, tp.InstanceNormBase))
    for cls in (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
                torch.nn.FeatureAlphaDropout):
        assert issubclass(cls, tp.DropoutBase) and cls().p == 0.5, cls
    assert not issubclass(torch.nn.Identity, tp.DropoutBase)


# ---- fake tensors, dispatch modes, pytrees --------------------------------------------------------------------------

def test_fake_tensors_their_mode_and_a_real_section_inside_one():
    with tp.FakeTensorMode() as mode:
        t = torch.empty(1000, 1000)
        with tp.unset_fake_temporarily():
            real = torch.ones(2)
    assert isinstance(t, tp.FakeTensor) and not isinstance(real, tp.FakeTensor)
    assert tp.detect_fake_mode([t]) is mode and tp.detect_fake_mode([real]) is None
    with tp.FakeTensorMode():
        assert bool(torch.tensor(True))                          # a constant's value is known
        with pytest.raises(tp.DataDependentOutputException) as e:
            bool(torch.all(torch.zeros(3, 4) == 1))              # a computed one's is not
    assert e.value.func is torch.ops.aten._local_scalar_dense.default


class _Seen(tp.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_dispatch_modes_see_op_overloads_and_can_be_stepped_aside():
    x = torch.ones(2)
    with _Seen() as seen:
        assert tp.current_dispatch_mode() is seen
        x + 1
        with tp.pop_mode_temporarily():
            assert tp.current_dispatch_mode() is None
            x * 2
        with tp.disable_current_modes():
            x - 1
    assert seen.funcs == [torch.ops.aten.add.Tensor]
    assert all(isinstance(f, tp.OpOverload) for f in seen.funcs)


def test_pytree_flattens_nested_batches_and_names_each_leafs_place():
    batch = ({"ids": torch.ones(2), "mask": torch.zeros(2)}, [torch.ones(1), 3])
    leaves, spec = tp.tree_flatten(batch)
    assert len(leaves) == 4 and tp.tree_leaves(batch)[3] == 3
    assert tp.tree_unflatten(leaves, spec)[0]["mask"] is batch[0]["mask"]
    assert tp.tree_map(lambda v: 0, batch)[1] == [0, 0]
    assert tp.tree_map_only(torch.Tensor, lambda t: t.shape, batch)[1] == [torch.Size([1]), 3]
    paths = [tp.keystr(path) for path, _ in tp.tree_flatten_with_path(batch)[0]]
    assert paths == ["[0]['ids']", "[0]['mask']", "[1][0]", "[1][1]"]        # memfit's layout reads "[0]" as x


# ---- ops and the dispatcher -----------------------------------------------------------------------------------------

def test_op_schema_says_arguments_aliasing_and_mutation():
    aten = torch.ops.aten
    schema = tp.op_schema(aten.add.Tensor)
    assert [a.name for a in schema.arguments] == ["self", "other", "alpha"]
    assert not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
    view = tp.op_schema(aten.view.default).returns[0].alias_info
    assert view is not None and not view.is_write
    assert tp.op_schema(aten.add_.Tensor).is_mutable
    out = [a for a in tp.op_schema(aten.add.out).arguments if a.kwarg_only and a.alias_info is not None]
    assert [(a.name, a.alias_info.is_write) for a in out] == [("out", True)]
    assert tp.op_schema(lambda x: x) is None and tp.op_schema(torch.nn.Linear(1, 1)) is None


def test_overload_name_is_the_overloads_own_name():
    aten = torch.ops.aten
    assert tp.overload_name(aten.add.Tensor) == "Tensor" and tp.overload_name(aten.rand.default) == "default"
    assert tp.overload_name(aten.randint.low_out) == "low_out"
    assert f"aten.{tp.op_schema(aten.add.out).name[6:]}.{tp.overload_name(aten.add.out)}" == "aten.add.out"


def test_op_kernel_computes_what_the_op_does():
    x = torch.arange(4.0)
    assert torch.equal(tp.op_kernel(torch.ops.aten.add.Tensor)(x, x), x + x)
    assert tp.op_kernel(torch.ops.aten.add.Tensor) is not torch.ops.aten.add.Tensor
    f = torch.nn.functional.relu
    assert tp.op_kernel(f) is f                           # no op: as it is


def test_has_kernel_tells_an_own_cpu_kernel_from_a_composite():
    aten = torch.ops.aten
    assert tp.has_kernel(aten.add.out, "CPU") and tp.has_kernel(aten.gelu.out, "CPU")
    assert not tp.has_kernel(aten.relu.out, "CPU")         # a generated out= wrapper: it allocates and copies


def test_nn_bindings_write_into_out():
    x, y = torch.linspace(-2, 2, 8), torch.empty(8)
    tp.nn_binding("gelu")(x, out=y)
    assert torch.equal(y, F.gelu(x))
    tp.nn_binding("hardtanh")(x, -1.0, 1.0, out=y)
    assert torch.equal(y, F.hardtanh(x))


def test_in_backward_is_true_inside_autograds_backward_only():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("forward", tp.in_backward()))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", tp.in_backward()))
            return g
    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [("forward", False), ("backward", True)] and not tp.in_backward()


def test_the_profilers_running_flag_and_its_allocation_events():
    assert not tp.profiler_running()
    with torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True) as prof:
        assert tp.profiler_running()
        t = torch.empty(1000)
    del t
    allocations = [e.typed[1] for e in profiled_events(prof) if e.typed[0] == tp.ProfilerEventType.Allocation]
    kinds = {e.typed[0] for e in profiled_events(prof)}
    assert {tp.ProfilerEventType.TorchOp, tp.ProfilerEventType.Allocation} <= kinds
    assert [(a.alloc_size, a.device.type) for a in allocations][:1] == [(4000, "cpu")]
    assert not tp.profiler_running()


def test_the_dict_version_changes_with_every_write_and_is_no_other_dicts():
    version = tp.dict_version_reader()
    d, other = {"a": 1}, {"a": 1}
    seen = [version(d), version(other)]
    d["a"] = 2
    seen.append(version(d))
    d.pop("a")
    seen.append(version(d))
    assert len(set(seen)) == 4
    assert version(d) == seen[-1]                       # reading is no write


def test_torch_has_the_tensor_check_the_fingerprint_uses():
    # memfit.memory.fingerprint_check.tensor_checker builds it (its behaviour is tested there)
    assert callable(tp.tensor_guards())


# ---- autograd graph nodes -------------------------------------------------------------------------------------------

def test_node_order_inputs_and_saved_tensors():
    x, w = torch.ones(2, 3, requires_grad=True), torch.ones(3, dtype=torch.float64, requires_grad=True)
    unpacked = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(t) or t):
        a = x * w                                        # MulBackward0 saves self and other
        b = a.exp()
    assert tp.node_sequence_nr(b.grad_fn) > tp.node_sequence_nr(a.grad_fn)     # later ops run first
    def described(node):
        return [(tuple(m.shape), m.dtype, m.device.type) for m in tp.node_input_metadata(node)]
    assert described(a.grad_fn) == [((2, 3), torch.float64, "cpu")]          # the gradient flowing into a node
    assert [described(nxt) for nxt, _ in a.grad_fn.next_functions] == [[((2, 3), torch.float32, "cpu")],
                                                                        [((3,), torch.float64, "cpu")]]
    tp.read_saved_tensors(a.grad_fn)
    assert len(unpacked) == 2


# ---- torch.distributed -----------------------------------------------------------------------------------------------

@pytest.fixture
def fake_group():
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("fake", store=tp.fake_store(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_fsdp2_and_ddp_internals_the_per_rank_model_reads(fake_group):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    local = torch.ones(3)
    d = DTensor.from_local(local, fake_group, [Shard(0)])
    assert tuple(d.shape) == (6,) and tuple(tp.local_tensor(d).shape) == (3,)
    assert tp.storage_key(tp.local_tensor(d).untyped_storage()) == tp.storage_key(local.untyped_storage())
    assert tp.local_tensor(local) is local

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0], mesh=fake_group)
    fully_shard(model, mesh=fake_group)
    groups = tp.fsdp_param_groups(model[0])
    assert len(groups) == 1 and not tp.is_hsdp(groups[0])
    weight = next(p for p in groups[0].fsdp_params if tuple(tp.fsdp_param_size(p)) == (4, 4))   # unsharded size
    shard = tp.fsdp_param_shard(weight)
    assert shard.numel() == weight.padded_sharded_param_size.numel() == 8                   # 2 of 4 rows, 2 ranks
    assert tp.storage_key(shard.untyped_storage()) == \
        tp.storage_key(tp.local_tensor(weight.sharded_param).untyped_storage())
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    lock, entered = ShardingPropagator._fake_mode_lock, []
    scoped = tp.sharding_fake_mode_lock_scoped(lambda torchs: entered.append(torchs) or torchs)

    def propagate():
        with ShardingPropagator._fake_mode_lock:                    # what the propagation enters
            pass
    with scoped.active():
        propagate()                                                 # ours, handed torch's lock
        in_thread(propagate)                                        # another thread: torch's only
    assert entered == [lock] and ShardingPropagator._fake_mode_lock is lock
    assert {"foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"} <= set(vars(tp.fsdp_param_group()))
    assert callable(tp.fsdp_collectives().foreach_reduce_scatter_copy_in)

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    assert tp.ddp_comm_hook(ddp) is None

    def my_hook(state, bucket):
        return bucket
    ddp.register_comm_hook(None, my_hook)
    assert tp.ddp_comm_hook(ddp) == "test_fsdp2_and_ddp_internals_the_per_rank_model_reads.<locals>.my_hook"
    builtin = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    assert "FP16_COMPRESS" in tp.ddp_comm_hook(builtin)


def test_the_memory_trackers_the_benchmarks_compare_with_are_there():
    assert {"track_external", "get_tracker_snapshot"} <= set(dir(tp.mem_tracker()))
    assert issubclass(tp.fsdp_mem_tracker(), tp.mem_tracker())


def test_dynamo_reset_and_inductors_config_patch():
    tp.dynamo_reset()
    config = tp.inductor_config()
    with config.patch(fx_graph_cache=False, autotune_local_cache=False):
        assert config.fx_graph_cache is False and config.autotune_local_cache is False


# ---- replacements of torch functions --------------------------------------------------------------------------------

def test_aot_tracing_keeps_torchs_generator_only_outside_the_thread_inside():
    from torch._dynamo.utils import preserve_rng_state
    from torch._functorch import aot_autograd
    assert aot_autograd.preserve_rng_state is preserve_rng_state         # what AOT tracing enters

    def rewound() -> bool:
        before = torch.get_rng_state()
        with aot_autograd.preserve_rng_state():
            torch.rand(3)
        return torch.equal(before, torch.get_rng_state())
    assert rewound()                                                     # torch's: save and restore
    with tp.aot_rng_not_saved():
        assert not rewound()                                             # this thread: neither
        assert in_thread(rewound)                                        # another thread: torch's
    assert aot_autograd.preserve_rng_state is preserve_rng_state
    with pytest.raises(ValueError), tp.aot_rng_not_saved():
        raise ValueError
    assert aot_autograd.preserve_rng_state is preserve_rng_state


def test_the_fx_tracers_patches_act_in_the_tracing_thread_only():
    from torch.fx._symbolic_trace import _Patcher
    original = vars(_Patcher)["patch_method"]

    class C:
        def f(self):
            return "before"
    with tp.tracer_patches_this_thread_only(), _Patcher() as patcher:
        patcher.patch_method(C, "f", lambda self: "patched", deduplicate=False)
        assert C().f() == "patched" and in_thread(lambda: C().f()) == "before"
    assert C().f() == "before" and vars(_Patcher)["patch_method"] is original
    with _Patcher() as patcher:                                         # outside: torch's, for every thread
        patcher.patch_method(C, "f", lambda self: "patched", deduplicate=False)
        assert in_thread(lambda: C().f()) == "patched"
    with pytest.raises(ValueError), tp.tracer_patches_this_thread_only():
        raise ValueError
    assert vars(_Patcher)["patch_method"] is original


def test_the_kept_split_of_a_decomposition_table_is_torchs_and_sees_ops_registered_since():
    from torch.export import exported_program
    split = vars(exported_program)["_split_decomp_table_to_cia_and_python_decomp"]     # what run_decompositions calls
    aten = torch.ops.aten
    table = {aten.linear.default: lambda *a: None, aten.hardswish.default: lambda *a: None}   # a CIA op, a kernel

    def torchs() -> tuple:                      # torch's own, from another thread: outside the replacement
        return in_thread(lambda: split(dict(table)))

    def kept() -> tuple:
        mine = dict(table)
        cia, rest = exported_program._split_decomp_table_to_cia_and_python_decomp(mine)
        assert rest is mine and aten.linear.default not in mine      # the table left as torch leaves it
        return cia, rest
    with tp.cia_split_kept():
        assert kept() == kept() == torchs()
        assert aten.linear.default in kept()[0] and list(kept()[1]) == [aten.hardswish.default]
        with torch.library._scoped_library("memfit_cia_test", "DEF") as lib:
            lib.define("twice(Tensor x) -> Tensor")
            lib.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
            twice = torch.ops.memfit_cia_test.twice.default
            assert twice in kept()[0] and kept() == torchs()
        assert twice not in kept()[0] and kept() == torchs()
    assert vars(exported_program)["_split_decomp_table_to_cia_and_python_decomp"] is split


def test_the_split_is_kept_through_the_names_it_keys_on():
    """The key's private names (a torch without them makes `_split_kept` fall back to torch's split at every
    capture: captures still right, 0.11 s slower each): present, and a second split of one table is the kept one."""
    assert isinstance(torch.ops._dir, list) and "aten" in torch.ops._dir
    assert "aten::linear" in torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    from torch.export import exported_program
    split = vars(exported_program)["_split_decomp_table_to_cia_and_python_decomp"]
    calls = []

    def counted(table):
        calls.append(1)
        return split(table)
    table = {torch.ops.aten.linear.default: lambda *a: None, torch.ops.aten.hardswish.default: lambda *a: None}
    first, second = tp._split_kept(counted, dict(table)), tp._split_kept(counted, dict(table))
    assert first == second and len(calls) == 1      # the second split is the kept one (its table is new: a miss first)


def test_torch_export_still_traces_inside_the_fx_and_aot_replacements():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
    with tp.tracer_patches_this_thread_only(), tp.aot_rng_not_saved():
        ep = torch.export.export(model, (torch.ones(2, 3),))
    x = torch.randn(2, 3)
    assert torch.equal(ep.module()(x), model(x))


# ---- c10's flag ------------------------------------------------------------------------------------------------------

def test_c10s_flag_counts_another_threads_allocation_in_the_total_while_on():
    flag = tp._c10_flag()
    before = flag.value

    def total_seen_after_another_thread_allocates() -> int:
        held = []
        with torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True) as prof:
            a = torch.empty(1000)
            in_thread(lambda: held.append(torch.empty(250_000)))       # 1 MB, allocated by another thread
            b = torch.empty(1000)
        del a, b
        held.clear()
        totals = [e.typed[1].total_allocated for e in profiled_events(prof)
                  if e.typed[0] == tp.ProfilerEventType.Allocation and e.typed[1].alloc_size > 0]
        return totals[1] - totals[0]
    with tp.cpu_total_kept_for_every_thread():
        assert flag.value
        assert total_seen_after_another_thread_allocates() == 4000 + 1_000_000
        with pytest.raises(ValueError), tp.cpu_total_kept_for_every_thread():
            raise ValueError
        assert flag.value                                                # still one user inside
    assert flag.value == before
    if not before:
        assert total_seen_after_another_thread_allocates() == 4000      # off: this thread's only


def test_c10s_flag_is_refused_with_what_failed_where_its_library_is_not_found(monkeypatch):
    monkeypatch.setattr(tp, "_C10_FLAG", {"users": 0, "before": False, "flag": None})
    monkeypatch.setitem(tp._C10_LIBRARY, sys.platform, "libc10.missing")
    with pytest.raises(RuntimeError, match=r"libc10\.missing.*failed on .*every_thread=False"), \
            tp.cpu_total_kept_for_every_thread():
        pass
    assert tp._C10_FLAG["users"] == 0


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU build of torch has no cuBLAS to clear")
def test_the_cublas_workspaces_can_be_cleared_on_a_cuda_build():
    assert callable(torch._C._cuda_clearCublasWorkspaces)         # what clear_cublas_workspaces calls


@pytest.mark.cuda
def test_clearing_the_cublas_workspaces_frees_the_first_matmuls_workspace():
    a = torch.ones(64, 64, device="cuda")
    (a @ a).sum().item()                                            # the main thread's handle: its workspace
    before = torch.cuda.memory_allocated()
    tp.clear_cublas_workspaces()
    assert torch.cuda.memory_allocated() < before


def test_every_private_aten_op_memfit_names_exists_in_this_torch():
    """ATen ops with a leading underscore (`aten._scaled_dot_product_attention_math`, the flash attention backward,
    `_local_scalar_dense`, ...) are torch's internal operators: a release may rename or drop one. memfit names them
    where their meaning is (fake kernels, the storage log, the planner's masks) rather than here; this scan of the
    source fails by name, file and overload on a torch that lacks one, instead of a KeyError deep in a prediction."""
    import pathlib
    import re
    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "memfit"
    named = {(m.group(1), m.group(2) or "", f.relative_to(src.parent).as_posix())
             for f in src.rglob("*.py")
             for m in re.finditer(r"\baten\.(_[A-Za-z0-9_]+)(?:\.([A-Za-z_][A-Za-z0-9_]*))?", f.read_text())}
    assert len({op for op, _, _ in named}) >= 10           # the scan finds them (15 ops in 24 places on torch 2.13)

    def exists(op: str, overload: str) -> bool:
        try:
            packet = getattr(torch.ops.aten, op)
        except (AttributeError, RuntimeError):
            return False
        return not overload or hasattr(packet, overload)
    missing = sorted(f"aten.{op}{'.' + o if o else ''} in {f}" for op, o, f in named if not exists(op, o))
    assert not missing, f"torch {torch.__version__} lacks ATen ops memfit names: {missing}"


def test_the_compile_front_end_every_optimizer_imports_is_a_module_of_this_torch():
    """memfit.testing.ranks' forkserver preloads it (multiprocessing ignores a preload that fails to import: the
    ranks would only be slower, so this test is what fails when a torch release moves it)."""
    import importlib
    assert callable(importlib.import_module(tp.DYNAMO_MODULE).reset)


def test_a_value_read_on_a_fake_tensor_is_the_op_memfit_answers():
    """`.item()` and `bool(t)` on a fake tensor reach READ_VALUE, and torch refuses them with the exception memfit
    catches to answer (stand-ins in an optimizer's step, known values, transformers' mask questions): a torch that
    renames either would leave every such read refused, silently for the stand-ins."""
    seen = []

    class Reads(tp.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))
    with tp.FakeTensorMode(), Reads():
        t = torch.ones(2)
        for read in (lambda: t.sum().item(), lambda: bool(t.sum() > 0)):
            with pytest.raises(tp.DataDependentOutputException) as e:
                read()
            assert str(tp.READ_VALUE) in str(e.value)
    assert seen.count(tp.READ_VALUE) == 2

"""CUDA answers from a machine without a GPU (`memfit.memory.cuda_step`): the caching allocator replayed over the
step's allocations and frees, the fixed costs as named terms. References: hand-derived allocation sequences
replayed by `memfit.device.cuda_caching.replay`, the fake runs at sizes the lines were not fitted at, the CUDA
kernels' byte formulas (`memfit.device.cuda_kernels`)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit.budget import BudgetExceeded
from memfit.device.cuda_blocks import round_size
from memfit.device.cuda_caching import replay
from memfit.device.cuda_costs import CONTEXT_LAZY
from memfit.device.cuda_kernels import sdpa_forward
from memfit.memory.cuda_step import STEPS, event_lines
from memfit.memory.cuda_target import resolve_gpu
from memfit.memory.fake_run import CudaTarget, StepSpec
from memfit.memory.probes import StepProbes
from memfit.memory.step import ExampleBatch
from memfit.memory.step_model import step_memory_model

MiB = 1 << 20
A100 = 4096 * 1024 * 2 + 16 * 1024 * 8          # cuBLAS's workspace below compute capability 9.0


@pytest.fixture(autouse=True)
def _stated_defaults(monkeypatch):
    for name in ("CUDA_MODULE_LOADING", "CUBLAS_WORKSPACE_CONFIG", "PYTORCH_CUDA_ALLOC_CONF",
                 "TORCH_CUBLASLT_UNIFIED_WORKSPACE"):
        monkeypatch.delenv(name, raising=False)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def test_an_inference_forward_is_the_replay_of_its_hand_derived_allocations():
    model = nn.Linear(256, 1024, bias=False).eval()
    mm = memfit.memory_model(model, (256,), device="cuda", gpu="A100-40GB")
    for n in (3, 1000):
        events = [("weight", 1024 * 256 * 4)]
        for step in range(STEPS):       # the batch, mm's output, the first matmul's cuBLAS workspace, then freed
            events += [(("x", step), n * 256 * 4), (("out", step), n * 1024 * 4)]
            events += [("workspace", A100)] if step == 0 else []
            events += [(("out", step), -n * 1024 * 4), (("x", step), -n * 256 * 4)]
        r = replay(events)
        assert (mm.cuda(n).reserved, mm.cuda(n).allocated) == (r.peak_reserved, r.peak_allocated)
        assert mm.total_bytes(n) == r.peak_reserved + CONTEXT_LAZY
        parts = mm.breakdown(n)
        assert parts["cuBLAS workspace"] == A100 and parts["CUDA context"] == CONTEXT_LAZY
        assert parts["parameters"] == round_size(1024 * 256 * 4)


def test_each_allocation_is_exact_at_a_batch_size_the_lines_were_not_fitted_at():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    spec = StepSpec(model, ExampleBatch((32,)), torch.device("cpu"), optimizer=opt, cuda=CudaTarget((9, 0), False))
    probes = StepProbes(spec)
    lines = event_lines({n: probes.at(n) for n in (1, 4)})
    seven = probes.at(7)                                  # a fake run of its own at 7
    assert np.array_equal(seven.events, probes.runs[4].events)
    assert np.array_equal(lines.at(7), seven.sizes)


def test_a_batch_squared_allocation_is_fitted_as_a_quadratic_and_exact_elsewhere():
    class Similarity(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x)
            return (h @ h.t()).softmax(-1)                 # (n, n)

    model = Similarity()
    spec = StepSpec(model, ExampleBatch((16,)), torch.device("cpu"), cuda=CudaTarget((9, 0), False))
    probes = StepProbes(spec)
    runs = {n: probes.at(n) for n in (1, 2, 4, 8)}
    lines = event_lines(runs)
    assert lines is not None and lines.c is not None and "quadratic" in lines.how
    assert np.array_equal(lines.at(5), probes.at(5).sizes)


def test_reserved_holds_allocated_and_the_breakdown_sums_to_the_total():
    model = mlp()
    mm = memfit.memory_model(model, (32,), train=True, optimizer=torch.optim.AdamW(model.parameters()),
                             device="cuda", gpu="H100")
    for n in (1, 9, 300, 5000):
        peak, parts = mm.cuda(n), mm.breakdown(n)
        assert peak.reserved >= peak.allocated > 0 and peak.exact
        assert sum(parts.values()) == mm.total_bytes(n) == peak.reserved + peak.outside
        held = sum(v for k, v in parts.items() if k not in ("allocator: reserved beyond allocated", "CUDA context"))
        assert held <= peak.allocated and parts["allocator: reserved beyond allocated"] >= 0
        assert peak.reserved % (2 * MiB) == 0                 # whole segments


def test_the_fixed_costs_are_named_terms_with_their_sources():
    model = mlp()
    train = dict(train=True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), device="cuda")
    hopper = memfit.memory_model(model, (32,), gpu="H100", **train)
    ampere = memfit.memory_model(model, (32,), gpu="A100-40GB", **train)
    assert hopper.breakdown(8)["cuBLAS workspace"] == 2 * 32 * MiB          # forward's thread and backward's
    assert ampere.breakdown(8)["cuBLAS workspace"] == 2 * A100
    assert hopper.breakdown(8)["CUDA context"] == CONTEXT_LAZY
    assert "stated defaults" in hopper.method and "32 MiB per handle" in hopper.explain(8)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())                      # no matmul: no cuBLAS handle
    parts = memfit.memory_model(conv, (3, 8, 8), device="cuda", gpu="H100").breakdown(2)
    assert "cuBLAS workspace" not in parts and "cuDNN" in memfit.memory_model(conv, (3, 8, 8), device="cuda").method


def test_cuda_keeps_adams_step_counters_on_the_host_unless_fused():
    model = mlp()
    sizes = [p.numel() * 4 for p in model.parameters()]
    for fused, extra in ((False, 0), (True, 512 * len(sizes))):
        opt = torch.optim.AdamW(model.parameters(), fused=fused)
        mm = memfit.memory_model(model, (32,), train=True, optimizer=opt, device="cuda", gpu="H100")
        assert mm.breakdown(64)["optimizer state"] == 2 * sum(round_size(s) for s in sizes) + extra


class Attention(nn.Module):
    """q, k, v (B, 4, T, 16) from the input; attention alone."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3, 1, 4, 1, 16))

    def forward(self, x):                  # (B, T, 64)
        b, t, _ = x.shape
        q, k, v = (x.view(b, t, 4, 16).transpose(1, 2).unsqueeze(0) * self.w).unbind(0)
        return F.scaled_dot_product_attention(q, k, v)


def test_the_memory_efficient_kernels_saving_over_math_is_its_formula():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = Attention()
    fused = memfit.memory_model(model, (256, 64), train=True, device="cuda", gpu="H100")
    with sdpa_kernel([SDPBackend.MATH]):
        math = memfit.memory_model(model, (256, 64), train=True, device="cuda", gpu="H100")
    assert "efficient" in fused.method and "routed as the GPU runs it: math" in math.method
    slope = lambda mm: mm.saved_activation_bytes(8) - mm.saved_activation_bytes(4)     # four more samples
    formula = lambda kernel: (sdpa_forward(kernel, 8, 4, 256, 256, 16, torch.float32).saved
                              - sdpa_forward(kernel, 4, 4, 256, 256, 16, torch.float32).saved)
    assert slope(math) - slope(fused) == formula("math") - formula("efficient")
    assert math.total_bytes(64) > fused.total_bytes(64)


def test_device_memory_bounds_the_largest_batch_the_allocator_serves():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    kw = dict(train=True, optimizer=opt, device="cuda")
    big = memfit.max_batch_size(model, (32,), **kw, device_memory="400MiB")
    small = memfit.max_batch_size(model, (32,), **kw, device_memory="360MiB")
    mm = memfit.memory_model(model, (32,), **kw, gpu=400 * MiB)
    assert mm.serves(big, 400 * MiB) and not mm.serves(big + 1, 400 * MiB)
    assert 0 < small < big and mm.serves(big, mm.total_bytes(big))
    with pytest.raises(BudgetExceeded, match="not even a batch of 1"):
        memfit.max_batch_size(model, (32,), **kw, device_memory="200MiB")          # below the context
    with pytest.raises(ValueError, match="pass device='cuda' too"):
        memfit.max_batch_size(model, (32,), train=True, optimizer=opt, device_memory="24GiB")


def test_a_gpu_is_named_by_family_capability_or_memory_and_refused_otherwise():
    assert resolve_gpu("RTX 4090").capability == (8, 9) and resolve_gpu("24GiB").memory == 24 << 30
    assert resolve_gpu((7, 5)).capability == (7, 5)
    with pytest.raises(ValueError, match="expected gpu= a GPU's name"):
        resolve_gpu("Z80")
    with pytest.raises(ValueError, match="pass device='cuda' too"):
        memfit.memory_model(mlp(), (32,), gpu="H100")


def test_ddp_on_cuda_holds_its_buckets_as_blocks_and_fsdp_says_it_is_not_replayed():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    ddp = memfit.memory_model(model, (32,), train=True, optimizer=opt, parallel="ddp", world_size=2, device="cuda",
                              gpu="H100")
    param_bytes = sum(p.numel() * 4 for p in model.parameters())           # one bucket: below DDP's 1 MiB cap
    assert ddp.breakdown(8)["gradient buckets (DDP)"] == round_size(param_bytes)
    assert ddp.serves(8, ddp.total_bytes(8)) and "gradient buckets as blocks" in ddp.explain(8)
    with pytest.raises(ValueError, match="expected parallel='ddp' for a per-rank CUDA prediction"):
        memfit.memory_model(model, (32,), train=True, optimizer=opt, parallel="fsdp", device="cuda")


def test_the_cpu_figures_do_not_move():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    cpu = step_memory_model(model, (32,), train=True, optimizer=opt)
    assert "allocator margin" in cpu.breakdown(8) and cpu.breakdown(8)["allocator margin"] == 16
    with pytest.raises(ValueError, match="cuda\\(n\\) gives the caching allocator's figures of a CUDA model"):
        cpu.cuda(8)


@pytest.mark.cuda
def test_the_prediction_on_a_gpu_is_the_real_allocators_reserved_bytes():
    from memfit.cli.bench.gpu_cases import CudaSide, cases, loop
    side = CudaSide(torch.device("cuda", torch.cuda.current_device()))
    case = cases(quick=True)["mlp"]
    model = case.build()
    x, y = case.sample(2)
    mm = memfit.memory_model(model, x, train=True, optimizer=case.optimizer(model.parameters()), loss_fn=case.loss_fn,
                             target=y, device="cuda")
    for n in case.batches:
        allocated, reserved = side.run(loop(case, n))
        assert 1.0 <= mm.cuda(n).reserved / reserved <= 1.05
        assert mm.cuda(n).allocated >= allocated

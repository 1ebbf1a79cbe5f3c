"""Fake CUDA runs: the node-by-node backward against autograd's engine (on the CPU, where the engine runs fake
tensors), attention routed as a GPU would, and a whole step on fake CUDA where the torch build allows it."""

import pytest
import torch
import torch.nn.functional as F

from memfit.device.fake_cuda import backward_by_nodes, cuda_fakes, log_fake_cuda

CPU_BUILD = (f"torch {torch.__version__} is a CPU build: recording autograd on a CUDA fake aborts the process (no "
             "CUDA device guard to give the node a stream), so only a forward without grad runs on fake CUDA here")


class Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 + x * 0


def mlp(dev):
    m = torch.nn.Sequential(torch.nn.Linear(64, 128, device=dev), torch.nn.ReLU(), torch.nn.Linear(128, 10, device=dev))
    return F.cross_entropy(m(torch.randn(32, 64, device=dev)), torch.zeros(32, dtype=torch.long, device=dev))


def conv(dev):
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, device=dev), torch.nn.BatchNorm2d(8, device=dev),
                            torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10, device=dev))
    return m(torch.randn(4, 3, 16, 16, device=dev)).sum()


def shared(dev):
    """A weight used twice, residual adds, one grad flowing to two leaves, views (chunk, cat), a Python Function."""
    w = torch.nn.Parameter(torch.randn(32, 32, device=dev))
    b = torch.nn.Parameter(torch.randn(32, device=dev))
    h = torch.randn(16, 32, device=dev) @ w + b
    h = h + torch.tanh(h @ w)
    left, right = h.chunk(2, dim=1)
    h = torch.cat([Twice.apply(right), left], dim=1)
    return (h * h).mean() + (w + b).sum()


def attention(dev):
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0, device=dev)
    return layer(torch.randn(2, 10, 32, device=dev)).pow(2).mean()


def checkpointed(dev):
    """A block recomputed in backward (torch.utils.checkpoint, non-reentrant): its inputs are read by the
    recomputation, from inside the unpack of the block's first node to run, not as that node's own."""
    from torch.utils.checkpoint import checkpoint
    first = torch.nn.Linear(32, 64, device=dev)
    block = torch.nn.Sequential(torch.nn.Linear(64, 64, device=dev), torch.nn.GELU(),
                                torch.nn.Linear(64, 64, device=dev))
    h = torch.relu(first(torch.randn(8, 32, device=dev)))
    h = checkpoint(block, h, use_reentrant=False)
    return (h * h).mean()


STEPS = {"mlp": mlp, "conv": conv, "shared": shared, "attention": attention, "checkpointed": checkpointed}


def _events(run):
    """The bytes allocated and freed through backward; the frees between two allocations in sorted order (in any
    order they leave the same live bytes, and the caching allocator the same state, at the next allocation)."""
    out, frees = [], []
    for op, _, n in run.log:
        if op >= run.phases["backward"]:
            break
        if n < 0:
            frees.append(n)
        else:
            out += sorted(frees) + [n]
            frees = []
    return out + sorted(frees)


@pytest.mark.parametrize("name", [k for k in STEPS if k != "checkpointed"])
def test_backward_by_nodes_allocates_and_frees_as_autograds_engine(name):
    engine = log_fake_cuda(lambda: STEPS[name]("cpu"), device="cpu", engine="torch")
    nodes = log_fake_cuda(lambda: STEPS[name]("cpu"), device="cpu", engine="nodes")
    assert _events(nodes) == _events(engine) and nodes.peak() == engine.peak()


def test_backward_by_nodes_runs_a_checkpointed_block_and_never_counts_less_than_the_engine():
    """A checkpointed block ran into "a saved tensor was read after its node ran" (its inputs, read by the
    recomputation inside another node's unpack, were released with that node): every CUDA prediction from a machine
    without a GPU, on a CUDA build of torch, with checkpointing. Its bytes are not the engine's yet: over them
    (1.21x on this block), never under."""
    engine = log_fake_cuda(lambda: checkpointed("cpu"), device="cpu", engine="torch")
    nodes = log_fake_cuda(lambda: checkpointed("cpu"), device="cpu", engine="nodes")
    assert engine.peak() <= nodes.peak() <= 1.25 * engine.peak()


@pytest.mark.parametrize("name", STEPS)
def test_backward_by_nodes_computes_autograds_gradients(name):
    def grads(run_backward):
        torch.manual_seed(0)
        leaves = []
        loss = STEPS[name]("cpu")
        stack, seen = [loss.grad_fn], set()
        while stack:                              # the leaves, from the graph
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if hasattr(node, "variable"):
                leaves.append(node.variable)
            stack += [n for n, _ in node.next_functions]
        run_backward(loss)
        return sorted((tuple(v.shape), v.grad.sum().item()) for v in leaves)

    got, want = grads(backward_by_nodes), grads(lambda loss: loss.backward())
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [g for _, g in got] == pytest.approx([g for _, g in want], rel=1e-5, abs=1e-6)


def test_support_is_what_this_build_can_do():
    support = cuda_fakes()
    assert support.forward == support.backward == (torch.version.cuda is not None)
    if torch.version.cuda is None:
        with pytest.raises(RuntimeError, match="CPU build"):
            log_fake_cuda(lambda: torch.ones(2, device="cuda", requires_grad=True).sum())


def attention_step(dtype, requires_grad):
    def step():
        q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=dtype, requires_grad=requires_grad)
                   for _ in range(3))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()
    return step


@pytest.mark.parametrize("dtype, kernel", [(torch.float16, "flash"), (torch.bfloat16, "flash"),
                                           (torch.float32, "efficient")])
def test_attention_forward_on_fake_cuda_runs_the_gpus_kernel(dtype, kernel):
    """Runs on any build (no grad): no T x T matrix is allocated, unlike the math kernel's."""
    fused = log_fake_cuda(attention_step(dtype, False), backward=False)
    math = log_fake_cuda(attention_step(dtype, False), backward=False, sdpa="math")
    assert fused.sdpa == [kernel] and math.sdpa == ["math"]
    square = 2 * 4 * 256 * 256 * 2                       # one (B, H, T, T) matrix of 2-byte elements
    assert max(n for _, _, n in fused.log) < square <= max(n for _, _, n in math.log)


@pytest.mark.skipif(torch.version.cuda is None, reason=CPU_BUILD)
def test_a_training_step_on_fake_cuda_with_flash_attention():
    flash = log_fake_cuda(attention_step(torch.bfloat16, True))
    math = log_fake_cuda(attention_step(torch.bfloat16, True), sdpa="math")
    assert flash.sdpa == ["flash"] and "backward" in flash.phases
    assert any("flash_attention_backward" in str(op) for op in flash.ops)
    assert flash.peak() * 3 < math.peak()                # 2.1 MB against 8.7 MB at T = 256 (torch 2.14.1)


@pytest.mark.skipif(torch.version.cuda is None, reason=CPU_BUILD)
@pytest.mark.parametrize("name", STEPS)
def test_models_train_on_fake_cuda(name):
    run = log_fake_cuda(lambda: STEPS[name]("cuda"))
    assert run.phases["backward"] > run.phases["forward"] and run.peak() > 0


def test_the_kernel_chosen_follows_the_gpu_and_the_enabled_backends():
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import sdpa_kernel as backends

    from memfit.device.fake_cuda import sdpa_kernel
    q = torch.empty(1, 2, 8, 16, dtype=torch.bfloat16)
    mask = torch.ones(8, 8, dtype=torch.bool)
    assert sdpa_kernel(q, q, q) == "flash" and sdpa_kernel(q, q, q, capability=(7, 5)) == "efficient"
    assert sdpa_kernel(q, q, q, mask) == "efficient" and sdpa_kernel(q.float(), q.float(), q.float()) == "efficient"
    with backends([SDPBackend.MATH]):
        assert sdpa_kernel(q, q, q) == "math"
    with backends([SDPBackend.EFFICIENT_ATTENTION]):
        assert sdpa_kernel(q, q, q) == "efficient"


def test_attention_is_routed_inside_a_backwards_recomputation_and_inside_multihead_attention():
    """`SdpaRouting` stays on inside the torch functions that run attention within them (torch pops a mode while its
    handler runs): a checkpointed block's attention recomputed inside `Tensor.backward` (it ran the CPU's own
    kernel, saving other tensors: torch.utils.checkpoint's CheckpointError on BERT with a layer checkpointed,
    `device="cuda"`), and `nn.MultiheadAttention`'s attention inside `F.multi_head_attention_forward`."""
    from torch.utils.checkpoint import checkpoint

    from memfit.device.fake_cuda import SdpaRouting
    from memfit.device.torch_private import FakeTensorMode

    class Run:
        def __init__(self):
            self.sdpa = []
    recomputed, inner = Run(), Run()
    with FakeTensorMode():
        x = torch.randn(2, 4, 16, 32, requires_grad=True)
        with SdpaRouting("auto", recomputed):
            out = checkpoint(lambda t: F.scaled_dot_product_attention(t * 2, t, t), x, use_reentrant=False)
            out.sum().backward()
        mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        h = torch.randn(2, 16, 32, requires_grad=True)
        with SdpaRouting("auto", inner):
            mha(h, h, h, need_weights=False)[0].sum().backward()
    assert recomputed.sdpa == ["efficient", "efficient"]        # the forward's, then the recomputation's
    assert inner.sdpa == ["efficient"]

"""CUDA paths against references nobody here wrote: planned outputs against eager PyTorch on the GPU,
evaluate's out-of-memory back-off under a real memory cap, and nccl evaluation on two GPUs against a
single process. Every test is marked `cuda` (skipped without a device): run them with `make test-cuda`.
(The loaders' CUDA tests, the prefetcher under a slow consumer among them, are in loading/test_minibatches.py;
its stream protocol is checked on the CPU in loading/test_cuda_protocol.py.)"""
import numpy as np
import pytest
import torch
from torch import nn

from memfit import evaluate, plan
from memfit.compact import CompactDataset
from memfit.testing.ranks import run_ranks
from memfit.testing.zoo import MODELS, build

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", list(MODELS))
def test_planned_outputs_equal_eager_on_cuda(name):
    model, shape = build(name, image=32)
    model = model.cuda()
    x = torch.randn(2, *shape, device="cuda")
    pm = plan(model, (x,))
    with torch.inference_mode():
        ref = model(x)
        out = pm(x)
        assert out.device.type == "cuda"
        # cuDNN may pick another algorithm for an out= convolution than for eager's: rounding differs
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(pm(x), ref, rtol=1e-3, atol=1e-3)     # the arena is reused correctly


def integer_mlp(features: int = 64, hidden: int = 16384, classes: int = 10, seed: int = 0) -> nn.Module:
    """Weights in {-1, 0, 1} and inputs in 0..3: every logit is an integer below 2**24, exact in float32
    (and TF32) whatever the summation order, so any chunking and any device give the same argmax."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(features, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, classes, bias=False))
    with torch.no_grad():
        for layer in (model[0], model[2]):
            layer.weight.copy_(torch.randint(-1, 2, layer.weight.shape, generator=g).float())
    return model.eval()


def integer_data(n: int, features: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 4, (n, features), dtype=np.uint8), rng.integers(0, 10, n)


def test_evaluate_backs_off_from_a_real_out_of_memory():
    n = 8192
    x, y = integer_data(n)
    ds = CompactDataset.from_arrays(x, y, device="cuda")
    model = integer_mlp().cuda()
    ref = evaluate(model, ds, metrics=("accuracy", "confusion", "loss"), chunk_size=64, device="cuda",
                   progress=False, planned=False)
    assert ref.retries == 0
    dev = torch.device("cuda", torch.cuda.current_device())    # set_per_process_memory_fraction needs an index
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    # room for about 160 MiB more: a chunk of 4096 needs 256 MiB of hidden activations (64 KiB a sample)
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(dev) + 160 * 2**20) / total, dev)
    try:
        r = evaluate(model, ds, metrics=("accuracy", "confusion", "loss"), chunk_size=4096, device="cuda",
                     progress=False, planned=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()
    assert r.retries >= 1 and 4096 in r.oom_sizes and r.n == n      # it really ran out, then went on
    assert r.metrics["accuracy"] == ref.metrics["accuracy"]           # exact: integer logits
    assert torch.equal(r.metrics["confusion"].cpu(), ref.metrics["confusion"].cpu())
    assert r.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5)


def _nccl_rank(rank, world):
    x, y = integer_data(1003)
    torch.cuda.set_device(rank)
    model = integer_mlp(hidden=256).cuda(rank)
    ds = CompactDataset.from_arrays(x, y, device="cpu")
    r = evaluate(model, ds, metrics=("accuracy", "confusion"), chunk_size="auto", device=f"cuda:{rank}",
                 progress=False, distributed=True)
    return r.metrics["accuracy"], r.metrics["confusion"].cpu().tolist(), r.n


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_evaluation_on_two_gpus_equals_one_process():
    x, y = integer_data(1003)
    single = evaluate(integer_mlp(hidden=256), (x, y), metrics=("accuracy", "confusion"), chunk_size=100,
                      device="cpu", progress=False)
    out = run_ranks(_nccl_rank, 2, timeout=300, backend="nccl")
    assert sorted(out) == [0, 1], out
    for status, value in out.values():
        assert status == "ok", value
        acc, conf, n = value
        assert n == 1003 and acc == single.metrics["accuracy"] and conf == single.metrics["confusion"].tolist()

"""The GPU benchmark's models (`cases`) and the two sides it measures them on: a CUDA device (`CudaSide`, the only
place with CUDA calls, kept thin) and, for `memfit bench gpu --dry-run`, the CPU measured the same way (`CpuSide`),
so that everything but those calls runs and is tested anywhere.

A measurement (`Side.run`) is a training loop as the memory model predicts it (`memfit.memory.cuda_step`): from a
clean start (on CUDA: the cache emptied, the cuBLAS workspaces freed, the peaks reset: as a fresh process), the
model built on the CPU and moved to the device, then `STEPS` training steps (`memfit.memory.step.training_step`),
each on a batch moved to the device before it and dropped after it; it returns the peaks (allocated, reserved), or
None when the device ran out of memory.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from memfit.device.measure import held_bytes, track_memory
from memfit.memory.cuda_step import STEPS
from memfit.memory.step import training_step
from memfit.testing.zoo import EncoderBlock, MainOutput, build

__all__ = ["Case", "CpuSide", "CudaSide", "cases", "loop"]


@dataclass(frozen=True)
class Case:
    """One model of the benchmark: how to build it and its batches, the loss, the batch sizes compared."""
    name: str
    build: Callable[[], nn.Module]                    # a fresh model on the CPU, in training mode, seeded
    sample: Callable[[int], tuple]                    # n -> (x, y) on the CPU (y None: the loss takes the output)
    loss_fn: Callable
    batches: tuple[int, ...]                          # predicted vs real at these sizes
    autocast: torch.dtype | None = None
    attention: bool = False                           # it calls scaled_dot_product_attention (flash on a GPU)

    def optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params)


def _zoo(name: str, image: int | None = None) -> Callable[[], nn.Module]:
    return lambda: build(name, image=image)[0].train()


def _lm(quick: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        from memfit.testing.zoo import quiet_transformers
        quiet_transformers()
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_embd=64 if quick else 256, n_layer=2 if quick else 4, n_head=4,
                                      vocab_size=1000, n_positions=256, use_cache=False)
        return MainOutput(transformers.GPT2LMHeadModel(cfg)).train()
    return make


def _bert(quick: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        from memfit.testing.zoo import quiet_transformers
        quiet_transformers()
        torch.manual_seed(0)
        d = 64 if quick else 256
        cfg = transformers.BertConfig(hidden_size=d, num_hidden_layers=2 if quick else 4, num_attention_heads=4,
                                      intermediate_size=4 * d, vocab_size=1000)
        return MainOutput(transformers.BertForSequenceClassification(cfg)).train()
    return make


class CausalBlock(EncoderBlock):
    """The zoo's pre-norm transformer block calling `scaled_dot_product_attention(is_causal=True)` (nanoGPT's):
    flash attention on a GPU under bf16 autocast, no mask made."""

    def __init__(self, dim: int, heads: int):
        super().__init__(dim, heads)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _causal(quick: bool) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        dim = 64 if quick else 256
        return nn.Sequential(*(CausalBlock(dim, 4) for _ in range(2))).train()
    return make


def _tokens(length: int) -> Callable[[int], tuple]:
    return lambda n: (torch.randint(0, 1000, (n, length)), torch.randint(0, 1000, (n, length)))


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def cases(quick: bool = False) -> dict[str, Case]:
    """The models, by name: at least six, conv nets (ResNet-18, a UNet) and a transformers LM (GPT-2) among them, and
    a causal transformer whose attention is flash attention on a GPU (`quick`: smaller)."""
    image, seq = (32, 32) if quick else (64, 128)
    small = lambda full, q: q if quick else full
    images = lambda c, s, classes: lambda n: (torch.randn(n, c, s, s), torch.randint(0, classes, (n,)))
    out = [
        Case("mlp", _zoo("mlp"), images(1, 28, 10), F.cross_entropy, small((64, 512), (8, 32))),
        Case("resnet18", _zoo("resnet18", image), images(3, image, 1000), F.cross_entropy, small((16, 64), (2, 4))),
        Case("unet", _zoo("unet", image), lambda n: (torch.randn(n, 3, image, image),
                                                     torch.randint(0, 2, (n, image, image))),
             F.cross_entropy, small((4, 16), (1, 2))),
        Case("encoder", _zoo("transformer"), lambda n: (torch.randn(n, 64, 256), None),
             lambda out: out.pow(2).mean(), small((8, 32), (1, 2))),
        Case("causal-bf16", _causal(quick), lambda n: (torch.randn(n, seq, 64 if quick else 256), None),
             lambda out: out.float().pow(2).mean(), small((8, 32), (1, 2)), torch.bfloat16, attention=True),
        Case("gpt2", _lm(quick), _tokens(seq), _lm_loss, small((8, 32), (1, 2)), attention=True),
        Case("gpt2-bf16", _lm(quick), _tokens(seq), _lm_loss, small((8, 32), (1, 2)), torch.bfloat16,
             attention=True),
        Case("bert", _bert(quick), lambda n: (torch.randint(0, 1000, (n, seq)), torch.randint(0, 2, (n,))),
             F.cross_entropy, small((8, 32), (1, 2)), attention=True),
    ]
    return {c.name: c for c in out}


def _to(t, device: torch.device):
    return None if t is None else t.to(device)


def loop(case: Case, n: int, steps: int = STEPS) -> Callable[[torch.device], None]:
    """The measured work: the model moved to the device, its optimizer, `steps` training steps at batch n."""
    def run(device: torch.device) -> None:
        model = case.build().to(device)
        opt = case.optimizer(model.parameters())
        for _ in range(steps):
            x, y = case.sample(n)
            x, y = _to(x, device), _to(y, device)
            training_step(model, x, opt, case.loss_fn, y, case.autocast)
            del x, y
    return run


class CudaSide:
    """A CUDA device measured for real; `total`: its memory (`set_per_process_memory_fraction` is of it)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.total = torch.cuda.mem_get_info(device)[1]
        self.clean()

    def clean(self) -> None:
        """As a fresh process: nothing cached, no cuBLAS workspace, the peaks reset."""
        from memfit.device.torch_private import clear_cublas_workspaces
        gc.collect()
        torch.cuda.synchronize(self.device)
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def context(self) -> int:
        """The device memory in use outside the caching allocator (the CUDA context, other processes')."""
        from memfit.device.cuda_costs import context_cost
        return context_cost(self.device).nbytes

    def run(self, work: Callable[[torch.device], None], fraction: float | None = None) -> tuple[int, int] | None:
        """(max_memory_allocated, max_memory_reserved) of `work` from a clean start, or None on out-of-memory."""
        self.clean()
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        try:
            work(self.device)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        except torch.OutOfMemoryError:
            return None
        finally:
            if fraction is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            self.clean()

    def plan_peak(self, plan, batch, model, optimizer, steps: int = STEPS) -> int:
        """The device memory `plan.step(batch)` needed over `steps` steps: the peak reserved from here (the model
        and optimizer already on the device) plus what lies outside the allocator."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(steps):
            plan.step(batch)
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_reserved(self.device) + self.context()


class CpuSide:
    """`--dry-run`: the CPU measured as the device would be, its live tensor bytes (`track_memory`) standing for
    both peaks; out of memory is emulated: a peak above `fraction * total`."""

    def __init__(self, total: int = 1 << 30):
        self.device, self.total = torch.device("cpu"), total

    def context(self) -> int:
        return 0

    def run(self, work: Callable[[torch.device], None], fraction: float | None = None) -> tuple[int, int] | None:
        gc.collect()
        with track_memory("cpu") as mem:
            work(self.device)
        if fraction is not None and mem.peak > fraction * self.total:
            return None
        return mem.peak, mem.peak

    def plan_peak(self, plan, batch, model, optimizer, steps: int = STEPS) -> int:
        """The live bytes at the peak of `plan.step(batch)` after a first step (the optimizer state made), with
        what was held before it (the model, its optimizer state, the batch)."""
        plan.step(batch)
        held = held_bytes(model, optimizer) + sum(t.nbytes for t in batch if isinstance(t, torch.Tensor))
        with track_memory("cpu") as mem:
            for _ in range(steps - 1):
                plan.step(batch)
        return held + mem.peak

"""A model set up to run on fake tensors, one way for every fake run: the memory model's step
(`memfit.memory.fake_run`), the forward that builds an example target (`memfit.memory.example_target`) and fit's
op counts (`memfit.fitting.costs`).

`FakeModel(model, mode, device)` is a `memfit.memory.isolation.structural_copy` of the module tree (the user's
module untouched: hooks and fake parameters go on the copy, which no other thread sees) with one fake tensor per
real parameter and buffer on the device the run is for (tied weights stay tied; a Parameter stays a Parameter with
its requires_grad). `running()` swaps them in (torch's reparametrisation, as `torch.func.functional_call` does)
inside the fake mode's section (`isolation.fake_section`: nothing draws from torch's generators).

Example:
    >>> import torch
    >>> from memfit.device.torch_private import FakeTensor, FakeTensorMode
    >>> model = torch.nn.Linear(1000, 1000)
    >>> fm = FakeModel(model, FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"))
    >>> with fm.running() as run:
    ...     out = run(torch.zeros(64, 1000))
    >>> isinstance(out, FakeTensor), tuple(out.shape), isinstance(model.weight, FakeTensor)
    (True, (64, 1000), False)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from memfit.device.torch_private import FakeTensorMode, reparametrized
from memfit.memory.isolation import fake_section, structural_copy

__all__ = ["FakeModel", "fake_maker"]


def fake_maker(mode: FakeTensorMode, device: torch.device, memo: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """A function giving each real tensor its fake on `device` (one per tensor, kept in `memo` by id: tied weights
    stay tied; a Parameter stays a Parameter with its requires_grad)."""
    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in memo:
            f = mode.from_tensor(t)
            if t.device != device:
                with fake_section(mode):
                    f = f.to(device)
            memo[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return memo[id(t)]
    return fake


class FakeModel:
    """`model`'s structural copy over fake parameters and buffers on `device` (see the module docstring).

    Args:
        model: the user's module (read, never changed).
        mode: the fake mode the run uses (shared by the runs of one prediction: its op cache serves them all).
        device: where the fakes are made (the device the run is for).
        memo: id of a real tensor -> its fake, shared by the runs of one prediction (default: a new one).
        train: a model in eval mode is run in training mode (a training step of a model in eval mode trains all
            of it; a training model's modules keep their modes, a frozen BatchNorm stays frozen).

    Attributes:
        copy: the structural copy the fakes are swapped into.
        real: name -> the model's parameter or buffer (`named_parameters` and `named_buffers`, duplicates kept).
        named: name -> its fake.
        fake: the function giving any real tensor its fake (the optimizer's parameters and state).
    """

    def __init__(self, model: torch.nn.Module, mode: FakeTensorMode, device: torch.device, memo: dict | None = None,
                 *, train: bool = False):
        self.mode = mode
        self.fake = fake_maker(mode, device, {} if memo is None else memo)
        self.copy = structural_copy(model)
        if train and not model.training:
            self.copy.train()
        self.real = {**dict(model.named_parameters(remove_duplicate=False)),
                     **dict(model.named_buffers(remove_duplicate=False))}
        self.named = {k: self.fake(v) for k, v in self.real.items()}

    @contextmanager
    def running(self) -> Iterator[torch.nn.Module]:
        """The copy with its fakes swapped in, inside the fake mode's section."""
        with fake_section(self.mode), reparametrized(self.copy, self.named, tie_weights=True, strict=False):
            yield self.copy

"""Each private torch name memfit uses (`memfit.device.torch_private`), checked against the torch installed: a torch
upgrade that moves or changes one fails here, by name, before any prediction goes wrong."""

import torch

from memfit.device import torch_private


def test_a_compiled_module_is_seen_and_its_inner_module_is_the_original():
    lin = torch.nn.Linear(3, 2)
    compiled = torch.compile(lin)
    assert torch_private.compiled_inner(compiled) is lin           # OptimizedModule._orig_mod
    assert torch_private.compiled_inner(lin) is None
    assert torch_private.compiled_inner(torch.nn.Sequential(compiled)) is None     # only the outermost is unwrapped
    assert [p for p in compiled.parameters()] == [p for p in lin.parameters()]

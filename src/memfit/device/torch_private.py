"""Every private torch name memfit relies on, in one place: a torch upgrade that moves one fails
tests/device/test_torch_private.py loudly (one test per name), instead of a prediction going silently wrong.

Each name is reached through a small function or constant here, with what it is for and where torch defines it.
(Being moved here one module at a time: `grep -rn "torch\\._\\|_C\\._" src/memfit` lists those not moved yet.)
"""

from __future__ import annotations

import torch

__all__ = ["compiled_inner"]


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

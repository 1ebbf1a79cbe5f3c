"""The example target a training step's loss needs, built from the model's output for the common losses.

`max_batch_size(model, (64,), "1GiB", train=True, optimizer=opt, loss_fn=F.cross_entropy)` names a loss
that takes a target but gives none. For the losses whose target follows from the output, the memory model
builds it (`example_target`) from one fake forward at batch 2 (nothing allocated) and says in `method`
which target it assumed:
- class ids (cross-entropy, negative log-likelihood): int64, the output's shape without its class
  dimension 1: (n,) for (n, classes) logits, (n, H, W) for (n, classes, H, W);
- like the output (MSE, L1, smooth L1, BCE with logits): the output's shape and dtype.
Any other loss without a target gets an error saying exactly what to pass.

Example:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> tgt, note = example_target(torch.nn.Linear(8, 5), ExampleBatch((8,)), F.cross_entropy, torch.device("cpu"))
    >>> tuple(tgt.template.shape), tgt.template.dtype
    ((1,), torch.int64)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.batches import forward
from memfit.device.torch_private import FakeTensorMode
from memfit.memory.fake_model import FakeModel
from memfit.memory.fake_run import FakeRunError
from memfit.memory.global_caches import function_caches_kept_real
from memfit.memory.isolation import predicting
from memfit.memory.step import ExampleBatch, loss_name, missing_target
from memfit.messages import first_line

__all__ = ["CLASS_IDS", "LIKE_OUTPUT", "example_target", "loss_target"]

CLASS_IDS = "class ids"              # int64, the output's shape without dimension 1
LIKE_OUTPUT = "like the output"      # the output's shape and dtype

_FUNCTIONS = {F.cross_entropy: CLASS_IDS, F.nll_loss: CLASS_IDS, F.mse_loss: LIKE_OUTPUT, F.l1_loss: LIKE_OUTPUT,
              F.smooth_l1_loss: LIKE_OUTPUT, F.binary_cross_entropy_with_logits: LIKE_OUTPUT}
_MODULES = ((nn.CrossEntropyLoss, CLASS_IDS), (nn.NLLLoss, CLASS_IDS), (nn.MSELoss, LIKE_OUTPUT),
            (nn.L1Loss, LIKE_OUTPUT), (nn.SmoothL1Loss, LIKE_OUTPUT), (nn.BCEWithLogitsLoss, LIKE_OUTPUT))


def loss_target(loss_fn: Callable | None) -> str | None:
    """CLASS_IDS or LIKE_OUTPUT for a loss whose target follows from the output (a function, a loss module or a
    functools.partial of either); None for any other."""
    f = loss_fn
    while isinstance(f, functools.partial):
        f = f.func
    if isinstance(f, nn.Module):
        return next((kind for cls, kind in _MODULES if isinstance(f, cls)), None)
    try:
        return _FUNCTIONS.get(f)
    except TypeError:                       # an unhashable callable
        return None


def _output(model: nn.Module, batch: ExampleBatch, device: torch.device, train: bool):
    """The model's output at batch 2 on fake tensors (no_grad, the modes training would run in), on a copy of
    the module tree: the model is not touched."""
    with predicting(), function_caches_kept_real(model):
        fm = FakeModel(model, FakeTensorMode(allow_non_fake_inputs=True), device, train=train)
        with fm.running() as run_model, torch.no_grad():
            return forward(run_model, batch.at(2, device))


def example_target(model: nn.Module, batch: ExampleBatch, loss_fn: Callable, device: torch.device,
                   train: bool = True) -> tuple[ExampleBatch, str]:
    """(the example target `loss_fn` needs, built from the model's output, and a note saying which was assumed)
    for a loss `loss_target` knows; raises `missing_target`'s TypeError for any other, or for an output that is
    not one tensor."""
    kind = loss_target(loss_fn)
    if kind is None:
        raise missing_target(loss_fn)
    try:
        out = _output(model, batch, device, train)
    except Exception as e:                  # whatever the forward raises on fake tensors: the user can say it
        raise FakeRunError(f"could not run the forward of {type(model).__name__} on fake tensors to build the example "
                           f"target ({first_line(e)}); {missing_target(loss_fn)}") from e
    if not isinstance(out, torch.Tensor):
        raise missing_target(loss_fn, f"the model's output is a {type(out).__name__}, not one tensor to build it from")
    if kind == CLASS_IDS:
        if out.dim() < 2:
            raise missing_target(loss_fn, f"the output {tuple(out.shape)} at batch 2 has no class dimension 1")
        template = torch.zeros((1, *out.shape[2:]), dtype=torch.int64, device="meta")
        what = "class ids, int64, the output's shape without its class dimension 1"
    else:
        template = torch.zeros((1, *out.shape[1:]), dtype=out.dtype, device="meta")
        what = f"the output's shape and dtype ({str(out.dtype).removeprefix('torch.')})"
    shape = ", ".join(["n", *map(str, template.shape[1:])])
    note = (f"no target given: {loss_name(loss_fn)}'s target assumed {what}, ({shape}); pass target= if yours "
            "differs")
    return ExampleBatch(template), note

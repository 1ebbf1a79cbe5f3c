"""What one op of a captured graph costs at a batch size, as `planner.slice_rule` weighs it: the bytes it holds at
once (its tensor inputs, parameters aside, its output, what its kernel allocates inside) and its estimated seconds
(a time model: a call, its FLOPs and the bytes it reads and writes, each at a fitted rate).

The rates were fitted on one CPU thread (2-core AMD EPYC VM, torch 2.13) to eager's thread time at batch 2, 8 and 37
of MobileViT, MobileNetV2, RegNet, ResNet, UNet and ResNet-18 (4-335 ms), within 30%: an estimate for weighing
slices of the batch against the calls they add, never a promise about time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Node

from memfit.device.torch_private import OpOverload, tree_leaves, tree_map
from memfit.planner.graph import Meta, concrete, meta_value

__all__ = ["BYTE_SECONDS", "CALL_SECONDS", "FLOP_SECONDS", "OpCost"]

CALL_SECONDS = 46e-6            # a kernel call beyond its work
FLOP_SECONDS = 1 / 52e9         # a convolution's or matmul's FLOP (torch.utils.flop_counter's count)
BYTE_SECONDS = 1 / 10e9         # a byte an op reads or writes


def _frozen(a):
    """An fx argument with each node replaced by its value (a fake tensor, a symbolic size): kept after the graph's
    segments replaced those nodes."""
    if isinstance(a, Node):
        return a.meta.get("val")
    if isinstance(a, (list, tuple)):
        return type(a)(_frozen(x) for x in a)
    return a


def _shapes(a, env: dict):
    """A frozen argument at a batch, a tensor as its `Meta` (cheaper than a meta tensor: every op at every batch)."""
    if isinstance(a, torch.Tensor):
        return Meta.of(a, env)
    if isinstance(a, (list, tuple)):
        return type(a)(_shapes(x, env) for x in a)
    return concrete(a, env)


@dataclass
class OpCost:
    """One op of the graph as the rule weighs it: the bytes it holds at once (its tensor inputs, parameters aside,
    its output, what its kernel allocates inside) and its estimated seconds."""
    name: str
    target: object
    out: object                 # the graph's value of its output (a fake tensor)
    ins: tuple                  # its tensor inputs' values, parameters aside
    args: tuple                 # frozen (`_frozen`)
    kwargs: dict
    held: bool                  # counted in where the call peaks (a view of a parameter allocates nothing)
    _inside: tuple | None = None

    @classmethod
    def of(cls, node: Node, held: bool, ins: tuple) -> OpCost:
        return cls(node.name, node.target, node.meta.get("val"), ins, _frozen(tuple(node.args)),
                   {k: _frozen(v) for k, v in node.kwargs.items()}, held)

    def at(self, env: dict, ref: dict, scale: float) -> tuple[int, float]:
        """(bytes held at once, seconds) at the batch of `env`, `scale` times that of `ref`. What the kernel
        allocates inside is measured at `ref` only (`kernel_scratch.inside_parts` runs the real kernel at each new
        batch: a convolution at batch 1024 to weigh that batch took most of a capture), its growing part scaled."""
        from torch.utils.flop_counter import flop_registry

        from memfit.memory.kernel_scratch import inside_parts
        outs = self.out if isinstance(self.out, (tuple, list)) else (self.out,)
        out = sum(Meta.of(v, env).nbytes for v in outs if isinstance(v, torch.Tensor))
        peak, seconds = out + sum(Meta.of(v, env).nbytes for v in self.ins), CALL_SECONDS
        if not isinstance(self.target, OpOverload):
            return peak, seconds
        if self._inside is None:
            self._inside = inside_parts(self.target, meta_value(self.args, ref),
                                        {k: meta_value(v, ref) for k, v in self.kwargs.items()})
        peak += self._inside[0] + int(self._inside[1] * scale)
        args, kwargs = _shapes(self.args, env), {k: _shapes(v, env) for k, v in self.kwargs.items()}
        seconds += (out + sum(m.nbytes for m in tree_leaves(args) if isinstance(m, Meta))) * BYTE_SECONDS
        formula = flop_registry.get(self.target.overloadpacket)
        if formula is not None and isinstance(outs[0], torch.Tensor):
            shape = lambda a: a.shape if isinstance(a, Meta) else a        # the formulas read tensors' shapes only
            try:
                seconds += formula(*tree_map(shape, args), **tree_map(shape, kwargs),
                                   out_val=Meta.of(outs[0], env).shape) * FLOP_SECONDS
            except (TypeError, ValueError, AttributeError, IndexError, RuntimeError):
                pass                  # a formula that cannot read these arguments: no FLOPs counted (a time estimate)
        return peak, seconds

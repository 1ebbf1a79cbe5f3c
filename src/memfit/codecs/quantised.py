"""LOSSY per-channel quantisation of float data, asked for by name only: `q8` (256 levels, one byte) and `q4`
(16 levels, two to a byte), each with a bound on its error (`max_abs_error`) that holds for the float32 decode.
"""

from __future__ import annotations

import math

import torch

from memfit.arrays import by_channel, channel_min_max
from memfit.codecs.base import Codec, check_finite

__all__ = ["Q4Codec", "Q8Codec", "QuantCodec"]

class QuantCodec(Codec):
    """Float data quantised per channel (axis 1) to `levels + 1` codes between the channel's min and max."""
    lossless = False
    levels = 255

    def __init__(self) -> None:
        super().__init__()
        self.lo: torch.Tensor | None = None   # (C,) float64 channel minimum
        self.hi: torch.Tensor | None = None   # (C,) float64 channel maximum

    def fit(self, x):
        super().fit(x)
        if x.shape[0] == 0:
            return
        check_finite(x, self.name)
        lo, hi = channel_min_max(x)
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    @property
    def step(self) -> torch.Tensor:
        """(C,) quantisation step; 1 for constant channels (any step is exact there)."""
        if self.lo is None:
            raise ValueError(f"codec {self.name!r} was not fitted: call fit(x) before encode")
        span = self.hi - self.lo
        return torch.where(span > 0, span / self.levels, torch.ones_like(span))

    def affine(self):
        return self.step, self.lo.clone()

    def _track_error(self, x: torch.Tensor, stored: torch.Tensor) -> None:
        """Raise `max_abs_error` to a bound on |decoded - x| that holds for the float32 decode.

        Two parts, per channel: the quantisation error |code * a + b - x| (at most half a step),
        measured exactly in float64, plus the worst rounding of the float32 decode of any code
        (`decode_rounding`). The first part alone understates the error of what a user gets (by 2e-4
        with per-channel scales of 1e3).
        """
        if not x.numel():
            return
        a, b = self.affine()
        shape = (1, -1) + (1,) * (x.dim() - 2)
        back = self.unpack(stored, tuple(x.shape[1:])).double() * a.view(shape) + b.view(shape)
        quant = (back - x.double()).abs()                                            # (n, C, ...)
        per_channel = by_channel(quant).amax(1)                                      # (C,)
        bound = per_channel * (1 + 2**-40) + self.decode_rounding()
        self.max_abs_error = max(self.max_abs_error, float(bound.max()))

    def decode_rounding(self) -> torch.Tensor:
        """(C,) worst |float32 decode - exact value| over every code, for the ways a float32 decode can
        round: a and b rounded to float32, then one rounding (fused) or two (multiply, then add)."""
        a, b = self.affine()                                          # float64 (C,)
        codes = torch.arange(self.levels + 1, dtype=torch.float64)    # every code a value can have
        exact = codes[None, :] * a[:, None] + b[:, None]              # (C, L)
        a32, b32 = a.float().double()[:, None], b.float().double()[:, None]
        fused = (codes * a32 + b32).float().double()
        fused_wide = (codes * a[:, None] + b32).float().double()      # alpha passed as a float64 scalar
        two = ((codes * a32).float().double() + b32).float().double()
        worst = torch.stack([fused, fused_wide, two]).sub_(exact).abs_().amax((0, 2))
        return worst

    def quantise(self, x: torch.Tensor) -> torch.Tensor:
        self.check(x)
        step = self.step                     # raises when the codec was not fitted
        shape = (1, -1) + (1,) * (x.dim() - 2)
        q = ((x.double() - self.lo.view(shape)) / step.view(shape)).round_()
        return q.clamp_(0, self.levels).to(torch.uint8)


class Q8Codec(QuantCodec):
    """float -> uint8 with a per-channel scale and zero point; error at most half a step."""
    name = "q8"

    def encode(self, x):
        q = self.quantise(x)
        self._track_error(x, q)
        return q


class Q4Codec(QuantCodec):
    """float -> 16 levels per channel, two values per byte (high nibble first)."""
    name = "q4"
    levels = 15

    def stored_shape(self, sample_shape):
        return ((math.prod(sample_shape) + 1) // 2,)

    def encode(self, x):
        q = self.quantise(x).reshape(x.shape[0], -1)          # (n, D) codes 0..15
        if q.shape[1] % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        packed = (q[:, 0::2] << 4) | q[:, 1::2]               # (n, ceil(D/2))
        self._track_error(x, packed)
        return packed

    def unpacked_width(self, stored_shape):
        return 2 * stored_shape[0]

    def unpack(self, stored, sample_shape, out=None):
        n, w = stored.shape[0], 2 * stored.shape[1]
        out = (torch.empty((n, w), dtype=torch.uint8, device=stored.device) if out is None
               else out.reshape(-1)[:n * w].view(n, w))
        torch.bitwise_right_shift(stored, 4, out=out[:, 0::2])
        torch.bitwise_and(stored, 15, out=out[:, 1::2])
        return out[:, :math.prod(sample_shape)].reshape(n, *sample_shape)

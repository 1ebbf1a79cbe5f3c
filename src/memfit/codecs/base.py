"""What every codec is: the `Codec` base class (fit, check, encode, unpack, the per-channel affine that turns
codes into values) and the range checks whose errors name the worst value and where it is.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Array", "Codec", "check_finite", "check_range"]

Array = torch.Tensor | np.ndarray


def _where(mask: torch.Tensor) -> str:
    """'sample 3, channel 1' for the first True of a (N, C, ...) mask."""
    first = torch.nonzero(mask)[0].tolist()
    return f"sample {first[0]}, channel {first[1]}" if len(first) > 1 else f"sample {first[0]}"


def check_finite(x: torch.Tensor, codec: str) -> None:
    if x.is_floating_point():
        bad = ~torch.isfinite(x)
        if bad.any():
            raise ValueError(f"codec {codec!r} needs finite values; found {int(bad.sum())} NaN/inf values "
                             f"(first at {_where(bad)}); clean the data (e.g. np.nan_to_num) first")


def check_range(x: torch.Tensor, lo: float, hi: float, codec: str, hint: str, integral: bool = True) -> None:
    """Raise a ValueError naming the worst value and where it is when x leaves [lo, hi]."""
    check_finite(x, codec)
    if x.dtype == torch.bool or (x.dtype == torch.uint8 and lo <= 0 and hi >= 255):
        return
    xmin, xmax = x.min().item(), x.max().item()
    if xmin < lo or xmax > hi:
        worst = xmax if xmax > hi else xmin
        raise ValueError(f"codec {codec!r} needs values in [{lo:g}, {hi:g}], found {worst:g} at "
                         f"{_where(x == worst)}; {hint}")
    if integral and x.is_floating_point() and not torch.equal(x, x.round()):
        frac = x != x.round()
        raise ValueError(f"codec {codec!r} needs integer values, found {x[frac].flatten()[0].item():g} at "
                         f"{_where(frac)}; {hint}")


class Codec:
    """Base class. Subclasses set `name` and `lossless`; `stored_shape`/`stored_dtype` say what is stored."""
    name = "?"
    lossless = True
    offset: int | None = None       # integer codecs: value = stored + offset exactly (integer outputs need it)

    def __init__(self) -> None:
        self.max_abs_error = 0.0          # a bound on |decoded - original| over everything encoded
        self.channels: int | None = None

    def fit(self, x: torch.Tensor) -> None:
        """Learn parameters from (a chunk of) the data; call once per chunk before `encode`."""
        if self.channels is None:
            self.channels = x.shape[1]

    def check(self, x: torch.Tensor) -> None:
        """Raise ValueError when x cannot be stored by this codec."""
        check_finite(x, self.name)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(n, *sample_shape) CPU tensor -> (n, *stored_shape) stored tensor."""
        raise NotImplementedError

    def unpack(self, stored: torch.Tensor, sample_shape: tuple[int, ...],
               out: torch.Tensor | None = None) -> torch.Tensor:
        """(n, *stored_shape) -> (n, *sample_shape) codes (integers or floats) on the same device.

        Codecs that unpack into new memory (`unpacked_width` > 0) write into `out` when given: a
        contiguous uint8 buffer of at least n * unpacked_width elements (loaders reuse one)."""
        return stored

    def unpacked_width(self, stored_shape: tuple[int, ...]) -> int:
        """Bytes per sample `unpack` writes into new memory (0: it returns the stored rows or a view)."""
        return 0

    def affine(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel (a, b), float64 (C,): value = code * a + b."""
        c = self.channels or 1
        return torch.ones(c, dtype=torch.float64), torch.full((c,), float(self.offset or 0), dtype=torch.float64)

    def stored_shape(self, sample_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sample_shape)

    @property
    def stored_dtype(self) -> torch.dtype:
        return torch.uint8

    def describe(self) -> str:
        """'uint8 (lossless)' or 'q8 (LOSSY: |decoded - x| <= 0.0118)': what a user must know about it."""
        if self.lossless or self.max_abs_error == 0:
            return f"{self.name} (lossless)"
        return f"{self.name} (LOSSY: |decoded - x| <= {self.max_abs_error:.4g} in the units of x)"

    def __repr__(self) -> str:
        extra = "" if self.lossless else f", max_abs_error={self.max_abs_error:.4g}"
        if self.offset:
            extra += f", offset={self.offset}"
        return f"{type(self).__name__}(name={self.name!r}{extra})"

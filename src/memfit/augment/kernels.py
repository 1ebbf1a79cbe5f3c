"""The batch-wide kernels behind `memfit.augment`: every op on a whole batch at once, per-sample parameters as
tensors, no Python loop over samples.

Every kernel works on one canonical view of a batch, `(B, P, H, W, Q)`: H and W the spatial axes, P the
axes before them and Q the axes after them (channels-first `(B, C, H, W)` is `(B, C, H, W, 1)`,
channels-last `(B, H, W, C)` is `(B, 1, H, W, C)`, a plain `(B, H, W)` is `(B, 1, H, W, 1)`), so one
image row is W runs of Q contiguous values. The kernels move values without looking at them: they work
on any dtype (the stored codes of a compact dataset as well as decoded floats) and are exact.

What they cost on a CPU (measured on 512 CIFAR images, uint8, one thread): a crop is one `index_select` of
overlapping row windows (`unfold`) from a copy of the batch with its columns padded (~0.2 ms; a gather
with an index per value took 1.7 ms, advanced indexing 10 ms); a flip picks each sample from the batch
or its flipped copy with one `index_select` of whole samples (~0.3 ms; `torch.where` took 3 ms,
`index_copy_` of the flipped samples 0.7 ms); a cutout is one `index_fill_` of the rectangles' positions
(~0.3 ms; `masked_fill_` with a broadcast mask took 1.3 ms).
"""

from __future__ import annotations

import torch

__all__ = ["LAYOUTS", "canonical", "canonical_shape", "crop", "crop_work_numel", "fill_rects", "flip", "mix",
           "paste_rects", "spatial_size", "with_size"]

LAYOUTS = ("CHW", "HWC")


def spatial_size(sample_shape: tuple[int, ...], layout: str) -> tuple[int, int]:
    """(H, W) of one sample: the last two axes of a 'CHW' sample (or of an (H, W) one), the first two of 'HWC'."""
    if len(sample_shape) == 2:
        return int(sample_shape[0]), int(sample_shape[1])
    if len(sample_shape) != 3:
        raise ValueError(f"augmentation needs images: samples of shape (C, H, W), (H, W, C) or (H, W); found "
                         f"shape {tuple(sample_shape)}")
    h, w = (sample_shape[1], sample_shape[2]) if layout == "CHW" else (sample_shape[0], sample_shape[1])
    return int(h), int(w)


def with_size(sample_shape: tuple[int, ...], layout: str, size: tuple[int, int]) -> tuple[int, ...]:
    """`sample_shape` with its spatial axes made `size`."""
    if len(sample_shape) == 2:
        return tuple(size)
    return (sample_shape[0], *size) if layout == "CHW" else (*size, sample_shape[2])


def canonical_shape(sample_shape: tuple[int, ...], layout: str) -> tuple[int, int, int, int]:
    """(P, H, W, Q) of one sample (see the module docstring)."""
    h, w = spatial_size(sample_shape, layout)
    if len(sample_shape) == 2:
        return 1, h, w, 1
    return (sample_shape[0], h, w, 1) if layout == "CHW" else (1, h, w, sample_shape[2])


def canonical(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The (B, P, H, W, Q) view of a batch (a contiguous copy first where x is not contiguous)."""
    return x.contiguous().view(x.shape[0], *canonical_shape(tuple(x.shape[1:]), layout))


def crop(v: torch.Tensor, top: torch.Tensor, left: torch.Tensor, size: tuple[int, int], pad: int, mode: str,
         fill: float, out: torch.Tensor, work: torch.Tensor | None, flips: torch.Tensor | None = None) -> torch.Tensor:
    """out (B, P, h, w, Q) = each sample padded by `pad` on every side ('zero': `fill`; 'reflect': mirrored
    without repeating the edge, as `numpy.pad(mode='reflect')`), then cut at rows [top, top + h) and columns
    [left, left + w) of the padded sample; then, where `flips` (bool (B,), or None) is set, mirrored
    left-right (a crop and a flip in one gather: those windows are cut from a mirrored copy of the padded
    batch). top, left: integers (B,); `work`: a flat buffer of `crop_work_numel` values (None when it is 0)."""
    b, p, h_in, w_in, q = v.shape
    h, w = size
    dev = v.device
    rows = top.view(b, 1) + (torch.arange(h, device=dev) - pad)          # (B, h) source row of each output row
    wp = w_in + 2 * pad
    n = b * p * h_in * wp * q                                             # one (padded) copy of the batch
    outside = None
    if work is None:
        src = v.reshape(-1)
    else:
        src = work[:crop_work_numel(v.shape, pad, mode, flips is not None)]
        padded = src[:n].view(b, p, h_in, wp, q)
        padded[:, :, :, pad:pad + w_in].copy_(v)
        if pad and mode == "zero":
            padded[:, :, :, :pad].fill_(fill)
            padded[:, :, :, pad + w_in:].fill_(fill)
            src[(2 if flips is not None else 1) * n:].fill_(fill)         # one row of fill past the copies
            outside = (rows < 0) | (rows >= h_in)
        elif pad:
            padded[:, :, :, :pad].copy_(v[:, :, :, 1:pad + 1].flip(3))
            padded[:, :, :, pad + w_in:].copy_(v[:, :, :, w_in - 1 - pad:w_in - 1].flip(3))
            rows = rows.abs()
            rows = torch.where(rows >= h_in, 2 * (h_in - 1) - rows, rows)
        if flips is not None:
            src[n:2 * n].view(b, p, h_in, wp, q).copy_(padded.flip(3))
            # flip(crop)[j] = padded[left + w - 1 - j] = mirrored[wp - w - left + j]: a window of the mirrored copy
            left = torch.where(flips, (n // q + wp - w) - left, left)
    # each output row is w runs of q values, contiguous in a (padded) source row: one window of that row
    first = torch.arange(0, b * p * h_in * wp, h_in * wp, device=dev).view(b, p) + left.view(b, 1)   # (B, P)
    start = first.view(b, p, 1) + (rows * wp).view(b, 1, h)
    if outside is not None:                                              # rows in the padding: the row of fill
        start = torch.where(outside.view(b, 1, h), (2 if flips is not None else 1) * n // q, start)
    windows = src.unfold(0, w * q, q)                                    # (L, w * q) overlapping views
    torch.index_select(windows, 0, start.view(-1), out=out.view(b * p * h, w * q))
    return out


def crop_work_numel(shape: tuple[int, ...], pad: int, mode: str, mirrored: bool = False) -> int:
    """Values of `crop`'s work buffer for a (B, P, H, W, Q) batch: the batch with padded columns (twice with
    its mirrored copy), and one row of fill for 'zero' padding; 0: none needed."""
    b, p, h, w, q = shape
    if not pad and not mirrored:
        return 0
    return (2 if mirrored else 1) * b * p * h * (w + 2 * pad) * q + ((w + 2 * pad) * q if pad and mode == "zero" else 0)


def flip(v: torch.Tensor, flips: torch.Tensor, out: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """out = v with the samples where `flips` (bool (B,)) is set mirrored left-right. `work`: 2 * v.numel()
    values (the batch and its flipped copy, from which each sample is picked whole)."""
    b = v.shape[0]
    both = work[:2 * v.numel()].view(2 * b, *v.shape[1:])
    both[:b].copy_(v)
    both[b:].copy_(v.flip(3))
    pick = torch.arange(b, device=v.device) + b * flips.to(torch.int64)
    torch.index_select(both.view(2 * b, -1), 0, pick, out=out.view(b, -1))
    return out


def fill_rects(flat: torch.Tensor, shape: tuple[int, ...], top: torch.Tensor, left: torch.Tensor,
               height: torch.Tensor, width: torch.Tensor, most: tuple[int, int], fill: float,
               on: torch.Tensor | None = None) -> None:
    """Write `fill` into the rectangle rows [top, top + height), columns [left, left + width) of each sample
    (all inside the image, height and width >= 1, at most `most`) of the (B, P, H, W, Q) batch held by
    `flat[:n]`; where `on` (bool (B,)) is False, nothing (those positions go to `flat[n]`, a spare value)."""
    b, p, h, w, q = shape
    dev = flat.device
    # a rectangle smaller than `most` repeats its last row and column: the same positions written twice
    rows = top.view(b, 1) + torch.minimum(torch.arange(most[0], device=dev).view(1, -1), height.view(b, 1) - 1)
    cols = left.view(b, 1) + torch.minimum(torch.arange(most[1], device=dev).view(1, -1), width.view(b, 1) - 1)
    # positions in units of Q values: sample and P, plus row (small tensors), then plus column (the one full add)
    where = torch.arange(0, b * p * h * w, h * w, device=dev).view(b, p, 1) + (rows * w).view(b, 1, -1)
    idx = where.view(b, p, -1, 1) + cols.view(b, 1, 1, -1)                # (B, P, most_h, most_w)
    if q > 1:
        idx = (idx * q).unsqueeze(-1) + torch.arange(q, device=dev)       # (B, P, most_h, most_w, Q)
    if on is not None:
        idx = torch.where(on.view((b,) + (1,) * (idx.dim() - 1)), idx, b * p * h * w * q)
    flat.index_fill_(0, idx.view(-1), fill)


def paste_rects(v: torch.Tensor, top: torch.Tensor, left: torch.Tensor, height: torch.Tensor,
                width: torch.Tensor) -> torch.Tensor:
    """A new batch: v with each sample's rectangle taken from the sample before it in the batch (the first
    from the last)."""
    b, _, h, w, _ = v.shape
    dev = v.device
    r = torch.arange(h, device=dev).view(1, h)
    c = torch.arange(w, device=dev).view(1, w)
    inside_r = (r >= top.view(b, 1)) & (r < (top + height).view(b, 1))     # (B, H)
    inside_c = (c >= left.view(b, 1)) & (c < (left + width).view(b, 1))    # (B, W)
    mask = (inside_r.view(b, 1, h, 1, 1) & inside_c.view(b, 1, 1, w, 1))
    return torch.where(mask, v.roll(1, 0), v)


def mix(t: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """A new batch t * lam + t_before * (1 - lam), per sample (t_before: the sample before it in the batch, the
    first's the last's); lam float32 (B,), each factor rounded to t's dtype first; two products and a sum,
    each rounded once (no fused multiply-add: the same bits however the kernel vectorises)."""
    shape = (-1,) + (1,) * (t.dim() - 1)
    own = lam.to(t.dtype).view(shape)
    other = (1 - lam).to(t.dtype).view(shape)
    return t.mul(own).add_(t.roll(1, 0).mul_(other))

"""Strip kernels of the exact strip executor: small pure functions on row bands of a frame.

* :class:`ChannelStats`: per-channel moments of strips, merged exactly (Chan et al.);
* :func:`group_norm_affine`: a GroupNorm as a per-channel affine map from full-frame statistics;
* :func:`conv_rows`, :func:`upsample2x_rows`, :func:`resize_rows`: output rows ``[a, b)`` of a
  convolution / bilinear resize from only the input rows they read (``read(a, b)`` callbacks).

See :mod:`flowlift.upscale.chunked.executor` for why these give the full-frame result to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.models.upscaler_unet import strided_conv2d

RowFn = Callable[[int, int], torch.Tensor]

__all__ = [
    "ChannelStats",
    "RowFn",
    "affine_silu",
    "as_nchw",
    "bilinear_taps",
    "conv_rows",
    "group_norm_affine",
    "resize_rows",
    "upsample2x_rows",
]


# --------------------------------------------------------------------------------------------------
# small pure functions


def bilinear_taps(
    in_size: int, out_size: int, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source taps of output positions ``[start, stop)`` of a bilinear resize (``align_corners=False``).

    ``src = max(0, (dst + 0.5) * in/out - 0.5)``, ``i0 = floor(src)``, ``i1 = min(i0 + 1, in - 1)``,
    ``lam = src - i0``; the output is ``(1 - lam) * x[i0] + lam * x[i1]`` (computed in float32, as
    PyTorch does). Returns ``(i0, i1, lam)``.
    """
    scale = torch.tensor(in_size / out_size, dtype=torch.float32)
    dst = torch.arange(start, stop, dtype=torch.float32)
    src = ((dst + 0.5) * scale - 0.5).clamp_min(0.0)
    i0 = src.floor().long().clamp_max(in_size - 1)
    i1 = (i0 + 1).clamp_max(in_size - 1)
    lam = (src - i0.float()).clamp(0.0, 1.0)
    return i0, i1, lam


@dataclass
class ChannelStats:
    """Per-(sample, channel) count, mean and sum of squared deviations ``m2``, merged strip by strip."""

    count: int
    mean: torch.Tensor  # (B, C), float64
    m2: torch.Tensor  # (B, C), float64

    @staticmethod
    def of(x: torch.Tensor, acc_dtype: torch.dtype) -> ChannelStats:
        """Statistics of a strip (B, C, h, w), computed in float32 then widened to ``acc_dtype``.

        The per-channel moments come from PyTorch's GroupNorm kernel with one group per channel
        (numerically stable row-wise moments, ~15x faster than ``torch.var_mean`` over two dims on
        CPU); with ``eps = 0`` it returns ``rstd = 1 / sqrt(var)``, so ``var = rstd ** -2``.
        """
        b, c, h, w = x.shape
        _, mean, rstd = torch.native_group_norm(as_nchw(x).float(), None, None, b, c, h * w, c, 0.0)
        var = rstd.to(acc_dtype).pow(-2)
        count = h * w
        return ChannelStats(count, mean.to(acc_dtype).view(b, c), (var * count).view(b, c))

    def merge(self, other: ChannelStats) -> ChannelStats:
        """Chan et al.: ``n = na + nb``, ``d = mb - ma``, ``mean = ma + d nb / n``,
        ``m2 = m2a + m2b + d^2 na nb / n``."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta.square() * (self.count * other.count / n)
        return ChannelStats(n, mean, m2)

    def cat(self, other: ChannelStats) -> ChannelStats:
        """Statistics of the channel concatenation of two frames of the same size."""
        assert self.count == other.count
        return ChannelStats(self.count, torch.cat([self.mean, other.mean], 1), torch.cat([self.m2, other.m2], 1))


def as_nchw(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, C, H, W) as a contiguous NCHW tensor, the same values. A channels-last one is copied sample by
    sample as an (H*W, C) matrix transposed, which torch copies in cache blocks (a 384-channel bf16 strip of
    64x384: ~3x faster than the 4-D permutation of ``contiguous()``; docs/cpu.md)."""
    b, c, h, w = x.shape
    if x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
        return x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for i in range(b):
        out[i].view(c, h * w).copy_(x[i].permute(1, 2, 0).reshape(h * w, c).t())
    return out


def group_norm_affine(stats: ChannelStats, norm: nn.GroupNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """GroupNorm as a per-(sample, channel) affine map ``y = x * A + B`` from full-frame channel stats.

    Over the ``k`` channels of a group (equal counts): ``mean_g = avg(mean_c)``,
    ``var_g = avg(var_c) + avg((mean_c - mean_g)^2)``; ``A = gamma / sqrt(var_g + eps)``,
    ``B = beta - mean_g * A``. Returns float32 (B, C) tensors (float64 stays float64).
    """
    b, c = stats.mean.shape
    g = norm.num_groups
    mean_c = stats.mean.view(b, g, c // g)
    var_c = (stats.m2 / stats.count).view(b, g, c // g)
    mean_g = mean_c.mean(-1, keepdim=True)
    var_g = var_c.mean(-1, keepdim=True) + (mean_c - mean_g).square().mean(-1, keepdim=True)
    rstd = torch.rsqrt(var_g + norm.eps).expand(b, g, c // g).reshape(b, c)
    mean = mean_g.expand(b, g, c // g).reshape(b, c)
    gamma = norm.weight.to(rstd.dtype) if norm.weight is not None else torch.ones_like(rstd[0])
    beta = norm.bias.to(rstd.dtype) if norm.bias is not None else torch.zeros_like(rstd[0])
    scale = gamma * rstd
    shift = beta - mean * scale
    out_dtype = torch.promote_types(torch.float32, norm.weight.dtype)
    return scale.to(out_dtype), shift.to(out_dtype)


def affine_silu(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``silu(x * scale + shift)`` with (B, C) ``scale``/``shift``, returned in x's dtype.

    Computed in the statistics' precision and rounded once; except a half-precision ``x`` on the CPU, where the
    affine map is an inference batch norm of each sample (``(x - 0) / sqrt(1 + 0) * scale + shift``, float32
    inside, its result rounded to x's dtype) and SiLU runs in x's dtype: the two roundings the plain forward's
    GroupNorm and SiLU make, in ~1/5 of the float32 round trip's CPU time (docs/cpu.md). A GPU keeps the round
    trip (element-wise work is not what its chunked passes wait on, and no GPU measured the other here).
    """
    if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
        zeros, ones = torch.zeros_like(scale[0]), torch.ones_like(scale[0])
        samples = [
            F.batch_norm(x[i : i + 1], zeros, ones, scale[i], shift[i], False, 0.0, 0.0) for i in range(x.shape[0])
        ]
        return F.silu(samples[0] if len(samples) == 1 else torch.cat(samples), inplace=True)
    y = torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])
    return F.silu(y, inplace=True).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# strip kernels: rows [a, b) of a layer's output from the rows of its input


def conv_rows(
    read: RowFn,
    height: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: int,
    padding: tuple[int, int],
    a: int,
    b: int,
) -> torch.Tensor:
    """Output rows ``[a, b)`` of ``conv2d(x, weight, bias, stride, padding)`` for a frame of ``height`` rows.

    Reads input rows ``[a*s - p, (b-1)*s - p + k)`` clipped to the frame; the rows outside the frame
    (first and last strip only) are the convolution's zero padding, added with ``F.pad``. Every
    output row is computed exactly once over all strips.
    """
    k = weight.shape[2]
    p, pw = padding
    lo, hi = a * stride - p, (b - 1) * stride - p + k
    lo_c, hi_c = max(lo, 0), min(hi, height)
    x = read(lo_c, hi_c)
    if lo_c != lo or hi_c != hi:
        x = F.pad(x, (0, 0, lo_c - lo, hi - hi_c))
    return strided_conv2d(x, weight, bias, stride, (0, pw))  # F.conv2d, minus torch's one-column bf16 bug


def upsample2x_rows(read: RowFn, height: int, a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of the exact x2 bilinear upsample (``align_corners=False``) of a ``height``-row frame.

    Output row ``r`` blends source rows ``floor(r/2 - 1/4)`` and the next one, so rows ``[a, b)`` need
    source rows ``[a//2 - 1, (b-1)//2 + 2)`` (clipped). Upsampling that window with the same scale
    gives identical taps and weights for every row that does not touch the window's edge.
    """
    w0, w1 = max(0, a // 2 - 1), min(height, (b - 1) // 2 + 2)
    out = F.interpolate(read(w0, w1), scale_factor=2.0, mode="bilinear", align_corners=False)
    return out[:, :, a - 2 * w0 : b - 2 * w0]


def resize_rows(read: RowFn, in_size: tuple[int, int], out_size: tuple[int, int], a: int, b: int) -> torch.Tensor:
    """Rows ``[a, b)`` of ``F.interpolate(x, out_size, mode="bilinear", align_corners=False)``.

    Identity for equal sizes; :func:`upsample2x_rows` for an exact x2; otherwise the row taps of
    :func:`bilinear_taps` (``(1 - lam) x[i0] + lam x[i1]``) followed by a column-only resize (row
    scale 1 keeps rows unchanged).
    """
    (in_h, in_w), (out_h, out_w) = in_size, out_size
    if (in_h, in_w) == (out_h, out_w):
        return read(a, b)
    if (out_h, out_w) == (2 * in_h, 2 * in_w):
        return upsample2x_rows(read, in_h, a, b)
    i0, i1, lam = bilinear_taps(in_h, out_h, a, b)
    lo, hi = int(i0.min()), int(i1.max()) + 1
    src = read(lo, hi)
    top = src.index_select(2, (i0 - lo).to(src.device))
    bottom = src.index_select(2, (i1 - lo).to(src.device))
    out = torch.lerp(top, bottom, lam.to(device=src.device, dtype=src.dtype)[None, None, :, None])
    if in_w != out_w:
        out = F.interpolate(out, size=(b - a, out_w), mode="bilinear", align_corners=False)
    return out

"""Exact, bounded-memory evaluation of the Flow Upscaler UNet in row strips.

The UNet has no attention, so every layer is local — except GroupNorm, whose statistics span the
whole frame. Naive tiling therefore changes the result. :class:`ChunkedExecutor` evaluates the
network *layer by layer*: each full-frame activation is kept in a store (on ``offload_device`` when
given, e.g. host memory for a GPU run) and every layer is computed strip by strip, where a strip is a
band of full-width rows:

* a 3x3 convolution of output rows ``[a, b)`` (stride ``s``, padding 1) reads input rows
  ``[a*s - 1, (b-1)*s + 2)`` — a halo of one row — with zero rows outside the frame, which is exactly
  the convolution's zero padding;
* a GroupNorm is applied as a per-(sample, channel) affine map ``y = x * A + B`` whose statistics were
  accumulated over *all* strips when the normalized tensor was produced (per-strip mean/variance in
  float32, merged across strips with Chan's formula in float64), so it equals the full-frame norm;
* a bilinear resize of output rows ``[a, b)`` reads only the source rows its taps touch
  (:func:`bilinear_taps`), giving the same numbers as ``F.interpolate`` on the whole frame;
* residual blocks write their output over their input (the skip path reads only the strip's own rows,
  and the convolutions read ``h = conv1(...)``, kept in its own buffer), so a full-resolution level
  holds two frames plus the long skip.

Two passes per residual block (conv1 and norm2's statistics; then conv2 + skip and the next norm's
statistics) — no convolution is ever recomputed, so the FLOPs equal the plain forward's. The result
equals the plain forward to float rounding (<= 1e-4 in fp32) for any ``chunk``, odd strip boundaries
and any batch size. Peak memory: the stores (about three full-resolution 384-channel frames) plus one
strip's temporaries on the compute device; with ``offload_device="cpu"`` on a GPU only the strip
temporaries and the weights live on the device.

Use :func:`should_chunk` to decide when to switch the executor on by size (the user can force or
forbid it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.models.upscaler_unet import (
    GROUP_NORM_EPS,
    FlowUpscalerUNet,
    ResBlock,
    check_inputs,
)

DEFAULT_CHUNK = 32
# Measured peak of the plain forward's activations, in units of one (B, base_channels, H, W) frame
# (fp32, CPU, 2048 px output; see docs/unet.md and benchmarks/bench_unet.py).
PLAIN_PEAK_FRAMES = 8.0
DEFAULT_CPU_BUDGET_BYTES = 1 << 30
CUDA_BUDGET_FRACTION = 0.5

RowFn = Callable[[int, int], torch.Tensor]


# --------------------------------------------------------------------------------------------------
# when to chunk


def plain_peak_bytes(
    height: int, width: int, *, batch: int = 1, base_channels: int = 384, dtype: torch.dtype = torch.float32
) -> int:
    """Estimated activation peak of the plain forward for a (batch, 32, height, width) sample.

    ``PLAIN_PEAK_FRAMES * batch * base_channels * height * width * itemsize`` (height/width in latent
    pixels of the *output*, i.e. the sample's size).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return int(PLAIN_PEAK_FRAMES * batch * base_channels * height * width * itemsize)


def should_chunk(
    height: int,
    width: int,
    device: str | torch.device,
    *,
    batch: int = 1,
    base_channels: int = 384,
    dtype: torch.dtype = torch.float32,
    force: bool | None = None,
    budget_bytes: int | None = None,
) -> bool:
    """Whether to run the UNet through :class:`ChunkedExecutor` for a sample of ``height x width`` latents.

    ``force=True``/``False`` forces or forbids chunking. Otherwise chunk when :func:`plain_peak_bytes`
    exceeds ``budget_bytes``; by default that is ``CUDA_BUDGET_FRACTION`` of the free memory of a CUDA
    device, and ``DEFAULT_CPU_BUDGET_BYTES`` (1 GiB, about 2300 px output in fp32) elsewhere.
    """
    if force is not None:
        return bool(force)
    device = torch.device(device)
    if budget_bytes is None:
        if device.type == "cuda" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * CUDA_BUDGET_FRACTION)
        else:
            budget_bytes = DEFAULT_CPU_BUDGET_BYTES
    need = plain_peak_bytes(height, width, batch=batch, base_channels=base_channels, dtype=dtype)
    return need > budget_bytes


# --------------------------------------------------------------------------------------------------
# small pure functions


def bilinear_taps(in_size: int, out_size: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
        """Statistics of a strip (B, C, h, w): two-pass variance in float32, then widened."""
        var, mean = torch.var_mean(x.float(), dim=(2, 3), correction=0)
        count = x.shape[2] * x.shape[3]
        return ChannelStats(count, mean.to(acc_dtype), var.to(acc_dtype) * count)

    def merge(self, other: ChannelStats) -> ChannelStats:
        """Chan et al.: ``n = na + nb``, ``d = mb - ma``, ``mean = ma + d nb / n``, ``m2 = m2a + m2b + d^2 na nb / n``."""
        n = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta.square() * (self.count * other.count / n)
        return ChannelStats(n, mean, m2)

    def cat(self, other: ChannelStats) -> ChannelStats:
        """Statistics of the channel concatenation of two frames of the same size."""
        assert self.count == other.count
        return ChannelStats(self.count, torch.cat([self.mean, other.mean], 1), torch.cat([self.m2, other.m2], 1))


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
    """``silu(x * scale + shift)`` with (B, C) ``scale``/``shift``, computed in their precision, returned in x's dtype."""
    y = torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])
    return F.silu(y, inplace=True).to(x.dtype)


# --------------------------------------------------------------------------------------------------
# frames: full-size feature maps read in row strips


@dataclass
class Frame:
    """A (B, C, H, W) feature map that can be read in row strips ``read(a, b)`` on the compute device.

    ``buffer`` is the stored tensor when the frame is materialized (None for derived frames);
    ``stats`` its full-frame channel statistics when they were collected.
    """

    read: RowFn
    shape: tuple[int, int, int, int]
    buffer: torch.Tensor | None = None
    stats: ChannelStats | None = None

    @property
    def height(self) -> int:
        return self.shape[2]

    @property
    def width(self) -> int:
        return self.shape[3]


class ChunkedExecutor:
    """Runs a :class:`FlowUpscalerUNet` exactly, in row strips, with bounded memory.

    Callable like the model: ``executor(sample, timestep, latents_small) -> velocity``. ``chunk`` is
    the number of rows per strip at the output resolution (lower-resolution levels use proportionally
    more rows, so every strip has about the same number of pixels). Full-frame activations are kept
    on ``offload_device`` (default: the model's device); strips are computed on the model's device.
    Inference only: dropout is never applied, whatever ``model.training`` says.
    """

    def __init__(
        self, model: FlowUpscalerUNet, chunk: int = DEFAULT_CHUNK, offload_device: str | torch.device | None = None
    ) -> None:
        if int(chunk) < 1:
            raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
        self.model = model
        self.chunk = int(chunk)
        self.offload_device = torch.device(offload_device) if offload_device is not None else None

    # -- set-up per call -------------------------------------------------------------------------

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor | float, latents_small: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        check_inputs(sample, timestep, latents_small, model.config["sample_channels"])
        param = model.in_conv.weight
        self.device, self.dtype = param.device, param.dtype
        self.store_device = self.offload_device or self.device
        self.acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.ref_width = sample.shape[3]
        with torch.no_grad():
            return self._forward(sample, timestep, latents_small)

    def _forward(self, sample: torch.Tensor, timestep: torch.Tensor | float, small: torch.Tensor) -> torch.Tensor:
        m = self.model
        batch, _, height, width = sample.shape
        cond = m.time_conditioning(timestep, batch)

        # Low-resolution encoder at the small latent's size, 1/2 and 1/4.
        enc = m.low_res_encoder
        small_frame = self._input(small)
        x = self._materialize(self._conv(enc.in_conv, small_frame), base_shape(small_frame, m), stats=True)
        l1 = self._block(enc.block_1, x, cond, into=x.buffer, stats=False)
        l2 = self._down_first(enc.block_2, l1, cond)
        l3 = self._down_first(enc.block_3, l2, cond)

        # UNet encoder: FiLM from the resized low-res features before each level.
        sample_frame = self._input(sample)
        x = self._conv(m.in_conv, sample_frame)
        x = self._film(m.film_cond_1, x, l1, (batch, l1.shape[1], height, width), into=None)
        del l1
        for block in m.down_stages[0].blocks:
            x = self._block(block, x, cond, into=x.buffer)
        s1 = x
        x = self._downsample(m.down_stages[0].downsample, s1)
        x = self._film(m.film_cond_2, x.read, l2, x.shape, into=x.buffer)
        del l2
        for block in m.down_stages[1].blocks:
            x = self._block(block, x, cond, into=x.buffer)
        s2 = x
        x = self._downsample(m.down_stages[1].downsample, s2)
        x = self._film(m.film_cond_3, x.read, l3, x.shape, into=x.buffer)
        del l3
        x = self._block(m.mid_stages[0], x, cond, into=x.buffer, stats=False)

        # UNet decoder: upsample, concat the skip (never stored), blocks written over the skip.
        for stage, skip in ((m.up_stages[0], s2), (m.up_stages[1], s1)):
            x = self._concat(self._upsample(x, skip.shape), skip)
            for i, block in enumerate(stage.blocks):
                x = self._block(block, x, cond, into=skip.buffer if i == 0 else x.buffer)
        del s1, s2

        out_shape = (batch, m.out_conv.out_channels, height, width)
        out = self._materialize(self._conv(m.out_conv, x), out_shape, stats=False, device=self.device)
        return out.buffer

    # -- building blocks -------------------------------------------------------------------------

    def _rows(self, width: int) -> int:
        """Rows per strip for a frame ``width`` pixels wide: ``chunk`` at output width, proportionally more below."""
        return max(1, (self.chunk * self.ref_width) // max(1, width))

    def _input(self, tensor: torch.Tensor) -> Frame:
        stored = tensor if self.offload_device is None else tensor.to(self.store_device)
        return self._stored(stored, None)

    def _stored(self, buffer: torch.Tensor, stats: ChannelStats | None) -> Frame:
        def read(a: int, b: int) -> torch.Tensor:
            return buffer[:, :, a:b].to(device=self.device, dtype=self.dtype)

        return Frame(read, tuple(buffer.shape), buffer, stats)

    def _materialize(
        self,
        rows: RowFn,
        shape: tuple[int, int, int, int],
        *,
        into: torch.Tensor | None = None,
        stats: bool = True,
        device: torch.device | None = None,
    ) -> Frame:
        """Evaluate ``rows`` strip by strip into a buffer (``into``, or a new one), collecting channel stats.

        Writing over a frame that ``rows`` reads is safe when strip ``[a, b)`` reads that frame only
        at rows ``[a, b)`` (later strips then read rows not yet written).
        """
        if into is None:
            into = torch.empty(shape, dtype=self.dtype, device=device or self.store_device)
        height = shape[2]
        step = self._rows(shape[3])
        collected: ChannelStats | None = None
        for a in range(0, height, step):
            b = min(a + step, height)
            strip = rows(a, b)
            if stats:
                part = ChannelStats.of(strip, self.acc_dtype)
                collected = part if collected is None else collected.merge(part)
            into[:, :, a:b].copy_(strip)
            del strip
        return self._stored(into, collected)

    def _conv(self, conv: nn.Conv2d, source: Frame | RowFn, source_height: int | None = None) -> RowFn:
        """Rows ``[a, b)`` of ``conv(source)``: input rows ``[a*s - p, (b-1)*s - p + k)``, zero rows outside."""
        read = source.read if isinstance(source, Frame) else source
        height = source.height if isinstance(source, Frame) else source_height
        k, s, p = conv.kernel_size[0], conv.stride[0], conv.padding[0]

        def rows(a: int, b: int) -> torch.Tensor:
            lo, hi = a * s - p, (b - 1) * s - p + k
            x = read(max(lo, 0), min(hi, height))
            top, bottom = max(0, -lo), max(0, hi - height)
            if top or bottom:
                x = F.pad(x, (0, 0, top, bottom))
            return F.conv2d(x, conv.weight, conv.bias, stride=conv.stride, padding=(0, conv.padding[1]))

        return rows

    def _block(
        self, block: ResBlock, x: Frame, cond: torch.Tensor, *, into: torch.Tensor | None, stats: bool = True
    ) -> Frame:
        """One residual block in two strip passes; the output is written to ``into`` (may be x's own buffer)."""
        batch, _, height, width = x.shape
        out_shape = (batch, block.out_channels, height, width)
        # Pass 1: h = conv1(silu(norm1(x))), stored with its channel statistics (for norm2).
        scale1, shift1 = group_norm_affine(x.stats, block.norm1)
        h = self._materialize(
            self._conv(block.conv1, lambda a, b: affine_silu(x.read(a, b), scale1, shift1), height), out_shape
        )
        # Pass 2: norm2 and the time FiLM fold into one affine map; then conv2 and the skip.
        norm_scale, norm_shift = group_norm_affine(h.stats, block.norm2)
        film_scale, film_shift = (t[:, :, 0, 0].to(norm_scale.dtype) for t in block.scale_shift(cond))
        scale2 = norm_scale * (1 + film_scale)
        shift2 = norm_shift * (1 + film_scale) + film_shift
        conv2 = self._conv(block.conv2, lambda a, b: affine_silu(h.read(a, b), scale2, shift2), height)

        def rows(a: int, b: int) -> torch.Tensor:
            out = conv2(a, b)
            return out.add_(block.skip(x.read(a, b)))

        return self._materialize(rows, out_shape, into=into, stats=stats)

    def _downsample(self, conv: nn.Conv2d, x: Frame, *, stats: bool = False) -> Frame:
        height = (x.height + 2 * conv.padding[0] - conv.kernel_size[0]) // conv.stride[0] + 1
        width = (x.width + 2 * conv.padding[1] - conv.kernel_size[1]) // conv.stride[1] + 1
        return self._materialize(self._conv(conv, x), (x.shape[0], conv.out_channels, height, width), stats=stats)

    def _down_first(self, stage: nn.Module, x: Frame, cond: torch.Tensor) -> Frame:
        """A downsample-first stage of the low-res encoder: stride-2 conv, then its blocks (in place)."""
        y = self._downsample(stage.downsample, x, stats=bool(stage.blocks))
        for i, block in enumerate(stage.blocks):
            y = self._block(block, y, cond, into=y.buffer, stats=i + 1 < len(stage.blocks))
        return y

    def _resize_rows(self, source: Frame, height: int, width: int) -> RowFn:
        """Rows ``[a, b)`` of the bilinear resize of ``source`` to ``height x width`` (align_corners=False)."""

        def rows(a: int, b: int) -> torch.Tensor:
            if source.height == height and source.width == width:
                return source.read(a, b)
            i0, i1, lam = bilinear_taps(source.height, height, a, b)
            lo, hi = int(i0.min()), int(i1.max()) + 1
            src = source.read(lo, hi)
            top = src.index_select(2, (i0 - lo).to(src.device))
            bottom = src.index_select(2, (i1 - lo).to(src.device))
            out = torch.lerp(top, bottom, lam.to(device=src.device, dtype=src.dtype)[None, None, :, None])
            if source.width != width:  # columns: the row scale is 1, so F.interpolate keeps the rows as they are
                out = F.interpolate(out, size=(b - a, width), mode="bilinear", align_corners=False)
            return out

        return rows

    def _film(
        self, film: nn.Module, x: RowFn, feature: Frame, shape: tuple[int, int, int, int], *, into: torch.Tensor | None
    ) -> Frame:
        """``x * (1 + scale) + shift`` with ``scale, shift = chunk(conv1x1(silu(resize(feature))), 2)``, pointwise."""
        feature_rows = self._resize_rows(feature, shape[2], shape[3])

        def rows(a: int, b: int) -> torch.Tensor:
            scale, shift = film.cond_proj(feature_rows(a, b)).chunk(2, dim=1)
            return x(a, b).mul_(1 + scale).add_(shift) if into is None else x(a, b) * (1 + scale) + shift

        return self._materialize(rows, shape, into=into)

    def _upsample(self, x: Frame, shape: tuple[int, int, int, int]) -> Frame:
        """The up stage's x2 bilinear upsample to the skip's size, as a derived frame with stats."""
        height, width = shape[2], shape[3]
        if (height, width) != (2 * x.height, 2 * x.width):
            raise RuntimeError(f"up stage expects an exact x2 upsample, got {x.shape[2:]} -> {(height, width)}")
        rows = self._resize_rows(x, height, width)
        step = self._rows(width)
        collected: ChannelStats | None = None
        for a in range(0, height, step):
            part = ChannelStats.of(rows(a, min(a + step, height)), self.acc_dtype)
            collected = part if collected is None else collected.merge(part)
        return Frame(rows, (x.shape[0], x.shape[1], height, width), None, collected)

    def _concat(self, first: Frame, second: Frame) -> Frame:
        def read(a: int, b: int) -> torch.Tensor:
            return torch.cat([first.read(a, b), second.read(a, b)], dim=1)

        shape = (first.shape[0], first.shape[1] + second.shape[1], first.shape[2], first.shape[3])
        return Frame(read, shape, None, first.stats.cat(second.stats))


def base_shape(frame: Frame, model: FlowUpscalerUNet) -> tuple[int, int, int, int]:
    """(B, base_channels, H, W) for a frame's batch and size."""
    return (frame.shape[0], model.config["base_channels"], frame.shape[2], frame.shape[3])

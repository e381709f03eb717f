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

Use :func:`flowlift.upscale.chunked.budget.should_chunk` to decide when to switch the executor on by
size (the user can force or forbid it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowlift.models.upscaler_unet import (
    FlowUpscalerUNet,
    ResBlock,
    check_inputs,
)
from flowlift.upscale.chunked.budget import CUDA_BUDGET_FRACTION, default_chunk, strip_rows_for_budget
from flowlift.upscale.chunked.strip_io import OffloadedStores
from flowlift.upscale.chunked.strip_kernels import (
    ChannelStats,
    RowFn,
    affine_silu,
    bilinear_taps,
    conv_rows,
    group_norm_affine,
    resize_rows,
    upsample2x_rows,
)

__all__ = [
    "ChannelStats",
    "ChunkedExecutor",
    "Frame",
    "StripCallback",
    "affine_silu",
    "bilinear_taps",
    "conv_rows",
    "group_norm_affine",
    "resize_rows",
    "upsample2x_rows",
]

#: ``on_strip(done, total)``: called after every strip of a forward; may raise to cancel the run.
StripCallback = Callable[[int, int], None]


# --------------------------------------------------------------------------------------------------
# frames: full-size feature maps read in row strips


@dataclass
class Frame:
    """A (B, C, H, W) feature map read in row strips: ``read(a, b)`` = rows ``[a, b)`` on the compute device.

    ``buffer`` is the stored tensor (None for a derived frame such as an upsample); ``stats`` the
    full-frame channel statistics when they were collected.
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


def concat_stats(parts: list[Frame]) -> ChannelStats:
    """Channel statistics of the channel concatenation of ``parts``."""
    stats = parts[0].stats
    for part in parts[1:]:
        stats = stats.cat(part.stats)
    return stats


def _model_memory_format(model: torch.nn.Module) -> torch.memory_format:
    """Channels-last when the model's first 3x3 convolution holds its weight channels-last (a 1x1 weight is
    both layouts at once), else contiguous."""
    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d) and module.weight.shape[-2:] == (3, 3):
            if module.weight.is_contiguous(memory_format=torch.channels_last) and not module.weight.is_contiguous():
                return torch.channels_last
            break
    return torch.contiguous_format


class ChunkedExecutor:
    """Runs a :class:`FlowUpscalerUNet` exactly, in row strips, with bounded memory.

    Callable like the model: ``executor(sample, timestep, latents_small) -> velocity``. ``chunk`` is
    the number of rows per strip at the output resolution (lower-resolution levels use proportionally
    more rows, so every strip has about the same number of pixels). Without ``chunk`` the strips are
    sized from ``budget_bytes`` (the device memory the executor may use: stores plus strips,
    :func:`strip_rows_for_budget`); without either, from ``CUDA_BUDGET_FRACTION`` of the free memory on a
    CUDA device, and :func:`default_chunk` (cache-sized) on the CPU.

    Full-frame activations are kept on ``offload_device`` (default: the model's device); strips are
    computed on the model's device. Offloaded stores are row-major, pinned and copied on a side
    stream with the next strip's reads started ahead (:class:`flowlift.upscale.chunked.strip_io.OffloadedStores`;
    ``prefetch=False`` makes every copy synchronous). Inference only: dropout is never applied,
    whatever ``model.training`` says.

    ``on_strip(done, total)`` (optional) is called after every strip, ``total`` being the forward's
    number of strips (counted beforehand by a dry run of the same layer walk that computes nothing);
    front-ends use it for progress, and an exception it raises (a user's cancel) stops the forward.
    """

    def __init__(
        self,
        model: FlowUpscalerUNet,
        chunk: int | None = None,
        offload_device: str | torch.device | None = None,
        on_strip: StripCallback | None = None,
        *,
        budget_bytes: int | None = None,
        prefetch: bool = True,
    ) -> None:
        if chunk is not None and int(chunk) < 1:
            raise ValueError(f"chunk must be a positive number of rows, got {chunk}")
        if budget_bytes is not None and int(budget_bytes) < 1:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        self.model = model
        self.chunk = None if chunk is None else int(chunk)
        self.budget_bytes = None if budget_bytes is None else int(budget_bytes)
        self.offload_device = torch.device(offload_device) if offload_device is not None else None
        self.prefetch = prefetch
        self.stage_on_same_device = False  # tests: run the offload path with a CPU "host" and CPU compute
        self.stores: OffloadedStores | None = None
        self.last_chunk: int | None = None
        self.on_strip = on_strip
        self._counting = False
        self._strips_done = 0
        self._strips_total = 0

    def strip_rows(self, batch: int, height: int, width: int) -> int:
        """Rows per strip at the output resolution for a (batch, 32, height, width) sample (see the class)."""
        if self.chunk is not None:
            return self.chunk
        param = self.model.in_conv.weight
        sizes = {
            "batch": batch,
            "base_channels": self.model.config["base_channels"],
            "dtype": param.dtype,
            "offloaded": self.offload_device is not None and self.offload_device != param.device,
        }
        budget = self.budget_bytes
        if budget is None and param.device.type == "cuda" and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(param.device)
            budget = int(free * CUDA_BUDGET_FRACTION)
        if budget is None:
            return default_chunk(width)
        return strip_rows_for_budget(budget, height, width, **sizes)

    def __call__(
        self, sample: torch.Tensor, timestep: torch.Tensor | float, latents_small: torch.Tensor
    ) -> torch.Tensor:
        model = self.model
        check_inputs(sample, timestep, latents_small, model.config["sample_channels"], model.config["base_channels"])
        self._setup(sample)
        if self.on_strip is not None:
            self._strips_total = self.count_strips(sample, timestep, latents_small)
            self._strips_done = 0
        staged = self.store_device != self.device or self.stage_on_same_device
        self.stores = (
            OffloadedStores(self.device, self.dtype, self.store_device, prefetch=self.prefetch) if staged else None
        )
        try:
            with torch.no_grad():
                out = self._forward(sample, timestep, latents_small)
            if self.stores is not None:
                self.stores.finish()
            return out
        finally:
            self.stores_used, self.stores = self.stores, None

    def _setup(self, sample: torch.Tensor) -> None:
        param = self.model.in_conv.weight
        self.device, self.dtype = param.device, param.dtype
        # Frames in the model's own layout: a channels-last model's strips are then dense channels-last row
        # ranges; contiguous frames made every strip a transposing copy each way and oneDNN reorder every
        # convolution's input (the bf16 pass took twice the plain forward's CPU time, docs/cpu.md).
        self.memory_format = _model_memory_format(self.model)
        self.store_device = self.offload_device or self.device
        self.acc_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.ref_width = sample.shape[3]
        self.last_chunk = self.strip_rows(sample.shape[0], sample.shape[2], sample.shape[3])

    def count_strips(self, sample: torch.Tensor, timestep: torch.Tensor | float, latents_small: torch.Tensor) -> int:
        """Strips one forward on these inputs computes: the same layer walk with every strip skipped."""
        self._setup(sample)
        stores, self.stores = self.stores, None
        self._counting, self._strips_total = True, 0
        try:
            with torch.no_grad():
                self._forward(sample, timestep, latents_small)
        finally:
            self._counting = False
            self.stores = stores
        return self._strips_total

    def _strip_finished(self) -> None:
        if self.on_strip is not None:
            self._strips_done += 1
            self.on_strip(self._strips_done, self._strips_total)

    def _dry_frame(self, shape: tuple[int, int, int, int]) -> Frame:
        """A placeholder frame of the counting walk: no buffer, neutral statistics (the norms need some)."""
        batch, channels = shape[0], shape[1]
        stats = ChannelStats(
            1,
            torch.zeros(batch, channels, dtype=self.acc_dtype, device=self.device),
            torch.ones(batch, channels, dtype=self.acc_dtype, device=self.device),
        )
        return Frame(self._no_read, tuple(shape), None, stats)

    @staticmethod
    def _no_read(a: int, b: int) -> torch.Tensor:
        raise RuntimeError("the strip-counting walk must not read rows")

    def _forward(self, sample: torch.Tensor, timestep: torch.Tensor | float, small: torch.Tensor) -> torch.Tensor:
        m = self.model
        batch, _, height, width = sample.shape
        base = m.config["base_channels"]
        cond = m.time_conditioning(timestep, batch)

        # Low-resolution encoder at the small latent's size, 1/2 and 1/4.
        enc = m.low_res_encoder
        small_frame = self._input(small)
        x = self._materialize(self._pointwise_conv(enc.in_conv, small_frame), (batch, base, *small.shape[2:]))
        l1 = self._block(enc.block_1, [x], cond, into=x.buffer, stats=False)
        l2 = self._down_first(enc.block_2, l1, cond)
        l3 = self._down_first(enc.block_3, l2, cond)

        # UNet encoder: FiLM from the resized low-res features before each level.
        x = self._film(
            m.film_cond_1,
            self._pointwise_conv(m.in_conv, self._input(sample)),
            l1,
            (batch, base, height, width),
            into=None,
        )
        del l1
        for block in m.down_stages[0].blocks:
            x = self._block(block, [x], cond, into=x.buffer)
        s1 = x
        x = self._downsample(m.down_stages[0].downsample, s1)
        x = self._film(m.film_cond_2, x.read, l2, x.shape, into=x.buffer)
        del l2
        for block in m.down_stages[1].blocks:
            x = self._block(block, [x], cond, into=x.buffer)
        s2 = x
        x = self._downsample(m.down_stages[1].downsample, s2)
        x = self._film(m.film_cond_3, x.read, l3, x.shape, into=x.buffer)
        del l3
        x = self._block(m.mid_stages[0], [x], cond, into=x.buffer, stats=False)

        # UNet decoder: [upsample(x), skip] is never stored; the first block writes over the skip.
        for stage, skip in ((m.up_stages[0], s2), (m.up_stages[1], s1)):
            parts = [self._upsample(x, skip.shape), skip]
            for i, block in enumerate(stage.blocks):
                x = self._block(block, parts, cond, into=skip.buffer if i == 0 else x.buffer)
                parts = [x]
        del s1, s2

        out_shape = (batch, m.out_conv.out_channels, height, width)
        out = self._materialize(self._pointwise_conv(m.out_conv, x), out_shape, stats=False, device=self.device)
        return out.buffer

    # -- storage ---------------------------------------------------------------------------------

    def _rows(self, width: int) -> int:
        """Rows per strip for a frame ``width`` wide: ``chunk`` at output width, proportionally more below."""
        return max(1, (self.last_chunk * self.ref_width) // max(1, width))

    def _input(self, tensor: torch.Tensor) -> Frame:
        if self._counting:
            return self._dry_frame(tuple(tensor.shape))
        if self.stores is not None:
            return self._stored(self.stores.from_tensor(tensor), None, offloaded=True)
        return self._stored(tensor, None)

    def _stored(self, buffer: torch.Tensor, stats: ChannelStats | None, *, offloaded: bool = False) -> Frame:
        """A frame over ``buffer``: a (B, C, H, W) tensor, or with ``offloaded`` a row-major store."""
        stores = self.stores
        if offloaded and stores is not None:

            def read_store(a: int, b: int) -> torch.Tensor:
                return stores.read(buffer, a, b)

            return Frame(read_store, stores.logical_shape(buffer), buffer, stats)

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

        Without ``device`` the buffer is a store (with offloading a row-major host store; ``into``
        must then be one too); with ``device`` a plain tensor there (the output). Writing over a
        frame that ``rows`` reads is safe when strip ``[a, b)`` reads that frame only at rows
        ``[a, b)``: later strips then read rows not yet written.
        """
        if self._counting:
            self._strips_total += len(range(0, shape[2], self._rows(shape[3])))
            return self._dry_frame(shape)
        stores = self.stores
        if into is None:
            if stores is not None and device is None:
                into = stores.empty(shape)
            else:
                into = torch.empty(
                    shape, dtype=self.dtype, device=device or self.device, memory_format=self.memory_format
                )
        offloaded = stores is not None and device is None
        step = self._rows(shape[3])
        collected: ChannelStats | None = None
        for a in range(0, shape[2], step):
            b = min(a + step, shape[2])
            strip = rows(a, b)
            if offloaded:  # statistics from the strip, on the compute device
                written = strip
                stores.write(into, a, b, strip)
            else:  # same device: free the strip first and take the statistics from the stored rows
                into[:, :, a:b].copy_(strip)
                written = into[:, :, a:b]
            del strip
            if stats:
                part = ChannelStats.of(written, self.acc_dtype)
                collected = part if collected is None else collected.merge(part)
            del written
            self._strip_finished()
        return self._stored(into, collected, offloaded=offloaded)

    # -- layers ----------------------------------------------------------------------------------

    def _pointwise_conv(self, conv: nn.Conv2d, x: Frame) -> RowFn:
        return lambda a, b: F.conv2d(x.read(a, b), conv.weight, conv.bias)

    def _block(
        self,
        block: ResBlock,
        parts: list[Frame],
        cond: torch.Tensor,
        *,
        into: torch.Tensor | None,
        stats: bool = True,
    ) -> Frame:
        """One residual block in two strip passes over ``x = cat(parts)``, into ``into`` (may be a part).

        Pass 1 stores ``h = conv1(silu(norm1(x)))`` with its statistics; pass 2 computes
        ``conv2(silu(norm2(h) * (1 + scale) + shift)) + skip(x)``. A concatenated input is never
        built: ``conv(cat(u, v)) = conv_u(u) + conv_v(v)`` with the weight split along input channels.
        """
        batch, _, height, width = parts[0].shape
        out_shape = (batch, block.out_channels, height, width)
        spans, start = [], 0
        for part in parts:
            spans.append((start, start + part.shape[1]))
            start += part.shape[1]

        scale1, shift1 = group_norm_affine(concat_stats(parts), block.norm1)

        def conv1(a: int, b: int) -> torch.Tensor:
            out = None
            for part, (c0, c1) in zip(parts, spans, strict=True):

                def normed(i: int, j: int, part: Frame = part, c0: int = c0, c1: int = c1) -> torch.Tensor:
                    return affine_silu(part.read(i, j), scale1[:, c0:c1], shift1[:, c0:c1])

                y = conv_rows(
                    normed,
                    height,
                    block.conv1.weight[:, c0:c1],
                    block.conv1.bias if out is None else None,
                    1,
                    (1, 1),
                    a,
                    b,
                )
                out = y if out is None else out.add_(y)
            return out

        h = self._materialize(conv1, out_shape)

        # norm2 and the time FiLM fold into one affine map.
        norm_scale, norm_shift = group_norm_affine(h.stats, block.norm2)
        film_scale, film_shift = (t[:, :, 0, 0].to(norm_scale.dtype) for t in block.scale_shift(cond))
        scale2 = norm_scale * (1 + film_scale)
        shift2 = norm_shift * (1 + film_scale) + film_shift

        def normed2(i: int, j: int) -> torch.Tensor:
            return affine_silu(h.read(i, j), scale2, shift2)

        def conv2_and_skip(a: int, b: int) -> torch.Tensor:
            out = conv_rows(normed2, height, block.conv2.weight, block.conv2.bias, 1, (1, 1), a, b)
            if isinstance(block.skip, nn.Conv2d):
                for part, (c0, c1) in zip(parts, spans, strict=True):
                    out.add_(F.conv2d(part.read(a, b), block.skip.weight[:, c0:c1], block.skip.bias))
            else:
                out.add_(parts[0].read(a, b))
            return out

        return self._materialize(conv2_and_skip, out_shape, into=into, stats=stats)

    def _downsample(self, conv: nn.Conv2d, x: Frame, *, stats: bool = False) -> Frame:
        k, s, p = conv.kernel_size[0], conv.stride[0], conv.padding[0]
        height = (x.height + 2 * p - k) // s + 1
        width = (x.width + 2 * conv.padding[1] - conv.kernel_size[1]) // conv.stride[1] + 1

        def rows(a: int, b: int) -> torch.Tensor:
            return conv_rows(x.read, x.height, conv.weight, conv.bias, s, conv.padding, a, b)

        return self._materialize(rows, (x.shape[0], conv.out_channels, height, width), stats=stats)

    def _down_first(self, stage: nn.Module, x: Frame, cond: torch.Tensor) -> Frame:
        """A downsample-first stage of the low-res encoder: stride-2 conv, then its blocks (in place)."""
        y = self._downsample(stage.downsample, x, stats=len(stage.blocks) > 0)
        for i, block in enumerate(stage.blocks):
            y = self._block(block, [y], cond, into=y.buffer, stats=i + 1 < len(stage.blocks))
        return y

    def _film(
        self,
        film: nn.Module,
        x: RowFn,
        feature: Frame,
        shape: tuple[int, int, int, int],
        *,
        into: torch.Tensor | None,
    ) -> Frame:
        """Pointwise ``x * (1 + scale) + shift``, ``scale, shift = chunk(conv1x1(silu(resize(feature))), 2)``.

        With ``into=None``, ``x`` yields fresh tensors and is modified in place; otherwise ``x`` reads
        ``into`` itself and the result is a new tensor.
        """
        size = (feature.height, feature.width)

        def rows(a: int, b: int) -> torch.Tensor:
            scale, shift = film.cond_proj(resize_rows(feature.read, size, shape[2:], a, b)).chunk(2, dim=1)
            if into is None:
                return x(a, b).mul_(1 + scale).add_(shift)
            return x(a, b) * (1 + scale) + shift

        return self._materialize(rows, shape, into=into)

    def _upsample(self, x: Frame, shape: tuple[int, int, int, int]) -> Frame:
        """The up stage's x2 bilinear upsample to the skip's size: derived frame, stats pass, not stored."""
        height, width = shape[2], shape[3]
        if (height, width) != (2 * x.height, 2 * x.width):
            raise RuntimeError(f"up stage expects an exact x2 upsample, got {x.shape[2:]} -> {(height, width)}")

        def rows(a: int, b: int) -> torch.Tensor:
            return upsample2x_rows(x.read, x.height, a, b)

        step = self._rows(width)
        if self._counting:
            self._strips_total += len(range(0, height, step))
            return Frame(rows, (x.shape[0], x.shape[1], height, width), None, self._dry_frame(x.shape).stats)
        collected: ChannelStats | None = None
        for a in range(0, height, step):
            part = ChannelStats.of(rows(a, min(a + step, height)), self.acc_dtype)
            collected = part if collected is None else collected.merge(part)
            self._strip_finished()
        return Frame(rows, (x.shape[0], x.shape[1], height, width), None, collected)

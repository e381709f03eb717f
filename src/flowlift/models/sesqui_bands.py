"""SesquiLSR in row bands: the network of :mod:`flowlift.models.sesqui_lsr` with two 128-channel frames stored
and every other activation made a band of rows at a time, for a memory budget (``--max-memory``, or the size).

Whole-frame, SesquiLSR's peak is its 2x grid's ``refine`` block (and an ``out_block`` at a 2x target): 1,200-1,450
float32 values per grid position (the 128-channel stream, the normalized copy, the 288-channel expansion, its
gated and activated halves), ~5 KB; a 1.5x fraction to an 8K frame (1024x1024 latents from 683x683) is ~10 GB.
Here each stage reads one frame and writes the other (:func:`run_rows`):

* the local layers (``head_conv``, the grid's ``expand``, ``tail_conv``, ``skip_conv``) on bands of ``rows`` rows
  with a halo of their reach (2, 1, 1, 2 rows: their 3x3/5x5 convolutions): the rows the band's own reflection
  padding spoils at an inner edge are exactly the halo, cropped; at the frame's edges the band's padding is the
  frame's;
* each :class:`~flowlift.models.sesqui_lsr.GatedBlock` normalizes by its input frame's statistics
  (:func:`frame_statistics`, float64 sums over bands), then runs on bands with a halo of 1 (its ``mix``);
* the resampling to the target on bands of output rows, each reading the grid rows its taps reach
  (:func:`~flowlift.models.sesqui_lsr.source_rows`);
* the skip's bicubic upsample of the 32-channel input whole (a quarter of one stored frame at the target).

Peak: the two frames, ``2 * B * 128 * 2h * 2w`` float32 values (the grid is the largest stage: every target is
within 2x), the 32-channel skip and result at the target, and one band's activations
(:func:`banded_peak_bytes`). The result equals the whole-frame forward up to float32 rounding: the statistics
are summed in another order (measured: tests/test_sesqui_bands.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from flowlift.models.sesqui_lsr import (
    LATENT_CHANNELS,
    NORM_EPS,
    WIDTH,
    GatedBlock,
    SesquiLSR,
    check_target_size,
    sesqui_upscale_latents,
    source_rows,
)

#: float32 values a whole-frame forward holds at its peak, per position of its 2x grid (its grid's ``refine``
#: block, or an ``out_block`` at a 2x target), and per position of one band row at the grid's width in the banded
#: forward; measured with a dispatch mode that tracks every tensor the forward makes (``_PeakTensorMemory`` of
#: :mod:`flowlift.measure.tiled_inference`; tests/test_sesqui_bands.py asserts both bound it).
WHOLE_VALUES_PER_POSITION = 1440
BAND_VALUES_PER_POSITION = 1200
#: The rows a band adds at its inner edges beyond ``rows`` (one above and one below for the blocks' ``mix``).
BAND_HALO_ROWS = 2


def whole_peak_bytes(batch: int, height: int, width: int) -> int:
    """Estimated peak of the whole-frame float32 forward on (batch, 32, height, width) raw latents (any target):
    ``4 * batch * 1440 * 2h * 2w``."""
    return 4 * batch * WHOLE_VALUES_PER_POSITION * 4 * height * width


def banded_peak_bytes(batch: int, height: int, width: int, target: tuple[int, int], rows: int) -> int:
    """Estimated peak of :func:`sesqui_banded`: the two frames at the grid's size, the 32-channel skip and result at
    the target, one band of ``rows + 2`` rows at the grid's width:
    ``4 * batch * (256 * 4hw + 64 * th * tw + (rows + 2) * 2w * 1200)``."""
    stores = 2 * WIDTH * 4 * height * width + 2 * LATENT_CHANNELS * target[0] * target[1]
    return 4 * batch * (stores + (rows + BAND_HALO_ROWS) * 2 * width * BAND_VALUES_PER_POSITION)


def rows_for_budget(budget_bytes: int, batch: int, height: int, width: int, target: tuple[int, int]) -> int:
    """The most band rows whose :func:`banded_peak_bytes` fits ``budget_bytes`` (at most the grid's height);
    0 where even one row does not."""
    fixed = banded_peak_bytes(batch, height, width, target, 0)
    per_row = 4 * batch * 2 * width * BAND_VALUES_PER_POSITION
    return max(min((budget_bytes - fixed) // per_row, 2 * height), 0)


def frame_statistics(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's ``mean`` and ``spread = sqrt(var + 1e-6)`` over (C, H, W), as
    :func:`~flowlift.models.sesqui_lsr.sample_statistics`, summed over bands of ``rows`` rows in float64 (float32
    on MPS, which has no float64) as ``var = sum((x - mean)**2) / n``, two passes: (B, 1, 1, 1) in x's dtype."""
    count, accumulate = x[0].numel(), torch.float32 if x.device.type == "mps" else torch.float64
    total = x.new_zeros(x.shape[0], dtype=accumulate)
    for a in range(0, x.shape[-2], rows):
        total += x[:, :, a : a + rows].sum(dim=(1, 2, 3), dtype=accumulate)
    mean = (total / count).to(x.dtype).view(-1, 1, 1, 1)
    squares = x.new_zeros(x.shape[0], dtype=accumulate)
    for a in range(0, x.shape[-2], rows):
        squares += (x[:, :, a : a + rows] - mean).square().sum(dim=(1, 2, 3), dtype=accumulate)
    spread = torch.sqrt(squares / count + NORM_EPS).to(x.dtype).view(-1, 1, 1, 1)
    return mean, spread


def run_rows(
    op: Callable[[torch.Tensor], torch.Tensor],
    source: torch.Tensor,
    out: torch.Tensor,
    *,
    reach: int,
    rows: int,
    scale: int = 1,
    add: bool = False,
) -> torch.Tensor:
    """``out = op(source)`` (``add``: ``out += op(source)``) a band of ``rows`` source rows at a time.

    ``op`` is local: output row ``i`` (of ``scale`` rows per source row) reads source rows ``i / scale +- reach``,
    with reflection padding at the frame's edges. Each band takes ``reach`` more rows at each inner edge and
    drops their output, which the band's own padding spoiled; at the frame's edges the band's padding is the
    frame's, so every kept row is the whole frame's.
    """
    height = source.shape[-2]
    for a in range(0, height, rows):
        b = min(a + rows, height)
        first, end = max(a - reach, 0), min(b + reach, height)
        band = op(source[:, :, first:end])
        kept = band[:, :, (a - first) * scale : (b - first) * scale]
        target = out[:, :, a * scale : b * scale]
        target.add_(kept) if add else target.copy_(kept)
    return out


class TwoFrames:
    """Two float32 stores of ``batch * 128 * positions`` values, each viewed as a (batch, 128, h, w) frame."""

    def __init__(self, like: torch.Tensor, batch: int, positions: int) -> None:
        self.batch = batch
        self.stores = [like.new_empty(batch * WIDTH * positions) for _ in range(2)]

    def __call__(self, index: int, size: tuple[int, int]) -> torch.Tensor:
        return self.stores[index][: self.batch * WIDTH * size[0] * size[1]].view(self.batch, WIDTH, *size)


def gated_blocks(blocks: Sequence[GatedBlock], frames: TwoFrames, index: int, size: tuple[int, int], rows: int) -> int:
    """Each block from frame ``index`` into the other: its input frame's statistics, then bands with a halo of
    1 (its ``mix``). Returns the index of the frame that holds the result."""
    for block in blocks:
        source, out = frames(index, size), frames(1 - index, size)
        mean, spread = frame_statistics(source, rows)
        run_rows(partial(block.with_statistics, mean=mean, spread=spread), source, out, reach=1, rows=rows)
        index = 1 - index
    return index


def sesqui_banded(model: SesquiLSR, raw_latents: torch.Tensor, target_size: tuple[int, int], rows: int) -> torch.Tensor:
    """``model(raw_latents, target_size)`` with bands of ``rows`` rows (at least 1) and two stored frames."""
    th, tw = check_target_size(tuple(raw_latents.shape), target_size)
    rows = max(int(rows), 1)
    batch, _, h, w = raw_latents.shape
    small, grid_size, target = (h, w), (2 * h, 2 * w), (th, tw)
    frames = TwoFrames(raw_latents, batch, 4 * h * w)  # the grid is the largest frame: a target is within 2x
    head = model.upsample
    run_rows(model.head_conv, raw_latents, frames(0, small), reach=2, rows=rows)
    index = gated_blocks(model.in_blocks, frames, 0, small, rows)
    run_rows(head.expand, frames(index, small), frames(1 - index, grid_size), reach=1, rows=max(rows // 2, 1), scale=2)
    index = gated_blocks([head.refine], frames, 1 - index, grid_size, rows)
    grid, resampled = frames(index, grid_size), frames(1 - index, target)
    ranks = head.resampling(grid_size, target)
    for a in range(0, th, rows):
        b = min(a + rows, th)
        first, end = source_rows(ranks[0].base_y, (a, b), grid_size[0])
        resampled[:, :, a:b] = head.resample_rows(grid[:, :, first:end], ranks, (a, b), first)
    index = gated_blocks(model.out_blocks, frames, 1 - index, target, rows)
    result = raw_latents.new_empty(batch, LATENT_CHANNELS, th, tw)
    run_rows(model.tail_conv, frames(index, target), result, reach=1, rows=rows)
    skip = F.interpolate(raw_latents, size=target, mode="bicubic", align_corners=False)
    return run_rows(model.skip_conv, skip, result, reach=2, rows=rows, add=True)


def sesqui_to_size(
    model: SesquiLSR,
    latents: torch.Tensor,
    target_size: tuple[int, int],
    bn_mean: torch.Tensor | None,
    bn_std: torch.Tensor | None,
    rows: int | None = None,
) -> torch.Tensor:
    """:func:`~flowlift.models.sesqui_lsr.sesqui_upscale_latents` (normalized latents in and out) whole-frame, or
    with ``rows`` in bands of that many rows (:func:`sesqui_banded`, a memory plan's choice): an integer >= 1."""
    from flowlift.knobs import check_positive

    rows = check_positive("rows", rows, integer=True, optional=True)  # 0, "3", 2.7 were taken, nan a ValueError
    forward = None if rows is None else partial(sesqui_banded, rows=rows)
    return sesqui_upscale_latents(model, latents, target_size, bn_mean, bn_std, forward=forward)

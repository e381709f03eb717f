"""The FLUX.2 VAE's tiled encode and decode in memory bounded by a tile: diffusers' tiles, blended as diffusers
blends them, each written into the result as soon as it is final.

diffusers' ``AutoencoderKLFlux2.tiled_decode`` (and ``_tiled_encode``) runs the decoder on every tile first and keeps
them all (overlapping tiles: ``(tile / stride)**2`` = 1.78 frames at its 25% overlap), then blends them, crops them
into rows (one more frame) and concatenates the rows (one more): about 3.8 frames of the image in the VAE's dtype,
plus flowlift's float32 ``(x + 1) / 2`` of the whole frame (two more float32 frames while it is computed). Measured
on the CPU with a tiny random VAE (docs/vae.md, "Design notes"): 988 MiB to decode 4096², 3662 MiB for 8192² (4.8
times the 768 MiB result), where the memory plan costed the tiled decode at the result, the latent and one tile's
working set; these functions: 439 and 1106 MiB.

:func:`decode_tiled` and :func:`encode_tiled` run the same tiles in the same order through the same modules and the
same blend (diffusers' own ``blend_v`` / ``blend_h``), so the result is diffusers' tiled result bit for bit; what a
later tile reads of an earlier one is kept (the bottom ``blend`` rows of the row of tiles above, the right ``blend``
columns of the tile to the left) and the rest goes straight into the preallocated result. Working set beside the
result and the input: one tile's activations and strips of ``blend`` rows across the frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from flowlift.flux2.latents import LATENT_CHANNELS

#: ``on_tile(done, total)`` after every tile.
TileCallback = Callable[[int, int], None]


def needs_tiles(model: Any, height: int, width: int, *, latent: bool) -> bool:
    """Whether diffusers' tiling would split a (height, width) input of ``model``: a side over one tile
    (``tile_latent_min_size`` for latents, ``tile_sample_min_size`` for images)."""
    tile = model.tile_latent_min_size if latent else model.tile_sample_min_size
    return height > tile or width > tile


def _spans(size: int, tile: int, stride: int, keep: int, scale: float) -> list[tuple[int, int, int, int]]:
    """Per tile along one side: (input start, input length, output start, kept length) for diffusers' tiles of
    ``tile`` input px every ``stride`` (``range(0, size, stride)``, as diffusers loops), each ``scale`` times the
    input's length out and cropped to ``keep`` (what diffusers concatenates)."""
    spans, out = [], 0
    for start in range(0, size, stride):
        length = min(tile, size - start)
        kept = min(keep, round(length * scale))
        spans.append((start, length, out, kept))
        out += kept
    return spans


def _samples(tensor: torch.Tensor, sliced: bool) -> Iterator[slice]:
    """The batch slices diffusers runs at once: one image at a time with ``use_slicing``, else the whole batch."""
    batch = tensor.shape[0]
    if sliced and batch > 1:
        yield from (slice(b, b + 1) for b in range(batch))
    else:
        yield slice(0, batch)


def _blend_into(
    model: Any,
    out: torch.Tensor,
    grid: tuple[list, list],
    run_tile: Callable[[int, int, int, int], torch.Tensor],
    blend: int,
    write: Callable[[torch.Tensor, torch.Tensor], None],
    on_tile: TileCallback | None,
) -> None:
    """Run ``run_tile(row_start, rows, col_start, cols)`` on every tile of ``grid`` (the rows' and columns' spans),
    blend it with the blended tile above and the one to the left as diffusers does (in place: above first, then
    left), and ``write(view of out, cropped tile)``. Keeps the bottom ``blend`` rows of each tile of the previous
    row and the right ``blend`` columns of the previous tile, all that a later blend reads."""
    rows, cols = grid
    above: list[torch.Tensor | None] = [None] * len(cols)
    total, done = len(rows) * len(cols), 0
    for row_start, row_len, out_top, kept_rows in rows:
        left = None
        for j, (col_start, col_len, out_left, kept_cols) in enumerate(cols):
            tile = run_tile(row_start, row_len, col_start, col_len)
            if above[j] is not None:
                tile = model.blend_v(above[j], tile, blend)
            if left is not None:
                tile = model.blend_h(left, tile, blend)
            above[j] = tile[:, :, -blend:, :].clone()
            left = tile[:, :, :, -blend:].clone()
            view = out[:, :, out_top : out_top + kept_rows, out_left : out_left + kept_cols]
            write(view, tile[:, :, :kept_rows, :kept_cols])
            del tile
            done += 1
            if on_tile is not None:
                on_tile(done, total)


@torch.no_grad()
def decode_tiled(
    model: Any, z: torch.Tensor, *, dtype: torch.dtype = torch.float32, on_tile: TileCallback | None = None
) -> torch.Tensor:
    """diffusers' tiled decode of raw latents ``z`` (B, 32, h, w) on ``model`` (an ``AutoencoderKLFlux2``), as
    ``(x + 1) / 2`` in ``dtype`` (B, 3, 8h, 8w), bit for bit ``((model.tiled_decode(z).sample.float() + 1) / 2)``;
    ``on_tile(done, total)`` after every tile (of every batch slice, with ``use_slicing``)."""
    tile, sample = model.tile_latent_min_size, model.tile_sample_min_size
    stride = int(tile * (1 - model.tile_overlap_factor))
    blend = int(sample * model.tile_overlap_factor)
    scale = sample // tile
    height, width = z.shape[-2:]
    grid = (_spans(height, tile, stride, sample - blend, scale), _spans(width, tile, stride, sample - blend, scale))
    out_h, out_w = sum(s[3] for s in grid[0]), sum(s[3] for s in grid[1])
    out = torch.empty(z.shape[0], 3, out_h, out_w, dtype=dtype, device=z.device)
    slices = list(_samples(z, bool(getattr(model, "use_slicing", False))))
    done = 0

    def write(view: torch.Tensor, pixels: torch.Tensor) -> None:
        view.copy_((pixels.float() + 1) / 2)  # what flowlift does to diffusers' whole result, per element

    def progress(_: int, total: int) -> None:
        nonlocal done
        done += 1
        if on_tile is not None:
            on_tile(done, total * len(slices))

    for part in slices:
        latents = z[part]

        def run_tile(top: int, rows: int, left: int, cols: int, latents: torch.Tensor = latents) -> torch.Tensor:
            piece = latents[:, :, top : top + rows, left : left + cols]
            if model.config.use_post_quant_conv:
                piece = model.post_quant_conv(piece)
            return model.decoder(piece)

        _blend_into(model, out[part], grid, run_tile, blend, write, progress)
    return out


@torch.no_grad()
def encode_tiled(model: Any, images: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """diffusers' tiled encode's posterior mode (the raw latents, (B, 32, H/8, W/8) in ``dtype``) of ``images`` in
    [0, 1] (B, 3, H, W) on ``model``, bit for bit ``model.encode(2x - 1).latent_dist.mode()`` with its tiling on.

    Each tile is made ``2x - 1`` in float32 and rounded to the model's dtype on its own (flowlift's adapter does the
    same to the whole frame, per element), and only the mean's 32 channels are blended and kept (the blend is per
    channel; the mode is the mean)."""
    tile, latent_tile = model.tile_sample_min_size, model.tile_latent_min_size
    stride = int(tile * (1 - model.tile_overlap_factor))
    blend = int(latent_tile * model.tile_overlap_factor)
    height, width = images.shape[-2:]
    keep, scale = latent_tile - blend, latent_tile / tile
    grid = (_spans(height, tile, stride, keep, scale), _spans(width, tile, stride, keep, scale))
    param = next(model.parameters())
    out_h, out_w = (sum(s[3] for s in spans) for spans in grid)
    out = torch.empty(images.shape[0], LATENT_CHANNELS, out_h, out_w, dtype=dtype, device=param.device)
    wide = torch.promote_types(images.dtype, torch.float32)

    def write(view: torch.Tensor, latents: torch.Tensor) -> None:
        view.copy_(latents)

    for part in _samples(images, bool(getattr(model, "use_slicing", False))):
        pixels = images[part]

        def run_tile(top: int, rows: int, left: int, cols: int, pixels: torch.Tensor = pixels) -> torch.Tensor:
            piece = pixels[:, :, top : top + rows, left : left + cols]
            signed = piece.to(param.device, wide, copy=True).mul_(2).sub_(1).to(param.dtype)
            moments = model.encoder(signed)
            if model.config.use_quant_conv:
                moments = model.quant_conv(moments)
            return moments[:, :LATENT_CHANNELS]

        _blend_into(model, out[part], grid, run_tile, blend, write, None)
    return out

"""Exact, bounded-memory Mage-VAE encode and decode: layer-synchronous passes over window-aligned tiles.

Why a plain tiling (TAEF2's) cannot work here: three operations of the codec see the whole frame —
every DiCo block's channel gate ``sigmoid(ca(mean_hw(a)))``, every GroupNorm of the CoD decoder, and
the window attention's fixed grid. A tile that computed them from its own pixels would differ.

**The schedule.** Everything before the per-pixel MLP runs at the codec's 1/16 resolution, so the
executor keeps that resolution's activations as whole-frame *stores* (one sample at a time) and
runs the network one layer at a time, each layer as a *pass* over tiles:

* a pass reads its input tile plus a halo of 1 (one 3x3 or depthwise 3x3 convolution per pass; at
  the frame border the slice is clipped and the convolution's zero padding *is* the frame's),
  computes the layer, crops the halo and writes the tile into an output store;
* global statistics of a layer's *output* are summed while it is written (float64 per-group sums of
  ``x`` and ``x**2`` for the next GroupNorm) and finished with GroupNorm's formula before the next
  pass, which then applies them pointwise (:func:`~flowlift.models.mage_vae.group_norm_apply`);
* a DiCo block is two passes: the first only sums its branch ``a = gelu(dwconv(conv1(LN(x))))``
  over tiles (the gate needs the mean of ``a``, which needs every tile's halo, so it cannot ride on
  the pass that wrote ``x``); the second recomputes ``a`` (conv1 is ~1/10 of a block's work), gates
  it and runs the rest of the block;
* window attention passes use tiles whose sides are multiples of the 32-latent window and whose
  origins lie on the grid, so every tile holds whole windows; an edge tile ends at the frame edge
  and :func:`~flowlift.models.mage_vae.window_attention` replicate-pads it exactly as the frame;
* the decoder's per-pixel path (features, adaLN MLP, RMSNorm, fold) is independent per latent
  position and runs last, on its own smaller tiles, writing straight into the output image.

The result equals the whole-frame computation up to float summation order (tested at <= 1e-5
relative in float32; the statistics are exact sums in float64).

**The bound** (one sample at a time; ``C`` = 384, the frame at 1/16 is ``h x w``):
decode holds 3 stores ``(C, h, w)`` (the conditioning, needed again by the per-pixel path, and the
residual stream double-buffered: a pass reads its input's halo while writing its output), i.e.
``3 * C / 256 = 4.5`` values per output pixel, besides its input latent and output image, plus
one tile's working set (:func:`tile_working_bytes`). Encode holds two stores (768 + 384 channels
during the head blocks, 2 x 384 after) beside the image. Nothing else grows with the frame.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError
from flowlift.models.mage_passes import (
    GroupSums,
    Progress,
    Region,
    TileCallback,
    band_rows,
    crop,
    dico_run,
    run_pass,
    store_source,
    store_writer,
    tile_grid,
)
from flowlift.models.mage_vae import (
    MAGE_LATENT_CHANNELS,
    MAGE_PATCH,
    MageDecoder,
    MageEncoder,
    MageVAEConfig,
    ResnetBlock,
    WindowAttentionBlock,
    group_norm_apply,
    image_dtype,
    keeps_released_sums,
)

#: Positions per pixel tile where the per-pixel path runs the released float32 sums (:func:`keeps_released_sums`):
#: unfused, it makes a 96-wide adaLN output and four 32-wide tensors per block, 6 and 2 MB at 8x8 positions (16,384
#: pixels), which stay in the L3 cache; at 32x32 (100 MB) each pass goes to memory. On a 2-core AMD EPYC (Zen 3,
#: AVX2) 1.8x less CPU time for the per-pixel path, the same results bit for bit where both tilings' sub-tiles are
#: whole (docs/cpu.md, issue 47). The half dtypes' fused path measured slower on 8 (Zen 4, bf16) and keeps 32.
RELEASED_SUMS_PIXEL_TILE = 8


@dataclass(frozen=True)
class MageTiling:
    """Tile sides in codec positions (1 position = 16x16 pixels).

    ``tile``: the 1/16-resolution passes; a multiple of the attention window (32) so tiles hold whole
    windows. ``pixel_tile``: the per-pixel path, whose activations are 256 pixels x 32-96 features per
    position, so it takes smaller tiles. ``whole_tiles``: a frame of at most this many tiles' area
    (``whole_tiles * tile**2`` positions) runs each DiCo block whole-frame, its pointwise MLP half in
    full-width bands of at most ``tile**2`` positions (:func:`~flowlift.models.mage_passes.dico_whole`),
    and the decoder's 3x3 convolution passes whole-frame: no halo copies, no recomputed branch (a
    fifth of a block's work), for tensors of up to ``whole_tiles * C * tile**2`` values (the 3072x2048
    output of a 4x upscale of a 768x512 image is two 128-position tiles' area).
    """

    tile: int = 128
    pixel_tile: int = 32
    whole_tiles: int = 2

    def __post_init__(self) -> None:
        from flowlift.knobs import check_count, check_positive

        for name in ("tile", "pixel_tile"):  # 2.5 or True would size a tile grid of floats or of one position
            object.__setattr__(self, name, check_positive(name, getattr(self, name), integer=True))
        object.__setattr__(self, "whole_tiles", check_count("whole_tiles", self.whole_tiles))

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> MageTiling:
        """The default tiling for a codec in ``dtype``: float32 (and wider) on :data:`RELEASED_SUMS_PIXEL_TILE`
        positions per pixel tile, half dtypes on the default 32."""
        return cls(pixel_tile=RELEASED_SUMS_PIXEL_TILE) if keeps_released_sums(dtype) else cls()

    def dico_band(self, height: int, width: int) -> int | None:
        """Rows of the DiCo MLP bands of a (height, width) frame at 1/16 when it runs its DiCo blocks
        whole-frame (:attr:`whole_tiles`), else None (two tiled passes per block)."""
        if height * width > self.whole_tiles * self.tile**2:
            return None
        return band_rows((height, width), self.tile**2, self.pixel_tile)

    def conv_tile(self, height: int, width: int) -> int:
        """Tile side of the decoder's 3x3 convolution passes: the whole frame where :meth:`dico_band` runs
        the DiCo blocks whole-frame (no halo copies), else :attr:`tile`."""
        return self.tile if self.dico_band(height, width) is None else max(height, width, 1)

    def check(self, window: int = 1) -> None:
        """One line when :attr:`tile` is no multiple of the attention ``window`` (tiles must hold whole windows)."""
        if self.tile % window:
            raise FlowliftError(f"tile must be a multiple of the window {window}, got {self.tile}", field="tile")


def decode_tile_numel(config: MageVAEConfig, tiling: MageTiling) -> int:
    """Elements of the largest tensor one tile of the decode allocates (the frame's stores aside).

    ``max((t + 2)**2 * max(4C, 128), (t / d)**2 * d**4, p**2 * 256 * 3c)``: a haloed 1/16 tile through
    the DiCo MLP (or the latent's 128 channels), the softmax weights of a tile's ``(t / d)**2``
    attention windows of ``d**2`` positions each, and a pixel tile's adaLN output (shift, scale, gate
    of the ``c`` per-pixel features for each of its 256 pixels per position).
    """
    grown = (tiling.tile + 2) ** 2
    ffn = int(config.mlp_ratio * config.hidden)
    window = config.attention_window
    attention = (-(-tiling.tile // window)) ** 2 * window**4
    pixels = tiling.pixel_tile**2 * MAGE_PATCH**2 * 3 * config.pixel_width
    return max(grown * max(ffn, config.hidden, MAGE_LATENT_CHANNELS), attention, pixels)


def encode_tile_numel(config: MageVAEConfig, tiling: MageTiling) -> int:
    """Elements of the largest tensor one tile of the encode allocates (the stores aside).

    ``(t + 2)**2 * max(4 C_head, 4C, 3 * 256)``: the head blocks' MLP, or the haloed image tile.
    """
    widths = (int(config.mlp_ratio * config.encoder_head), int(config.mlp_ratio * config.hidden), 3 * MAGE_PATCH**2)
    return (tiling.tile + 2) ** 2 * max(widths)


# --------------------------------------------------------------------------------------------------
# Encoder
# --------------------------------------------------------------------------------------------------


def final_regions(height: int, width: int, tiling: MageTiling, blocks: int) -> list[Region]:
    """The regions a chain of ``blocks`` DiCo blocks writes its output in: tiles, or whole-frame bands."""
    band = tiling.dico_band(height, width)
    if band is None or not blocks:
        return tile_grid(height, width, tiling.tile)
    return [(r0, min(r0 + band, height), 0, width) for r0 in range(0, height, band)]


def dico_steps(height: int, width: int, tiling: MageTiling, blocks: int) -> int:
    """Tile steps of a chain of ``blocks`` DiCo blocks: two passes over the tiles per block, or (whole-frame)
    one for the branch and one per band; a chain of none copies its input, one step per tile."""
    if not blocks:
        return len(tile_grid(height, width, tiling.tile))
    if tiling.dico_band(height, width) is None:
        return 2 * blocks * len(tile_grid(height, width, tiling.tile))
    return blocks * (1 + len(final_regions(height, width, tiling, blocks)))


def encode_steps(encoder: MageEncoder, height: int, width: int, tiling: MageTiling) -> int:
    """Tile steps of one sample's tiled encode (:func:`dico_steps` of the head blocks, then of the blocks)."""
    return sum(dico_steps(height, width, tiling, len(b)) for b in (encoder.head_blocks, encoder.blocks))


def encode_tiled(
    encoder: MageEncoder, x: torch.Tensor, on_tile: TileCallback | None = None, *, tiling: MageTiling | None = None
) -> torch.Tensor:
    """Images [-1, 1] (B, 3, H, W), sides multiples of 16 -> posterior mean (B, 128, H/16, W/16).

    Equals ``encoder(x)``; the hook of :class:`flowlift.models.vae.MageVAE` (``tiled_encoder``).
    The patch embedding is recomputed from the image per tile (it is cheap and pointwise per patch),
    so the first store is the first head block's output.
    """
    tiling = tiling or MageTiling()
    tiling.check()
    b, _, height, width = x.shape
    h, w = height // MAGE_PATCH, width // MAGE_PATCH
    out = torch.empty(b, MAGE_LATENT_CHANNELS, h, w, device=x.device, dtype=x.dtype)
    progress = Progress(b * encode_steps(encoder, h, w, tiling), on_tile)
    kw = {"size": (h, w), "tile": tiling.tile, "progress": progress, "band": tiling.dico_band(h, w)}
    for i in range(b):
        image = x[i : i + 1]

        def new_store(channels: int) -> Callable[[], torch.Tensor]:
            return lambda: _store(x, channels, h, w)

        def patches(r: Region, image: torch.Tensor = image) -> torch.Tensor:
            p = MAGE_PATCH
            return encoder.patch_cond_embed(image[:, :, r[0] * p : r[1] * p, r[2] * p : r[3] * p])

        stem = new_store(encoder.proj_down.out_channels)()
        dico_run(
            encoder.head_blocks,
            patches,
            _writer(stem, encoder.project),
            new_store=new_store(encoder.patch_cond_embed.out_channels),
            **kw,
        )
        dico_run(
            encoder.blocks,
            store_source(stem),
            _writer(out[i : i + 1], encoder.head),
            new_store=new_store(stem.shape[1]),
            pool=[stem],
            reading=stem,
            **kw,
        )
    return out


def _store(like: torch.Tensor, channels: int, h: int, w: int) -> torch.Tensor:
    """A (1, channels, h, w) store in ``like``'s layout: channels-last when the input is (as
    :class:`~flowlift.models.vae.MageVAE` runs it), so tiles go in and out without transposing copies."""
    layout = torch.channels_last if like.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    return torch.empty(1, channels, h, w, device=like.device, dtype=like.dtype, memory_format=layout)


def _writer(store: torch.Tensor, pointwise: Callable[[torch.Tensor], torch.Tensor]):
    """Writes ``pointwise(y)`` of each tile into ``store``."""

    def write(r: Region, y: torch.Tensor) -> None:
        store[:, :, r[0] : r[1], r[2] : r[3]] = pointwise(y)

    return write


# --------------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------------


def sub_grid(region: Region, side: int) -> list[Region]:
    """Tiles of ``side`` inside ``region``, anchored at its origin, in frame coordinates."""
    r0, r1, c0, c1 = region
    return [(r0 + a, r0 + b, c0 + c, c0 + d) for a, b, c, d in tile_grid(r1 - r0, c1 - c0, side)]


def decode_steps(decoder: MageDecoder, height: int, width: int, tiling: MageTiling) -> int:
    """Tile steps of one sample's tiled decode: the 1/16 passes times their tiles, plus the pixel tiles."""
    cod = decoder.y_embedder.decoder
    convs = 2 + sum(2 for b in cod.block if isinstance(b, ResnetBlock))  # + conv_in, conv_out
    attention = sum(1 for b in cod.block if not isinstance(b, ResnetBlock))
    blocks = len(decoder.blocks)
    steps = convs * len(tile_grid(height, width, tiling.conv_tile(height, width)))
    steps += attention * len(tile_grid(height, width, tiling.tile)) + dico_steps(height, width, tiling, blocks)
    return steps + sum(len(sub_grid(r, tiling.pixel_tile)) for r in final_regions(height, width, tiling, blocks))


def decode_tiled(
    decoder: MageDecoder,
    z: torch.Tensor,
    on_tile: TileCallback | None = None,
    *,
    tiling: MageTiling | None = None,
    unit_range: bool = False,
) -> torch.Tensor:
    """Codec latents (B, 128, h, w) -> image (B, 3, 16h, 16w) in about [-1, 1], equal to ``decoder(z)``
    (``unit_range``: as ``(x + 1) / 2`` in float32, equal to ``decoder(z, unit_range=True)``).

    The hook of :class:`flowlift.models.vae.MageVAE` (``tiled_decoder``); one sample at a time, with
    three (C, h, w) stores: ``stream`` (the CoD residual stream, then a DiCo buffer), ``cond`` (the
    CoD ResNets' middles, then the conditioning the per-pixel path reads) and ``tokens`` (the first
    tokens, then the other DiCo buffer). The last DiCo block writes through the per-pixel path.
    """
    tiling = tiling or MageTiling()
    tiling.check(decoder.y_embedder.decoder.window)
    b, _, h, w = z.shape
    out = torch.empty(b, 3, h * MAGE_PATCH, w * MAGE_PATCH, device=z.device, dtype=image_dtype(z, unit_range))
    progress = Progress(b * decode_steps(decoder, h, w, tiling), on_tile)
    kw = {"size": (h, w), "tile": tiling.tile, "progress": progress}
    channels = decoder.s_embedder.proj2.out_channels
    for i in range(b):
        stream, cond, tokens = (_store(z, channels, h, w) for _ in range(3))
        _cod_passes(decoder, z[i : i + 1], stream, cond, tokens, conv_tile=tiling.conv_tile(h, w), **kw)
        pixels = _pixel_writer(decoder, cond, out[i : i + 1], tiling.pixel_tile, progress, unit_range)
        dico_run(
            decoder.blocks,
            store_source(tokens),
            pixels,
            new_store=_no_store,
            pool=[stream, tokens],
            reading=tokens,
            band=tiling.dico_band(h, w),
            **kw,
        )
    return out


def _no_store() -> torch.Tensor:
    raise AssertionError("Mage tiling: the decoder's DiCo chain has its two stores")


def _cod_passes(
    decoder: MageDecoder,
    z: torch.Tensor,
    a: torch.Tensor,
    spare: torch.Tensor,
    tokens: torch.Tensor,
    *,
    conv_tile: int,
    **kw,
) -> None:
    """The CoD decoder over tiles: the conditioning ends in ``spare``, ``tokens_in`` of it in ``tokens``.

    ``a`` holds the residual stream (attention blocks and ResNet skips update it in place, tile by
    tile, which is safe because those writes read only their own tile); each ResNet's middle goes to
    ``spare``. Every pass gathers the GroupNorm sums of what it writes, for the next pass. The
    convolution passes take tiles of ``conv_tile`` (the whole frame of a small one), the attention
    passes ``kw["tile"]``.
    """
    cod = decoder.y_embedder.decoder
    attention_kw, kw = kw, {**kw, "tile": conv_tile}
    sums = GroupSums(a.shape[1])
    run_pass(lambda x, inner, _: crop(cod.conv_in(x), inner), store_source(z), store_writer(a, sums), halo=1, **kw)
    for block in cod.block:
        stats, sums = sums.finish(a.device), GroupSums(a.shape[1])
        if isinstance(block, ResnetBlock):
            middle = GroupSums(a.shape[1])
            run_pass(
                _gn_conv(block.norm1, block.conv1, stats), store_source(a), store_writer(spare, middle), halo=1, **kw
            )
            second = _gn_conv(block.norm2, block.conv2, middle.finish(a.device))
            run_pass(_plus_skip(second, a), store_source(spare), store_writer(a, sums), halo=1, **kw)
        elif isinstance(block, WindowAttentionBlock):
            run_pass(_attention(block, stats), store_source(a), store_writer(a, sums), halo=0, **attention_kw)
        else:
            raise TypeError(f"Mage tiling: unexpected CoD block {type(block).__name__}")

    def write(r: Region, cond: torch.Tensor) -> None:
        spare[:, :, r[0] : r[1], r[2] : r[3]] = cond
        tokens[:, :, r[0] : r[1], r[2] : r[3]] = decoder.tokens_in(cond)

    run_pass(_gn_conv(cod.norm_out, cod.conv_out, sums.finish(a.device)), store_source(a), write, halo=1, **kw)


def _gn_conv(norm, conv, stats) -> Callable[[torch.Tensor, tuple[slice, slice], Region], torch.Tensor]:
    """``crop(conv(silu(GN(x))))`` with the frame's GroupNorm statistics ``stats``: a 3x3 conv, halo 1."""
    mean, inv_std = stats

    def layer(x: torch.Tensor, inner: tuple[slice, slice], _: Region) -> torch.Tensor:
        return crop(conv(F.silu(group_norm_apply(x, mean, inv_std, norm.weight, norm.bias), inplace=True)), inner)

    return layer


def _plus_skip(layer, store: torch.Tensor):
    """``store[tile] + layer(...)``: the ResNet skip, read at the tile just before it is overwritten."""

    def with_skip(x: torch.Tensor, inner: tuple[slice, slice], r: Region) -> torch.Tensor:
        return store[:, :, r[0] : r[1], r[2] : r[3]] + layer(x, inner, r)

    return with_skip


def _attention(block: WindowAttentionBlock, stats):
    """``x + block.attend(GN(x))`` (its four projections, folded into two in half dtypes) on a tile of whole
    windows (halo 0)."""
    mean, inv_std = stats

    def layer(x: torch.Tensor, inner: tuple[slice, slice], _: Region) -> torch.Tensor:
        return x + block.attend(group_norm_apply(x, mean, inv_std, block.norm.weight, block.norm.bias))

    return layer


def _pixel_writer(
    decoder: MageDecoder, cond: torch.Tensor, out: torch.Tensor, side: int, progress: Progress, unit_range: bool
):
    """The last DiCo block's output tiles -> the per-pixel path on sub-tiles of ``side`` -> ``out``."""
    p = MAGE_PATCH

    def write(region: Region, tokens: torch.Tensor) -> None:
        for r in sub_grid(region, side):
            dr, dc = r[0] - region[0], r[2] - region[2]
            decoder.pixels(
                cond[:, :, r[0] : r[1], r[2] : r[3]],
                tokens[:, :, dr : dr + r[1] - r[0], dc : dc + r[3] - r[2]],
                out[:, :, r[0] * p : r[1] * p, r[2] * p : r[3] * p],
                unit_range=unit_range,
            )
            progress.step()

    return write


__all__ = [
    "RELEASED_SUMS_PIXEL_TILE",
    "MageTiling",
    "decode_steps",
    "decode_tile_numel",
    "decode_tiled",
    "encode_steps",
    "encode_tile_numel",
    "encode_tiled",
    "tile_grid",
]

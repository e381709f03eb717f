"""TAEF2: the tiny autoencoder for the FLUX.2 latent space, with exact tiled encode/decode.

Architecture (madebyollin's released TAEF2, MIT; written here from its description):

* ``conv(a, b)``: 3x3 conv, padding 1, bias unless stated.
* ``Block(n)``: ``relu(conv(relu(conv(relu(conv(x))))) + x)`` with the convs at ``conv.0/2/4``. A
  *GN* block first adds ``pool(x)`` to ``x``, where ``pool`` = 1x1 conv n->4n (no bias),
  GroupNorm(4, 4n), ReLU, 1x1 conv 4n->n (no bias) at ``pool.0/1/3``.
* Encoder (indices 0..14): conv(3,64); Block; stride-2 conv; Block x3; stride-2 conv; Block x3;
  stride-2 conv; GN-Block x3; conv(64,32).
* Decoder (indices 0..19): ``tanh(x/3)*3``; conv(32,64); ReLU; GN-Block x3; Upsample; conv (no bias);
  Block x3; Upsample; conv; Block x3; Upsample; conv; Block; conv(64,3).

Images are float [0, 1]; the encoder's output already lives in the *normalized* FLUX.2 latent space;
the decoder output is approximately [0, 1] and is not clamped here.

Exact tiling
------------
The only non-local operations are the GroupNorms, all at latent resolution. The encoder's local
part (indices 0..10, image -> latent resolution) and the decoder's local part (indices 6..19, latent ->
image resolution) are plain 3x3 convolutions, stride-2 convolutions and nearest upsamplings, so an
output region depends on a finite input region that :func:`input_interval` computes layer by layer.
Tiled runs feed each tile exactly that region (cropping after every layer), so tiles are
bit-for-bit the full-frame computation up to float summation order; the latent-resolution part runs
on the whole frame. Decoding uses two tile levels: bands (latent -> 4x) and, inside each band, tiles
through the memory-dominant last stage (4x -> 8x).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

LATENT_CHANNELS = 32
WIDTH = 64
SPATIAL_FACTOR = 8

#: Default decode tiling, in latent pixels: bands through the 2x and 4x stages, tiles through the
#: 8x stage. A 64x64 tile is 512x512 output pixels (64 channels: ~70 MB per fp32 activation).
DEFAULT_DECODE_BAND = 128
DEFAULT_DECODE_TILE = 64
#: Default encode tiling, in latent pixels: bands through the 1/2..1/8 stages, tiles through the
#: full-resolution stem (conv, Block, stride-2 conv).
DEFAULT_ENCODE_BAND = 256
DEFAULT_ENCODE_TILE = 64


def _conv(n_in: int, n_out: int, *, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(n_in, n_out, 3, stride=stride, padding=1, bias=bias)


class Clamp(nn.Module):
    """Soft clamp ``tanh(x / 3) * 3`` (decoder index 0, no weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class Block(nn.Module):
    """``relu(conv(x') + x')`` with ``x' = x + pool(x)`` for GN blocks, ``x' = x`` otherwise."""

    def __init__(self, n: int, use_gn: bool = False) -> None:
        super().__init__()
        self.conv = nn.Sequential(
            _conv(n, n), nn.ReLU(inplace=True), _conv(n, n), nn.ReLU(inplace=True), _conv(n, n)
        )
        self.pool: nn.Sequential | None = None
        if use_gn:
            self.pool = nn.Sequential(
                nn.Conv2d(n, 4 * n, 1, bias=False),
                nn.GroupNorm(4, 4 * n),
                nn.ReLU(inplace=True),
                nn.Conv2d(4 * n, n, 1, bias=False),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool is not None:
            x = x + self.pool(x)
        y = self.conv(x)
        y += x
        return torch.relu_(y)


def build_encoder() -> nn.Sequential:
    """The TAEF2 encoder as a Sequential whose indices are the released state-dict keys."""
    n = WIDTH
    return nn.Sequential(
        _conv(3, n), Block(n),
        _conv(n, n, stride=2, bias=False), Block(n), Block(n), Block(n),
        _conv(n, n, stride=2, bias=False), Block(n), Block(n), Block(n),
        _conv(n, n, stride=2, bias=False), Block(n, True), Block(n, True), Block(n, True),
        _conv(n, LATENT_CHANNELS),
    )  # fmt: skip


def build_decoder() -> nn.Sequential:
    """The TAEF2 decoder as a Sequential whose indices are the released state-dict keys."""
    n = WIDTH
    return nn.Sequential(
        Clamp(), _conv(LATENT_CHANNELS, n), nn.ReLU(inplace=True),
        Block(n, True), Block(n, True), Block(n, True),
        nn.Upsample(scale_factor=2), _conv(n, n, bias=False), Block(n), Block(n), Block(n),
        nn.Upsample(scale_factor=2), _conv(n, n, bias=False), Block(n), Block(n), Block(n),
        nn.Upsample(scale_factor=2), _conv(n, n, bias=False), Block(n),
        _conv(n, 3),
    )  # fmt: skip


# Encoder: indices [0, 11) are local (image -> latent resolution); [11, 15) run on the whole frame.
ENCODER_LOCAL_END = 11
# ... of which [0, 3) is the full-resolution stem (the tiled part of the inner level).
ENCODER_STEM_END = 3
# Decoder: [0, 6) run on the whole frame at latent resolution; [6, 20) are local.
DECODER_LOCAL_START = 6
# ... of which [16, 20) is the last, 8x stage (the inner tile level).
DECODER_LAST_STAGE_START = 16


# --------------------------------------------------------------------------------------------------
# Region maths (pure functions)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalOp:
    """One spatially local layer: ``kind`` is ``"same"`` (stride-1 convs of total ``radius``),
    ``"down"`` (3x3 conv, stride 2, padding 1) or ``"up"`` (nearest 2x)."""

    kind: str
    radius: int = 0


def output_size(op: LocalOp, n_in: int) -> int:
    """Length of an axis after ``op``: same ``n``, down ``floor((n - 1) / 2) + 1``, up ``2n``."""
    if op.kind == "same":
        return n_in
    if op.kind == "down":
        return (n_in - 1) // 2 + 1
    if op.kind == "up":
        return 2 * n_in
    raise ValueError(f"unknown op kind {op.kind!r}")


def input_interval(op: LocalOp, a: int, b: int, n_in: int) -> tuple[int, int]:
    """Input rows ``[c, d)`` whose exact values make output rows ``[a, b)`` exact.

    * same, radius r: ``[a - r, b + r)`` — each 3x3 conv reads one row either side;
    * down: ``[2a - 2, 2b)`` — output ``j`` reads ``2j-1 .. 2j+1``; ``c`` is kept even so the tile's
      stride phase equals the full frame's (row ``2a - 2`` is then only padding for row ``a``);
    * up: ``[floor(a / 2), ceil(b / 2))``.

    Clipped to ``[0, n_in)``: at the frame border the tile's zero padding is the frame's padding.
    """
    if op.kind == "same":
        c, d = a - op.radius, b + op.radius
    elif op.kind == "down":
        c, d = 2 * a - 2, 2 * b
    elif op.kind == "up":
        c, d = a // 2, -(-b // 2)
    else:
        raise ValueError(f"unknown op kind {op.kind!r}")
    return max(c, 0), min(d, n_in)


def produced_interval(op: LocalOp, c: int, d: int) -> tuple[int, int]:
    """Rows an op yields (in output coordinates) when run on input rows ``[c, d)`` (c even for down)."""
    if op.kind == "same":
        return c, d
    if op.kind == "down":
        return c // 2, c // 2 + (d - c - 1) // 2 + 1
    if op.kind == "up":
        return 2 * c, 2 * d
    raise ValueError(f"unknown op kind {op.kind!r}")


def chain_intervals(ops: Sequence[LocalOp], a: int, b: int, n_in: int) -> list[tuple[int, int]]:
    """Needed intervals before each op and after the last: ``result[0]`` is the chain's input
    interval, ``result[-1] == (a, b)`` the requested output interval."""
    sizes = [n_in]
    for op in ops:
        sizes.append(output_size(op, sizes[-1]))
    intervals = [(a, b)]
    for op, n in zip(reversed(ops), reversed(sizes[:-1]), strict=True):
        intervals.append(input_interval(op, *intervals[-1], n))
    return intervals[::-1]


def split_axis(n: int, tile: int) -> list[tuple[int, int]]:
    """Split ``[0, n)`` into consecutive intervals of at most ``tile`` (near-equal lengths)."""
    if tile < 1:
        raise ValueError(f"tile size must be >= 1, got {tile}")
    count = max(1, math.ceil(n / tile))
    bounds = [round(i * n / count) for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(count)]


# --------------------------------------------------------------------------------------------------
# Tiled execution
# --------------------------------------------------------------------------------------------------

Provider = Callable[[int, int, int, int], torch.Tensor]


def run_region(
    layers: Sequence[nn.Module],
    ops: Sequence[LocalOp],
    provider: Provider,
    in_size: tuple[int, int],
    out_box: tuple[int, int, int, int],
) -> torch.Tensor:
    """Exact output of ``layers`` on the box ``(y0, y1, x0, x1)`` of its output frame.

    ``provider(y0, y1, x0, x1)`` returns the chain's *input* on a box of the input frame (of size
    ``in_size``). Needed regions are computed per axis by :func:`chain_intervals` and every layer's
    output is cropped to what the rest of the chain needs.
    """
    y0, y1, x0, x1 = out_box
    rows = chain_intervals(ops, y0, y1, in_size[0])
    cols = chain_intervals(ops, x0, x1, in_size[1])
    x = provider(rows[0][0], rows[0][1], cols[0][0], cols[0][1])
    for i, (layer, op) in enumerate(zip(layers, ops, strict=True)):
        x = layer(x)
        pr = produced_interval(op, *rows[i])
        pc = produced_interval(op, *cols[i])
        (r0, r1), (c0, c1) = rows[i + 1], cols[i + 1]
        if (pr, pc) != ((r0, r1), (c0, c1)):
            x = x[:, :, r0 - pr[0] : r1 - pr[0], c0 - pc[0] : c1 - pc[0]]
    return x


def _chain_out_size(ops: Sequence[LocalOp], size: tuple[int, int]) -> tuple[int, int]:
    h, w = size
    for op in ops:
        h, w = output_size(op, h), output_size(op, w)
    return h, w


def _tensor_provider(x: torch.Tensor, origin: tuple[int, int] = (0, 0)) -> Provider:
    oy, ox = origin

    def provide(y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        return x[:, :, y0 - oy : y1 - oy, x0 - ox : x1 - ox]

    return provide


def run_two_level(
    first_layers: Sequence[nn.Module],
    first_ops: Sequence[LocalOp],
    second_layers: Sequence[nn.Module],
    second_ops: Sequence[LocalOp],
    x: torch.Tensor,
    *,
    band: int,
    band_unit: int,
    tile: int,
    tile_unit: int,
    tile_first: bool,
) -> torch.Tensor:
    """Run the chain ``first`` then ``second`` over the whole of ``x`` in bands and tiles, exactly.

    The output frame is split into bands of at most ``band x band`` units of ``band_unit`` pixels.
    For each band the needed *mid* region (output of ``first``, input of ``second``) is found with
    :func:`chain_intervals`. With ``tile_first=False`` (decoding: cheap stages first) ``first`` runs
    once on the band's mid region and ``second`` in tiles of ``tile x tile`` units of ``tile_unit``
    output pixels; with ``tile_first=True`` (encoding: the expensive full-resolution stem first)
    ``first`` produces the mid region in such tiles and ``second`` runs once on the band. Every
    layer computes only its band/tile plus the halo the rest of the chain needs.
    """
    in_size = (x.shape[-2], x.shape[-1])
    mid_size = _chain_out_size(first_ops, in_size)
    out_h, out_w = _chain_out_size(second_ops, mid_size)
    out: torch.Tensor | None = None
    for by0, by1 in split_axis(-(-out_h // band_unit), band):
        for bx0, bx1 in split_axis(-(-out_w // band_unit), band):
            box = (by0 * band_unit, min(by1 * band_unit, out_h), bx0 * band_unit, min(bx1 * band_unit, out_w))
            rows = chain_intervals(second_ops, box[0], box[1], mid_size[0])[0]
            cols = chain_intervals(second_ops, box[2], box[3], mid_size[1])[0]
            mid_box = (rows[0], rows[1], cols[0], cols[1])
            if tile_first:
                mid = _assemble(
                    first_layers, first_ops, _tensor_provider(x), in_size, mid_box, tile, tile_unit
                )
                piece = run_region(
                    second_layers, second_ops, _tensor_provider(mid, (rows[0], cols[0])), mid_size, box
                )
            else:
                mid = run_region(first_layers, first_ops, _tensor_provider(x), in_size, mid_box)
                piece = _assemble(
                    second_layers,
                    second_ops,
                    _tensor_provider(mid, (rows[0], cols[0])),
                    mid_size,
                    box,
                    tile,
                    tile_unit,
                )
            del mid
            if out is None:
                out = piece.new_empty((x.shape[0], piece.shape[1], out_h, out_w))
            out[:, :, box[0] : box[1], box[2] : box[3]] = piece
            del piece
    assert out is not None
    return out


def _assemble(
    layers: Sequence[nn.Module],
    ops: Sequence[LocalOp],
    provider: Provider,
    in_size: tuple[int, int],
    box: tuple[int, int, int, int],
    tile: int,
    unit: int,
) -> torch.Tensor:
    """Output of the chain on ``box``, computed in tiles of at most ``tile`` units of ``unit`` pixels."""
    y0, y1, x0, x1 = box
    out = None
    for ty0, ty1 in _split_px(y1 - y0, tile, unit):
        for tx0, tx1 in _split_px(x1 - x0, tile, unit):
            piece = run_region(layers, ops, provider, in_size, (y0 + ty0, y0 + ty1, x0 + tx0, x0 + tx1))
            if out is None:
                out = piece.new_empty((piece.shape[0], piece.shape[1], y1 - y0, x1 - x0))
            out[:, :, ty0:ty1, tx0:tx1] = piece
    assert out is not None
    return out


def _split_px(n: int, tile: int, unit: int) -> list[tuple[int, int]]:
    """:func:`split_axis` of ``n`` pixels into tiles of at most ``tile`` units of ``unit`` pixels."""
    return [(a * unit, min(b * unit, n)) for a, b in split_axis(-(-n // unit), tile)]


def local_op(layer: nn.Module) -> LocalOp:
    """The :class:`LocalOp` of one TAEF2 layer outside the GroupNorm blocks."""
    if isinstance(layer, nn.Conv2d):
        if layer.kernel_size == (1, 1):
            return LocalOp("same", 0)
        if layer.kernel_size != (3, 3) or layer.padding != (1, 1):
            raise ValueError(f"unsupported conv {layer}")
        return LocalOp("down" if layer.stride == (2, 2) else "same", 0 if layer.stride == (2, 2) else 1)
    if isinstance(layer, Block):
        if layer.pool is not None:
            raise ValueError("GroupNorm blocks are not spatially local")
        return LocalOp("same", 3)
    if isinstance(layer, nn.Upsample):
        return LocalOp("up")
    if isinstance(layer, (nn.ReLU, Clamp)):
        return LocalOp("same", 0)
    raise ValueError(f"no local op for {type(layer).__name__}")


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class TAEF2(nn.Module):
    """TAEF2 encoder and/or decoder; state-dict keys ``encoder.{i}.*`` / ``decoder.{i}.*`` where
    ``i`` is the released Sequential index."""

    def __init__(self, encoder: bool = True, decoder: bool = True) -> None:
        super().__init__()
        if not (encoder or decoder):
            raise ValueError("TAEF2 needs an encoder, a decoder or both")
        self.encoder = build_encoder() if encoder else None
        self.decoder = build_decoder() if decoder else None

    # Full frame -------------------------------------------------------------------------------
    def encode_full(self, images: torch.Tensor) -> torch.Tensor:
        """Images [0, 1] (B, 3, H, W) -> latents (B, 32, H/8, W/8) in one pass."""
        return self._need(self.encoder, "encoder")(images)

    def decode_full(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, 32, h, w) -> images (B, 3, 8h, 8w), unclamped, in one pass."""
        return self._need(self.decoder, "decoder")(latents)

    # Tiled -------------------------------------------------------------------------------------
    def encode_tiled(
        self, images: torch.Tensor, *, band: int = DEFAULT_ENCODE_BAND, tile: int = DEFAULT_ENCODE_TILE
    ) -> torch.Tensor:
        """:meth:`encode_full` with bounded memory, equal up to float summation order.

        Per image: the full-resolution stem (indices 0..2) in tiles of ``tile x tile`` latent pixels,
        the rest of the local part (3..10) in bands of ``band x band`` latent pixels, then the
        GroupNorm blocks and the output conv (11..14) on the whole latent frame.
        """
        enc = self._need(self.encoder, "encoder")
        stem, rest = list(enc[:ENCODER_STEM_END]), list(enc[ENCODER_STEM_END:ENCODER_LOCAL_END])
        outs = []
        for image in images.split(1):
            x = run_two_level(
                stem, [local_op(m) for m in stem], rest, [local_op(m) for m in rest], image,
                band=band, band_unit=1, tile=tile, tile_unit=4, tile_first=True,
            )  # fmt: skip
            outs.append(enc[ENCODER_LOCAL_END:](x))
        return torch.cat(outs)

    def decode_tiled(
        self, latents: torch.Tensor, *, band: int = DEFAULT_DECODE_BAND, tile: int = DEFAULT_DECODE_TILE
    ) -> torch.Tensor:
        """:meth:`decode_full` with bounded memory, equal up to float summation order.

        Per latent: the latent-resolution part (indices 0..5, with the GroupNorms) on the whole
        frame, the 2x and 4x stages (6..15) in bands of ``band x band`` latent pixels, and the 8x
        stage (16..19) in tiles of ``tile x tile`` latent pixels inside each band.
        """
        dec = self._need(self.decoder, "decoder")
        mid = list(dec[DECODER_LOCAL_START:DECODER_LAST_STAGE_START])
        last = list(dec[DECODER_LAST_STAGE_START:])
        outs = []
        for latent in latents.split(1):
            h = dec[:DECODER_LOCAL_START](latent)
            outs.append(
                run_two_level(
                    mid,
                    [local_op(m) for m in mid],
                    last,
                    [local_op(m) for m in last],
                    h,
                    band=band,
                    band_unit=SPATIAL_FACTOR,
                    tile=tile,
                    tile_unit=SPATIAL_FACTOR,
                    tile_first=False,
                )  # fmt: skip
            )
            del h
        return torch.cat(outs)

    @staticmethod
    def _need(part: nn.Module | None, name: str) -> nn.Module:
        if part is None:
            from flowlift.errors import FlowliftError

            raise FlowliftError(f"this TAEF2 has no {name} (only the other half was loaded)")
        return part


# --------------------------------------------------------------------------------------------------
# State-dict layouts
# --------------------------------------------------------------------------------------------------


def _index_keys(state: Mapping[str, torch.Tensor]) -> set[int]:
    return {int(k.split(".", 1)[0]) for k in state if k.split(".", 1)[0].isdigit()}


def detect_layout(state: Mapping[str, torch.Tensor]) -> str:
    """Name the layout of a TAEF2 state dict from its keys.

    * ``"encoder"`` / ``"decoder"``: one released ``.pth`` (keys ``{i}.*``; the encoder has index 0
      with 3 input channels, the decoder starts at index 1 because its clamp has no weights);
    * ``"diffusers"``: ``encoder.layers.{i}.*`` and/or ``decoder.layers.{i-1}.*``;
    * ``"flowlift"``: this module's own ``encoder.{i}.*`` / ``decoder.{i}.*``;
    * ``"unknown"`` otherwise.
    """
    keys = list(state)
    if not keys:
        return "unknown"
    if all(k.startswith(("encoder.layers.", "decoder.layers.")) for k in keys):
        return "diffusers"
    if all(k.split(".", 1)[0] in ("encoder", "decoder") and k.split(".")[1].isdigit() for k in keys):
        return "flowlift"
    if all(k.split(".", 1)[0].isdigit() for k in keys):
        indices = _index_keys(state)
        first = state.get("0.weight")
        if 0 in indices and first is not None and first.ndim == 4 and first.shape[1] == 3:
            return "encoder"
        if 0 not in indices and "1.weight" in state and state["1.weight"].shape[1] == LATENT_CHANNELS:
            return "decoder"
    return "unknown"


def to_flowlift_layout(state: Mapping[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Rename a state dict of the given :func:`detect_layout` layout to ``encoder.{i}`` / ``decoder.{i}``.

    The diffusers layout's decoder index is the Sequential index minus one (``decoder.layers.{j}`` ->
    ``decoder.{j+1}``).
    """
    if layout in ("encoder", "decoder"):
        return {f"{layout}.{k}": v for k, v in state.items()}
    if layout == "flowlift":
        return dict(state)
    if layout == "diffusers":
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            part, _, index, rest = key.split(".", 3)
            i = int(index) + (1 if part == "decoder" else 0)
            out[f"{part}.{i}.{rest}"] = value
        return out
    raise ValueError(f"unknown TAEF2 layout {layout!r}")

"""Exact tiling of a chain of spatially local layers (3x3 convs, stride-2 convs, nearest 2x upsamplings).

:func:`chain_intervals` finds the input region an output region depends on, layer by layer;
:func:`run_region` and :func:`run_two_level` run a chain on bands and tiles fed exactly those regions,
so the result equals the full-frame computation up to float summation order. TAEF2's tiled
encode/decode (:class:`flowlift.models.taef2.TAEF2`) is built on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

#: Surplus (fraction of the needed size) a tile may carry between resampling ops before it is cropped.
CROP_SLACK = 0.125


# --------------------------------------------------------------------------------------------------
# Region maths (pure functions)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalOp:
    """One spatially local layer: ``kind`` is ``"same"`` (stride-1 convs of total ``radius``),
    ``"down"`` (3x3 conv, stride 2, padding 1), ``"up"`` (nearest 2x) or ``"upconv"`` (nearest 2x, then
    a 3x3 conv with padding 1, as one layer)."""

    kind: str
    radius: int = 0


def output_size(op: LocalOp, n_in: int) -> int:
    """Length of an axis after ``op``: same ``n``, down ``floor((n - 1) / 2) + 1``, up and upconv ``2n``."""
    if op.kind == "same":
        return n_in
    if op.kind == "down":
        return (n_in - 1) // 2 + 1
    if op.kind in ("up", "upconv"):
        return 2 * n_in
    raise ValueError(f"unknown op kind {op.kind!r}")


def input_interval(op: LocalOp, a: int, b: int, n_in: int) -> tuple[int, int]:
    """Input rows ``[c, d)`` whose exact values make output rows ``[a, b)`` exact.

    * same, radius r: ``[a - r, b + r)`` — each 3x3 conv reads one row either side;
    * down: ``[2a - 2, 2b)`` — output ``j`` reads ``2j-1 .. 2j+1``; ``c`` is kept even so the tile's
      stride phase equals the full frame's (row ``2a - 2`` is then only padding for row ``a``);
    * up: ``[floor(a / 2), ceil(b / 2))``;
    * upconv: the conv's rows ``[a - 1, b + 1)`` (clipped to the ``2 n_in`` upsampled rows), then up.

    Clipped to ``[0, n_in)``: at the frame border the tile's zero padding is the frame's padding.
    """
    if op.kind == "same":
        c, d = a - op.radius, b + op.radius
    elif op.kind == "down":
        c, d = 2 * a - 2, 2 * b
    elif op.kind == "up":
        c, d = a // 2, -(-b // 2)
    elif op.kind == "upconv":
        c, d = max(a - 1, 0) // 2, -(-min(b + 1, 2 * n_in) // 2)
    else:
        raise ValueError(f"unknown op kind {op.kind!r}")
    return max(c, 0), min(d, n_in)


def produced_interval(op: LocalOp, c: int, d: int) -> tuple[int, int]:
    """Rows an op yields (in output coordinates) when run on input rows ``[c, d)`` (c even for down)."""
    if op.kind == "same":
        return c, d
    if op.kind == "down":
        return c // 2, c // 2 + (d - c - 1) // 2 + 1
    if op.kind in ("up", "upconv"):
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
#: ``on_tile(done, total)``: progress after each finished tile.
TileCallback = Callable[[int, int], None]


def run_region(
    layers: Sequence[nn.Module],
    ops: Sequence[LocalOp],
    provider: Provider,
    in_size: tuple[int, int],
    out_box: tuple[int, int, int, int],
    *,
    slack: float = CROP_SLACK,
) -> torch.Tensor:
    """Exact output of ``layers`` on the box ``(y0, y1, x0, x1)`` of its output frame.

    ``provider(y0, y1, x0, x1)`` returns the chain's *input* on a box of the input frame (of size
    ``in_size``). Needed regions are computed per axis by :func:`chain_intervals`. A layer's output
    is cropped to what the rest of the chain needs before every resampling op, at the end, and
    whenever the surplus exceeds ``slack`` of the needed size; in between, a few surplus rows cost
    less than copying the activation. Surplus rows never reach the needed ones: each layer's needed
    output depends only on its needed input.
    """
    y0, y1, x0, x1 = out_box
    rows = chain_intervals(ops, y0, y1, in_size[0])
    cols = chain_intervals(ops, x0, x1, in_size[1])
    have_r, have_c = rows[0], cols[0]
    x = provider(have_r[0], have_r[1], have_c[0], have_c[1])
    last = len(ops) - 1
    for i, (layer, op) in enumerate(zip(layers, ops, strict=True)):
        x = call_layer(layer, x, owned=i > 0)  # after the first, the chain's own tensors: a layer may write over them
        have_r, have_c = produced_interval(op, *have_r), produced_interval(op, *have_c)
        need_r, need_c = rows[i + 1], cols[i + 1]
        if (have_r, have_c) == (need_r, need_c):
            continue
        surplus = max(
            (have_r[1] - have_r[0]) / (need_r[1] - need_r[0]),
            (have_c[1] - have_c[0]) / (need_c[1] - need_c[0]),
        )
        if i == last or ops[i + 1].kind != "same" or surplus > 1 + slack:
            x = x[
                :,
                :,
                need_r[0] - have_r[0] : need_r[1] - have_r[0],
                need_c[0] - have_c[0] : need_c[1] - have_c[0],
            ]
            have_r, have_c = need_r, need_c
    return x


def call_layer(layer: nn.Module, x: torch.Tensor, *, owned: bool) -> torch.Tensor:
    """``layer(x)``, or ``layer.consume(x)`` where the layer has one and ``owned`` (no one reads ``x`` after:
    the layer may write its result over it)."""
    consume = getattr(layer, "consume", None) if owned else None
    return layer(x) if consume is None else consume(x)


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
    on_tile: TileCallback | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the chain ``first`` then ``second`` over the whole of ``x`` in bands and tiles, exactly.

    The output frame is split into bands of at most ``band x band`` units of ``band_unit`` pixels.
    For each band the needed *mid* region (output of ``first``, input of ``second``) is found with
    :func:`chain_intervals`. With ``tile_first=False`` (decoding: cheap stages first) ``first`` runs
    once on the band's mid region and ``second`` in tiles of ``tile x tile`` units of ``tile_unit``
    output pixels; with ``tile_first=True`` (encoding: the expensive full-resolution stem first)
    ``first`` produces the mid region in such tiles and ``second`` runs once on the band. Every
    layer computes only its band/tile plus the halo the rest of the chain needs.

    ``on_tile(done, total)`` is called after every tile (progress; it sees nothing of the data, so the
    result is the same with or without it, and an exception it raises stops the run between tiles).

    ``out``: a buffer of the result's shape to write each band into (in its own dtype: the caller's float32 frame,
    so a half-precision frame never exists beside it); None allocates one in the bands' dtype and layout.
    """
    in_size = (x.shape[-2], x.shape[-1])
    mid_size = _chain_out_size(first_ops, in_size)
    out_h, out_w = _chain_out_size(second_ops, mid_size)
    bands = []
    for by0, by1 in split_axis(-(-out_h // band_unit), band):
        for bx0, bx1 in split_axis(-(-out_w // band_unit), band):
            box = (by0 * band_unit, min(by1 * band_unit, out_h), bx0 * band_unit, min(bx1 * band_unit, out_w))
            rows = chain_intervals(second_ops, box[0], box[1], mid_size[0])[0]
            cols = chain_intervals(second_ops, box[2], box[3], mid_size[1])[0]
            bands.append((box, (rows[0], rows[1], cols[0], cols[1])))
    tiled_box = 1 if tile_first else 0  # the region _assemble splits into tiles: mid (encode) or band (decode)
    counter = _TileCounter(sum(_tile_count(b[tiled_box], tile, tile_unit) for b in bands), on_tile)
    for box, mid_box in bands:
        origin = (mid_box[0], mid_box[2])
        if tile_first:
            mid = _assemble(first_layers, first_ops, _tensor_provider(x), in_size, mid_box, tile, tile_unit, counter)
            piece = run_region(second_layers, second_ops, _tensor_provider(mid, origin), mid_size, box)
        else:
            mid = run_region(first_layers, first_ops, _tensor_provider(x), in_size, mid_box)
            piece = _assemble(
                second_layers, second_ops, _tensor_provider(mid, origin), mid_size, box, tile, tile_unit, counter
            )
        del mid
        if out is None:
            out = _empty_like_layout(piece, (x.shape[0], piece.shape[1], out_h, out_w))
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
    counter: _TileCounter | None = None,
) -> torch.Tensor:
    """Output of the chain on ``box``, computed in tiles of at most ``tile`` units of ``unit`` pixels."""
    y0, y1, x0, x1 = box
    out = None
    for ty0, ty1 in _split_px(y1 - y0, tile, unit):
        for tx0, tx1 in _split_px(x1 - x0, tile, unit):
            piece = run_region(layers, ops, provider, in_size, (y0 + ty0, y0 + ty1, x0 + tx0, x0 + tx1))
            if out is None:
                out = _empty_like_layout(piece, (piece.shape[0], piece.shape[1], y1 - y0, x1 - x0))
            out[:, :, ty0:ty1, tx0:tx1] = piece
            if counter is not None:
                counter.tick()
    assert out is not None
    return out


def _tile_count(box: tuple[int, int, int, int], tile: int, unit: int) -> int:
    """How many tiles :func:`_assemble` splits ``box`` into."""
    y0, y1, x0, x1 = box
    return len(_split_px(y1 - y0, tile, unit)) * len(_split_px(x1 - x0, tile, unit))


class _TileCounter:
    """Counts finished tiles and reports ``(done, total)`` to an optional callback."""

    def __init__(self, total: int, on_tile: TileCallback | None) -> None:
        self.done, self.total, self.on_tile = 0, total, on_tile

    def tick(self) -> None:
        self.done += 1
        if self.on_tile is not None:
            self.on_tile(self.done, self.total)


def _split_px(n: int, tile: int, unit: int) -> list[tuple[int, int]]:
    """:func:`split_axis` of ``n`` pixels into tiles of at most ``tile`` units of ``unit`` pixels."""
    return [(a * unit, min(b * unit, n)) for a, b in split_axis(-(-n // unit), tile)]


def _empty_like_layout(piece: torch.Tensor, shape: tuple[int, int, int, int]) -> torch.Tensor:
    """An empty buffer of ``shape`` in ``piece``'s memory format (channels-last stays channels-last,
    so assembling tiles does not transpose them and the next convolution needs no reorder)."""
    channels_last = piece.shape[1] > 1 and piece.stride(1) == 1  # also true for cropped views
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return torch.empty(shape, dtype=piece.dtype, device=piece.device, memory_format=fmt)

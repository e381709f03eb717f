"""Tiled refine: the three knobs, their domains, and where the tiles of a frame go. Pure Python, no torch.

A frame larger than FLUX.2's specified maximum (4 megapixels, e.g. 2048x2048; the same for Klein) is refined in
overlapping tiles: :class:`~flowlift.refine.tiled_velocity.TiledVelocity` runs the transformer on each tile with
tile-local position ids and blends the velocities. This module holds what a front-end needs before any weights
load (a command's help imports no torch):

* the knobs' checks: ``tile_size`` (px, ``"auto"`` or ``"off"``; default ``auto``), ``tile_overlap`` (px,
  default 128), ``tile_batch`` (tiles per transformer call, ``"auto"`` or a count) are declared once in
  :mod:`flowlift.refine.settings` (:data:`~flowlift.refine.settings.TILE_KNOBS`, in ``REFINE_KNOBS``);
  :func:`parse_tile_size` / :func:`parse_tile_overlap` / :func:`parse_tile_batch` run the knob's check on a value
  given as text or as a Python value, then the 16-px grid rule;
* the 4 MP rule (:func:`exceeds_untiled_limit`) and :func:`resolve_tile_size`, what ``auto`` means for a frame;
* the layout (:func:`tile_starts`, :func:`tile_layout`): tiles of one size, starts on the 16-pixel grid of the
  2x2-patchified latent, spread evenly so that neighbours overlap by at least ``tile_overlap``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.limits import PIXEL_MULTIPLE
from flowlift.refine.settings import (
    DEFAULT_TILE_SIZE,
    MAX_UNTILED_PIXELS,
    TILE_BATCH,
    TILE_OVERLAP,
    TILE_SIZE,
)


def parse_tile_size(value: int | str) -> int | str:
    """``"auto"``, ``"off"``, or a tile side in pixels, given as text or a Python value: :data:`TILE_SIZE`'s check
    (its range and 16-px grid)."""
    return TILE_SIZE.check(value, loose=True)


def parse_tile_overlap(value: int | str) -> int:
    """An overlap in pixels, given as text or a Python value: :data:`TILE_OVERLAP`'s check, its range and 16-px
    grid (less than the tile: :func:`check_overlap`)."""
    return TILE_OVERLAP.check(value, loose=True)


def parse_tile_batch(value: int | str) -> int | str:
    """``"auto"`` or the number of tiles per transformer call (1 or more), given as text or a Python value:
    :data:`TILE_BATCH`'s check."""
    return TILE_BATCH.check(value, loose=True)


def check_overlap(tile: int, overlap: int) -> None:
    """Neighbours must advance: ``overlap < tile`` (one line otherwise, naming ``tile_overlap``; at the default
    overlap, the tile size the caller set is blamed, and the overlap said to be the default)."""
    if overlap >= tile and overlap == TILE_OVERLAP.default:
        raise FlowliftError(
            f"{FIELD_MARK} {tile} px must be larger than the tile overlap ({FIELD_MARK}, {overlap} px by default); "
            f"give a {FIELD_MARK} above {overlap} or a smaller {FIELD_MARK}",
            field=("tile_size", "tile_overlap", "tile_size", "tile_overlap"),
        )
    if overlap >= tile:
        raise FlowliftError(
            f"tile_overlap {overlap} px must be smaller than the tile ({tile} px); give a smaller tile overlap",
            field="tile_overlap",
        )


@dataclass(frozen=True)
class TileRequest:
    """The three knobs: ``size`` (px, ``auto`` or ``off``), ``overlap`` (px), ``batch`` (count or auto), each
    checked by its knob when the request is made (a Python value: ``512``, not ``"512"``; :meth:`parse` takes text),
    and the overlap against the tile (``auto``'s is 1024 px)."""

    size: int | str = TILE_SIZE.default
    overlap: int = TILE_OVERLAP.default
    batch: int | str = TILE_BATCH.default

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", TILE_SIZE.check(self.size))
        object.__setattr__(self, "overlap", TILE_OVERLAP.check(self.overlap))
        object.__setattr__(self, "batch", TILE_BATCH.check(self.batch))
        if self.size != "off":
            check_overlap(self.size if isinstance(self.size, int) else DEFAULT_TILE_SIZE, self.overlap)

    @classmethod
    def parse(
        cls,
        size: int | str = TILE_SIZE.default,
        overlap: int | str = TILE_OVERLAP.default,
        batch: int | str = TILE_BATCH.default,
    ) -> TileRequest:
        """The request of knobs given as text or Python values (the text doors: ``"512"``, ``" auto"``)."""
        return cls(parse_tile_size(size), parse_tile_overlap(overlap), parse_tile_batch(batch))

    def replace(self, size=None, overlap=None, batch=None) -> TileRequest:
        """This request with the knobs given (not None) replaced, checked again."""
        return TileRequest.parse(
            self.size if size is None else size,
            self.overlap if overlap is None else overlap,
            self.batch if batch is None else batch,
        )


def exceeds_untiled_limit(height: int, width: int) -> bool:
    """True when a ``height x width`` px frame is above FLUX.2's 4 MP: ``height * width > 2048 * 2048``."""
    return height * width > MAX_UNTILED_PIXELS


def resolve_tile_size(height: int, width: int, size: int | str, planned: int | None | str = "none") -> int | None:
    """The tile side (px) a ``height x width`` frame runs with, or None for one untiled call.

    ``off``: None. A number: that number. ``auto``: the memory plan's tile (``planned``: a side, or None when the
    plan keeps the frame whole; ``"none"`` when there is no plan), and in any case :data:`DEFAULT_TILE_SIZE` above
    4 MP (:func:`exceeds_untiled_limit`). A tile at least as large as both sides is None: one call, untiled.
    """
    if size == "off":
        tile = None
    elif isinstance(size, int):
        tile = size
    else:
        tile = None if planned == "none" else planned
        if tile is None and exceeds_untiled_limit(height, width):
            tile = DEFAULT_TILE_SIZE
    if tile is not None and tile >= height and tile >= width:
        return None
    return tile


def tile_starts(length: int, tile: int, overlap: int) -> list[int]:
    """Start offsets (px) of tiles of side ``tile`` covering ``[0, length)`` with neighbours sharing >= ``overlap``.

    ``n = ceil((length - overlap) / (tile - overlap))`` tiles (one when ``tile >= length``), the k-th at
    ``16 * floor(k * u / (n - 1) + 1/2)`` with ``u = (length - tile) / 16``: the first at 0, the last ending at
    ``length``, evenly spread on the 16-px grid. A step of ``floor(y + s) - floor(y)`` grid units is at most
    ``ceil(s)``, and ``s = u / (n - 1) <= (tile - overlap) / 16``, a whole number: every step is at most
    ``tile - overlap``, so each shared edge is at least ``overlap`` px wide.
    """
    if length % PIXEL_MULTIPLE or tile % PIXEL_MULTIPLE:
        raise FlowliftError(f"frame and tile sides must be multiples of {PIXEL_MULTIPLE} px, got {length} and {tile}")
    if tile >= length:
        return [0]
    check_overlap(tile, overlap)
    count = -(-(length - overlap) // (tile - overlap))
    units = (length - tile) // PIXEL_MULTIPLE
    return [PIXEL_MULTIPLE * ((2 * k * units + count - 1) // (2 * (count - 1))) for k in range(count)]


@dataclass(frozen=True)
class TileLayout:
    """Tiles of ``tile_height x tile_width`` px at ``rows x cols`` starts of a ``height x width`` px frame."""

    height: int
    width: int
    tile_height: int
    tile_width: int
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    overlap: int
    batch: int = 1

    @property
    def count(self) -> int:
        return len(self.rows) * len(self.cols)

    def record(self) -> dict[str, Any]:
        """What ran, for the output's metadata: tile size (h, w px), overlap, grid (rows, cols), tiles per call."""
        return {
            "size": [self.tile_height, self.tile_width],
            "overlap": self.overlap,
            "grid": [len(self.rows), len(self.cols)],
            "batch": self.batch,
        }

    def describe(self) -> str:
        return (
            f"{len(self.rows)}x{len(self.cols)} tiles of {self.tile_width}x{self.tile_height} px, "
            f"overlap {self.overlap} px"
        )


def tile_layout(height: int, width: int, tile: int, overlap: int, batch: int = 1) -> TileLayout:
    """The layout of ``tile``-px tiles on a ``height x width`` px frame (a side shorter than the tile is one tile
    of that side), ``batch`` tiles per call: at most the layout's tiles, so that the record says what runs."""
    tile_h, tile_w = min(tile, height), min(tile, width)
    rows = tile_starts(height, tile_h, overlap) if tile_h < height else [0]
    cols = tile_starts(width, tile_w, overlap) if tile_w < width else [0]
    per_call = max(1, min(int(batch), len(rows) * len(cols)))
    return TileLayout(height, width, tile_h, tile_w, tuple(rows), tuple(cols), overlap, per_call)


def tile_count(height: int, width: int, tile: int | None, overlap: int) -> int:
    """How many tiles :func:`tile_layout` makes (1 untiled)."""
    if tile is None:
        return 1
    return tile_layout(height, width, tile, overlap).count

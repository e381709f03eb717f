"""A velocity function run in overlapping tiles, blended into one (MultiDiffusion, Bar-Tal et al. 2023).

At every call (every sampler step, every Heun corrector) the one shared latent ``x`` is cut into the tiles of a
:class:`~flowlift.refine.tiling.TileLayout`; the inner velocity function runs on each tile as if it were a whole
image (a :class:`~flowlift.flux2.denoiser.Flux2Denoiser` builds its position ids from the tile's own size, so each
tile's ids start at (0, 0): a size the model was trained on) with the same prompt, guidance and reference images;
and the tiles' velocities are blended with weights that sum to 1 at every latent pixel:

    v(x) = sum_k W_k * v_inner(crop_k(x)),    W_k(i, j) = a_k(i) * b_k(j),
    a_k = r_k / sum_m r_m (rows; b_k likewise for columns),

``r_k`` a smoothstep ramp ``t^2 (3 - 2t)`` from 0 to 1 across each edge the tile shares with a neighbour
(``t = (d + 1/2) / overlap`` at ``d`` latent pixels in from that edge; the product of both ramps on a tile with
two neighbours), 1 elsewhere. The layout is a grid, so the 2-D weights are products of 1-D ones and
``sum_k W_k = (sum a)(sum b) = 1``. Since all tiles see one latent at every step, they agree on one trajectory and
no seam-fix pass is needed. Where one tile alone covers a pixel its weight is ``r / r = 1`` exactly, and one tile
covering the frame is the inner function called once: bit for bit the untiled result.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.flux2.sampling import VelocityFn
from flowlift.refine.tiling import TileLayout, TileRequest, exceeds_untiled_limit, resolve_tile_size, tile_layout


def smoothstep(t: torch.Tensor) -> torch.Tensor:
    """``t^2 (3 - 2t)`` on ``t`` clamped to [0, 1]: 0 -> 0, 1 -> 1, flat at both ends, ``s(t) + s(1-t) = 1``."""
    t = t.clamp(0.0, 1.0)
    return t * t * (3.0 - 2.0 * t)


def check_axis_layout(length: int, starts: Sequence[int], tile: int) -> None:
    """``starts`` lay tiles of side ``tile`` on an axis of ``length`` as :func:`edge_ramps` reads them: in order,
    the first at 0, the last ending at ``length``, each inside the axis (ValueError naming the first that is not)."""
    if not starts or tile <= 0 or starts[0] != 0 or starts[-1] + tile != length:
        raise ValueError(f"tiles of {tile} at {list(starts)[:8]} do not span an axis of {length} from 0 to its end")
    for before, start in zip(starts[:-1], starts[1:], strict=True):
        if not before < start <= before + tile:
            raise ValueError(f"tile starts {before} and {start} on an axis of {length}: not in order or leave a gap")


def edge_ramps(length: int, starts: Sequence[int], tile: int) -> list[torch.Tensor]:
    """Un-normalized 1-D weights ``r_k`` (float64, ``tile`` long) of tiles at ``starts`` on an axis of ``length``.

    All in latent pixels. Across an edge tile ``k`` shares with a neighbour, over that shared span of ``o`` pixels,
    ``r = smoothstep((d + 1/2) / o)`` at ``d`` pixels in from the edge; edges on the frame's border and abutting
    edges (``o = 0``) get no ramp. Which edges lie on the border is read from the order of ``starts``, so the
    layout must span the axis: :func:`check_axis_layout` (``length``'s use) refuses one that does not.
    """
    check_axis_layout(length, starts, tile)
    ramps = []
    centres = torch.arange(tile, dtype=torch.float64) + 0.5
    for k, start in enumerate(starts):
        ramp = torch.ones(tile, dtype=torch.float64)
        if k > 0:
            shared = starts[k - 1] + tile - start
            if shared > 0:
                ramp = ramp * smoothstep(centres / shared)
        if k + 1 < len(starts):
            shared = start + tile - starts[k + 1]
            if shared > 0:
                ramp = ramp * smoothstep((tile - centres) / shared)
        ramps.append(ramp)
    return ramps


def partition_weights(length: int, starts: Sequence[int], tile: int) -> list[torch.Tensor]:
    """Normalized 1-D weights ``a_k = r_k / sum_m r_m`` (float64): at every pixel of the axis they sum to 1."""
    ramps = edge_ramps(length, starts, tile)
    total = torch.zeros(length, dtype=torch.float64)
    for start, ramp in zip(starts, ramps, strict=True):
        total[start : start + tile] += ramp
    if bool((total <= 0).any()):
        raise ValueError("tile layout leaves latent pixels uncovered")
    return [ramp / total[start : start + tile] for start, ramp in zip(starts, ramps, strict=True)]


class TiledVelocity:
    """``velocity_fn(x, sigma)`` that runs ``inner`` on the tiles of ``layout`` and blends their velocities.

    ``layout`` is in image pixels (multiples of 16: each tile's offsets and sides are whole 2x2 latent patches);
    ``x`` is a (B, C, H/8, W/8) latent. ``layout.batch`` tiles go into one ``inner`` call (stacked on the batch
    axis); a batch of B > 1 images runs one tile (of all B) per call, as :func:`tiled_for_frame` lays it out and
    records: ``inner``'s conditioning is laid out for B latents (per-image prompt embeddings are batch B), and
    several tiles of B images would need it repeated in tile order. ``calls`` counts the inner calls, ``tiles_run``
    the tiles.
    """

    def __init__(self, inner: VelocityFn, layout: TileLayout) -> None:
        self.inner, self.layout = inner, layout
        f = VAE_SCALE_FACTOR
        self.tile_h, self.tile_w = layout.tile_height // f, layout.tile_width // f
        self.rows = [r // f for r in layout.rows]
        self.cols = [c // f for c in layout.cols]
        self.frame = (layout.height // f, layout.width // f)
        self.row_weights = partition_weights(self.frame[0], self.rows, self.tile_h)
        self.col_weights = partition_weights(self.frame[1], self.cols, self.tile_w)
        self.calls = self.tiles_run = 0
        self._weights: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype | None:
        return getattr(self.inner, "dtype", None)

    def tiles(self) -> list[tuple[int, int]]:
        """(row index, column index) of every tile, row-major."""
        return [(i, j) for i in range(len(self.rows)) for j in range(len(self.cols))]

    def _weight(self, i: int, j: int, device: torch.device) -> torch.Tensor:
        """Tile (i, j)'s float32 weights ``a_i (outer) b_j`` on ``device``, made once (one channel: small)."""
        weight = self._weights.get((i, j))
        if weight is None or weight.device != device:
            weight = torch.outer(self.row_weights[i], self.col_weights[j]).to(device=device, dtype=torch.float32)
            self._weights[(i, j)] = weight
        return weight

    def _crop(self, x: torch.Tensor, i: int, j: int) -> torch.Tensor:
        top, left = self.rows[i], self.cols[j]
        return x[:, :, top : top + self.tile_h, left : left + self.tile_w]

    def __call__(self, x: torch.Tensor, sigma: float) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.frame:
            raise ValueError(f"tiled velocity laid out for a {self.frame} latent, got {tuple(x.shape[-2:])}")
        if len(self.rows) * len(self.cols) == 1:
            self.calls += 1
            self.tiles_run += 1
            return self.inner(x, sigma)
        per_call = self.layout.batch if x.shape[0] == 1 else 1
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        tiles = self.tiles()
        for first in range(0, len(tiles), per_call):
            group = tiles[first : first + per_call]
            crops = torch.cat([self._crop(x, i, j) for i, j in group], dim=0)  # a copy: contiguous tiles
            velocity = self.inner(crops, sigma).float()
            self.calls += 1
            self.tiles_run += len(group)
            for n, (i, j) in enumerate(group):
                v = velocity[n * x.shape[0] : (n + 1) * x.shape[0]]
                top, left = self.rows[i], self.cols[j]
                out[:, :, top : top + self.tile_h, left : left + self.tile_w] += self._weight(i, j, x.device) * v
        return out.to(x.dtype)


def tiled_for_frame(
    velocity_fn: VelocityFn, latent_size: tuple[int, int], request: TileRequest, plan: Any = None, *, images: int = 1
) -> tuple[VelocityFn, dict[str, Any]]:
    """``velocity_fn`` for a frame of ``latent_size`` (h, w latent pixels) as ``request`` and the memory ``plan``
    (a :class:`~flowlift.refine.memory_plan.RefinePlan` or None) decide, and its metadata.

    :func:`~flowlift.refine.tiling.resolve_tile_size` picks the tile; untiled, ``velocity_fn`` itself is returned
    (a frame above 4 MP then costs one warning line). ``tile_batch auto`` is the plan's tiles per call when the
    plan made this tile, else 1; with ``images`` > 1 in the batch each call runs one tile of all of them (see
    :class:`TiledVelocity`; a ``tile_batch`` above 1 asked for then costs one warning line). The metadata:
    ``tile_size`` as asked, and ``tiles`` (size, overlap, grid, batch: the tiles per call that ran) when tiles ran.
    """
    from flowlift.errors import FlowliftWarning

    height, width = latent_size[0] * VAE_SCALE_FACTOR, latent_size[1] * VAE_SCALE_FACTOR
    planned = "none" if plan is None else plan.tile_size
    tile = resolve_tile_size(height, width, request.size, planned)
    record: dict[str, Any] = {"tile_size": request.size}
    if tile is None:
        if exceeds_untiled_limit(height, width):
            warnings.warn(
                FlowliftWarning(
                    f"refining {width}x{height} px ({height * width / 1e6:.1f} MP) in one transformer call, above "
                    "FLUX.2's 4 MP maximum; tile_size auto refines it in tiles"
                ),
                stacklevel=3,
            )
        return velocity_fn, record
    if isinstance(request.batch, int):
        batch = request.batch
    else:
        batch = plan.tile_batch if plan is not None and plan.tile_size == tile else 1
    if images > 1 and batch > 1:
        if isinstance(request.batch, int):
            warnings.warn(
                FlowliftWarning(
                    f"tile batch {batch}: with {images} images in one batch each transformer call runs "
                    f"one tile of all {images} (recorded as batch 1)"
                ),
                stacklevel=3,
            )
        batch = 1
    layout = tile_layout(height, width, tile, request.overlap, batch)
    record["tiles"] = layout.record()
    return TiledVelocity(velocity_fn, layout), record

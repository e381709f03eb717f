"""The tiled FLUX.2 refine as a ComfyUI model function wrapper: every model call of every sampler, in tiles.

ComfyUI's samplers call a patched model as ``wrapper(apply_model, {"input": x, "timestep": sigma, "c": conds,
"cond_or_uncond": ...})`` (``comfy/samplers.py``, ``model_function_wrapper``), where ``x`` is the FLUX.2 latent
in ComfyUI's layout (B, 128, H/16, W/16) and ``apply_model`` returns the denoised prediction
``x0 = x - sigma * v``. :class:`TiledModelFunction` runs flowlift's refine core on it: the latent is unpatchified
to flowlift's (B, 32, H/8, W/8), :func:`~flowlift.refine.tiled_velocity.tiled_for_frame` lays out the tiles (the
16-px grid, the 4 MP rule of ``auto``) and :class:`~flowlift.refine.tiled_velocity.TiledVelocity` cuts, runs and
blends them, each tile going through ``apply_model`` (patchified again) with the same sigma and conditioning.
ComfyUI's FLUX.2 model builds each tile's position ids from the tile's own size.

Blending the denoised predictions is blending the velocities: with weights ``W_k`` that sum to 1 at every latent
pixel, ``sum W_k (x - sigma v_k) = x - sigma sum W_k v_k`` (to float rounding of the weights' sum).

What runs per tile and what is refused (one line, :class:`~flowlift.errors.FlowliftError`):

* per tile: the text conditioning and guidance (the same for every tile), FLUX.2 reference latents (every tile
  sees the whole reference images, as ``flowlift img2img --reference`` does), batched latents and cond/uncond
  batches (a batch of B > 1 runs one tile per call, all B at once), inpaint masks (ComfyUI applies the noise mask
  to the blended prediction, outside the model function);
* refused: conditioning that is laid out over the whole frame (``c_concat``, ControlNet ``control``, an
  ``attention_mask`` over the image tokens) and any conditioning this module does not know, since a crop of it
  cannot be told from a copy; latents that are not FLUX.2's 128 channels.

No ComfyUI import here (the node is :mod:`flowlift.comfyui.refine_nodes`): ``check_interrupt`` is ComfyUI's
``throw_exception_if_processing_interrupted``, called before every tile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import PATCHIFIED_CHANNELS, VAE_SCALE_FACTOR, patchify, unpatchify
from flowlift.refine.tiled_velocity import TiledVelocity, tiled_for_frame
from flowlift.refine.tiling import TileRequest, resolve_tile_size, tile_layout

log = logging.getLogger("flowlift")

#: Conditioning entries that mean the same for every tile: passed to each tile's call unchanged (tensors with
#: one row per batch item are repeated when tiles are stacked on the batch axis).
PER_TILE_CONDITIONING = frozenset(
    {"c_crossattn", "guidance", "ref_latents", "ref_latents_method", "transformer_options"}
)
#: Conditioning laid out over the whole frame: a tile would get the whole frame's, which is wrong, so refused.
FRAME_CONDITIONING = {
    "c_concat": "concatenated image conditioning (an inpaint or control model's c_concat)",
    "control": "ControlNet residuals",
    "attention_mask": "an attention mask over the image tokens",
}

ModelFunction = Callable[..., torch.Tensor]
#: Image pixels per latent pixel of ComfyUI's FLUX.2 layout (8x VAE, then 2x2 patches).
COMFY_LATENT_PX = 2 * VAE_SCALE_FACTOR


def check_conditioning(conditioning: dict[str, Any], where: str) -> None:
    """One line unless every entry of a model call's conditioning works per tile (:data:`PER_TILE_CONDITIONING`)."""
    for key, value in conditioning.items():
        if key in PER_TILE_CONDITIONING or value is None:
            continue
        what = FRAME_CONDITIONING.get(key, f"conditioning {key!r}, which it does not know to work per tile")
        raise FlowliftError(f"{where}: cannot refine in tiles with {what}; connect the model without the tiled refine")


def repeat_rows(value: Any, batch: int, times: int) -> Any:
    """``value`` with every tensor of ``batch`` rows (also inside lists) repeated ``times`` on the batch axis."""
    if times == 1:
        return value
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
        return torch.cat([value] * times, dim=0)
    if isinstance(value, list):
        return [repeat_rows(item, batch, times) for item in value]
    return value


class TiledModelFunction:
    """ComfyUI ``model_function_wrapper`` running each model call in flowlift's tiles (see the module docstring).

    ``request`` is the node's three knobs, checked; ``previous`` an earlier wrapper of the same model (another
    patch), which then runs per tile in place of ``apply_model``; ``where`` names the node in error lines. The
    first call on a new frame size logs its grid.
    """

    def __init__(
        self,
        request: TileRequest,
        check_interrupt: Callable[[], None] = lambda: None,
        previous: Callable[..., torch.Tensor] | None = None,
        where: str = "Tiled FLUX.2 Refine",
    ) -> None:
        self.request, self.check_interrupt, self.previous, self.where = request, check_interrupt, previous, where
        self.logged: set[tuple[int, int]] = set()

    def _run(self, apply_model: ModelFunction, x: torch.Tensor, timestep: torch.Tensor, args: dict) -> torch.Tensor:
        if self.previous is None:
            return apply_model(x, timestep, **args["c"])
        return self.previous(apply_model, {**args, "input": x, "timestep": timestep})

    def __call__(self, apply_model: ModelFunction, args: dict[str, Any]) -> torch.Tensor:
        x, timestep, conditioning = args["input"], args["timestep"], args["c"]
        if x.ndim != 4 or x.shape[1] != PATCHIFIED_CHANNELS:
            raise FlowliftError(
                f"{self.where}: needs FLUX.2 latents (batch, {PATCHIFIED_CHANNELS}, h, w), got {tuple(x.shape)}"
            )
        if not bool(torch.isfinite(x).all()):  # one NaN spreads to every tile: an all-NaN LATENT, status success
            raise FlowliftError(
                f"{self.where}: the sampler's latents hold NaN/Inf; check the node that made the LATENT it samples"
            )
        frame = (2 * x.shape[2], 2 * x.shape[3])  # flowlift's latent pixels (1/8 of the image)
        batch = x.shape[0]

        def tile_call(crops: torch.Tensor, _sigma: Any) -> torch.Tensor:
            self.check_interrupt()
            times = crops.shape[0] // batch
            tile_args = {**args, "c": {k: repeat_rows(v, batch, times) for k, v in conditioning.items()}}
            return unpatchify(self._run(apply_model, patchify(crops), repeat_rows(timestep, batch, times), tile_args))

        tiled, record = tiled_for_frame(tile_call, frame, self.request, images=batch)
        if not isinstance(tiled, TiledVelocity):  # untiled ("auto" up to 4 MP): the model function itself, bit for bit
            return self._finite(self._run(apply_model, x, timestep, args))
        check_conditioning(conditioning, self.where)
        if frame not in self.logged:
            self.logged.add(frame)
            log.info("flowlift: %s", tiling_line(frame, record))
        return self._finite(patchify(tiled(unpatchify(x), timestep)))

    def _finite(self, output: torch.Tensor) -> torch.Tensor:
        """``output``, or one line when it holds NaN/Inf (which would end as a black image with status success)."""
        if not bool(torch.isfinite(output).all()):
            raise FlowliftError(f"{self.where}: the model's output holds NaN/Inf (weights that overflow in its dtype?)")
        return output

    def call_shape(self, latent_shape: Sequence[int]) -> list[int]:
        """The largest input one model call gets for a ComfyUI latent of ``latent_shape`` (B, 128, h, w): a tile
        (times the tiles stacked per call, which only a batch of one stacks) when the frame runs in tiles, else the
        latent itself. ComfyUI's memory estimate before sampling is made for this shape."""
        batch, channels = latent_shape[0], latent_shape[1]
        height, width = COMFY_LATENT_PX * latent_shape[-2], COMFY_LATENT_PX * latent_shape[-1]
        tile = resolve_tile_size(height, width, self.request.size)
        if tile is None or len(latent_shape) != 4:
            return list(latent_shape)
        layout = tile_layout(height, width, tile, self.request.overlap)
        per_call = self.request.batch if isinstance(self.request.batch, int) and batch == 1 else 1
        return [batch * per_call, channels, layout.tile_height // COMFY_LATENT_PX, layout.tile_width // COMFY_LATENT_PX]

    def prepare_sampling(self, executor: Callable[..., Any], model: Any, noise_shape: Sequence[int], *args, **kwargs):
        """ComfyUI's ``PREPARE_SAMPLING`` wrapper: the model is loaded with room for one tiled call's activations
        (:meth:`call_shape`) instead of the whole frame's, which the tiles never need at once."""
        return executor(model, self.call_shape(noise_shape), *args, **kwargs)


def tiling_line(frame: tuple[int, int], record: dict[str, Any]) -> str:
    """What a tiled call runs, in one log line: the frame (w x h px), the grid (rows x columns), the tile (w x h
    px), the overlap and the tiles per call."""
    height, width = frame[0] * VAE_SCALE_FACTOR, frame[1] * VAE_SCALE_FACTOR
    tiles = record["tiles"]
    (rows, cols), (tile_h, tile_w) = tiles["grid"], tiles["size"]
    return (
        f"Tiled FLUX.2 Refine: {width}x{height} px in {rows}x{cols} tiles of {tile_w}x{tile_h} px, overlap "
        f"{tiles['overlap']} px, {tiles['batch']} per call"
    )

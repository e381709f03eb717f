"""The refine core every door runs: a velocity function tiled for its frame, sampled on the shifted schedule.

:func:`refine_tiled` is the one composition of :func:`~flowlift.refine.tiled_velocity.tiled_for_frame` (the
transformer in overlapping tiles above FLUX.2's 4 MP, or where the memory plan tiles) and
:func:`~flowlift.refine.loop.refine_latents`. :class:`~flowlift.refine.refiner.Flux2Refiner` runs every mode through
it; :func:`tiled_refine_raw_latents` runs it on a host application's *raw* FLUX.2 latents and its own transformer
(InvokeAI's *Tiled FLUX.2 Denoise* node, a ComfyUI node), so no front-end holds a copy of refine code.
:func:`tiling_line` words the tiling record for a log (a latents output has no metadata to carry it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from flowlift.refine.loop import RefineResult, StepCallback, VelocityFn, denoising_start_for, refine_latents
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest

#: Init latents as :func:`refine_latents` takes them: (latents, bn_mean, bn_std); the statistics None for
#: normalized latents, given for *raw* VAE latents (then only the init is normalized, never the noise blend).
InitLatents = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def refine_tiled(
    velocity_fn: VelocityFn | None,
    init: InitLatents | None,
    *,
    sampling: SamplingSettings,
    tiles: TileRequest,
    denoising_start: float,
    shape: Sequence[int] | None = None,
    memory_plan: Any = None,
    mask: torch.Tensor | None = None,
    denoising_end: float = 1.0,
    on_step: StepCallback | None = None,
    device: torch.device | str = "cpu",
) -> RefineResult:
    """:func:`refine_latents` over ``velocity_fn`` tiled for the frame as ``tiles`` and ``memory_plan`` decide;
    the result's ``tiling`` is the record (``tile_size`` as asked; ``tiles`` when they ran).

    ``init`` None is txt2img at ``shape``; ``velocity_fn`` None is strength 0 (no model call, nothing tiled).
    """
    from flowlift.refine.tiled_velocity import tiled_for_frame

    latents, bn_mean, bn_std = init if init is not None else (None, None, None)
    full_shape = tuple(latents.shape if latents is not None else shape)
    record: dict[str, Any] = {}
    if velocity_fn is not None:  # a batch of several images runs one tile of all of them per call
        velocity_fn, record = tiled_for_frame(velocity_fn, full_shape[2:], tiles, memory_plan, images=full_shape[0])
    result = refine_latents(
        velocity_fn,
        init_latents=latents,
        shape=shape,
        bn_mean=bn_mean,
        bn_std=bn_std,
        denoising_start=denoising_start,
        denoising_end=denoising_end,
        sampling=sampling,
        mask=mask,
        on_step=on_step,
        device=device,
    )
    result.tiling = record
    return result


def tiled_refine_raw_latents(
    transformer: torch.nn.Module,
    raw_latents: torch.Tensor,
    bn_mean: torch.Tensor,
    bn_std: torch.Tensor,
    prompt_embeds: torch.Tensor,
    *,
    strength: float,
    sampling: SamplingSettings,
    tiles: TileRequest,
    device: torch.device | str,
    on_step: Callable[..., Any] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Refine raw FLUX.2 latents (B, 32, h, w) at img2img ``strength`` in tiles; (raw latents, tiling record).

    The host's transformer (a diffusers ``Flux2Transformer2DModel``) becomes a
    :class:`~flowlift.flux2.denoiser.Flux2Denoiser` on ``prompt_embeds`` (1, L, D); ``denoising_start = 1 -
    strength`` (linear); the schedule is flowlift's (``mu`` 2.02, respaced, unless ``sampling`` says otherwise).
    The record is the CLI's: ``tile_size`` as asked and ``tiles`` (size, overlap, grid, batch) when tiles ran.
    """
    from flowlift.flux2.denoiser import Flux2Denoiser
    from flowlift.flux2.latents import denormalize

    denoiser = Flux2Denoiser(transformer, prompt_embeds.to(device))
    init = (raw_latents.to(device=device, dtype=torch.float32), bn_mean.to(device), bn_std.to(device))
    result = refine_tiled(denoiser, init, sampling=sampling, tiles=tiles, denoising_start=denoising_start_for(strength),
                          on_step=on_step, device=device)  # fmt: skip
    return denormalize(result.latents, bn_mean.to(device), bn_std.to(device)), result.tiling


def tiling_line(frame: tuple[int, int], record: dict[str, Any]) -> str:
    """The tiling ``record`` of a refine of a ``frame`` (h, w px) in one log line: the grid (rows x columns), the
    tile (w x h px), the overlap and tiles per call, or that the frame ran in one transformer call."""
    height, width = frame
    tiles = record.get("tiles")
    if tiles is None:
        return f"{width}x{height} px refined untiled (tile size {record['tile_size']})"
    (rows, cols), (tile_h, tile_w) = tiles["grid"], tiles["size"]
    return (
        f"{width}x{height} px refined in {rows}x{cols} tiles of {tile_w}x{tile_h} px, overlap {tiles['overlap']} px, "
        f"{tiles['batch']} per call"
    )

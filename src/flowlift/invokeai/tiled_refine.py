"""The Tiled FLUX.2 Denoise node's work, without InvokeAI: flowlift's refine loop on InvokeAI's raw latents.

InvokeAI hands the node its loaded FLUX.2 transformer (a diffusers ``Flux2Transformer2DModel``), the Qwen3 prompt
embeddings of its FLUX.2 text encoder node (``FLUXConditioningInfo.t5_embeds``, (1, L, joint_attention_dim)) and
the VAE's *raw* latents with the VAE's BatchNorm statistics. :func:`tiled_refine_raw_latents` runs the same core
as ``flowlift img2img``: :class:`~flowlift.flux2.denoiser.Flux2Denoiser` over the transformer, tiled by
:func:`~flowlift.refine.tiled_velocity.tiled_for_frame` (:class:`~flowlift.refine.tiled_velocity.TiledVelocity`),
sampled by :func:`~flowlift.refine.loop.refine_latents` (only the init latents are normalized, never the noise
blend), and returns raw latents again, as InvokeAI's FLUX.2 nodes pass them. :func:`tiling_line` words the
tiling record for InvokeAI's log (a ``LatentsOutput`` has no metadata to carry it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from flowlift.refine.loop import denoising_start_for, refine_latents
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest


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

    ``denoising_start = 1 - strength`` (linear); the schedule is flowlift's (``mu`` 2.02, respaced, unless
    ``sampling`` says otherwise). The record is the CLI's: ``tile_size`` as asked and ``tiles`` (size, overlap,
    grid, batch) when tiles ran.
    """
    from flowlift.flux2.denoiser import Flux2Denoiser
    from flowlift.flux2.latents import denormalize
    from flowlift.refine.tiled_velocity import tiled_for_frame

    denoiser = Flux2Denoiser(transformer, prompt_embeds.to(device))
    velocity_fn, record = tiled_for_frame(denoiser, tuple(raw_latents.shape[2:]), tiles, images=raw_latents.shape[0])
    result = refine_latents(
        velocity_fn,
        init_latents=raw_latents.to(device=device, dtype=torch.float32),
        bn_mean=bn_mean.to(device),
        bn_std=bn_std.to(device),
        denoising_start=denoising_start_for(strength),
        steps=sampling.steps,
        seed=sampling.seed,
        sampler=sampling.sampler,
        on_step=on_step,
        device=device,
        **({} if sampling.mu is None else {"mu": sampling.mu}),
        **({} if sampling.schedule is None else {"schedule": sampling.schedule}),
    )
    return denormalize(result.latents, bn_mean.to(device), bn_std.to(device)), record


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

"""The hires fix, composed once: base latents -> the Flow Upscaler (any :class:`LatentUpscaler`) -> refine -> decode.

``flowlift hires``, the web app's hires modes and scripts run :func:`hires_fix`; the node packs run the same two
steps as nodes (the upscaler's ``upscale_latents``, then :func:`flowlift.refine.tiled_refine.refine_tiled` through
:func:`~flowlift.refine.tiled_refine.tiled_refine_raw_latents`). refine/ never imports the upscaler: it arrives as
an object with ``upscale_latents`` (:class:`~flowlift.refine.request.LatentUpscaler`; the Flow Upscaler's pipeline is
one), so refine and upscale stay siblings.
"""

from __future__ import annotations

from typing import Any

from flowlift.refine.parameters import RefineOutput
from flowlift.refine.request import HiresSettings, LatentUpscaler
from flowlift.refine.settings import STRENGTH_MAP, SamplingSettings
from flowlift.refine.tiling import TileRequest


def hires_fix(
    refiner: Any,
    upscaler: LatentUpscaler,
    settings: HiresSettings,
    *,
    images: Any = None,
    sampling: SamplingSettings | None = None,
    strength_map: str = STRENGTH_MAP.default,
    tiles: TileRequest | None = None,
    upscaler_name: str | None = None,
    conditioning: dict[str, Any] | None = None,
) -> RefineOutput:
    """The hires fix on ``refiner`` (:class:`~flowlift.refine.refiner.Flux2Refiner`): ``images`` (B, 3, H, W) in
    [0, 1] encoded, or a txt2img of ``settings.base_size`` at ``settings.base_steps``; upscaled ``settings.scale``
    times by ``upscaler`` (``settings.passes`` passes, the sampling seed, stage 1 at ``transplant_strength``,
    ``color_fix``); refined at ``settings.refine_strength`` with ``sampling`` and ``tiles``; decoded.

    The output's parameters are the refiner's plus the upscale's (``upscaler`` as ``upscaler_name`` records it,
    ``transplant_strength``, ``color_fix``), the same whichever front-end asked.
    """
    sampling = sampling if sampling is not None else SamplingSettings()

    def upscale(latents: Any) -> Any:
        from flowlift.progress import report_stage

        report_stage("upscale")  # the run's stage, for every door's progress (flowlift.progress)
        return upscaler.upscale_latents(latents, settings.passes, seed=sampling.seed,
                                        transplant_strength=settings.transplant_strength,
                                        color_fix=settings.color_fix)  # fmt: skip

    width, height = settings.base_size
    result = refiner.hires(
        upscale,
        images=images,
        height=height,
        width=width,
        base_steps=settings.base_steps,
        refine_strength=settings.refine_strength,
        strength_map=strength_map,
        sampling=sampling,
        scale=settings.scale,
        tiles=tiles,
        **(conditioning or {}),
    )
    result.parameters.update(
        upscaler=upscaler_name, transplant_strength=settings.transplant_strength, color_fix=settings.color_fix
    )
    return result

"""The hires fix, a mode of :class:`~flowlift.refine.refiner.Flux2Refiner`: base latents -> the latent upscaler ->
a low-strength refine -> decode.

:class:`HiresFix` holds the one hires composition; :class:`~flowlift.refine.refiner.Flux2Refiner` takes it as a base
class and gives it what the other modes use: ``_conditioned`` (the denoiser, its embeddings' batch checked),
``encode``, ``decode``, ``txt2img``, ``_run``, ``_parameters``, ``_with_steps`` and the ``device``, ``tiling`` and
``default_steps`` attributes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR, check_latents
from flowlift.knobs import check_kind
from flowlift.limits import hires_latent_size, whole_passes
from flowlift.progress import report_stage
from flowlift.refine.canvas import checked_images
from flowlift.refine.loop import denoising_start_for
from flowlift.refine.parameters import RefineOutput, check_conditioning, conditioning_parameters
from flowlift.refine.request import HiresSettings, LatentUpscaler
from flowlift.refine.settings import STRENGTH_MAP, SamplingSettings, check_hires_size
from flowlift.refine.tiling import TileRequest

# A caller's upscaler answers latents of its own making: a NaN there is its fault, not the input's.
RETURNED = "the latents it returned"


class HiresFix:
    """The hires fix as a refiner mode (see the module's docstring for what the refiner gives it)."""

    def hires(
        self,
        upscaler: LatentUpscaler,
        settings: HiresSettings | None = None,
        *,
        images: torch.Tensor | None = None,
        strength_map: str = STRENGTH_MAP.default,
        sampling: SamplingSettings | None = None,
        tiles: TileRequest | None = None,
        **conditioning: Any,
    ) -> RefineOutput:
        """The hires fix: base latents -> ``upscaler`` (the Flow Upscaler) -> refine at low strength -> decode.

        The base is ``images`` (B, 3, H, W) encoded, or a txt2img of ``settings.base_size`` (width, height) at
        ``settings.base_steps`` (None: the model's). ``upscaler.upscale_latents`` maps normalized latents to
        normalized latents ``settings.scale`` times larger (:attr:`HiresSettings.passes` 2x passes, the sampling
        seed, stage 1 at ``settings.transplant_strength``, ``settings.color_fix``); any other scale ends with
        ``upscaler.to_size`` (SesquiLSR) at :func:`~flowlift.limits.hires_latent_size`. The refine pass is
        img2img on them in the window below ``1 - settings.refine_strength``; both passes shift with ``mu`` (for
        ``"empirical"``, each from its own size and step count) and tile as ``tiles`` say (the refine pass of a 4x
        or 8x fix is where tiles run). ``sampling`` is the refine pass's; the txt2img base runs it with
        ``base_steps``. The output's parameters are the refiner's plus the upscale's (``upscaler`` as the settings'
        source names it, ``transplant_strength``, ``color_fix``), the same whichever front-end asked.
        """
        check_conditioning(conditioning, "hires")  # before any work: scale=2 here is a HiresSettings field
        _check_upscaler(upscaler)
        settings = check_kind("settings", settings, HiresSettings, "a HiresSettings", optional=True) or HiresSettings()
        images = checked_images(images) if images is not None else None
        width, height = (images.shape[-1], images.shape[-2]) if images is not None else settings.base_size
        field = "images" if images is not None else "hires.base_size"
        # the whole pass plan, before the base runs
        check_hires_size(int(width), int(height), settings.scale, field, "settings.scale")
        warn_grid_size(int(width), int(height), settings.scale)
        base_latent = (int(height) // VAE_SCALE_FACTOR, int(width) // VAE_SCALE_FACTOR)
        check_memory = getattr(upscaler, "check_memory", None)  # and the upscaler's memory plan, where it has one
        if check_memory is not None:
            fraction = None if whole_passes(settings.scale) else hires_latent_size(*base_latent, settings.scale)
            check_memory(base_latent, settings.passes, fraction, 1 if images is None else images.shape[0])
        sampling = self._with_steps(sampling)
        tiles = self._tiles(tiles)
        start = denoising_start_for(settings.refine_strength, strength_map)
        den = self._conditioned(1 if images is None else images.shape[0], conditioning)
        params: dict[str, Any] = {}
        if images is not None:
            base = self.encode(images.to(self.device, torch.float32))
            params["base"] = "image"
        else:
            base_steps = self.default_steps if settings.base_steps is None else settings.base_steps
            base_sampling = replace(sampling, steps=base_steps, schedule=None)  # a full window: no schedule choice
            base_out = self.txt2img(height=height, width=width, sampling=base_sampling, tiles=tiles, **conditioning)
            base = base_out.latents
            params.update(base="txt2img", base_steps=base_steps, height=height, width=width)
            params.update(base_mu=base_out.parameters["mu"])
            if "tiles" in base_out.parameters:
                params["base_tiles"] = base_out.parameters["tiles"]
        report_stage("upscale")  # the run's stage, for every door's progress (flowlift.progress)
        expect = hires_latent_size(base.shape[2], base.shape[3], settings.scale)
        up = _upscaled(upscaler, base, settings, sampling.seed, expect).float().to(self.device)
        if tuple(up.shape[2:]) != expect:
            raise FlowliftError(f"the upscaler returned {tuple(up.shape[2:])} latents, expected {expect}")
        result = self._run(
            "hires refine",
            den,
            init=(up, None, None),
            shape=None,
            denoising_start=start,
            sampling=sampling,
            tiles=tiles,
        )
        upscale = settings.upscaler.name if settings.upscaler is not None else None
        params.update(
            self._parameters(
                "hires",
                result,
                sampling,
                scale=settings.scale,
                refine_strength=settings.refine_strength,
                strength_map=strength_map,
                denoising_start=round(start, 6),
                **conditioning_parameters(conditioning, den),
            ),
            upscaler=upscale,
            transplant_strength=settings.transplant_strength,
            color_fix=settings.color_fix,
            passes=settings.passes,
            latent_upscaler=getattr(settings.upscaler, "latent_upscaler", None),  # the fraction's, if any
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)


def warn_grid_size(width: int, height: int, scale: float) -> None:
    """One warning when the hires fix's size, ``scale`` times ``width x height`` on the 16 px grid its refine needs
    (:func:`~flowlift.limits.hires_latent_size`), is not ``round(scale * side)`` on each side: the image written is
    the grid's size (1.5x of 48x32 is 80x48, where 72x48 keeps the aspect)."""
    import warnings

    from flowlift.errors import FlowliftWarning

    out_h, out_w = (VAE_SCALE_FACTOR * n for n in hires_latent_size(height // 8, width // 8, scale))
    exact = (round(width * scale), round(height * scale))
    if (out_w, out_h) != exact:
        warnings.warn(
            FlowliftWarning(
                f"hires at {scale:g}x of {width}x{height} is {exact[0]}x{exact[1]}, off the 16 px grid the refine "
                f"needs: the image is {out_w}x{out_h} (aspect {width / height:.3f} -> {out_w / out_h:.3f})"
            ),
            stacklevel=3,
        )


def _check_upscaler(upscaler: object) -> None:
    """One line naming ``upscaler`` when it cannot upscale latents (``hires("flow")`` was an AttributeError)."""
    if not callable(getattr(upscaler, "upscale_latents", None)):
        kind = type(upscaler).__name__
        raise FlowliftError(
            f"upscaler must have upscale_latents() (a FlowUpscalerPipeline), got {kind}", field="upscaler"
        )


def _upscaled(
    upscaler: LatentUpscaler, base: torch.Tensor, settings: HiresSettings, seed: Any, expect: tuple[int, int]
) -> torch.Tensor:
    """``base`` upscaled by ``settings.passes`` 2x passes, then to ``expect`` for a fraction; a caller's own upscaler
    may answer anything, so each answer is checked as latents before any use."""
    up = base
    if settings.passes:
        up = upscaler.upscale_latents(
            base,
            settings.passes,
            seed=seed,
            color_fix=settings.color_fix,
            transplant_strength=settings.transplant_strength,
        )
        check_latents(up, "hires: the upscaler's upscale_latents", what=RETURNED)
    if not whole_passes(settings.scale):  # the fraction
        up = check_latents(upscaler.to_size(up, expect), "hires: the upscaler's to_size", what=RETURNED)
    return up

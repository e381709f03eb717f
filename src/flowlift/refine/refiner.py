"""The FLUX.2 refiner: txt2img, img2img, inpaint, outpaint, reference images and the hires fix.

:class:`Flux2Refiner` puts the VAE and the prompt conditioning around :func:`flowlift.refine.loop.refine_latents`,
one method per mode (``hires`` from :class:`flowlift.refine.hires_fix.HiresFix`);
:func:`flowlift.refine.loading.load_refiner` builds one from FLUX.2 Klein / dev weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from flowlift.devices import check_holds_values, resolve_device_option
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.knobs import check_callable, check_cfg_scale, check_dtype, check_kind, check_positive
from flowlift.limits import LATENT_CHANNELS
from flowlift.models.weights import finite_result
from flowlift.progress import report_stage
from flowlift.refine.canvas import (
    check_outpaint_strength,
    checked_images,
    checked_mask,
    latent_mask,
    outpaint_canvas,
    pad_to_multiple,
)
from flowlift.refine.hires_fix import HiresFix
from flowlift.refine.loop import RefineResult, VelocityFn, _Progress, denoising_start_for, refine_latents
from flowlift.refine.offload import Placement, place_transformer, with_transformer_on_device
from flowlift.refine.parameters import (
    RefineOutput,
    check_conditioning,
    conditioning_parameters,
    output_parameters,
)
from flowlift.refine.settings import (
    MU,
    OUTPAINT_STRENGTH,
    SCHEDULE,
    STEPS,
    STRENGTH,
    STRENGTH_MAP,
    SamplingSettings,
    check_txt2img_size,
    check_within_cap,
)
from flowlift.refine.tiling import TileRequest


class RefineVAE(Protocol):
    """What :class:`Flux2Refiner` needs from a VAE: normalized latents in and out.

    A FLUX.2 VAE also has ``encode_raw`` (raw 32-channel latents) and ``bn_mean``/``bn_std`` ([128]);
    img2img then blends noise with ``normalize(raw)`` (the normalization touches the init only).
    """

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


class Flux2Refiner(HiresFix):
    """txt2img / img2img / inpaint / outpaint / hires on a FLUX.2 transformer and VAE.

    ``transformer`` is a diffusers ``Flux2Transformer2DModel`` (or a module with its forward signature);
    ``vae`` follows :class:`RefineVAE` (e.g. a :func:`flowlift.models.vae_loading.load_vae` adapter).
    ``prompt_encoder`` (optional) turns prompt strings into embeddings; without it, pass
    ``prompt_embeds`` tensors. ``mu`` (2.02, a number, or ``"empirical"``) and ``schedule`` (``respaced`` or
    ``clipped``) are the schedule every mode runs unless a call gives its own (see
    :func:`flowlift.flux2.schedule.flux2_sigmas`). ``placement`` (:class:`~flowlift.refine.offload.Placement`:
    the offload mode, the VAE's tiling and the memory plan they came from) says where the models run;
    ``provenance`` (files, LoRAs with SHA-256 and scale, offload) joins every output's parameters. ``tiles``
    (:class:`~flowlift.refine.tiling.TileRequest`; every mode takes one too) runs the transformer in overlapping
    tiles (:mod:`flowlift.refine.tiled_velocity`): ``auto`` above FLUX.2's 4 MP or where the memory plan tiles.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        vae: RefineVAE,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prompt_encoder: Callable[[str], torch.Tensor] | None = None,
        progress: bool | None = False,
        model_name: str = "",
        mu: float | str = MU.default,
        schedule: str = SCHEDULE.default,
        placement: Placement | None = None,
        provenance: dict[str, Any] | None = None,
        tiles: TileRequest | None = None,
    ) -> None:
        mu, schedule = MU.check(mu), SCHEDULE.check(schedule)
        check_kind("transformer", transformer, torch.nn.Module, "a torch module (the FLUX.2 transformer)")
        if not callable(getattr(vae, "decode", None)):  # encode() only for image inputs: txt2img decodes only
            raise FlowliftError(
                f"vae must have decode() (and encode() for images), got {type(vae).__name__}", field="vae"
            )
        dtype, prompt_encoder = check_dtype(dtype), check_callable("prompt_encoder", prompt_encoder)
        model_name = check_kind("model_name", model_name, str, "a string")
        placement = check_kind("placement", placement, Placement, "a Placement", optional=True) or Placement()
        provenance = check_kind("provenance", provenance, dict, "a dict", optional=True)
        self.tiling = check_kind("tiles", tiles, TileRequest, "a TileRequest", optional=True) or TileRequest()
        if progress is not None:
            check_kind("progress", progress, bool, "True, False or None")
        self.mu, self.schedule = mu, schedule
        self.device, self.dtype = resolve_device_option(device), dtype  # one line for a device that is not here
        self.placement = placement
        self.offload, self.vae_tiled, self.memory_plan = placement.offload, placement.vae_tiled, placement.plan
        self.provenance = dict(provenance or {})
        self.transformer = place_transformer(
            transformer.eval(), offload=placement.offload, device=self.device, dtype=dtype
        )
        self.vae = vae
        self.prompt_encoder = prompt_encoder
        self.progress = progress
        self.model_name = model_name
        #: The steps ``SamplingSettings(steps=None)`` runs: the model's (:func:`flowlift.refine.loading.load_refiner`
        #: sets 4 for a step-distilled Klein), else the knob's 28.
        self.default_steps = STEPS.default

    def _with_steps(self, sampling: SamplingSettings | None) -> SamplingSettings:
        """``sampling`` (None: the knobs' defaults) with ``steps`` None as the model's (:attr:`default_steps`)."""
        sampling = check_kind("sampling", sampling, SamplingSettings, "a SamplingSettings", optional=True)
        sampling = sampling if sampling is not None else SamplingSettings()
        return sampling if sampling.steps is not None else replace(sampling, steps=self.default_steps)

    def _tiles(self, tiles: TileRequest | None) -> TileRequest:
        """A mode's ``tiles`` (a TileRequest; None: the refiner's own :attr:`tiling`)."""
        return check_kind("tiles", tiles, TileRequest, "a TileRequest", optional=True) or self.tiling

    # -- conditioning

    def _embeds(self, prompt: str | None, embeds: torch.Tensor | None, what: str) -> torch.Tensor | None:
        key = what.replace(" ", "_")  # the keywords: prompt / prompt_embeds, negative_prompt / negative_prompt_embeds
        if embeds is not None:
            name = f"{key}_embeds"
            check_holds_values(check_kind(name, embeds, torch.Tensor, "a tensor"), name, field=name)
            if not embeds.is_floating_point():  # checked here: the float32 cast below would hide an integer tensor
                message = f"{name} must be a float tensor (batch, tokens, dim), got {embeds.dtype}"
                raise FlowliftError(message, field=name)
            return embeds.to(self.device, torch.float32)
        if prompt is None:
            return None
        check_kind(key, prompt, str, "a string")
        if self.prompt_encoder is None:
            raise FlowliftError(
                f"no text encoder loaded to embed the {what}; pass precomputed embeddings (prompt_embeds)"
            )
        return self.prompt_encoder(prompt).to(self.device, torch.float32)

    def denoiser(
        self,
        *,
        prompt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        cfg_scale: float = 1.0,
        guidance: float | None = None,
        reference_images: Sequence[torch.Tensor] = (),
        **unknown: Any,
    ):
        """The :class:`~flowlift.flux2.denoiser.Flux2Denoiser` for a prompt (and references); any other keyword is
        one :class:`~flowlift.errors.FlowliftError` naming it."""
        from flowlift.flux2.denoiser import Flux2Denoiser

        check_conditioning(unknown, "denoiser")

        pos = self._embeds(prompt, prompt_embeds, "prompt")
        if pos is None:
            raise FlowliftError("give a prompt or prompt embeddings")
        cfg_scale = check_cfg_scale("cfg_scale", cfg_scale)  # before a negative prompt is embedded for it
        neg = None
        if cfg_scale == 1.0 and (negative_prompt is not None or negative_prompt_embeds is not None):
            raise FlowliftError(
                "a negative prompt is used only by true CFG: give cfg_scale other than 1 (Klein base models use ~4), "
                "or drop the negative prompt"
            )
        if cfg_scale != 1.0:
            neg = self._embeds(
                "" if negative_prompt is None else negative_prompt, negative_prompt_embeds, "negative prompt"
            )
        if reference_images is not None and not isinstance(reference_images, (list, tuple)):
            raise FlowliftError(
                f"reference_images must be a list of image tensors (or None), got {type(reference_images).__name__}",
                field="reference_images",
            )
        # clean, no noise
        refs = [self.encode(checked_images(img, "reference_images")) for img in reference_images or ()]
        return Flux2Denoiser(
            self.transformer,
            pos,
            negative_prompt_embeds=neg,
            cfg_scale=cfg_scale,
            guidance=guidance,
            reference_latents=refs,
        )

    def _conditioned(self, images: int, conditioning: dict[str, Any]):
        """:meth:`denoiser` for a mode's ``conditioning``, its embeddings' batch checked against the ``images`` the
        mode refines (:func:`~flowlift.flux2.denoiser.check_embeds_batch`), before any step: every strength checks
        the same conditioning, though strength 0 runs no step."""
        from flowlift.flux2.denoiser import check_embeds_batch

        den = self.denoiser(**conditioning)
        embeds = {"prompt_embeds": den.prompt_embeds, "negative_prompt_embeds": den.negative_prompt_embeds}
        check_embeds_batch(embeds, images)
        return den

    # -- VAE

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Images [0, 1] (sides multiples of 16) -> normalized latents."""
        check_kind("images", images, torch.Tensor, "an RGB tensor (B, 3, H, W)")
        report_stage("encode")  # the run's stage, for every door's progress (flowlift.progress)
        return finite_result("the VAE's encode", self.vae.encode, images.to(self.device), **self._tiling()).float()

    def _encode_init(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Init latents for img2img: raw + BN stats when the VAE exposes them, else normalized."""
        if hasattr(self.vae, "encode_raw") and getattr(self.vae, "bn_mean", None) is not None:
            report_stage("encode")
            raw = finite_result("the VAE", self.vae.encode_raw, images.to(self.device), **self._tiling()).float()
            return raw, self.vae.bn_mean.to(self.device), self.vae.bn_std.to(self.device)
        return self.encode(images), None, None

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalized latents -> images clamped to [0, 1]."""
        report_stage("decode")
        images = finite_result("the VAE's decode", self.vae.decode, latents, **self._tiling()).float()
        return images.clamp_(0.0, 1.0)

    def _tiling(self) -> dict[str, bool]:
        """The VAE's ``tiled`` argument when the memory plan decided it (VAEs without the argument never get it)."""
        return {} if self.vae_tiled is None else {"tiled": self.vae_tiled}

    # -- modes

    @with_transformer_on_device
    def _run(
        self,
        mode: str,
        velocity_fn: VelocityFn | None,
        *,
        init: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None,
        shape: Sequence[int] | None,
        denoising_start: float,
        sampling: SamplingSettings,
        mask: torch.Tensor | None = None,
        tiles: TileRequest,
    ) -> RefineResult:
        """:func:`~flowlift.refine.loop.refine_latents` with this refiner's schedule where ``sampling`` gives none,
        tiled for the frame as ``tiles`` and the memory plan say, on the refiner's device with its progress bar."""
        latents, bn_mean, bn_std = init if init is not None else (None, None, None)
        mu = self.mu if sampling.mu is None else sampling.mu
        schedule = self.schedule if sampling.schedule is None else sampling.schedule
        progress = _Progress(self.progress, mode)
        try:
            return refine_latents(
                velocity_fn,
                init_latents=latents,
                shape=shape,
                bn_mean=bn_mean,
                bn_std=bn_std,
                denoising_start=denoising_start,
                sampling=replace(sampling, mu=mu, schedule=schedule),
                mask=mask,
                on_step=progress,
                device=self.device,
                tiles=tiles,
                memory_plan=self.memory_plan,
            )
        finally:
            progress.close()  # a stopped or failed run's bar too: its ticker wrote a line after "interrupted"

    def _parameters(self, mode: str, result: RefineResult, sampling: SamplingSettings, **kwargs: Any) -> dict[str, Any]:
        where = {"model": self.model_name, "dtype": self.dtype, "device": self.device, "provenance": self.provenance}
        asked = {"steps": sampling.steps, "seed": sampling.seed, "sampler": sampling.sampler}
        return output_parameters(mode, result, **where, **kwargs, **asked)

    def txt2img(
        self,
        *,
        height: int,
        width: int,
        sampling: SamplingSettings | None = None,
        batch: int = 1,
        tiles: TileRequest | None = None,
        **conditioning: Any,
    ) -> RefineOutput:
        """Generate from pure noise (``denoising_start = 0``) at ``height x width`` (multiples of 16)."""
        check_conditioning(conditioning, "txt2img")
        batch = check_positive("batch", batch, integer=True)
        sampling = self._with_steps(sampling)
        tiles = self._tiles(tiles)
        width, height = check_txt2img_size(width, height, ("width", "height"))
        den = self._conditioned(batch, conditioning)
        shape = (batch, LATENT_CHANNELS, height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR)
        result = self._run(
            "txt2img",
            den,
            init=None,
            shape=shape,
            denoising_start=0.0,
            sampling=sampling,
            tiles=tiles,
        )
        params = self._parameters(
            "txt2img", result, sampling, height=height, width=width, **conditioning_parameters(conditioning, den)
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)

    def img2img(
        self,
        images: torch.Tensor,
        *,
        strength: float,
        strength_map: str = STRENGTH_MAP.default,
        sampling: SamplingSettings | None = None,
        mask: torch.Tensor | None = None,
        tiles: TileRequest | None = None,
        **conditioning: Any,
    ) -> RefineOutput:
        """Refine ``images`` (B, 3, H, W) in [0, 1] at ``strength``; with ``mask`` (B|1, 1, H, W) inpaint.

        Sides that are not multiples of 16 are edge-padded for the model and cropped back.
        ``strength`` 0 returns the VAE round trip of the input (no model call; the conditioning is checked as at any
        strength); 1 ignores the input (txt2img noise). The input is the output's size: within the 16384 px cap.
        """
        check_conditioning(conditioning, "inpaint" if mask is not None else "img2img")
        sampling = self._with_steps(sampling)
        tiles = self._tiles(tiles)
        images = checked_images(images)
        h, w = images.shape[-2:]
        check_within_cap(w, h, "images")  # the output is the input's size
        start = denoising_start_for(strength, strength_map)
        padded, _ = pad_to_multiple(images.to(self.device, torch.float32))
        lmask = None
        if mask is not None:
            lmask = latent_mask(pad_to_multiple(checked_mask(mask, images).to(self.device))[0])
        den = self._conditioned(images.shape[0], conditioning)  # checked at strength 0 too
        mode = "inpaint" if mask is not None else "img2img"
        result = self._run(
            mode,
            den if start < 1.0 else None,  # strength 0: no step, so no transformer (nor tiles) to run
            init=self._encode_init(padded),
            shape=None,
            denoising_start=start,
            sampling=sampling,
            mask=lmask,
            tiles=tiles,
        )
        out = self.decode(result.latents)[..., :h, :w]
        params = self._parameters(
            mode,
            result,
            sampling,
            strength=strength,
            strength_map=strength_map,
            denoising_start=round(start, 6),
            width=w,
            height=h,
            **(conditioning_parameters(conditioning, den) if start < 1.0 else {}),  # what a step used
        )
        return RefineOutput(out, result.latents, params)

    def inpaint(
        self, images: torch.Tensor, mask: torch.Tensor, *, strength: float = STRENGTH.default, **kwargs: Any
    ) -> RefineOutput:
        """Regenerate where ``mask`` is 1 (soft masks blend); the rest is kept (re-noised with the same noise). The
        default strength is ``--strength``'s (0.5), as every door's inpaint. A mask of None is refused (it would be
        img2img over the whole image)."""
        if mask is None:
            raise FlowliftError("mask must be an image or tensor in [0, 1] (1 = regenerate), got None", field="mask")
        return self.img2img(images, strength=strength, mask=mask, **kwargs)

    def outpaint(
        self,
        images: torch.Tensor,
        *,
        left: int = 0,
        top: int = 0,
        right: int = 0,
        bottom: int = 0,
        strength: float = OUTPAINT_STRENGTH,
        strength_map: str = STRENGTH_MAP.default,
        sampling: SamplingSettings | None = None,
        tiles: TileRequest | None = None,
        **conditioning: Any,
    ) -> RefineOutput:
        """Extend the canvas by the given borders (rounded up to 16 px) and paint them in.

        The border starts from an edge-replicated canvas; the original region's latents are the
        encoding of the original image alone and are kept exactly (mask 0) through every step.
        """
        check_conditioning(conditioning, "outpaint")
        start = check_outpaint_strength(strength, strength_map)  # a strength that runs no step paints nothing
        sampling = self._with_steps(sampling)
        tiles = self._tiles(tiles)
        images = checked_images(images).to(self.device)
        canvas, mask, pads = outpaint_canvas(images, left, top, right, bottom)
        lmask = latent_mask(mask)
        init, bn_mean, bn_std = self._encode_init(canvas)
        original, _, _ = self._encode_init(images)
        l8, t8 = pads[0] // VAE_SCALE_FACTOR, pads[1] // VAE_SCALE_FACTOR
        init = init.clone()
        init[:, :, t8 : t8 + original.shape[2], l8 : l8 + original.shape[3]] = original
        den = self._conditioned(images.shape[0], conditioning)
        result = self._run(
            "outpaint",
            den,
            init=(init, bn_mean, bn_std),
            shape=None,
            denoising_start=start,
            sampling=sampling,
            mask=lmask,
            tiles=tiles,
        )
        params = self._parameters(
            "outpaint",
            result,
            sampling,
            left=pads[0],
            top=pads[1],
            right=pads[2],
            bottom=pads[3],
            strength=strength,
            strength_map=strength_map,
            denoising_start=round(start, 6),
            **conditioning_parameters(conditioning, den),
        )
        return RefineOutput(self.decode(result.latents), result.latents, params)

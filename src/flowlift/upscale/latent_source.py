"""The Flow Upscaler as the hires fix's upscaler: :class:`FlowUpscalerSource`, refine's
:class:`~flowlift.refine.request.LatentUpscalerSource` for the Flow Upscaler.

refine/ asks an upscaler source two things: ``find`` its weights (with every other weight, before any loads) and
``load`` a latent-only :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` on the refiner's VAE (its BatchNorm
statistics), device and dtype, within what the refiner's memory plan leaves. A front-end builds the source and
hands it down in :class:`~flowlift.refine.request.HiresSettings`; refine/ never imports this package.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlift.upscale.latent_fraction import find_sesqui, sesqui_path
from flowlift.upscale.loading import DEFAULT_UPSCALER


@dataclass
class FlowUpscalerSource:
    """The Flow Upscaler's weights (``weights``: a file, folder or hub id; None: the released
    TensorForger/FlowUpscaler), or a UNet already in memory (``unet``, shared with an upscale pipeline: the web
    app's), for the hires fix."""

    weights: str | None = None
    unet: Any = None
    latent_upscaler: str | None = None  # "sesqui:PATH": SesquiLSR for a fractional scale's last step

    def __post_init__(self) -> None:
        from flowlift.knobs import check_kind, check_path

        check_path("weights", self.weights, optional=True)  # "" named the released weights, 5 failed in find()
        check_kind("unet", self.unet, torch.nn.Module, "a Flow Upscaler UNet (a torch module)", optional=True)
        if self.latent_upscaler is not None:
            sesqui_path(self.latent_upscaler)  # a malformed spec is one line at construction

    @property
    def name(self) -> str:
        """What the output's metadata records as the upscaler."""
        return self.weights or DEFAULT_UPSCALER

    def find(self) -> Path:
        """The weights file (one line saying how to get it when it is missing)."""
        from flowlift.upscale.loading import find_upscaler_file

        if self.latent_upscaler is not None:
            find_sesqui(self.latent_upscaler)
        return find_upscaler_file(self.name)

    def load(
        self,
        vae: Any,
        *,
        device: Any,
        dtype: Any,
        budget_bytes: int | None = None,
        check_interrupt: Callable[[], None] | None = None,
    ) -> Any:
        """A latent-only pipeline on ``vae`` (the refiner's), ``budget_bytes`` its memory budget (None: by size),
        ``check_interrupt`` asked before every layer of its passes (the web app's Stop; the pipeline's own)."""
        from flowlift.upscale.pipeline import FlowUpscalerPipeline
        from flowlift.upscale.settings import MemoryPolicy

        weights = self.unet if self.unet is not None else self.find()
        memory = MemoryPolicy(max_memory=budget_bytes)
        pipeline = FlowUpscalerPipeline(
            weights, vae, device=device, dtype=dtype, memory=memory, check_interrupt=check_interrupt
        )
        if self.latent_upscaler is None:
            return FractionalUpscaler(pipeline, None, vae, None)
        return FractionalUpscaler.loading(pipeline, vae, self.latent_upscaler)


class FractionalUpscaler:
    """The Flow Upscaler's whole 2x passes (``upscale_latents``) and, with SesquiLSR (``sesqui``; None: passes only),
    the fraction (``to_size``): normalized -> raw with the VAE's BN statistics -> SesquiLSR to the size -> normalized
    (:func:`flowlift.models.sesqui_lsr.sesqui_upscale_latents`; TAEF2/Mage-VAE have no statistics: one line).
    ``check_memory`` refuses before any work what they would refuse under the pipeline's ``max_memory``."""

    def __init__(self, pipeline: Any, sesqui: Any, vae: Any, spec: str | None) -> None:
        self.pipeline, self.sesqui, self.vae, self.latent_upscaler = pipeline, sesqui, vae, spec

    @classmethod
    def loading(cls, pipeline: Any, vae: Any, spec: str) -> FractionalUpscaler:
        """``pipeline`` (latent-only) with SesquiLSR loaded from ``spec``'s file in float32 on the pipeline's device."""
        from flowlift.models.sesqui_lsr import load_sesqui_lsr

        sesqui = load_sesqui_lsr(find_sesqui(spec), device=pipeline.device, dtype=torch.float32)
        return cls(pipeline, sesqui, vae, spec)

    def upscale_latents(self, latents: Any, num_passes: int, **options: Any) -> Any:
        return self.pipeline.upscale_latents(latents, num_passes, **options)

    def check_memory(
        self, latent_size: tuple[int, int], num_passes: int, target: tuple[int, int] | None, batch: int = 1
    ) -> None:
        """One FlowliftError line now when the pipeline's ``max_memory`` cannot hold ``num_passes`` passes from
        ``latent_size`` (h, w) latents, or SesquiLSR from their output to ``target`` (None: no fraction): what
        :meth:`upscale_latents` and :meth:`to_size` would refuse, said before a hires fix's base pass runs."""
        from flowlift.upscale.memory_plan import latent_upscaler_rows

        pipeline = self.pipeline
        if pipeline.max_memory is None:
            return
        (h, w), factor = latent_size, pipeline.spatial_factor
        pipeline.plan_memory(h * factor, w * factor, num_passes, batch, latents_only=True)  # as upscale_latents plans
        if target is not None and self.sesqui is not None:
            latent_upscaler_rows(pipeline, self.sesqui, (h * 2**num_passes, w * 2**num_passes), tuple(target), batch)

    def to_size(self, latents: Any, size: tuple[int, int]) -> Any:
        """Normalized latents (B, 32, h, w) -> normalized latents of latent ``size`` (h, w), each side 1-2x;
        whole-frame or in bands as the pipeline's memory settings say
        (:func:`flowlift.upscale.memory_plan.latent_upscaler_rows`)."""
        from flowlift.errors import FlowliftError
        from flowlift.models.sesqui_bands import sesqui_to_size
        from flowlift.upscale.interrupts import checked_modules
        from flowlift.upscale.memory_plan import latent_upscaler_rows

        if self.sesqui is None:
            raise FlowliftError(f"a fraction of 2x ({size[0]}x{size[1]} latents) needs a latent upscaler (SesquiLSR)")
        bn_mean, bn_std = getattr(self.vae, "bn_mean", None), getattr(self.vae, "bn_std", None)
        passed, batch = tuple(latents.shape[-2:]), latents.shape[0]
        rows = latent_upscaler_rows(self.pipeline, self.sesqui, passed, tuple(size), batch)
        with checked_modules(self.pipeline.check_interrupt, [self.sesqui]):  # a door's cancel, before every layer
            return sesqui_to_size(self.sesqui, latents, size, bn_mean, bn_std, rows)

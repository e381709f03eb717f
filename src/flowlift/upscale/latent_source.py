"""The Flow Upscaler as the hires fix's upscaler: :class:`FlowUpscalerSource`, refine's
:class:`~flowlift.refine.request.LatentUpscalerSource` for the Flow Upscaler.

refine/ asks an upscaler source two things: ``find`` its weights (with every other weight, before any loads) and
``load`` a latent-only :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` on the refiner's VAE (its BatchNorm
statistics), device and dtype, within what the refiner's memory plan leaves. A front-end builds the source and
hands it down in :class:`~flowlift.refine.request.HiresSettings`; refine/ never imports this package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowlift.upscale.loading import DEFAULT_UPSCALER


@dataclass
class FlowUpscalerSource:
    """The Flow Upscaler's weights (``weights``: a file, folder or hub id; None: the released
    TensorForger/FlowUpscaler), or a UNet already in memory (``unet``, shared with an upscale pipeline: the web
    app's), for the hires fix."""

    weights: str | None = None
    unet: Any = None

    @property
    def name(self) -> str:
        """What the output's metadata records as the upscaler."""
        return self.weights or DEFAULT_UPSCALER

    def find(self) -> Path:
        """The weights file (one line saying how to get it when it is missing)."""
        from flowlift.upscale.loading import resolve_upscaler_file

        return resolve_upscaler_file(self.name)

    def load(self, vae: Any, *, device: Any, dtype: Any, budget_bytes: int | None = None) -> Any:
        """A latent-only pipeline on ``vae`` (the refiner's), ``budget_bytes`` its memory budget (None: by size)."""
        from flowlift.upscale.pipeline import FlowUpscalerPipeline
        from flowlift.upscale.settings import MemoryPolicy

        weights = self.unet if self.unet is not None else self.find()
        memory = MemoryPolicy(max_memory=budget_bytes)
        return FlowUpscalerPipeline(weights, vae, device=device, dtype=dtype, memory=memory)

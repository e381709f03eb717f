"""What :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` checks of its inputs beyond the knobs: finite
values at every stage, and a Pillow or RGBA array input's alpha split off to be re-attached after the upscale.

Seeds, counts and strengths are the knob checks (:func:`flowlift.knobs.check_seed`, :func:`~flowlift.knobs.check_count`,
:func:`~flowlift.knobs.check_unit_interval`), latents :func:`flowlift.flux2.latents.check_latents`. Each refusal is one
:class:`~flowlift.errors.FlowliftError` line instead of a ``ValueError: not enough values to unpack`` from deep inside.
"""

from __future__ import annotations

from typing import Any

import torch

from flowlift.errors import FlowliftError


def non_finite_refusal(stage: str, what: str = "latents") -> FlowliftError:
    """The pipeline's line for a stage whose result holds NaN or Inf: ``"<stage> non-finite <what> (NaN/Inf)"``."""
    return FlowliftError(f"Flow Upscaler: {stage} non-finite {what} (NaN/Inf); nothing was written")


def check_finite(tensor: torch.Tensor, stage: str, what: str = "latents") -> None:
    """Raise :func:`non_finite_refusal` unless every value is finite (one read,
    :func:`flowlift.devices.non_finite_kind`)."""
    from flowlift.devices import non_finite_kind

    if non_finite_kind(tensor) is not None:
        raise non_finite_refusal(stage, what)


def image_alpha(image: Any) -> Any:
    """The alpha channel of a Pillow image (palette transparency included) or of an RGBA array
    (:func:`flowlift.files.images.array_alpha`) as a Pillow ``"L"`` image, else None."""
    import numpy as np
    from PIL import Image

    if isinstance(image, np.ndarray):
        from flowlift.files.images import array_alpha

        return array_alpha(image)
    if not isinstance(image, Image.Image):
        return None
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").getchannel("A")
    return None

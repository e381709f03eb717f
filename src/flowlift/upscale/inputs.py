"""What the public entry points accept, checked at the door: :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`'s
methods, :func:`~flowlift.upscale.colorfix_image.color_fix_image` and :func:`~flowlift.refine.loop.refine_latents`.

Seeds lie in [0, 2^64 - 1] (:data:`flowlift.knobs.SEED`), counts are non-negative integers, strengths
real numbers in [0, 1], latents floating (B, 32, h, w) tensors (the package's normalized, unpatchified
FLUX.2 layout) with finite values; a
Pillow input's alpha is split off to be re-attached after the upscale. Each refusal is one
:class:`~flowlift.errors.FlowliftError` line instead of a ``ValueError: not enough values to unpack``
from deep inside.
"""

from __future__ import annotations

from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import (
    check_latents,  # noqa: F401  (its home; imported from here too)
)
from flowlift.knobs import check_count, check_unit_interval  # noqa: F401  (their home; imported from here too)
from flowlift.knobs import check_seed as _check_seed


def check_seed(seed: Any) -> int | list[int]:
    """A seed of :data:`flowlift.knobs.SEED` ([0, 2^64 - 1], exact), or a sequence of them (one per image of a
    batch), else one line."""
    return _check_seed(seed)


def check_finite(tensor: torch.Tensor, stage: str, what: str = "latents") -> None:
    """Raise ``"<stage> non-finite <what> (NaN/Inf)"`` unless every value is finite (one reduction)."""
    if not bool(torch.isfinite(tensor).all()):
        raise FlowliftError(f"Flow Upscaler: {stage} non-finite {what} (NaN/Inf); nothing was written")


def image_alpha(image: Any) -> Any:
    """The alpha channel of a Pillow image (palette transparency included), else None."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        return None
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (image.mode == "P" and "transparency" in image.info):
        return image.convert("RGBA").getchannel("A")
    return None

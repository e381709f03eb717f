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
from flowlift.flux2.latents import LATENT_CHANNELS
from flowlift.knobs import check_seed as _check_seed


def check_count(name: str, value: Any) -> int:
    """``value`` as an int if it is a non-negative integer (numpy ints too; not bool, not 1.5), else one line."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise FlowliftError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_seed(seed: Any) -> int | list[int]:
    """A seed of :data:`flowlift.knobs.SEED` ([0, 2^64 - 1], exact), or a sequence of them (one per image of a
    batch), else one line."""
    return _check_seed(seed)


def check_unit_interval(name: str, value: Any) -> float:
    """``value`` as a float if it is a real number in [0, 1] (not bool, not a string, not NaN), else one line."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise FlowliftError(f"{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_latents(latents: Any, where: str, *, even: bool = False) -> torch.Tensor:
    """``latents`` if they are package-convention latents: a floating (B, 32, h, w) tensor, every size >= 1
    (``even``: h and w even, as FLUX.2's 2x2 patches need), all values finite; else one line starting with
    ``where`` (the entry point's name)."""
    if not isinstance(latents, torch.Tensor):
        raise FlowliftError(
            f"{where}: latents must be a torch.Tensor of shape (B, {LATENT_CHANNELS}, h, w), "
            f"got {type(latents).__name__}"
        )
    shape = tuple(latents.shape)
    if latents.ndim != 4 or shape[1] != LATENT_CHANNELS:
        raise FlowliftError(
            f"{where}: latents must have shape (B, {LATENT_CHANNELS}, h, w) (normalized, unpatchified FLUX.2 "
            f"latents), got {shape}"
        )
    if min(shape) < 1:
        raise FlowliftError(f"{where}: the latents are empty, shape {shape}")
    if even and (shape[2] % 2 or shape[3] % 2):
        raise FlowliftError(f"{where}: latents need an even height and width (FLUX.2's 2x2 patches), got {shape}")
    if not latents.is_floating_point():
        raise FlowliftError(f"{where}: latents must be floating point, got {str(latents.dtype).removeprefix('torch.')}")
    if not bool(torch.isfinite(latents).all()):
        raise FlowliftError(f"{where}: the input latents contain non-finite values (NaN/Inf)")
    return latents


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

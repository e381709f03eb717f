"""What :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`'s public methods accept, checked at the door.

Seeds and counts must be non-negative integers, tensors finite; a Pillow input's alpha is split off
to be re-attached after the upscale. Each refusal is one :class:`~flowlift.errors.FlowliftError` line.
"""

from __future__ import annotations

from typing import Any

import torch

from flowlift.errors import FlowliftError


def check_count(name: str, value: Any) -> int:
    """``value`` as an int if it is a non-negative integer (numpy ints too; not bool, not 1.5), else one line."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise FlowliftError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


def check_seed(seed: Any) -> int | list[int]:
    """A non-negative integer seed, or a sequence of them (one per image of a batch), else one line."""
    if isinstance(seed, (list, tuple)):
        return [check_count("seed", value) for value in seed]
    return check_count("seed", seed)


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

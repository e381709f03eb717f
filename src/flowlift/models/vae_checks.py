"""What every VAE adapter (:mod:`flowlift.models.vae`) checks of its inputs, and the dtype it answers in.

Each refusal is one :class:`~flowlift.errors.FlowliftError` line before any model work: images must be float
(B, 3, H, W) in [0, 1] (0..255 or -1..1 given are refused) with sides a multiple of the VAE's, latents float
(B, 32, h, w), both finite; ``tiled`` is True, False or None and nothing else.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flowlift.devices import check_holds_values
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import LATENT_CHANNELS


def value_range(x: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of a float tensor in one read (``aminmax``: a NaN comes out in both, an Inf in one); (0, 0)
    for an empty one."""
    if not x.numel():
        return 0.0, 0.0
    try:
        low, high = torch.aminmax(x.detach())
    except (NotImplementedError, RuntimeError):  # a dtype without the kernel (float8)
        low, high = torch.aminmax(x.detach().float())
    return float(low), float(high)


def check_images(images: torch.Tensor, multiple: int) -> None:
    """Images for an encode: float (B, 3, H, W), finite, in [0, 1] (within 0.5), sides multiples of ``multiple``."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise FlowliftError(f"VAE encode expects images of shape (B, 3, H, W), got {shape}")
    if not images.is_floating_point():
        raise FlowliftError(f"VAE encode expects float images in [0, 1], got dtype {images.dtype}")
    check_holds_values(images, "VAE encode: the images")
    low, high = value_range(images)
    if not (math.isfinite(low) and math.isfinite(high)):
        raise FlowliftError("VAE encode: the images hold NaN or Inf")
    if not -0.5 <= low <= high <= 1.5:  # 0..255 or -1..1 given
        raise FlowliftError(f"VAE encode expects images in [0, 1], got values in [{low:g}, {high:g}]")
    h, w = images.shape[-2:]
    if h % multiple or w % multiple or h == 0 or w == 0:
        raise FlowliftError(f"VAE encode needs image sides that are multiples of {multiple}, got {h}x{w}; resize first")


def tiles_asked(tiled: Any, by_size: bool) -> bool:
    """``tiled`` as asked (None: ``by_size``); a bool or None and nothing else (``"no"`` would tile)."""
    if tiled is not None and not isinstance(tiled, bool):
        raise FlowliftError(f"tiled must be True, False or None (by size), got {tiled!r}", field="tiled")
    return by_size if tiled is None else tiled


def check_latents(latents: torch.Tensor, multiple: int) -> None:
    """Latents for a decode: float (B, 32, h, w), finite, sides multiples of ``multiple``."""
    if not isinstance(latents, torch.Tensor) or latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise FlowliftError(f"VAE decode expects latents of shape (B, {LATENT_CHANNELS}, h, w), got {shape}")
    if not latents.is_floating_point():
        raise FlowliftError(f"VAE decode expects float latents, got dtype {latents.dtype}")
    check_holds_values(latents, "VAE decode: the latents")
    if not all(math.isfinite(end) for end in value_range(latents)):
        raise FlowliftError("VAE decode: the latents hold NaN or Inf")
    h, w = latents.shape[-2:]
    if h % multiple or w % multiple or h == 0 or w == 0:
        raise FlowliftError(f"VAE decode needs latent sides that are multiples of {multiple}, got {h}x{w}")


def out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an adapter answers in: the input's floating dtype, float32 for an integer input."""
    return x.dtype if x.is_floating_point() else torch.float32

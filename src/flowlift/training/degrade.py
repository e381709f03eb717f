"""Pixel-space degradation: how the Flow Upscaler's conditioning latents are made.

The model card is explicit: the conditioning latent of a high-resolution target latent ``z`` is

    cond = encode(degrade(decode(z)))

where ``degrade`` is a 2x **antialiased downscale in pixel space** (area filter by default, the
``INTER_AREA`` box average for an integer factor), optionally followed by JPEG compression and/or
Gaussian pixel noise. Downscaling the latent itself (``F.interpolate(z, scale_factor=0.5)``) breaks
the VAE's latent patterns and trains a blurry model; nothing here ever does that.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError

FILTERS = ("area", "bicubic", "bilinear", "lanczos")


class LatentCodec(Protocol):
    """The part of a flowlift VAE the training code uses (normalized 32-channel latents)."""

    def encode(self, images: torch.Tensor) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class Degradation:
    """How a high-resolution image becomes the low-resolution input the model is conditioned on.

    ``filter``: antialiased downscale filter (``area`` = box average, the default and the model
    card's choice; ``bicubic``/``bilinear`` with antialiasing; ``lanczos`` through Pillow).
    ``factor``: integer downscale factor (2 for the released model).
    ``jpeg_quality``: if set (1-100), the downscaled image goes through a JPEG round trip.
    ``noise_std``: standard deviation of Gaussian noise added to the downscaled image ([0, 1] units).
    """

    filter: str = "area"
    factor: int = 2
    jpeg_quality: int | None = None
    noise_std: float = 0.0

    def __post_init__(self) -> None:
        from flowlift.knobs import check_positive, check_quality, check_unit_interval

        if not isinstance(self.filter, str) or self.filter not in FILTERS:
            raise FlowliftError(f"filter must be one of {', '.join(FILTERS)}, got {self.filter!r}", field="filter")
        # the checked values are the ones kept: numpy's int64 / float32 pass the checks but are no JSON (the manifest)
        object.__setattr__(self, "factor", check_positive("factor", self.factor, integer=True))
        object.__setattr__(self, "jpeg_quality", check_quality(self.jpeg_quality, "jpeg_quality"))
        # in [0, 1] image units: past 1 the conditioning is only noise
        object.__setattr__(self, "noise_std", check_unit_interval("noise_std", self.noise_std))

    @property
    def is_deterministic(self) -> bool:
        return self.noise_std == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Degradation:
        known = {"filter", "factor", "jpeg_quality", "noise_std"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FlowliftError(f"unknown degradation setting(s): {', '.join(unknown)}")
        return cls(**data)


def pil_lanczos_resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Pillow LANCZOS resize of (B, C, H, W) to ``size = (h, w)``, per channel in float mode ('F'),
    so nothing is quantized (antialiased when shrinking)."""
    from PIL import Image

    out = torch.empty(images.shape[0], images.shape[1], size[0], size[1], dtype=torch.float32)
    array = images.detach().to("cpu", torch.float32).numpy()
    for b in range(array.shape[0]):
        for c in range(array.shape[1]):
            plane = Image.fromarray(np.ascontiguousarray(array[b, c]), mode="F")
            resized = plane.resize((size[1], size[0]), Image.Resampling.LANCZOS)
            out[b, c] = torch.from_numpy(np.array(resized, dtype=np.float32))
    return out.to(images.device, images.dtype)


def downscale(images: torch.Tensor, factor: int = 2, filter: str = "area") -> torch.Tensor:
    """Antialiased integer downscale of images (B, C, H, W); H and W must be multiples of ``factor``.

    ``area``: ``out[i, j] = mean(images[f*i : f*i+f, f*j : f*j+f])`` (box filter, = cv2 INTER_AREA).
    ``bicubic`` / ``bilinear``: ``F.interpolate(..., antialias=True)`` (filter support scaled by f).
    ``lanczos``: Pillow's Lanczos-3, support scaled by f.
    """
    h, w = images.shape[-2:]
    if h % factor or w % factor:
        raise FlowliftError(f"image size {h}x{w} is not divisible by the downscale factor {factor}")
    size = (h // factor, w // factor)
    if filter == "area":
        return F.avg_pool2d(images, kernel_size=factor, stride=factor)
    if filter in ("bicubic", "bilinear"):
        return F.interpolate(images, size=size, mode=filter, antialias=True, align_corners=False)
    if filter == "lanczos":
        return pil_lanczos_resize(images, size)
    raise FlowliftError(f"degradation filter must be one of {', '.join(FILTERS)}, got {filter!r}")


def jpeg_roundtrip(images: torch.Tensor, quality: int) -> torch.Tensor:
    """Encode each image as 8-bit JPEG at ``quality`` (4:2:0, Pillow) and decode it back to [0, 1]."""
    from PIL import Image

    out = []
    array = (images.detach().clamp(0, 1).to("cpu", torch.float32) * 255).round().to(torch.uint8)
    for image in array:
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=int(quality))
        buffer.seek(0)
        decoded = np.asarray(Image.open(buffer).convert("RGB"), dtype=np.float32) / 255.0
        out.append(torch.from_numpy(decoded).permute(2, 0, 1))
    return torch.stack(out).to(images.device, images.dtype)


#: One generator for a whole batch, or one per image (a sequence as long as the batch).
Generators = torch.Generator | Sequence[torch.Generator] | None


def _pixel_noise(shape: torch.Size, generator: Generators) -> torch.Tensor:
    """Standard normal noise of ``shape`` (B, C, H, W) on the CPU: image ``b``'s from ``generator[b]`` when given one
    per image (so an image's noise does not depend on the batch it is in), else the batch's from one generator."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(shape, generator=generator, dtype=torch.float32, device="cpu")
    if len(generator) != shape[0]:
        raise FlowliftError(f"{len(generator)} generators for a batch of {shape[0]} images; give one per image")
    return torch.stack([torch.randn(shape[1:], generator=g, dtype=torch.float32, device="cpu") for g in generator])


def degrade_images(images: torch.Tensor, degradation: Degradation, generator: Generators = None) -> torch.Tensor:
    """Apply ``degradation`` to images in [0, 1]: clamp, downscale, optional JPEG, optional noise.

    Noise is drawn on the CPU (float32) from ``generator``, one for the batch or one per image, so a seed gives the
    same result anywhere (and, one per image, whatever the batch).
    """
    x = downscale(images.clamp(0, 1), degradation.factor, degradation.filter)
    if degradation.jpeg_quality is not None:
        x = jpeg_roundtrip(x, degradation.jpeg_quality)
    if degradation.noise_std > 0:
        noise = _pixel_noise(x.shape, generator)
        x = (x + degradation.noise_std * noise.to(x.device, x.dtype)).clamp(0, 1)
    return x


@torch.no_grad()
def conditioning_from_images(
    vae: LatentCodec,
    images: torch.Tensor,
    degradation: Degradation | None = None,
    generator: Generators = None,
) -> torch.Tensor:
    """``encode(degrade(images))``: the conditioning latent of a high-resolution image batch."""
    degradation = degradation or Degradation()
    return vae.encode(degrade_images(images, degradation, generator))


@torch.no_grad()
def conditioning_latents(
    vae: LatentCodec,
    target_latents: torch.Tensor,
    degradation: Degradation | None = None,
    generator: Generators = None,
) -> torch.Tensor:
    """Conditioning of a target latent: ``encode(degrade(decode(target)))`` — decode, pixel-space
    antialiased downscale (area by default), re-encode. Shape (B, 32, H/f, W/f) for target (B, 32, H, W).
    """
    images = vae.decode(target_latents)
    return conditioning_from_images(vae, images, degradation, generator)

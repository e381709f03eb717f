"""FLUX.2 latent layouts and normalization.

The FLUX.2 VAE emits *raw* latents with 32 channels at 1/8 of the image size. The transformer (and
the Flow Upscaler) work on *normalized* latents:

1. patchify 2x2 into 128 channels, channel index ``c*4 + pi*2 + pj``;
2. per 128 channels, ``(z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)``.

flowlift's default latent is that normalized tensor *unpatchified* back to 32 channels at 1/8 size
(the Flow Upscaler's input convention). ``patchified`` means (B, 128, H/2, W/2) — ComfyUI's FLUX.2
LATENT — and ``packed`` means the transformer's token layout (B, h*w, 128).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.limits import LATENT_CHANNELS

PATCHIFIED_CHANNELS = 128
VAE_SCALE_FACTOR = 8
DEFAULT_BATCH_NORM_EPS = 1e-4


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, 4C, H/2, W/2) with channel index ``c*4 + pi*2 + pj``.

    ``out[b, c*4 + pi*2 + pj, i, j] = latents[b, c, 2i + pi, 2j + pj]``.
    """
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"patchify needs even height and width, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(patchified: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify`: (B, 4C, h, w) -> (B, C, 2h, 2w)."""
    b, c4, h, w = patchified.shape
    if c4 % 4:
        raise ValueError(f"unpatchify needs a channel count divisible by 4, got {c4}")
    x = patchified.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


def pack(patchified: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C) transformer tokens, row-major over (h, w)."""
    b, c, h, w = patchified.shape
    return patchified.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack`: (B, h*w, C) -> (B, C, h, w) for the given token grid ``height x width``."""
    b, n, c = packed.shape
    if n != height * width:
        raise ValueError(f"unpack: {n} tokens do not fill a {height}x{width} grid")
    return packed.permute(0, 2, 1).reshape(b, c, height, width)


def bn_std(running_var: torch.Tensor, eps: float = DEFAULT_BATCH_NORM_EPS) -> torch.Tensor:
    """``sqrt(running_var + eps)``, the divisor of FLUX.2 latent normalization."""
    return torch.sqrt(running_var + eps)


def _apply_per_patchified_channel(latents: torch.Tensor, fn) -> torch.Tensor:
    """Run ``fn`` on the 128-channel view: 32-channel inputs are patchified and back."""
    channels = latents.shape[1]
    if channels == PATCHIFIED_CHANNELS:
        return fn(latents)
    if channels == LATENT_CHANNELS:
        return unpatchify(fn(patchify(latents)))
    raise ValueError(f"expected {LATENT_CHANNELS} or {PATCHIFIED_CHANNELS} latent channels, got {channels}")


def normalize(latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """Raw -> normalized: ``(z - bn_mean) / bn_std`` per patchified channel.

    Accepts 32-channel (B, 32, H, W) or 128-channel patchified (B, 128, h, w) latents and returns
    the same layout. ``bn_mean`` and ``bn_std`` have shape [128].
    """

    def fn(z: torch.Tensor) -> torch.Tensor:
        mean = bn_mean.to(z.device, z.dtype).view(1, -1, 1, 1)
        std = bn_std.to(z.device, z.dtype).view(1, -1, 1, 1)
        return (z - mean) / std

    return _apply_per_patchified_channel(latents, fn)


def denormalize(latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """Normalized -> raw: ``z * bn_std + bn_mean``; inverse of :func:`normalize`, same layouts."""

    def fn(z: torch.Tensor) -> torch.Tensor:
        mean = bn_mean.to(z.device, z.dtype).view(1, -1, 1, 1)
        std = bn_std.to(z.device, z.dtype).view(1, -1, 1, 1)
        return z * std + mean

    return _apply_per_patchified_channel(latents, fn)


def seeded_noise(
    shape: Sequence[int],
    seed: int | torch.Generator,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Unit Gaussian noise drawn on the CPU in float32, then moved to ``device``/``dtype``.

    Drawing on the CPU in a fixed dtype makes one seed give the same noise on every device.
    ``seed`` may be an int or a CPU :class:`torch.Generator` (to continue a stream).
    """
    if isinstance(seed, torch.Generator):
        generator = seed
    else:
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
    noise = torch.randn(tuple(shape), generator=generator, device="cpu", dtype=torch.float32)
    return noise.to(device=device, dtype=dtype)


def latent_size(image_height: int, image_width: int) -> tuple[int, int]:
    """Latent grid (h, w) of an image: 1/8 of each side (sides must be multiples of 8)."""
    if image_height % VAE_SCALE_FACTOR or image_width % VAE_SCALE_FACTOR:
        raise ValueError(f"image size {image_height}x{image_width} is not a multiple of {VAE_SCALE_FACTOR}")
    return image_height // VAE_SCALE_FACTOR, image_width // VAE_SCALE_FACTOR


def image_seq_len(latent_height: int, latent_width: int) -> int:
    """Transformer sequence length of a 32-channel latent grid: (h/2) * (w/2) packed tokens."""
    return (latent_height // 2) * (latent_width // 2)


def to_comfyui_latent(latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """flowlift latents -> ComfyUI's FLUX.2 ``LATENT`` dict (normalized, patchified 4-D ``samples``)."""
    return {"samples": patchify(latents)}


def from_comfyui_latent(latent: dict[str, torch.Tensor]) -> torch.Tensor:
    """ComfyUI's FLUX.2 ``LATENT`` dict -> flowlift latents (normalized, unpatchified 32 channels)."""
    samples = latent["samples"]
    if samples.ndim != 4 or samples.shape[1] != PATCHIFIED_CHANNELS:
        raise ValueError(f"expected a FLUX.2 LATENT of shape (B, 128, h, w), got {tuple(samples.shape)}")
    return unpatchify(samples)


def check_bn_statistics(bn_mean: Any, bn_std: Any, where: str) -> None:
    """Both FLUX.2 VAE BatchNorm statistics or neither, each a floating (128,) tensor of the patchified channels,
    ``bn_mean`` finite and ``bn_std`` finite and above 0; else one line naming the field (``where``, the entry point,
    for a missing half). A string was an AttributeError, a 5-element tensor a RuntimeError mid-normalization, a
    NaN ran a whole sampler first, and a negative std mirrors the latents silently."""
    if (bn_mean is None) != (bn_std is None):
        raise FlowliftError(f"{where}: give both bn_mean and bn_std, or neither")
    for name, value in (("bn_mean", bn_mean), ("bn_std", bn_std)):
        if value is None:
            continue
        statistics = isinstance(value, torch.Tensor) and value.is_floating_point()
        if not statistics or value.shape != (PATCHIFIED_CHANNELS,):
            shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise FlowliftError(
                f"{name} must be a floating tensor of the VAE's {PATCHIFIED_CHANNELS} statistics, got {shown}",
                field=name,
            )
    if bn_mean is None:
        return
    from flowlift.devices import check_holds_values

    check_holds_values(bn_mean, "bn_mean", field="bn_mean")
    check_holds_values(bn_std, "bn_std", field="bn_std")
    if not bool(torch.isfinite(bn_mean).all()):
        raise FlowliftError("bn_mean must be finite (the VAE's BatchNorm means), got NaN or Inf", field="bn_mean")
    if not bool((bn_std > 0).all() and torch.isfinite(bn_std).all()):
        raise FlowliftError(
            "bn_std must be finite and above 0 (the VAE's BatchNorm standard deviations)", field="bn_std"
        )


def check_latents(latents: Any, where: str, *, even: bool = False, what: str = "the input latents") -> torch.Tensor:
    """``latents`` if they are package-convention latents: a floating (B, 32, h, w) tensor, every size >= 1
    (``even``: h and w even, as FLUX.2's 2x2 patches need), all values finite; else one line starting with
    ``where`` (the entry point's name). ``what`` names the latents in the non-finite line: a caller checking what
    a model returned says so, since "the input latents" would send the user to look at the wrong tensor."""
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
    from flowlift.devices import non_finite_kind

    if non_finite_kind(latents, f"{where}: the latents") is not None:
        raise FlowliftError(f"{where}: {what} contain non-finite values (NaN/Inf)")
    return latents

"""Canvas geometry in pixels: the input images checked, the 16-pixel grid, edge padding, the latent mask and the
outpaint canvas.

Pure pixel geometry, no model: what img2img, inpaint, outpaint and the hires fix do to an image and its mask before
the VAE sees them, and what the command line checks outpaint borders (and an outpaint's strength: one that runs no
step paints nothing) with before it loads any weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flowlift.devices import check_holds_values
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.limits import PIXEL_MULTIPLE, cap_words
from flowlift.refine.loop import denoising_start_for


def checked_images(images: Any, name: str = "images", channels: int = 3) -> torch.Tensor:
    """``images`` (B, ``channels``, H, W), none of B, H, W zero, as float32 in [0, 1], else one line naming ``name``:
    floats must be finite and lie in [0, 1] (a [0, 255] float image is refused, not read as 255 times too bright);
    ``uint8`` is scaled by its range, ``x / 255``, and ``bool`` read as 0 and 1; other dtypes are refused."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != channels or not images.numel():
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        kind = "an RGB tensor" if channels == 3 else f"a {channels}-channel tensor"
        raise FlowliftError(f"{name} must be {kind} (B, {channels}, H, W), none of them 0, got {got}", field=name)
    check_holds_values(images, name, field=name)
    if images.dtype in (torch.uint8, torch.bool):
        return images.float() / (255.0 if images.dtype == torch.uint8 else 1.0)
    if not images.is_floating_point():
        raise FlowliftError(f"{name} must be float in [0, 1] or uint8, got {images.dtype}", field=name)
    images = images.detach().float()  # a caller's requires_grad tensor: its min/max read without torch's warning
    if not bool(torch.isfinite(images).all()):
        raise FlowliftError(f"{name}: non-finite values (NaN/Inf)", field=name)
    low, high = float(images.min()), float(images.max())
    if low < 0.0 or high > 1.0:
        raise FlowliftError(
            f"{name} must lie in [0, 1] (uint8 is scaled by 255), got values in [{low:g}, {high:g}]", field=name
        )
    return images


def checked_mask(mask: Any, images: torch.Tensor) -> torch.Tensor:
    """An inpaint mask for ``images`` (B, 3, H, W): (1 or B, 1, H, W) in [0, 1] (1 = regenerate) as float32, by
    :func:`checked_images`' rules (uint8 / 255, bool 0 and 1), else one line naming ``mask``. A mask that is 0
    everywhere (for any image of the batch) is refused too: it regenerates nothing, and the inpaint would run every
    step to write the VAE round trip, as outpaint's borders of 0 would (the command line reads its file through here,
    before any model loads)."""
    mask = checked_images(mask, "mask", channels=1)
    (b, _, h, w), (mb, _, mh, mw) = images.shape, mask.shape
    if (mh, mw) != (h, w):
        raise FlowliftError(f"mask size {mw}x{mh} differs from the image {w}x{h}", field="mask")
    if mb not in (1, b):
        raise FlowliftError(f"mask has a batch of {mb} for {b} image(s): give one mask or one per image", field="mask")
    empty = [i for i in range(mb) if not bool(mask[i].any())]
    if empty:
        which = "mask" if mb == 1 else f"the mask of image {empty[0]} (of {mb})"
        raise FlowliftError(
            f"{which} is all 0 (black: keep everything): nothing to paint; use img2img to refine the whole image, or "
            "paint white where to regenerate",
            field="mask",
        )
    return mask


def pad_to_multiple(images: torch.Tensor, multiple: int = PIXEL_MULTIPLE) -> tuple[torch.Tensor, tuple[int, int]]:
    """Edge-replicate pad (B, C, H, W) on the right/bottom to multiples of ``multiple``; returns the pad."""
    h, w = images.shape[-2:]
    ph, pw = (-h) % multiple, (-w) % multiple
    if ph or pw:
        images = F.pad(images, (0, pw, 0, ph), mode="replicate")
    return images, (ph, pw)


def latent_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pixel mask (B, 1, H, W) in [0, 1] (1 = regenerate) -> latent mask at 1/8: the mean of each 8x8 cell.

    Cells entirely outside the masked region are exactly 0, so they are kept exactly.
    """
    if mask.ndim != 4 or mask.shape[1] != 1:
        raise ValueError(f"mask must be (B, 1, H, W), got {tuple(mask.shape)}")
    return F.avg_pool2d(mask.float(), VAE_SCALE_FACTOR)


def outpaint_pads(height: int, width: int, left: int, top: int, right: int, bottom: int) -> tuple[int, int, int, int]:
    """The borders rounded up to multiples of 16 px, checked before anything is allocated (the command line's plan
    calls it before any model loads, :func:`outpaint_canvas` before the VAE).

    The image sides must be multiples of 16 px, and the canvas ``(height + top + bottom) x (width + left + right)``
    must stay within :data:`flowlift.limits.MAX_OUTPUT_SIDE` per side (the package's output cap), else one
    FlowliftError line: ``outpaint=(0, 0, 1000000, 0)`` would otherwise try to allocate the canvas.
    """
    from flowlift.knobs import exact_int
    from flowlift.limits import MAX_OUTPUT_SIDE

    if height % PIXEL_MULTIPLE or width % PIXEL_MULTIPLE:  # the original must sit on the transformer's 2x2 patches
        raise FlowliftError(
            f"outpaint needs image sides that are multiples of {PIXEL_MULTIPLE} px, got {width}x{height}; crop or "
            "resize first"
        )
    given = {"left": left, "top": top, "right": right, "bottom": bottom}
    for side, value in given.items():
        if (exact_int(value) if value is not None else None) is None or value < 0:
            raise FlowliftError(f"outpaint's {side} border must be a whole number of pixels >= 0, got {value!r}")
    pads = tuple(-(-int(p) // PIXEL_MULTIPLE) * PIXEL_MULTIPLE for p in given.values())
    if not any(pads):
        raise FlowliftError("outpaint needs a border: give at least one of left/top/right/bottom > 0")
    canvas_h, canvas_w = height + pads[1] + pads[3], width + pads[0] + pads[2]
    if max(canvas_h, canvas_w) > MAX_OUTPUT_SIDE:
        raise FlowliftError(
            f"outpaint borders make a {canvas_w}x{canvas_h} canvas, over {cap_words()}; use smaller borders",
            field="outpaint",
        )
    return pads  # type: ignore[return-value]


def outpaint_canvas(
    images: torch.Tensor, left: int, top: int, right: int, bottom: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int, int]]:
    """Edge-replicate canvas for outpainting and its pixel mask (1 on the new border).

    The image sides must be multiples of 16 px; the pads are rounded up to multiples of 16 px so the
    original region stays aligned with the transformer's 2x2 latent patches.
    """
    h, w = images.shape[-2:]
    pads = outpaint_pads(h, w, left, top, right, bottom)
    left, top, right, bottom = pads
    canvas = F.pad(images, (left, right, top, bottom), mode="replicate")
    mask = torch.ones(images.shape[0], 1, canvas.shape[-2], canvas.shape[-1], device=images.device)
    mask[:, :, top : top + h, left : left + w] = 0.0
    return canvas, mask, (left, top, right, bottom)


def check_outpaint_strength(strength: float, strength_map: str) -> float:
    """The ``denoising_start`` an outpaint runs from at ``strength`` under ``strength_map``, or one line when it runs
    no denoising step (0, and any strength the map takes to ``denoising_start`` 1 in float: 1e-17 linear, 1e-300
    canvas): nothing would be sampled, so the new border would be the input's edge pixels smeared out. The start
    comes from the loop's own map (:func:`flowlift.refine.loop.denoising_start_for`). The one rule: the request
    checks it when it is made, :meth:`~flowlift.refine.refiner.Flux2Refiner.outpaint` before the VAE."""
    start = denoising_start_for(strength, strength_map)
    if start >= 1.0:
        raise FlowliftError(
            f"outpaint at strength {strength:g} paints nothing into the new border (it runs no denoising step; the "
            "border would be the edge pixels smeared out): give a larger strength (its default is 1)",
            field="strength",
        )
    return start

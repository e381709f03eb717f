"""Stage 2 of the colour fix for any upscaled image: ``color_fix_image(upscaled, reference)``.

The Flow Upscaler's pipeline runs stage 2 (:func:`flowlift.upscale.colorfix.lab_lowband_transplant`) on its
own decoded output; this module applies the same exact L*a*b* low-band transplant to an image made by
any upscaler (Real-ESRGAN, a tiled diffusion upscaler, an editor's resize...), given the image it was
made from. The upscale factor is inferred from the two sizes and must be one integer on both axes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.upscale.colorfix import lab_lowband_transplant


def integer_scale(upscaled_size: tuple[int, int], reference_size: tuple[int, int], *, minimum: int = 2) -> int:
    """The integer factor ``s`` with ``upscaled_size == s * reference_size`` (sizes as ``(width, height)``).

    Raises :class:`FlowliftError` (one line) when the ratio is not the same integer ``>= minimum`` on
    both axes: stage 2 pins the low band below the reference's Nyquist by block means of ``s x s``
    output pixels, which needs whole blocks, and at ``s = 1`` that band is the whole image (the result
    would be the reference itself). ``flowlift eval`` takes ``minimum=1`` (a same-size output is
    compared pixel by pixel) and the same rule otherwise.
    """
    (width, height), (ref_w, ref_h) = upscaled_size, reference_size
    if min(width, height, ref_w, ref_h) < 1:
        raise FlowliftError(f"empty image: {width}x{height} against {ref_w}x{ref_h}")
    ratio_w, ratio_h = width / ref_w, height / ref_h
    if width % ref_w or height % ref_h or ratio_w != ratio_h:
        raise FlowliftError(
            f"{width}x{height} is not an integer multiple of the reference {ref_w}x{ref_h} "
            f"({ratio_w:.3g}x by {ratio_h:.3g}x); an upscale needs the same integer scale on both axes"
        )
    if ratio_w < max(2, minimum):
        if minimum <= 1:
            return 1
        raise FlowliftError(
            f"{width}x{height} is the reference's own size: nothing lies above its resolution to keep "
            "(the colour fix needs an upscale of 2x or more)"
        )
    return int(ratio_w)


def _rgb_and_alpha(image: Any, name: str) -> tuple[np.ndarray, Image.Image | None]:
    """uint8 HWC RGB array and the alpha channel (Pillow ``"L"``) or None; a Pillow image of any mode as
    :func:`flowlift.files.images.load_image` converts it (16-bit and float grey scaled by their range, not clipped).
    Anything else is one line naming the argument (``name``)."""
    if isinstance(image, Image.Image):
        from flowlift.files.images import rgb_and_alpha

        rgb, alpha = rgb_and_alpha(image)
        return np.asarray(rgb), alpha
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] not in (3, 4) or array.dtype != np.uint8:
        raise FlowliftError(
            f"{name} must be a Pillow image or a uint8 HWC RGB array, got {array.dtype} {array.shape}", field=name
        )
    if array.shape[-1] == 4:
        return np.ascontiguousarray(array[..., :3]), Image.fromarray(np.ascontiguousarray(array[..., 3]), "L")
    return array, None


def color_fix_array(
    upscaled: np.ndarray,
    reference: np.ndarray,
    strength: float = 1.0,
    *,
    device: torch.device | str = "cpu",
    on_strip: Callable[[], None] | None = None,
) -> np.ndarray:
    """:func:`color_fix_image` on uint8 or uint16 HWC RGB arrays (each scaled by its own range);
    returns an HWC RGB array of ``upscaled``'s dtype, so 16-bit images stay 16-bit. ``on_strip()`` runs before every
    row strip of the transplant: an exception it raises (a host's cancel) stops the fix there.

    ``Lab(area_down(result))`` equals ``Lab(reference)`` at strength 1 (to L*a*b*'s nonlinearity and
    clipping, which stage 2's iterations remove); detail above the reference's Nyquist stays the
    upscaled image's own.
    """
    from flowlift.devices import resolve_device_option
    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.files.sixteen_bit import tensor_to_uint16
    from flowlift.knobs import check_callable, check_unit_interval

    strength = check_unit_interval("strength", strength)
    on_strip = check_callable("on_strip", on_strip)
    for name, array in (("upscaled", upscaled), ("reference", reference)):
        if (
            not isinstance(array, np.ndarray)
            or array.ndim != 3
            or array.shape[-1] != 3
            or array.dtype
            not in (
                np.uint8,
                np.uint16,
            )
        ):
            got = f"{array.dtype} {array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
            raise FlowliftError(f"{name} must be a uint8 or uint16 HWC RGB array, got {got}", field=name)
    integer_scale((upscaled.shape[1], upscaled.shape[0]), (reference.shape[1], reference.shape[0]))
    device = resolve_device_option(device)  # 'cuda' without CUDA, 'bogus': one line, before any work
    out = to_tensor(upscaled, device=device, dtype=torch.float32)
    ref = to_tensor(reference, device=device, dtype=torch.float32)
    with torch.no_grad():
        fixed = lab_lowband_transplant(out, ref, strength, inplace=True, on_strip=on_strip)
    return tensor_to_uint16(fixed) if upscaled.dtype == np.uint16 else tensor_to_uint8(fixed)[0]


def color_fix_image(
    upscaled: Image.Image | np.ndarray,
    reference: Image.Image | np.ndarray,
    strength: float = 1.0,
    *,
    device: torch.device | str = "cpu",
    on_strip: Callable[[], None] | None = None,
) -> Image.Image:
    """Stage 2 on any upscaled image: pin its colour and tone below the reference's Nyquist.

    ``upscaled`` must be ``s`` times ``reference`` on both axes for an integer ``s >= 2``
    (:func:`integer_scale`; otherwise one :class:`FlowliftError`). With ``D`` the ``s x s`` block
    mean and ``Lab`` sRGB -> CIE L*a*b* (D65), the result satisfies, at strength ``t``::

        Lab(D result) = Lab(D upscaled) + t * (Lab(reference) - Lab(D upscaled))

    exactly as the pipeline's stage 2 (:func:`flowlift.upscale.colorfix.lab_lowband_transplant`, the same
    function). Pillow images or uint8 HWC arrays in; a Pillow image out, RGBA when ``upscaled`` had
    alpha (its alpha is kept unchanged; the reference's alpha is ignored). ``on_strip()``: as in
    :func:`color_fix_array`, before every row strip (a cancel point).
    """
    rgb, alpha = _rgb_and_alpha(upscaled, "upscaled")
    ref_rgb, _ = _rgb_and_alpha(reference, "reference")
    result = Image.fromarray(color_fix_array(rgb, ref_rgb, strength, device=device, on_strip=on_strip), "RGB")
    if alpha is not None:
        result.putalpha(alpha)
    return result

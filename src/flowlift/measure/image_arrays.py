"""What the metrics take: any image as a checked HWC RGB array at its own precision.

:mod:`flowlift.measure.metrics` reads ``uint8`` (0..255), ``uint16`` (0..65535: a 16-bit file's samples, never
rounded to 8 bits first, so a difference of 100/65535 is measured, not lost) and float data in [0, 1]; PIL images
(16-bit grey kept at 16 bits) and CHW / 1CHW float tensors are converted. An alpha channel (a PIL image's, an
``H x W x 4`` array's) is dropped with the warning the command line gives when any pixel is transparent: the metrics
measure its colour as if opaque. An empty image is one line that says so.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import numpy as np

from flowlift.errors import FlowliftError, FlowliftWarning

#: The white of each integer sample type: 8-bit data is 0..255, 16-bit data 0..65535.
FULL_SCALE = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0}
#: 16-bit values per 8-bit level: ``v / 255 == 257 v / 65535`` exactly, so an 8-bit image is the 16-bit one ``257 v``.
LEVEL_16 = 257


def _to_array(image: Any) -> np.ndarray:
    """PIL image, torch tensor (CHW / 1CHW) or array -> HWC numpy array (dtype kept; a PIL image's alpha as a fourth
    channel, its 16-bit grey as uint16)."""
    if hasattr(image, "detach") and hasattr(image, "cpu"):  # torch tensor, without importing torch
        t = image.detach().cpu()
        if t.ndim == 4:
            if t.shape[0] != 1:
                raise FlowliftError(f"expected one image, got a batch of {t.shape[0]}")
            t = t[0]
        if t.ndim != 3:
            raise FlowliftError(f"expected a CHW image tensor, got shape {tuple(t.shape)}")
        return t.float().permute(1, 2, 0).numpy()
    if hasattr(image, "mode") and hasattr(image, "size") and not isinstance(image, np.ndarray):
        from flowlift.files.images import rgb_and_alpha

        if image.mode.startswith("I;16"):  # 16-bit grey: its samples, not their 8-bit rounding
            grey = np.asarray(image).astype(np.uint16)
            return np.repeat(grey[..., None], 3, axis=2)
        rgb, alpha = rgb_and_alpha(image)  # other integer and float grey scaled by their range, not clipped
        return np.asarray(rgb) if alpha is None else np.dstack([np.asarray(rgb), np.asarray(alpha)])
    return np.asarray(image)


def rgb_array(image: Any, what: str = "the image") -> np.ndarray:
    """``image`` as an HWC RGB array (dtype kept), ``what`` naming it in the lines it may give: one line for anything
    that is no ``H x W x 3`` image (``x 4``: alpha dropped with :func:`warn_transparent`'s warning) or is empty."""
    a = _to_array(image)
    if a.ndim == 3 and a.shape[2] == 4:
        warn_transparent(a[..., 3], what)
        a = a[..., :3]
    if a.ndim != 3 or a.shape[2] != 3:
        raise FlowliftError(f"expected an HxWx3 RGB image, got shape {a.shape}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise FlowliftError(f"{what} is empty ({a.shape[1]}x{a.shape[0]} px, shape {a.shape}): nothing to measure")
    return a


def warn_transparent(alpha: np.ndarray, what: str) -> None:
    """The command line's warning (:func:`flowlift.measure.inputs.load_rgb`) when ``alpha`` holds a pixel below its
    white (255, 65535, or 1.0 for floats): the metrics are of RGB and measure such a pixel's colour as if opaque."""
    if alpha.size and float(alpha.min()) < FULL_SCALE.get(alpha.dtype, 1.0):
        warnings.warn(
            FlowliftWarning(f"{what} has transparent pixels; the metrics measure their colour as if opaque"),
            stacklevel=_caller_level(),
        )


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside flowlift, seen from the caller's ``warnings.warn``: a warning
    points at the line that called the metric, however deep inside the package it was raised."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/flowlift
    frame, level = sys._getframe(1), 1  # the frame that calls warnings.warn is stacklevel 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def as_float_rgb(image: Any, what: str = "the image") -> np.ndarray:
    """Return ``image`` as a float64 HWC RGB array in [0, 1] (uint8 divided by 255, uint16 by 65535).

    Raises :class:`FlowliftError` for anything that is not an ``H x W x 3`` RGB image with finite
    values in [0, 1] (half an 8-bit level of rounding either side is clamped): a float image in 0..255 would
    give meaningless figures (PSNR -37 dB for the same picture at half brightness).
    """
    a = rgb_array(image, what)
    if a.dtype in FULL_SCALE:
        return a.astype(np.float64) / FULL_SCALE[a.dtype]
    if not np.issubdtype(a.dtype, np.floating):
        raise FlowliftError(f"expected uint8, uint16 or float image data, got {a.dtype}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        raise FlowliftError(f"{what} contains NaN or infinite values")
    low, high = float(a.min()), float(a.max())
    if low < -0.5 / 255 or high > 1 + 0.5 / 255:
        raise FlowliftError(f"a float image must lie in [0, 1], got values in [{low:g}, {high:g}] (0..255? divide)")
    return np.clip(a, 0.0, 1.0, out=a)


def as_uint8_rgb(image: Any, what: str = "the image") -> np.ndarray:
    """Return ``image`` as uint8 HWC RGB: uint8 unchanged, uint16 ``round(v / 257)``, floats ``round(x * 255)``."""
    from flowlift.files.deep_images import to_eight_bits

    a = rgb_array(image, what)
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.uint16:
        return to_eight_bits(a)
    return np.rint(as_float_rgb(a, what) * 255.0).astype(np.uint8)


def as_uint16_rgb(image: Any, what: str = "the image") -> np.ndarray:
    """Return ``image`` as uint16 HWC RGB: uint16 unchanged, uint8 ``257 v`` (the same values), floats
    ``round(x * 65535)``."""
    a = rgb_array(image, what)
    if a.dtype == np.uint16:
        return a
    if a.dtype == np.uint8:
        return a.astype(np.uint16) * LEVEL_16
    return np.rint(as_float_rgb(a, what) * 65535.0).astype(np.uint16)


def same_precision(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    """``a`` and ``b`` as integer RGB at the finer of their precisions: 16 bits when either holds 16-bit samples (the
    other's 8-bit values exactly, ``257 v``), else 8 (floats rounded to 8 bits, the super-resolution protocol's)."""
    ra, rb = rgb_array(a, "image a"), rgb_array(b, "image b")
    if np.uint16 in (ra.dtype, rb.dtype):
        return as_uint16_rgb(ra, "image a"), as_uint16_rgb(rb, "image b")
    return as_uint8_rgb(ra, "image a"), as_uint8_rgb(rb, "image b")


def check_same_size(a: np.ndarray, b: np.ndarray) -> None:
    """One line unless ``a`` and ``b`` (HW or HWC arrays) have one shape."""
    if a.shape != b.shape:
        raise FlowliftError(f"images differ in size: {a.shape[1]}x{a.shape[0]} vs {b.shape[1]}x{b.shape[0]}")

"""Protocol C on the luma channel, as super-resolution papers report it: PSNR-Y and SSIM-Y.

Two lumas, one knob (:data:`Y_CHANNEL`): ``matlab`` is MATLAB ``rgb2ycbcr``'s BT.601 Y rounded to whole levels, as the
MATLAB evaluation scripts compute it (RCAN's and the tables before it); ``basicsr`` is the same Y left unrounded, as
BasicSR's ``calculate_psnr`` / ``calculate_ssim(..., test_y_channel=True)`` compute it (SwinIR, HAT and most tables
since). The rounding adds about 1/6 level^2 of noise to the MSE, so the two differ more the higher the PSNR
(docs/measure.md). Both shave ``shave`` px off each border, the field's ``crop_border = scale``. The functions are
re-exported by :mod:`flowlift.measure.metrics`, beside the other metrics.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flowlift.errors import FlowliftError
from flowlift.knobs import Knob
from flowlift.measure.image_arrays import (
    LEVEL_16,
    as_float_rgb,
    as_uint8_rgb,
    check_same_size,
    rgb_array,
    same_precision,
)

#: MATLAB ``rgb2ycbcr``'s Y row (ITU-R BT.601, studio swing) for R, G, B in [0, 1]: Y in [16, 235].
YCBCR_Y_WEIGHTS = (65.481, 128.553, 24.966)
YCBCR_Y_OFFSET = 16.0
#: The SSIM of Wang et al. (2004) as the field computes it: 11x11 Gaussian window, sigma 1.5, L = 255.
SSIM_WINDOW, SSIM_SIGMA, SSIM_K1, SSIM_K2 = 11, 1.5, 0.01, 0.03

#: Which luma PSNR-Y and SSIM-Y are measured on: one declaration for ``flowlift eval --y-channel``, the request's
#: field and the metric functions' argument.
Y_CHANNEL = Knob(
    "y_channel",
    str,
    "matlab",
    "PSNR-Y / SSIM-Y's luma: matlab (rgb2ycbcr's Y rounded to whole levels, the MATLAB scripts' tables: RCAN and "
    "before) or basicsr (the same Y unrounded, BasicSR's test_y_channel: SwinIR, HAT)",
    choices=("matlab", "basicsr"),
)


def ycbcr_y(image: Any, what: str = "the image", y_channel: str = Y_CHANNEL.default) -> np.ndarray:
    """BT.601 luma on the 0..255 scale (:data:`Y_CHANNEL`), HW float64.

    ``matlab``: as MATLAB's ``rgb2ycbcr`` returns it for ``uint8`` (or ``uint16``) input,
    ``Y = round(16 + 65.481 R + 128.553 G + 24.966 B)`` with ``R, G, B = u8 / 255`` in [0, 1] (so white is
    235, black 16), rounded to an integer as MATLAB rounds its ``uint8`` result. The rounding is exact, in
    integers: with ``N = 65481 r + 128553 g + 24966 b`` on the 8-bit values, ``Y = 16 + floor((N + 127500) /
    255000)`` (halves up; float arithmetic would decide the exact halves by rounding error). A 16-bit image keeps its
    precision as MATLAB's ``uint16`` rule does, ``Y16 = round(257 Y)``: the same integer formula on the 16-bit values,
    ``Y16 = 4112 + floor((N + 127500) / 255000)``, returned as ``Y16 / 257``. Float images are first taken to 8 bits
    (:func:`as_uint8_rgb`).

    ``basicsr``: ``Y = 16 + 65.481 R + 128.553 G + 24.966 B`` unrounded, in float64, with ``R, G, B`` the image's own
    values in [0, 1] (8-bit / 255, 16-bit / 65535, float as given): BasicSR's ``to_y_channel`` (which keeps it in
    float32: under 1e-6 dB from this on the 24 Kodak images, bicubic 4x and JPEG 92).
    """
    y_channel = Y_CHANNEL.check(y_channel)
    a = rgb_array(image, what)
    if y_channel == "basicsr":
        return YCBCR_Y_OFFSET + as_float_rgb(a, what) @ np.asarray(YCBCR_Y_WEIGHTS)
    levels = LEVEL_16 if a.dtype == np.uint16 else 1
    values = (a if levels > 1 else as_uint8_rgb(a, what)).astype(np.int64)
    weights = np.asarray([round(1000 * w) for w in YCBCR_Y_WEIGHTS], dtype=np.int64)
    n = values @ weights
    return (levels * int(YCBCR_Y_OFFSET) + (n + 127_500) // 255_000) / float(levels)


def luma_pair(a: Any, b: Any, y_channel: str = Y_CHANNEL.default) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ycbcr_y` of two images at the finer of their precisions (16 bits when either holds 16-bit samples:
    an 8-bit image and its exact 16-bit copy have one luma), checked for one size."""
    ya, yb = (
        ycbcr_y(image, what, y_channel)
        for image, what in zip(same_precision(a, b), ("image a", "image b"), strict=True)
    )
    check_same_size(ya, yb)
    return ya, yb


def shave_border(image: np.ndarray, shave: int) -> np.ndarray:
    """``image[shave:-shave, shave:-shave]``: ``shave`` px off every border (0 keeps the image); one
    FlowliftError line when ``shave`` is no integer >= 0 (``2.5``, ``"2"``, ``True``) or nothing would be left."""
    from flowlift.knobs import exact_int

    number = exact_int(shave)
    if number is None or number < 0:
        raise FlowliftError(f"shave must be an integer >= 0 (px), got {shave!r}", field="shave")
    shave = number
    if 2 * shave >= min(image.shape[:2]):
        raise FlowliftError(f"cannot shave {shave} px off each border of a {image.shape[1]}x{image.shape[0]} image")
    return image[shave : image.shape[0] - shave, shave : image.shape[1] - shave]


def psnr_y(a: Any, b: Any, shave: int = 0, y_channel: str = Y_CHANNEL.default) -> float:
    """PSNR-Y in dB: ``10 log10(255^2 / mean((Y_a - Y_b)^2))`` over :func:`ycbcr_y` of both images (:func:`luma_pair`:
    at 16 bits when either is 16-bit; ``y_channel``: :data:`Y_CHANNEL`) with ``shave`` px (the upscale factor, by the
    field's convention) cut off each border; ``inf`` when equal."""
    ya, yb = luma_pair(a, b, y_channel)
    mse = float(np.mean((shave_border(ya, shave) - shave_border(yb, shave)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0**2 / mse)


def ssim_y(a: Any, b: Any, shave: int = 0, y_channel: str = Y_CHANNEL.default) -> float:
    """SSIM-Y: the mean SSIM of Wang et al. over :func:`ycbcr_y` (0..255; ``y_channel``: :data:`Y_CHANNEL`) of both
    images, ``shave`` px cut off.

    Local statistics use a normalized 11x11 Gaussian window ``w`` (sigma 1.5) over the *valid* region (no
    padding, so the map is 10 px smaller per axis): ``mu_a = w * Y_a``, ``s_a^2 = w * Y_a^2 - mu_a^2``,
    ``s_ab = w * (Y_a Y_b) - mu_a mu_b``, and
    ``SSIM = ((2 mu_a mu_b + C1)(2 s_ab + C2)) / ((mu_a^2 + mu_b^2 + C1)(s_a^2 + s_b^2 + C2))`` with
    ``C1 = (0.01 * 255)^2``, ``C2 = (0.03 * 255)^2``; the mean of that map.
    """
    import cv2

    ya, yb = luma_pair(a, b, y_channel)
    ya, yb = shave_border(ya, shave), shave_border(yb, shave)
    if min(ya.shape) < SSIM_WINDOW:
        raise FlowliftError(
            f"SSIM-Y needs at least {SSIM_WINDOW}x{SSIM_WINDOW} px after the {shave} px shave, "
            f"got {ya.shape[1]}x{ya.shape[0]}"
        )
    g = cv2.getGaussianKernel(SSIM_WINDOW, SSIM_SIGMA)
    window = g @ g.T
    r = SSIM_WINDOW // 2

    def local(x: np.ndarray) -> np.ndarray:
        return cv2.filter2D(x, cv2.CV_64F, window, borderType=cv2.BORDER_REFLECT)[r:-r, r:-r]

    c1, c2 = (SSIM_K1 * 255.0) ** 2, (SSIM_K2 * 255.0) ** 2
    mu_a, mu_b = local(ya), local(yb)
    var_a, var_b = local(ya * ya) - mu_a**2, local(yb * yb) - mu_b**2
    cov = local(ya * yb) - mu_a * mu_b
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(ssim_map.mean())

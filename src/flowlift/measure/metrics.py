"""Image metrics behind the model card's tables: drift (A), detail (B) and fidelity (C).

Every function takes images as **HWC RGB** arrays, ``uint8`` (0..255), ``uint16`` (0..65535: a 16-bit file's
samples, measured at 16 bits) or floating point in [0, 1]; PIL images and torch tensors (``CHW`` or ``1CHW``, float
[0, 1]) are accepted too and converted (:mod:`flowlift.measure.image_arrays`: an alpha channel is dropped with a warning
when any pixel is transparent). Float inputs are used as given (no clipping). Units:

* RGB quantities are reported **in /255** (a cast of ``5.0`` means 5/255).
* Lab uses CIE L*a*b* (D65, sRGB transfer) from :func:`skimage.color.rgb2lab`: ``L`` in 0..100,
  chroma ``C = sqrt(a^2 + b^2)`` in Lab units -- the same numbers as OpenCV's 8-bit ``a``/``b``
  channels, which is why the model card writes chroma figures "/255".
* Luma ("grey") is ``0.299 R + 0.587 G + 0.114 B`` (ITU-R BT.601, OpenCV's ``RGB2GRAY``) on the
  0..255 scale.

Protocol A -- drift at input scale (:func:`drift_at_input_scale`): area-downsample the output to the
input's size (``cv2.INTER_AREA``), then compare colour statistics with the input.
Protocol B -- detail (:func:`sharpness`, :func:`hf_energy`, :func:`grey_levels`,
:func:`pixel_agreement`, :func:`detail`).
Protocol C -- fidelity to a ground truth of the output's size (:func:`psnr`, :func:`ssim`,
:func:`fidelity`), and on the luma channel as super-resolution papers report it (:func:`psnr_y`,
:func:`ssim_y`: MATLAB ``rgb2ycbcr``'s BT.601 Y from 8-bit RGB, rounded as MATLAB's or unrounded as BasicSR's,
``scale`` px shaved off each border; :mod:`flowlift.measure.sr_metrics`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from flowlift.errors import FlowliftError
from flowlift.limits import MAX_OUTPUT_SIDE
from flowlift.measure.image_arrays import (
    FULL_SCALE,
    LEVEL_16,
    as_float_rgb,
    as_uint8_rgb,
    as_uint16_rgb,
    check_same_size,
    rgb_array,
    same_precision,
)
from flowlift.measure.sr_metrics import (
    SSIM_WINDOW,
    Y_CHANNEL,
    YCBCR_Y_OFFSET,
    YCBCR_Y_WEIGHTS,
    luma_pair,
    psnr_y,
    shave_border,
    ssim_y,
    ycbcr_y,
)

LUMA_WEIGHTS = (0.299, 0.587, 0.114)

Box = tuple[int, int, int, int]

__all__ = [
    "LUMA_WEIGHTS",
    "SSIM_WINDOW",
    "YCBCR_Y_OFFSET",
    "YCBCR_Y_WEIGHTS",
    "Y_CHANNEL",
    "area_resize",
    "as_float_rgb",
    "as_uint8_rgb",
    "as_uint16_rgb",
    "check_box_inside",
    "chroma",
    "crop_box",
    "detail",
    "drift_at_input_scale",
    "fidelity",
    "grey_levels",
    "hf_energy",
    "lab",
    "laplacian",
    "luma",
    "luma_pair",
    "pixel_agreement",
    "psnr",
    "psnr_y",
    "sharpness",
    "shave_border",
    "ssim",
    "ssim_y",
    "ycbcr_y",
]


# --------------------------------------------------------------------------------------------------
# conversions


def area_resize(image: Any, size: tuple[int, int], what: str = "the image") -> np.ndarray:
    """Resize a float RGB image to ``size = (width, height)`` with OpenCV ``INTER_AREA``.

    ``INTER_AREA`` averages the source pixels covering each destination pixel (an exact box filter
    for integer factors), so a downsample keeps every colour statistic below the new Nyquist. In float64,
    and an 8- or 16-bit image at one integer factor ``k`` by its integer block sums, ``sum / k^2 / white``: a block
    of one value ``v`` gives exactly ``v / white``, so an output whose blocks are its input measures ``inf``
    (the float32 resize measured 159 dB there, OpenCV's float64 one 167-317 dB).
    Returns float64; a same-size call returns the image unchanged. ``size`` is two integers (numpy's too), each in
    [1, 16384] (:data:`flowlift.limits.MAX_OUTPUT_SIDE`, or up to the image's own larger side), else one line.
    """
    import cv2

    array = rgb_array(image, what)
    width, height = _check_size(size, max(MAX_OUTPUT_SIDE, *array.shape[:2]))
    if (array.shape[1], array.shape[0]) == (width, height):
        return as_float_rgb(array, what)
    factor = array.shape[0] // height
    if array.dtype in FULL_SCALE and array.shape[:2] == (height * factor, width * factor):
        blocks = array.reshape(height, factor, width, factor, 3).sum(axis=(1, 3), dtype=np.int64)
        return blocks / float(factor * factor) / FULL_SCALE[array.dtype]
    f = as_float_rgb(array, what)
    return cv2.resize(f, (width, height), interpolation=cv2.INTER_AREA)


def _check_size(size: object, limit: int) -> tuple[int, int]:
    """``size`` as (width, height) if it is a pair of integers in [1, ``limit``], else one line naming ``size``."""
    from flowlift.knobs import exact_int

    pair = tuple(exact_int(side) for side in size) if isinstance(size, (tuple, list)) else ()
    if len(pair) != 2 or None in pair or not all(1 <= side <= limit for side in pair):
        raise FlowliftError(f"size must be (width, height): two integers in [1, {limit}], got {size!r}", field="size")
    return pair  # type: ignore[return-value]


def lab(image: Any) -> np.ndarray:
    """CIE L*a*b* (D65) of an sRGB image via :func:`skimage.color.rgb2lab`; HWC float64."""
    from skimage.color import rgb2lab

    return rgb2lab(as_float_rgb(image))


def chroma(lab_image: np.ndarray) -> np.ndarray:
    """Per-pixel chroma ``C = sqrt(a^2 + b^2)`` of a Lab image (Lab units)."""
    return np.hypot(lab_image[..., 1], lab_image[..., 2])


def luma(image: Any) -> np.ndarray:
    """Luma on the 0..255 scale: ``Y = 255 * (0.299 R + 0.587 G + 0.114 B)``; HW float64."""
    f = as_float_rgb(image)
    return 255.0 * (f @ np.asarray(LUMA_WEIGHTS))


def check_box(box: object, *, loose: bool = False) -> Box | None:
    """``box`` (x, y, w, h) in output pixels as four ints, x and y >= 0 and w and h > 0, or None; else one line
    (``loose``: the command line's text ``"x,y,w,h"`` too). Whether it lies inside an image is checked against each
    image (:func:`crop_box`)."""
    from flowlift.knobs import exact_int

    if box is None:
        return None
    items = box.split(",") if loose and isinstance(box, str) else box
    values = tuple(exact_int(v, loose=loose) for v in items) if isinstance(items, (tuple, list)) else ()
    if len(values) != 4 or None in values or min(values[:2]) < 0 or min(values[2:]) <= 0:
        raise FlowliftError(f"box must be x,y,w,h: four integers, x,y >= 0 and w,h > 0, got {box!r}", field="box")
    return values  # type: ignore[return-value]


def crop_box(image: np.ndarray, box: Box | None) -> np.ndarray:
    """Crop ``image[y:y+h, x:x+w]`` for ``box = (x, y, w, h)`` (:func:`check_box`); ``None`` returns the image.

    Raises :class:`FlowliftError` when the box is no box, or not inside the image.
    """
    if box is None:
        return image
    x, y, w, h = check_box_inside(box, (image.shape[1], image.shape[0]))
    return image[y : y + h, x : x + w]


def check_box_inside(box: object, size: tuple[int, int], image: str = "image") -> Box:
    """``box`` (:func:`check_box`) if it lies inside an image of ``size`` (width, height), else one line naming the
    box and the ``image`` it misses (a caller that checks from the files' headers, before any work, names the file)."""
    x, y, w, h = check_box(box)
    width, height = size
    if x + w > width or y + h > height:
        raise FlowliftError(f"box x,y,w,h = {x},{y},{w},{h} is not inside the {width}x{height} {image}", field="box")
    return x, y, w, h


# --------------------------------------------------------------------------------------------------
# Protocol A: drift at input scale


def drift_at_input_scale(output: Any, reference: Any) -> dict[str, float]:
    """Colour/tone drift of ``output`` against ``reference`` (its input), at the input's scale.

    ``output`` is area-downsampled (:func:`area_resize`, ``INTER_AREA``) to ``reference``'s size
    (it may be any size; same size means no resampling). With ``o``/``r`` the downsampled output and
    the reference, ``Lab`` from :func:`lab` and ``C`` from :func:`chroma`:

    * ``cast_r``, ``cast_g``, ``cast_b`` = ``255 * (mean(o_c) - mean(r_c))`` -- RGB mean cast, /255;
    * ``cast_max`` = the largest ``|cast_c|``;
    * ``c_mean_change_pct`` = ``100 * (mean C_o - mean C_r) / mean C_r`` (0 for a grey
      reference, ``mean C_r <= 0.01``);
    * ``dC`` = ``mean C_o - mean C_r`` -- chroma error in Lab units;
    * ``c_p99_change`` = ``p99(C_o) - p99(C_r)`` -- saturation of the most colourful 1%;
    * ``l_std_change`` = ``std(L_o) - std(L_r)`` -- tone contrast;
    * ``l_p5_change`` / ``l_p95_change`` = change of the 5th / 95th percentile of ``L`` (shadows /
      highlights);
    * ``psnr_input`` = :func:`psnr` of ``o`` against ``r`` in dB (``inf`` when identical).
    """
    ref = as_float_rgb(reference, "the reference")
    out = area_resize(output, (ref.shape[1], ref.shape[0]), "the output")
    cast = 255.0 * (out.reshape(-1, 3).mean(axis=0) - ref.reshape(-1, 3).mean(axis=0))
    lab_o, lab_r = lab(out), lab(ref)
    c_o, c_r = chroma(lab_o), chroma(lab_r)
    l_o, l_r = lab_o[..., 0], lab_r[..., 0]
    mean_c_o, mean_c_r = float(c_o.mean()), float(c_r.mean())
    # below a hundredth of a Lab unit the reference is grey and a relative change is meaningless
    c_change = 100.0 * (mean_c_o - mean_c_r) / mean_c_r if mean_c_r > 0.01 else 0.0
    p5_o, p95_o = np.percentile(l_o, [5, 95])
    p5_r, p95_r = np.percentile(l_r, [5, 95])
    return {
        "cast_r": float(cast[0]),
        "cast_g": float(cast[1]),
        "cast_b": float(cast[2]),
        "cast_max": float(np.abs(cast).max()),
        "c_mean_change_pct": float(c_change),
        "dC": mean_c_o - mean_c_r,
        "c_p99_change": float(np.percentile(c_o, 99) - np.percentile(c_r, 99)),
        "l_std_change": float(l_o.std() - l_r.std()),
        "l_p5_change": float(p5_o - p5_r),
        "l_p95_change": float(p95_o - p95_r),
        "psnr_input": psnr(out, ref),
    }


# --------------------------------------------------------------------------------------------------
# Protocol B: detail


def laplacian(image: Any) -> np.ndarray:
    """4-neighbour Laplacian of the luma (0..255): ``Y[i-1,j] + Y[i+1,j] + Y[i,j-1] + Y[i,j+1] - 4 Y``.

    OpenCV ``Laplacian(ksize=1)``, borders reflected (``BORDER_REFLECT_101``). Accepts an RGB image
    or an HW luma array (used as is).
    """
    import cv2

    a = np.asarray(image) if isinstance(image, np.ndarray) and image.ndim == 2 else luma(image)
    return cv2.Laplacian(a.astype(np.float64), cv2.CV_64F, ksize=1)


def sharpness(image: Any, box: Box | None = None) -> float:
    """Mean absolute Laplacian of the luma, ``mean |lap(Y)|`` on the 0..255 scale (model card's
    "sharpness"), over ``box = (x, y, w, h)`` or the whole frame (computed on the full frame, then
    cropped, so the box edges see real neighbours)."""
    return float(np.abs(crop_box(laplacian(image), box)).mean())


def hf_energy(image: Any, box: Box | None = None) -> float:
    """High-frequency energy: the variance of the luma Laplacian, ``var(lap(Y))`` (0..255 scale)."""
    return float(crop_box(laplacian(image), box).var())


def grey_levels(image: Any, box: Box | None = None) -> tuple[int, float]:
    """Posterization measure over ``box``: ``(levels, sigma)``.

    ``levels`` is the number of distinct 8-bit grey values ``round(0.299 R + 0.587 G + 0.114 B)``
    of the 8-bit image (:func:`as_uint8_rgb`); ``sigma`` is their standard deviation. A smooth
    gradient has many levels; a flat, banded sky has few.
    """
    u8 = crop_box(as_uint8_rgb(image), box)
    grey = np.rint(u8.astype(np.float64) @ np.asarray(LUMA_WEIGHTS)).astype(np.int64)
    return int(np.unique(grey).size), float(grey.std())


def pixel_agreement(a: Any, b: Any) -> dict[str, float]:
    """L1 distance and identical-pixel share of two same-size images, at the finer of their precisions (8 bits, or 16
    when either holds 16-bit samples: :func:`flowlift.measure.image_arrays.same_precision`).

    * ``l1`` = ``mean |a - b|`` over all pixels and channels, in /255;
    * ``identical_pct`` = ``100 * (#pixels whose three channels are all equal) / #pixels``.

    This is the img2img endpoint test: strength 0 must give ``l1 = 0`` and 100 % identical.
    """
    ia, ib = same_precision(a, b)
    check_same_size(ia, ib)
    diff = np.abs(ia.astype(np.int32) - ib.astype(np.int32))
    per_level = LEVEL_16 if ia.dtype == np.uint16 else 1
    return {
        "l1": float(diff.mean()) / per_level,
        "identical_pct": float(100.0 * (diff.max(axis=2) == 0).mean()),
    }


def detail(image: Any, box: Box | None = None) -> dict[str, float]:
    """Protocol B for one image: ``sharpness``, ``hf_energy`` (whole frame) and, when ``box`` is
    given, ``levels`` / ``grey_sigma`` in it (:func:`grey_levels`)."""
    lap = laplacian(image)
    out: dict[str, float] = {"sharpness": float(np.abs(lap).mean()), "hf_energy": float(lap.var())}
    if box is not None:
        levels, sigma = grey_levels(image, box)
        out["levels"] = float(levels)
        out["grey_sigma"] = sigma
    return out


# --------------------------------------------------------------------------------------------------
# Protocol C: fidelity


def psnr(a: Any, b: Any) -> float:
    """Peak signal-to-noise ratio in dB on [0, 1] data: ``10 log10(1 / mean((a - b)^2))``.

    Over all pixels and channels; ``inf`` for identical images. Sizes must match.
    """
    fa, fb = as_float_rgb(a, "image a"), as_float_rgb(b, "image b")
    check_same_size(fa, fb)
    mse = float(np.mean((fa - fb) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def ssim(a: Any, b: Any) -> float:
    """Mean structural similarity (:func:`skimage.metrics.structural_similarity`, 7x7 uniform
    window, per RGB channel then averaged, ``data_range = 1``). Sizes must match."""
    from skimage.metrics import structural_similarity

    fa, fb = as_float_rgb(a, "image a"), as_float_rgb(b, "image b")
    check_same_size(fa, fb)
    if min(fa.shape[:2]) < 7:
        raise FlowliftError(f"SSIM needs images of at least 7x7 pixels, got {fa.shape[1]}x{fa.shape[0]}")
    return float(structural_similarity(fa, fb, data_range=1.0, channel_axis=2))


def fidelity(output: Any, ground_truth: Any, shave: int = 0, y_channel: str = Y_CHANNEL.default) -> dict[str, float]:
    """Protocol C: ``psnr_gt`` (dB) and ``ssim_gt`` of ``output`` against a same-size ground truth, and the
    super-resolution field's ``psnr_y`` / ``ssim_y`` (:func:`psnr_y`, :func:`ssim_y`, ``shave`` px off each border,
    on the luma ``y_channel`` names: :data:`~flowlift.measure.sr_metrics.Y_CHANNEL`)."""
    return {
        "psnr_gt": psnr(output, ground_truth),
        "ssim_gt": ssim(output, ground_truth),
        "psnr_y": psnr_y(output, ground_truth, shave, y_channel),
        "ssim_y": ssim_y(output, ground_truth, shave, y_channel),
    }

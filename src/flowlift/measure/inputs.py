"""What ``flowlift eval`` feeds its methods and shows in its figure: the dataset's photos (distinct stems), the
(ground truth, low-res input) pair built from each (centre crop to a multiple of ``16 * scale``, exact area
downscale), and the figure's crop boxes mapped between output and input scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.naming import index_by_stem
from flowlift.measure import metrics as M
from flowlift.measure.image_arrays import LEVEL_16

#: Size multiple of the low-res inputs (FLUX.2 latents are patchified 2x2 at 1/8 scale).
INPUT_MULTIPLE = 16

Box = tuple[int, int, int, int]


#: The largest ``eval --run`` scale, and the largest denominator of a fractional one (1.5 = 3/2, 3.75 = 15/4).
MAX_SCALE = 16
MAX_SCALE_DENOMINATOR = 16


def check_scale(scale: float | str, *, allow_one: bool = False, loose: bool = False) -> int | float:
    """An eval scale: a number in (1, 16] (``allow_one``: [1, 16]) that is ``p / q`` with ``q <= 16`` (2, 3, 1.5,
    1.25, 3.75); an int when whole. Text (``"3"``) only with ``loose`` (the command line's); a bool never. Anything
    else is one FlowliftError line."""
    from fractions import Fraction

    try:
        if isinstance(scale, bool) or isinstance(scale, str) and not loose:
            raise TypeError(scale)
        value = float(scale)
    except (TypeError, ValueError):
        raise FlowliftError(f"scale must be a number, got {scale!r}", field="scale") from None
    if not (1 <= value if allow_one else 1 < value) or not value <= MAX_SCALE:  # NaN fails this too
        raise FlowliftError(f"scale must be above 1 and at most {MAX_SCALE}, got {scale}", field="scale")
    fraction = Fraction(value).limit_denominator(MAX_SCALE_DENOMINATOR)
    if abs(float(fraction) - value) > 1e-9:
        raise FlowliftError(
            f"scale {scale} is not a fraction p/q with q <= {MAX_SCALE_DENOMINATOR} (e.g. 1.5, 1.25)", field="scale"
        )
    return int(fraction) if fraction.denominator == 1 else float(fraction)


def scale_argument(text: str) -> int | float:
    """:func:`check_scale` as an argparse ``type``: its line, less the field argparse already names (``argument
    --scale: must be above 1 ...``), becomes argparse's message."""
    import argparse

    try:
        return check_scale(text, loose=True)
    except FlowliftError as error:
        raise argparse.ArgumentTypeError(error.worded({"scale": ""}).strip()) from None


def prepare_pair(
    photo: np.ndarray, scale: float, multiple: int = INPUT_MULTIPLE, *, name: str = "photo"
) -> tuple[np.ndarray, np.ndarray]:
    """``(ground_truth, lowres)`` from a uint8 (or uint16: a 16-bit file's) photo; the ground truth keeps the photo's
    precision, the low-res input every method takes is 8-bit.

    Integer ``scale``: the photo is centre-cropped to a multiple of ``multiple * scale`` (so the low-res
    input is a multiple of ``multiple``), then area-downsampled by :func:`box_downscale_uint8` (the exact
    box mean, rounded half to even in integer arithmetic).

    Fractional ``scale = p / q`` (:func:`check_scale`): the crop is a multiple of ``multiple * p`` and the
    low-res input ``q / p`` of it (a multiple of ``multiple * q``), downsampled with Pillow's antialiased
    ``LANCZOS`` -- the full-pipeline protocol of latent upscaler benchmarks (HR, Lanczos down, encode,
    upscale, decode, compare with HR); both sides stay multiples of ``multiple``. A photo too small for one crop
    is one line naming it (``name``) and the fix.
    """
    from fractions import Fraction

    scale = check_scale(scale, allow_one=True)
    fraction = Fraction(scale).limit_denominator(MAX_SCALE_DENOMINATOR)
    h, w = photo.shape[:2]
    nw, nh = ground_truth_size((w, h), scale, multiple, name=name)
    top, left = (h - nh) // 2, (w - nw) // 2
    gt = np.ascontiguousarray(photo[top : top + nh, left : left + nw])
    if fraction.denominator == 1:
        return gt, box_downscale_uint8(gt, int(scale))
    from PIL import Image

    size = (nw // fraction.numerator * fraction.denominator, nh // fraction.numerator * fraction.denominator)
    return gt, np.asarray(Image.fromarray(M.as_uint8_rgb(gt)).resize(size, Image.Resampling.LANCZOS))


def ground_truth_size(
    size: tuple[int, int], scale: float, multiple: int = INPUT_MULTIPLE, *, name: str = "photo"
) -> tuple[int, int]:
    """(width, height) of the ground truth :func:`prepare_pair` crops from a photo of ``size`` (width, height): each
    side down to a multiple of ``multiple * p`` for ``scale = p / q``. A photo too small for one crop is one line naming
    it (``name``) and the fix."""
    from fractions import Fraction

    scale = check_scale(scale, allow_one=True)
    step = multiple * Fraction(scale).limit_denominator(MAX_SCALE_DENOMINATOR).numerator
    w, h = size
    if w < step or h < step:
        raise FlowliftError(
            f"{name} ({w}x{h}) is too small for {FIELD_MARK} {scale:g}: it needs at least {step}x{step} px; use a "
            f"smaller {FIELD_MARK} or larger photos",
            field=("scale", "scale"),
        )
    return w - w % step, h - h % step


def check_dataset_sizes(paths: Sequence[Path], scale: float, box: Box | None) -> None:
    """From the headers, before anything is read or any model loads: every photo is large enough for ``scale``
    (:func:`ground_truth_size`) and ``box`` lies inside each one's ground truth (the output's size). One line naming the
    first photo that fails."""
    from flowlift.files.images import image_size

    for path in paths:
        size = ground_truth_size(image_size(path), scale, name=str(path))
        if box is not None:
            M.check_box_inside(box, size, f"ground truth cropped from {path}")


def box_downscale_uint8(image: np.ndarray, factor: int) -> np.ndarray:
    """Exact area downscale of a uint8 (or uint16) HWC image by an integer ``factor`` (sides divisible by it), to uint8.

    ``out = round_half_even(S / d)`` with ``S`` the integer sum of each ``factor x factor`` block and ``d = factor**2``
    (16-bit samples: ``257 factor**2``, their mean in 8-bit levels): ``q, r = divmod(S, d)``,
    ``out = q + (2r > d) + (2r == d and q odd)``. For 2x2 blocks of 8-bit values a quarter of the means land exactly on
    .5; rounding them after float32 arithmetic (where ``x.5`` comes out as ``x.5 +- ulp``) biased inputs by up to
    +0.09/255.
    """
    height, width, channels = image.shape
    if height % factor or width % factor:
        raise FlowliftError(f"box_downscale_uint8: {width}x{height} is not divisible by {factor}")
    blocks = image.astype(np.int64).reshape(height // factor, factor, width // factor, factor, channels)
    sums = blocks.sum(axis=(1, 3))
    divisor = factor * factor * (LEVEL_16 if image.dtype == np.uint16 else 1)
    quotient, remainder = np.divmod(sums, divisor)
    rounded = quotient + (2 * remainder > divisor) + ((2 * remainder == divisor) & (quotient % 2 == 1))
    return rounded.astype(np.uint8)


def default_crop(size: tuple[int, int], box: Box | None) -> Box:
    """The crop shown in the figure, in output pixels: ``box`` or a centred square of a quarter of the
    short side (at least 32 px)."""
    if box is not None:
        return box
    w, h = size
    side = max(32, min(w, h) // 4)
    side = min(side, w, h)
    return ((w - side) // 2, (h - side) // 2, side, side)


def _nearest_up(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize(size, resample=Image.Resampling.NEAREST))


def _scaled_box(box: Box, factor_x: float, factor_y: float) -> Box:
    x, y, w, h = box
    return (
        int(round(x * factor_x)),
        int(round(y * factor_y)),
        max(1, int(round(w * factor_x))),
        max(1, int(round(h * factor_y))),
    )


def input_crop(reference: np.ndarray, output_size: tuple[int, int], crop: Box) -> np.ndarray:
    """The crop region of the reference, nearest-upscaled to the crop's output size."""
    w_out, h_out = output_size
    fx, fy = reference.shape[1] / w_out, reference.shape[0] / h_out
    small = M.as_uint8_rgb(M.crop_box(reference, _scaled_box(crop, fx, fy)))  # a figure's crop: 8 bits
    return _nearest_up(small, (crop[2], crop[3]))


def load_rgb(path: Path) -> np.ndarray:
    """``path``'s RGB pixels (HWC) at the file's own precision: uint16 for a PNG or TIFF of 16-bit samples (colour or
    grey, :func:`flowlift.files.sixteen_bit.load_image_16bit`), else uint8, so a 16-bit ground truth is measured at
    16 bits, not after rounding to 8. One warning when it has transparent pixels, whose colour is measured as if they
    were opaque (the metrics are of RGB), and one when 16-bit samples could only be read at 8 bits."""
    import warnings

    from flowlift.errors import FlowliftWarning
    from flowlift.files.images import load_image
    from flowlift.files.sixteen_bit import has_16bit_samples, load_image_16bit

    rgb, alpha = load_image(path)  # every check (a bomb, a truncated file), the orientation, the reader's warnings
    if alpha is not None and alpha.getextrema()[0] < 255:
        warnings.warn(
            FlowliftWarning(f"{path}: has transparent pixels; the metrics measure their colour as if opaque"),
            stacklevel=2,
        )
    eight = np.asarray(rgb)
    if not has_16bit_samples(path):
        return eight
    deep = load_image_16bit(path)
    if deep is None or deep[0].shape != eight.shape:
        warnings.warn(FlowliftWarning(f"{path}: its 16-bit samples could not be read; measured at 8"), stacklevel=2)
        return eight
    return deep[0]


def dataset_paths(dataset: Sequence[str | Path], limit: int | None = None) -> list[Path]:
    """The photos of ``dataset`` (files/folders/globs, as listed by ``list_images``), the first
    ``limit`` of them when given; distinct stems are required (results are keyed by stem)."""
    from flowlift.files.images import list_images

    paths = list_images([str(d) for d in dataset])
    if limit is not None:
        paths = paths[:limit]
    if not paths:
        raise FlowliftError("the dataset holds no images")
    index_by_stem(paths, "dataset")
    return paths

"""Colour images of 16 bits a channel, decoded at their precision and rounded to 8 bits once.

Pillow has no 16-bit colour mode: it hands a 16-bit RGB, RGBA or grey-and-alpha PNG or TIFF over as 8-bit
``RGB`` / ``RGBA`` / ``LA`` keeping each value's high byte (``v >> 8``), a truncation that leaves every channel
half a level low on average (a -0.19/255 colour cast on a photo, more than the pixel resamplers' whole drift).
:func:`read_deep_colour` decodes such a file with OpenCV at 16 bits and rounds each value to the nearest 8-bit
level, ``round(v / 257)`` (``v / 257 = v * 255 / 65535`` maps 65535 to 255 exactly and never lands on a half).
16-bit grey (``I;16``, and ``I`` read from 16-bit samples) is Pillow's own: :func:`integer_white` says from the file
what is white in it, which :func:`flowlift.files.images.rgb_and_alpha` scales by.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from flowlift.errors import FlowliftError

_EXIF_ORIENTATION = 0x0112
#: Said when OpenCV cannot decode a 16-bit colour file Pillow reads (its values then lose their low byte).
DEEP_FALLBACK = "16 bits a channel, read at 8 as Pillow gives them (each value's high byte: OpenCV could not decode it)"


def is_deep_colour(opened: Image.Image) -> bool:
    """Whether Pillow would truncate ``opened`` (opened, not yet loaded): an ``RGB``, ``RGBA`` or ``LA`` image whose
    raw mode reads 16 bits a channel (PNG ``RGB;16B``, TIFF ``RGB;16N``, ...)."""
    if opened.mode not in ("RGB", "RGBA", "LA") or not opened.tile:
        return False
    args = opened.tile[0].args  # PNG: the raw mode; TIFF: (raw mode, compression, ...)
    raw = args if isinstance(args, str) else (args[0] if isinstance(args, tuple) and args else None)
    return isinstance(raw, str) and ";16" in raw


def to_eight_bits(values: np.ndarray) -> np.ndarray:
    """``round(v / 257)`` of 16-bit values, exactly in integers: ``(255 v + 32767) // 65535``."""
    return ((values.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def read_deep_colour(path: str | os.PathLike, opened: Image.Image) -> tuple[Image.Image, Image.Image | None] | None:
    """``path`` (``opened`` by Pillow, :func:`is_deep_colour`) as (8-bit RGB, alpha ``L`` or None), each value
    rounded from 16 bits, oriented by ``opened``'s EXIF as Pillow's images are; None where OpenCV cannot decode it
    at 16 bits into ``opened``'s size and channels."""
    import cv2

    data = np.fromfile(Path(path), dtype=np.uint8)
    pixels = cv2.imdecode(data, cv2.IMREAD_UNCHANGED | cv2.IMREAD_IGNORE_ORIENTATION)
    if pixels is None or pixels.dtype != np.uint16 or pixels.shape[:2] != (opened.height, opened.width):
        return None
    eight = to_eight_bits(pixels)
    if eight.ndim == 2 and opened.mode == "RGB":  # a grey file Pillow reads as RGB
        eight = np.repeat(eight[..., None], 3, axis=2)
    channels = eight.shape[2] if eight.ndim == 3 else 1
    if channels == 2:  # grey and alpha
        rgb, alpha = np.repeat(eight[..., :1], 3, axis=2), eight[..., 1]
    elif channels in (3, 4):  # OpenCV's BGR(A)
        rgb, alpha = eight[..., 2::-1], (eight[..., 3] if channels == 4 else None)
    else:
        return None
    if (alpha is not None) != (opened.mode in ("RGBA", "LA")):
        return None
    image = Image.fromarray(np.ascontiguousarray(rgb), "RGB")
    mask = None if alpha is None else Image.fromarray(np.ascontiguousarray(alpha), "L")
    return oriented_like(opened, image), (None if mask is None else oriented_like(opened, mask))


def oriented_like(opened: Image.Image, image: Image.Image) -> Image.Image:
    """``image`` turned and flipped as ``opened``'s EXIF orientation asks (:func:`PIL.ImageOps.exif_transpose`)."""
    exif = opened.getexif()
    if exif.get(_EXIF_ORIENTATION, 1) == 1:
        return image
    image.info["exif"] = exif.tobytes()
    turned = ImageOps.exif_transpose(image)
    turned.info.pop("exif", None)
    return turned


#: Pillow's integer grey modes: 16-bit samples (``I;16*``) and 32-bit integers (``I``).
INTEGER_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def integer_white(image: Image.Image) -> float:
    """The value that is white in an integer grey image (:data:`INTEGER_MODES`), from what the file says, never
    from its values (a 16-bit image whose values all lie below 256 is a dark image, not an 8-bit one):

    * ``I;16*``: 16-bit samples, 65535;
    * ``I`` read from 16-bit samples (the raw mode of a PNG or PGM, before the pixels load: ``I;16B``), from a PNG
      (16 bits at most) or from a PGM/PPM (Pillow scales its ``maxval`` to 65535): 65535.

    Any other ``I`` image (a TIFF's signed or 32-bit samples, one made in memory) has no known white: one line.
    """
    if image.mode.startswith("I;16"):
        return 65535.0
    tile, file_format = getattr(image, "tile", None), getattr(image, "format", None)  # a file's (ImageFile) only
    args = tile[0][3] if tile else None
    raw = args if isinstance(args, str) else (args[0] if isinstance(args, tuple) and args else "")
    unsigned_16 = isinstance(raw, str) and raw.startswith("I;16") and "S" not in raw
    if image.mode == "I" and (unsigned_16 or file_format in ("PNG", "PPM")):
        return 65535.0
    origin = f"a {file_format} file" if file_format else "made in memory"
    raise FlowliftError(
        f"a 32-bit integer image (mode {image.mode}, {origin}) has no known white level, so its brightness cannot be "
        "read: save it with 8 or 16 bits a sample (in memory: 16-bit data as mode I;16)"
    )

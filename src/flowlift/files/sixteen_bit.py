"""16-bit images kept 16-bit: read the samples Pillow would cut to 8 bits, write 16-bit PNG and TIFF.

Pillow opens 16-bit RGB(A) PNG and TIFF files as 8-bit images and cannot write 16-bit RGB at all, so a
16-bit photo would come out 8-bit. Everything between reading and writing is float (the package's
``[0, 1]`` NCHW tensors), so the extra bits survive when both ends keep them:

* :func:`has_16bit_samples` tells from the header whether a file holds 16 bits per sample;
* :func:`load_image_16bit` reads them with OpenCV (``IMREAD_UNCHANGED``), EXIF orientation applied as
  :func:`flowlift.files.images.load_image` applies it, as ``uint16`` RGB plus ``uint16`` alpha;
* :func:`save_image16_atomic` writes ``uint16`` RGB(A) as a 16-bit PNG (OpenCV's encoder, then the
  source's ICC profile, EXIF and flowlift's metadata as PNG chunks) or TIFF (tifffile: ICC profile
  and metadata; the source's EXIF is not carried into a 16-bit TIFF), atomically.

JPEG, WebP and BMP hold 8 bits per sample: :data:`SIXTEEN_BIT_SUFFIXES` says which outputs can keep 16.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.alpha import lanczos_plane
from flowlift.files.atomic import atomic_output
from flowlift.files.image_outputs import SourceProfile, read_source_profile
from flowlift.files.images import DECODE_ERRORS
from flowlift.files.output_checks import check_output_metadata, metadata_json, metadata_text
from flowlift.files.png_encoder import encode_png

#: Output suffixes written with 16 bits per sample when the source had them.
SIXTEEN_BIT_SUFFIXES = (".png", ".tif", ".tiff")


def has_16bit_samples(path: str | os.PathLike) -> bool:
    """True when ``path`` is a PNG or TIFF with 16 bits per sample (grey, grey+alpha, RGB, RGBA), from its
    header; False for anything else, unreadable files included (the loader reports those)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(path) as opened:
                if opened.format not in ("PNG", "TIFF"):
                    return False
                if opened.mode.startswith("I;16"):
                    return True
                args = opened.tile[0][3] if opened.tile else ""
                rawmode = args if isinstance(args, str) else (args[0] if args else "")
                return isinstance(rawmode, str) and ";16" in rawmode
    except Exception:  # noqa: BLE001 - not readable here means not a 16-bit image we can keep
        return False


def _orient(array: np.ndarray, orientation: int) -> np.ndarray:
    """EXIF orientation applied to an (H, W[, C]) array exactly as ``ImageOps.exif_transpose`` does:
    2 mirror, 3 rotate 180, 4 flip, 5 transpose, 6 rotate 270 (clockwise 90), 7 transverse, 8 rotate 90."""
    swap = (1, 0, *range(2, array.ndim))
    oriented = {
        2: lambda a: a[:, ::-1],
        3: lambda a: a[::-1, ::-1],
        4: lambda a: a[::-1],
        5: lambda a: a.transpose(swap),
        6: lambda a: np.rot90(a, -1),
        7: lambda a: a.transpose(swap)[::-1, ::-1],
        8: lambda a: np.rot90(a, 1),
    }.get(orientation, lambda a: a)(array)
    return np.ascontiguousarray(oriented)


def load_image_16bit(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None] | None:
    """``(uint16 (H, W, 3) RGB, uint16 (H, W) alpha or None)`` of a 16-bit file, EXIF orientation applied.

    None when OpenCV cannot give 16-bit samples for it (an unusual layout such as 16-bit CMYK): the
    caller then has the 8-bit image only and says so.
    """
    import cv2

    path = Path(path)
    try:
        array = cv2.imdecode(np.fromfile(path, dtype=np.uint8), cv2.IMREAD_UNCHANGED)
        with Image.open(path) as opened:
            orientation = int(opened.getexif().get(0x0112, 1) or 1)
    except (*DECODE_ERRORS, Image.DecompressionBombError, cv2.error):
        return None
    if array is None or array.dtype != np.uint16:
        return None
    alpha = None
    if array.ndim == 2:
        rgb = np.repeat(array[..., None], 3, axis=-1)
    elif array.shape[-1] == 2:  # grey and alpha
        rgb, alpha = np.repeat(array[..., :1], 3, axis=-1), array[..., 1]
    elif array.shape[-1] == 3:
        rgb = array[..., ::-1]  # OpenCV's BGR
    elif array.shape[-1] == 4:
        rgb, alpha = array[..., 2::-1], array[..., 3]
    else:
        return None
    return _orient(rgb, orientation), None if alpha is None else _orient(alpha, orientation)


def sixteen_bit_source(path: str | os.PathLike, out: str | os.PathLike) -> tuple[np.ndarray, np.ndarray | None] | None:
    """:func:`load_image_16bit` of ``path`` when it holds 16-bit samples and ``out``'s format keeps them;
    None otherwise. A 16-bit ``path`` that will be written 8-bit costs one warning line, naming why
    (before any work, so the user can stop and choose ``--format png``)."""
    from flowlift.errors import FlowliftWarning

    if not has_16bit_samples(path):
        return None
    suffix = Path(out).suffix.lower()
    deep = load_image_16bit(path) if suffix in SIXTEEN_BIT_SUFFIXES else None
    if deep is None:
        why = (
            "its 16-bit samples could not be read"
            if suffix in SIXTEEN_BIT_SUFFIXES
            else f"{suffix.lstrip('.').upper()} holds 8 bits per sample (use --format png, or -o NAME.tif, to keep 16)"
        )
        warnings.warn(FlowliftWarning(f"{path}: a 16-bit image, written 8-bit to {out}: {why}"), stacklevel=3)
    return deep


def tensor_to_uint16(image: torch.Tensor) -> np.ndarray:
    """One image tensor (3, H, W) or (1, 3, H, W) in [0, 1] -> uint16 (H, W, 3): ``round(65535 * x)``,
    clamped; NaN/Inf refused (they would become black)."""
    if image.ndim == 4:
        if image.shape[0] != 1:
            raise ValueError(f"tensor_to_uint16 takes one image, got a batch of {image.shape[0]}")
        image = image[0]
    values = image.detach().float()
    if not bool(torch.isfinite(values).all()):
        raise FlowliftError("the image to write contains NaN or Inf pixel values; nothing was written")
    scaled = values.clamp(0, 1).mul(65535.0).round().to(torch.int32)
    return scaled.permute(1, 2, 0).cpu().numpy().astype(np.uint16)


def resize_alpha16(alpha: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """A uint16 alpha channel Lanczos-resized to ``size`` (width, height), in float so no bit is lost."""
    if (alpha.shape[1], alpha.shape[0]) == tuple(size):
        return alpha
    return np.clip(np.round(lanczos_plane(alpha, size)), 0, 65535).astype(np.uint16)


def save_image16_atomic(
    rgb: np.ndarray,
    alpha: np.ndarray | None,
    path: str | os.PathLike,
    metadata: Mapping[str, object] | None = None,
    *,
    source: SourceProfile | str | os.PathLike | None = None,
) -> Path:
    """Write uint16 ``rgb`` (H, W, 3) and ``alpha`` (H, W) or None as a 16-bit PNG or TIFF, atomically.

    ``metadata`` as :func:`flowlift.files.image_outputs.save_image_atomic` writes it (PNG text chunks;
    TIFF: one JSON object in the ImageDescription, which ``read_metadata`` reads); ``source`` (an input
    path or its ``SourceProfile``) gives the ICC profile (PNG and TIFF) and EXIF (PNG).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SIXTEEN_BIT_SUFFIXES:
        raise FlowliftError(f"{path}: {suffix or '(no suffix)'} holds 8 bits per sample; write 16-bit as .png or .tif")
    if rgb.dtype != np.uint16 or rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise FlowliftError(f"expected uint16 (H, W, 3) RGB, got {rgb.dtype} {rgb.shape}")
    profile = source if isinstance(source, SourceProfile) else read_source_profile(source)
    array = rgb if alpha is None else np.concatenate([rgb, alpha[..., None].astype(np.uint16)], axis=-1)
    check_output_metadata(metadata, suffix)
    metadata = dict(metadata or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".png":
        exif = profile.exif.tobytes() if profile.exif is not None else None
        texts = {str(key): metadata_text(value, key) for key, value in metadata.items()}
        data = encode_png(array, profile.icc_profile, exif, texts)
        with atomic_output(path) as temporary:
            temporary.write_bytes(data)
        return path
    import tifffile

    description = metadata_json(metadata) if metadata else None
    software = metadata.get("Software") if isinstance(metadata.get("Software"), str) else None
    with atomic_output(path) as temporary:
        tifffile.imwrite(
            temporary,
            array,
            photometric="rgb",
            extrasamples=("unassalpha",) if alpha is not None else None,
            compression="zlib",
            metadata=None,
            description=description,
            software=software or False,
            iccprofile=profile.icc_profile or None,
        )
    return path

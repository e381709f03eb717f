"""Image files out: the formats flowlift writes, atomic saves, and what an output carries.

:func:`save_image_atomic` writes through a temporary file and a rename, so a crash never leaves a
truncated image under the final name. Outputs keep the input's ICC profile and EXIF
(:func:`read_source_profile`: orientation and sizes dropped) and carry ``metadata``: PNG text chunks,
or one JSON object in the EXIF UserComment of JPEG/WebP files (:func:`read_metadata` reads both).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, PngImagePlugin

from flowlift.errors import FlowliftError
from flowlift.files.atomic import atomic_output

#: Formats outputs are written in (by the output name's suffix).
OUTPUT_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
#: Suffix -> the format name ``--format`` uses.
OUTPUT_FORMAT_OF_SUFFIX = {".png": "png", ".jpg": "jpg", ".jpeg": "jpg", ".webp": "webp", ".bmp": "bmp",
                           ".tif": "tif", ".tiff": "tif"}  # fmt: skip
#: JPEG/WebP quality when none is given (WebP at 100 is written lossless).
DEFAULT_QUALITY = 95


#: EXIF tags that stop being true once flowlift has written a new image: the orientation (already
#: applied to the pixels) and the pixel sizes (the output has its own).
_STALE_EXIF_TAGS = (0x0112, 0x0100, 0x0101)  # Orientation, ImageWidth, ImageLength
_STALE_EXIF_IFD_TAGS = (0xA002, 0xA003)  # ExifImageWidth, ExifImageHeight (Exif sub-IFD)
_EXIF_IFD = 0x8769
_USER_COMMENT = 0x9286
_ASCII_PREFIX = b"ASCII\x00\x00\x00"


@dataclass(frozen=True)
class SourceProfile:
    """What an output inherits from the image it was made from: the ICC profile and the EXIF block.

    The pipelines work in the input's own encoded RGB, so its ICC profile stays the right description
    of the output's numbers. EXIF keeps everything except orientation (applied on load) and sizes.
    """

    icc_profile: bytes | None = None
    exif: Image.Exif | None = None


def read_source_profile(path: str | os.PathLike | None) -> SourceProfile:
    """The ICC profile and the EXIF (orientation and size tags dropped) of an input file.

    A file that cannot be read gives an empty profile: the loader reports unreadable inputs itself.
    """
    if path is None:
        return SourceProfile()
    try:
        with Image.open(path) as opened:
            icc = opened.info.get("icc_profile") or None
            exif = opened.getexif()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return SourceProfile()
    for tag in _STALE_EXIF_TAGS:
        exif.pop(tag, None)
    if _EXIF_IFD in exif:
        sub = exif.get_ifd(_EXIF_IFD)
        for tag in _STALE_EXIF_IFD_TAGS:
            sub.pop(tag, None)
    return SourceProfile(icc_profile=icc, exif=exif if len(exif) or exif.get_ifd(_EXIF_IFD) else None)


def _metadata_text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _png_info(metadata: Mapping[str, object]) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    for key, value in metadata.items():
        info.add_text(str(key), _metadata_text(value))
    return info


def _exif_with_metadata(exif: Image.Exif | None, metadata: Mapping[str, object] | None) -> Image.Exif | None:
    """``exif`` (or a new block) with ``metadata`` as JSON in the EXIF UserComment (ASCII, JSON-escaped)."""
    if not metadata:
        return exif
    out = Image.Exif()
    if exif is not None:
        out.load(exif.tobytes())
    payload = json.dumps({str(k): v for k, v in metadata.items()}, sort_keys=True, default=str, ensure_ascii=True)
    out.get_ifd(_EXIF_IFD)[_USER_COMMENT] = _ASCII_PREFIX + payload.encode("ascii")
    software = metadata.get("Software")
    if isinstance(software, str):
        out[0x0131] = software
    return out


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """flowlift's metadata of an output: PNG text chunks, or the JSON in a JPEG/WebP EXIF UserComment.

    JSON values are decoded; an image without flowlift metadata gives ``{}``.
    """
    with Image.open(path) as opened:
        if opened.format == "PNG":
            raw = dict(getattr(opened, "text", {}) or {})
        else:
            comment = opened.getexif().get_ifd(_EXIF_IFD).get(_USER_COMMENT)
            if not isinstance(comment, bytes) or not comment.startswith(_ASCII_PREFIX):
                return {}
            try:
                return json.loads(comment[len(_ASCII_PREFIX) :].decode("ascii"))
            except ValueError:
                return {}
    decoded: dict[str, object] = {}
    for key, text in raw.items():
        try:
            decoded[key] = json.loads(text)
        except ValueError:
            decoded[key] = text
    return decoded


def check_output_format(path: str | os.PathLike) -> str:
    """The format name of an output path's suffix (``png``, ``jpg``, ...) or one FlowliftError line."""
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise FlowliftError(
            f"{path}: unsupported output format {suffix or '(none)'} (writes {', '.join(OUTPUT_SUFFIXES)})"
        )
    return OUTPUT_FORMAT_OF_SUFFIX[suffix]


def save_image_atomic(
    image: Image.Image,
    path: str | os.PathLike,
    metadata: Mapping[str, object] | None = None,
    *,
    source: SourceProfile | str | os.PathLike | None = None,
    quality: int | None = None,
) -> Path:
    """Save ``image`` to ``path`` via a temporary file in the same folder and an atomic rename.

    The format follows the suffix. ``metadata`` goes into PNG text chunks (non-strings as JSON), and into
    the EXIF UserComment (one JSON object) of JPEG and WebP files. ``source`` (an input path or its
    :class:`SourceProfile`) gives the ICC profile and EXIF to carry over (PNG, JPEG, WebP, TIFF).
    ``quality`` (1-100, default :data:`DEFAULT_QUALITY`) applies to JPEG and WebP; WebP at 100 is lossless.
    """
    path = Path(path)
    check_output_format(path)
    if quality is not None and not 1 <= int(quality) <= 100:
        raise FlowliftError(f"quality must be in 1..100, got {quality}")
    profile = source if isinstance(source, SourceProfile) else read_source_profile(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    suffix = path.suffix.lower()
    kwargs: dict = {}
    exif = profile.exif
    if suffix == ".png":
        if metadata:
            kwargs["pnginfo"] = _png_info(metadata)
    elif suffix in (".jpg", ".jpeg", ".webp"):
        exif = _exif_with_metadata(exif, metadata)
        kwargs["quality"] = int(quality if quality is not None else DEFAULT_QUALITY)
        if suffix == ".webp" and kwargs["quality"] == 100:
            kwargs["lossless"] = True
        if suffix != ".webp" and image.mode == "RGBA":
            image = image.convert("RGB")
    if suffix in (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff"):
        if profile.icc_profile:
            kwargs["icc_profile"] = profile.icc_profile
        if exif is not None:
            kwargs["exif"] = exif.tobytes()
    with atomic_output(path) as temporary:
        image.save(temporary, format=Image.registered_extensions()[suffix], **kwargs)
    return path


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def input_hashes(paths: dict[str, str | None]) -> dict[str, str]:
    """``{"<role>_sha256": hex}`` for every given input file (the metadata of refine outputs)."""
    return {f"{key}_sha256": file_sha256(path) for key, path in paths.items() if path}

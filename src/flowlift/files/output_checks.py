"""What an image output can hold, checked before anything is written: the formats flowlift writes
(:data:`OUTPUT_SUFFIXES`), its metadata as each format stores it, and the image's mode and size as each format takes
them.

:func:`flowlift.files.image_outputs.save_image_atomic` (and the 16-bit writer) call these before they create a
folder, so a refused argument is one :class:`~flowlift.errors.FlowliftError` line naming it and leaves nothing
behind, and what is written is what was given: PNG keywords are Latin-1 (PNG spec 11.3.4: 1-79 printable
characters, no leading, trailing or double spaces), never cut at a NUL or dropped; a JPEG's EXIF block (where the
metadata goes as one JSON object) holds at most :data:`JPEG_EXIF_BYTES`.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from PIL import Image, PngImagePlugin

from flowlift.errors import FlowliftError

#: The suffixes flowlift writes images as, whatever the door (``-o FILE`` of upscale, colorfix, img2img, hires; the
#: Python API's paths); ``--format`` names png, jpg and webp of them.
OUTPUT_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
#: Suffix -> the format name ``--format`` uses (``.jpeg`` is ``jpg``, ``.tiff`` is ``tif``).
OUTPUT_FORMAT_OF_SUFFIX = {s: s[1:].replace("jpeg", "jpg").replace("tiff", "tif") for s in OUTPUT_SUFFIXES}
#: The longest EXIF block a JPEG holds: one APP1 segment of 65535 bytes less its 2-byte length (Pillow's limit).
JPEG_EXIF_BYTES = 65533
#: The longest side each format takes (WebP: 14-bit sizes; JPEG: libjpeg's limit); the others take any.
MAX_SIDE = {".webp": 16383, ".jpg": 65500, ".jpeg": 65500}
#: How flowlift's JSON (reports, image metadata) spells the floats JSON has no number for (an identical image's PSNR
#: is ``inf``; a NaN is ``"nan"``): strings ``float()`` reads back.
NON_FINITE_TEXT = {math.inf: "inf", -math.inf: "-inf"}
#: Suffixes whose metadata copies ``Software`` into an ASCII tag (EXIF's or TIFF's Software).
_ASCII_SOFTWARE_SUFFIXES = (".jpg", ".jpeg", ".webp", ".tif", ".tiff")


def strict_json_value(value: object, where: str) -> object:
    """``value`` as strict JSON (RFC 8259) takes it: a non-finite float as the string ``"inf"``, ``"-inf"`` or
    ``"nan"`` (as eval's reports write an identical image's PSNR: bare ``NaN`` breaks other tools' parsers), a path
    as its text, a number of another type (numpy's) as an int or float, a tuple as a list; anything else is one
    FlowliftError line naming ``where`` (the metadata key), never its ``str()`` in disguise."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else NON_FINITE_TEXT.get(number, "nan")
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        if bad := next((k for k in value if not isinstance(k, (str, int, float, bool)) and k is not None), None):
            raise FlowliftError(f"{where}: a key {bad!r} is not text; JSON keys are text", field="metadata")
        return {str(k): strict_json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json_value(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise FlowliftError(
        f"{where}: a value of type {type(value).__name__} cannot be written as JSON; give text, a number, a bool, "
        "None, a path, or a list or mapping of them",
        field="metadata",
    )


def metadata_text(value: object, key: object = "value") -> str:
    """One metadata value (under ``key``) as text: strings as they are, anything else as strict JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(strict_json_value(value, f"metadata[{key!r}]"), sort_keys=True, allow_nan=False)


def metadata_json(metadata: Mapping[str, object]) -> str:
    """All of ``metadata`` as one strict JSON object (EXIF UserComment, TIFF ImageDescription)."""
    strict = {str(k): strict_json_value(v, f"metadata[{k!r}]") for k, v in metadata.items()}
    return json.dumps(strict, sort_keys=True, allow_nan=False)


def check_output_suffix(path: str | os.PathLike, field: str | None = None) -> str:
    """The format name of an output path's suffix (``png``, ``jpg``, ...) or one FlowliftError line (naming
    ``field`` first when given)."""
    suffix = Path(path).suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise FlowliftError(
            f"{field + ' ' if field else ''}{path}: unsupported output format {suffix or '(none)'} "
            f"(writes {', '.join(OUTPUT_SUFFIXES)})",
            field=field,
        )
    return OUTPUT_FORMAT_OF_SUFFIX[suffix]


def png_keyword_problem(key: str) -> str | None:
    """Why ``key`` is no PNG text keyword (None: it is one): 1-79 printable Latin-1 characters (0x20-0x7E,
    0xA1-0xFF), no leading, trailing or consecutive spaces (PNG spec 11.3.4.2)."""
    if not 1 <= len(key) <= 79:
        return f"a PNG keyword is 1 to 79 characters, got {len(key)}"
    if any(not (" " <= char <= "~" or "\xa1" <= char <= "\xff") for char in key):
        return "a PNG keyword is printable Latin-1 text (no control characters, NUL or non-Latin-1 letters)"
    if key != key.strip(" ") or "  " in key:
        return "a PNG keyword has no leading, trailing or consecutive spaces"
    return None


def check_output_metadata(metadata: Mapping[str, object] | None, suffix: str) -> None:
    """One line naming ``metadata`` unless an output of ``suffix`` can hold it exactly: every value as text or JSON,
    no two keys the same name; in a PNG every key a keyword (:func:`png_keyword_problem`) and every value UTF-8 text
    without NUL; ``Software`` ASCII where it becomes an ASCII tag (JPEG, WebP, TIFF)."""
    if not metadata:
        return
    try:
        texts = {str(key): metadata_text(value, key) for key, value in metadata.items()}
        metadata_json(metadata)
    except (TypeError, ValueError, RecursionError) as error:  # a cycle; any other value is strict_json_value's line
        raise FlowliftError(f"metadata: a value cannot be written as JSON ({error})", field="metadata") from None
    if len(texts) != len(metadata):
        first = {}
        for key in metadata:
            if first.setdefault(str(key), key) is not key:
                raise FlowliftError(f"metadata: keys {first[str(key)]!r} and {key!r} are one entry", field="metadata")
    if suffix == ".png":
        for key, text in texts.items():
            if problem := png_keyword_problem(key):
                raise FlowliftError(f"metadata key {key[:100]!r}: {problem}", field="metadata")
            if "\0" in text or not _utf8(text):
                raise FlowliftError(
                    f"metadata[{key!r}]: a PNG text value is Unicode text without NUL characters", field="metadata"
                )
    software = metadata.get("Software")
    if suffix in _ASCII_SOFTWARE_SUFFIXES and isinstance(software, str) and not _ascii_tag(software):
        raise FlowliftError(
            f"metadata['Software'] must be ASCII text without NUL in a {suffix} (its Software tag), got {software!r}",
            field="metadata",
        )


def png_info(metadata: Mapping[str, object]) -> PngImagePlugin.PngInfo:
    """``metadata`` as Pillow's PNG text chunks (tEXt, iTXt for text beyond Latin-1; :func:`metadata_text`)."""
    info = PngImagePlugin.PngInfo()
    for key, value in metadata.items():
        info.add_text(str(key), metadata_text(value, key))
    return info


def check_encodable(
    mode: str, size: tuple[int, int], suffix: str, exif: bytes | None, metadata: Mapping[str, object] | None
) -> None:
    """One line naming ``image`` unless a file of ``suffix`` takes an image of ``mode`` and ``size``, or naming
    ``metadata`` (``source`` when there is none: the input's EXIF alone) when a JPEG's EXIF block, which carries
    the metadata as JSON, would be past :data:`JPEG_EXIF_BYTES`."""
    limit = MAX_SIDE.get(suffix)
    if limit is not None and max(size) > limit:
        raise FlowliftError(
            f"image is {size[0]}x{size[1]} pixels; a {suffix} holds at most {limit} per side (write .png or .tif)",
            field="image",
        )
    if problem := _mode_problem(mode, suffix):
        raise FlowliftError(
            f"image has mode {mode}, which a {suffix} cannot hold ({problem}); convert it first (image.convert('RGB'))",
            field="image",
        )
    if suffix not in (".jpg", ".jpeg") or exif is None or len(exif) <= JPEG_EXIF_BYTES:
        return
    field = "metadata" if metadata else "source"
    raise FlowliftError(
        f"{field} is too long for a JPEG: its EXIF block (metadata as JSON and the source's EXIF) would take "
        f"{len(exif)} bytes, at most {JPEG_EXIF_BYTES} (write .png, .webp or .tif)",
        field=field,
    )


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _ascii_tag(text: str) -> bool:
    return text.isascii() and "\0" not in text


@cache
def _mode_problem(mode: str, suffix: str) -> str | None:
    """Why Pillow cannot write a ``mode`` image as ``suffix`` (None: it can), found by writing one pixel."""
    try:
        Image.new(mode, (1, 1)).save(io.BytesIO(), format=Image.registered_extensions()[suffix])
    except (OSError, ValueError, KeyError) as error:
        return str(error) or type(error).__name__
    return None

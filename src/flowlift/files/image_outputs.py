"""Image files out: the formats flowlift writes, atomic saves, and what an output carries.

:func:`save_image_atomic` writes through a temporary file and a rename, so a crash never leaves a
truncated image under the final name. Outputs keep the input's ICC profile and EXIF
(:func:`read_source_profile`: orientation and sizes dropped) and carry ``metadata``: PNG text chunks,
one JSON object in the EXIF UserComment of JPEG/WebP files, or in the ImageDescription of TIFF files
(:func:`read_metadata` reads all three; BMP holds none). That metadata is also how a later run knows
an existing file as flowlift's own (:func:`inspect_existing`), which it may redo; any other image at
an output name is the user's. A format that cannot hold what the image has (alpha in a JPEG) costs one
warning line, never a silent loss.
"""

from __future__ import annotations

import hashlib
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import atomic_output
from flowlift.files.json_input import parse_json
from flowlift.files.output_checks import (
    OUTPUT_SUFFIXES,
    check_encodable,
    check_output_metadata,
    check_output_suffix,
    metadata_json,
    metadata_text,
    png_info,
)
from flowlift.knobs import check_kind, check_overwrite, check_path, check_quality

#: JPEG/WebP quality when none is given (WebP at 100 is written lossless).
DEFAULT_QUALITY = 95
#: zlib level of PNG outputs. Pillow's default (6) spends 3x the time of level 3 on a 6 MP output for files
#: 6-13% smaller (3072x2048: 18-24 s vs 8 s on a loaded 2-core EPYC, 4.20 vs 4.74 MB for a photo; docs/cpu.md).
PNG_COMPRESS_LEVEL = 3
#: zlib strategy of PNG outputs: ``Z_RLE`` (3; Pillow's ``compress_type``), matches only of the previous byte, after
#: PNG's per-row filters. Faster and smaller than the default strategy on photos: a 3072x2048 output in 0.41 vs
#: 0.72 CPU-s for 9.8 vs 10.4 MB (the random-UNet first command), 0.32 vs 0.53 CPU-s for 4.1 vs 4.7 MB (a Lanczos
#: 4x kodim23; docs/cpu.md). Lossless either way: the pixels are the same.
PNG_ZLIB_STRATEGY = 3
#: Output suffixes that store an alpha channel (JPEG does not).
ALPHA_SUFFIXES = (".png", ".webp", ".tif", ".tiff", ".bmp")


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
    if check_path("source", path, optional=True) is None:  # save_image_atomic's keyword: 5 is no path
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


def _exif_with_metadata(exif: Image.Exif | None, metadata: Mapping[str, object] | None) -> Image.Exif | None:
    """``exif`` (or a new block) with ``metadata`` as JSON in the EXIF UserComment (ASCII, JSON-escaped)."""
    if not metadata:
        return exif
    out = Image.Exif()
    if exif is not None:
        out.load(exif.tobytes())
    payload = metadata_json(metadata)  # strict JSON, ASCII (escaped)
    out.get_ifd(_EXIF_IFD)[_USER_COMMENT] = _ASCII_PREFIX + payload.encode("ascii")
    software = metadata.get("Software")
    if isinstance(software, str):
        out[0x0131] = software
    return out


def _json_object(text: object) -> dict[str, object] | None:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    if not isinstance(text, str) or not text.startswith("{"):
        return None
    try:
        value = parse_json(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def read_metadata(path: str | os.PathLike) -> dict[str, object]:
    """flowlift's metadata of an output: PNG text chunks, the JSON in a JPEG/WebP EXIF UserComment, or
    the JSON in a TIFF ImageDescription.

    JSON values are decoded; an image without flowlift metadata gives ``{}``. Every output reads with the same
    keys (:mod:`flowlift.files.metadata`, schema 1: ``Software`` and the ``flowlift`` object), files of the older
    layouts included.
    """
    from flowlift.files.metadata import as_current

    with Image.open(path) as opened:
        return as_current(_metadata_of(opened))


def _metadata_of(opened: Image.Image) -> dict[str, object]:
    if opened.format == "PNG":
        try:
            raw = dict(getattr(opened, "text", {}) or {})  # reads to the end for chunks after the image data
        except Exception:  # noqa: BLE001 - a truncated file: the text chunks before its image data are in .info
            raw = {str(k): v for k, v in opened.info.items() if isinstance(v, str)}
    else:
        exif = opened.getexif()
        if opened.format == "TIFF" and (found := _json_object(exif.get(0x010E))) is not None:
            return found
        comment = exif.get_ifd(_EXIF_IFD).get(_USER_COMMENT)
        if not isinstance(comment, bytes) or not comment.startswith(_ASCII_PREFIX):
            return {}
        return _json_object(comment[len(_ASCII_PREFIX) :].decode("ascii", "replace")) or {}
    decoded: dict[str, object] = {}
    for key, text in raw.items():
        try:
            decoded[key] = parse_json(text)
        except ValueError:
            decoded[key] = text
    return decoded


def is_flowlift_metadata(metadata: Mapping[str, object]) -> bool:
    """True for the metadata flowlift writes: ``Software: flowlift ...`` (upscale, colorfix) or a
    ``flowlift`` / ``flowlift.*`` key (the refine commands, ``eval --save-outputs``)."""
    software = metadata.get("Software")
    if isinstance(software, str) and software.startswith("flowlift"):
        return True
    return any(str(key) == "flowlift" or str(key).startswith("flowlift.") for key in metadata)


@dataclass(frozen=True)
class ExistingFile:
    """What is at an output path before a run writes it (see :func:`inspect_existing`)."""

    empty: bool = False
    image: bool = False  # opens as an image (its header parses)
    complete: bool = False  # all its data is there (PNG chunk CRCs, or a full decode)
    size: tuple[int, int] | None = None  # (width, height)
    by_flowlift: bool = False  # carries flowlift's metadata


_PIXEL_LIMIT = threading.Lock()
_INSPECTED: dict[tuple, ExistingFile] = {}


_PNG_END = b"\0\0\0\0IEND\xaeB`\x82"  # the empty IEND chunk with its CRC: every PNG's last 12 bytes


def _ends_whole(path: Path, fmt: str | None) -> bool:
    """O(1): the file ends as its format's files end (PNG: IEND; JPEG: EOI; WebP: the RIFF length).
    A file cut short does not; one that does not may still be whole (data after the end)."""
    with open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        if fmt == "PNG" and size >= 12:
            handle.seek(size - 12)
            return handle.read(12) == _PNG_END
        if fmt == "JPEG" and size >= 2:
            handle.seek(size - 2)
            return handle.read(2) == b"\xff\xd9"
        if fmt == "WEBP" and size >= 12:
            handle.seek(4)
            return int.from_bytes(handle.read(4), "little") + 8 <= size
    return False


def _is_complete(opened: Image.Image, path: Path) -> bool:
    """Whether all of an opened image's data is there: cheaply when the file ends as its format's
    files end (:func:`_ends_whole`), else by reading it: a PNG's chunks CRC-checked to IEND (no
    decompression), a JPEG decoded at 1/8 scale (every entropy-coded byte still read), anything else
    decoded in full. Pillow refuses truncated data unless told otherwise."""
    try:
        if _ends_whole(path, opened.format):
            return True
        if opened.format == "PNG":
            opened.verify()
        else:
            if opened.format == "JPEG":
                opened.draft("RGB", (max(1, opened.width // 8), max(1, opened.height // 8)))
            opened.load()
    except Exception:  # noqa: BLE001 - any decoder failure means the file is not whole
        return False
    return True


def inspect_existing(path: str | os.PathLike, expected_size: tuple[int, int] | None = None) -> ExistingFile:
    """Classify an existing file at an output path: empty, not an image, truncated, its size, and
    whether flowlift wrote it (:func:`is_flowlift_metadata`).

    ``expected_size`` (width, height) lifts Pillow's decompression-bomb limit to that many pixels for
    this one open, so a finished 16K output is recognised; a larger image that Pillow refuses counts
    as a whole image of unknown size (it is somebody's picture, never debris). Results are cached by
    the file's identity and modification time.
    """
    path = Path(path)
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, expected_size)
    if key in _INSPECTED:
        return _INSPECTED[key]
    if stat.st_size == 0:
        found = ExistingFile(empty=True)
    else:
        found = _inspect(path, expected_size)
    if len(_INSPECTED) > 4096:
        _INSPECTED.clear()
    _INSPECTED[key] = found
    return found


def _inspect(path: Path, expected_size: tuple[int, int] | None) -> ExistingFile:
    limit = (expected_size[0] * expected_size[1]) if expected_size else 0
    with _PIXEL_LIMIT:  # Pillow's limit is process-wide: raised for this inspection only
        default = Image.MAX_IMAGE_PIXELS
        if default is not None and limit > default:
            Image.MAX_IMAGE_PIXELS = limit
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with Image.open(path) as opened:
                    size = (int(opened.size[0]), int(opened.size[1]))
                    try:
                        by_flowlift = is_flowlift_metadata(_metadata_of(opened))
                    except Exception:  # noqa: BLE001 - unreadable metadata claims nothing
                        by_flowlift = False
                with Image.open(path) as fresh:  # verify() needs an image that has not been loaded
                    complete = _is_complete(fresh, path)
        except Image.DecompressionBombError:  # a real picture larger than any output: somebody's
            return ExistingFile(image=True, complete=True)
        except PermissionError:
            raise  # unreadable to us is not unreadable: the caller must not replace it
        except Exception:  # noqa: BLE001 - anything Pillow cannot open is not an image
            return ExistingFile()
        finally:
            Image.MAX_IMAGE_PIXELS = default
    return ExistingFile(image=True, complete=complete, size=size, by_flowlift=by_flowlift)


def is_users_file(path: Path) -> bool:
    """A regular file at ``path`` (no link), neither empty nor flowlift's: only an overwrite replaces it."""
    if not path.is_file() or path.is_symlink():
        return False
    found = inspect_existing(path)
    return not found.empty and not found.by_flowlift


def output_format(output: str | os.PathLike | None, requested: str | None) -> str:
    """The format a command writes: ``--format`` (``requested``), or the suffix of ``-o FILE``
    (:func:`flowlift.files.output_paths.names_output_file`; a suffix flowlift does not write is
    :func:`~flowlift.files.output_paths.output_file_format`'s one line), else ``png``; both given and different is
    an error."""
    from flowlift.files.output_paths import names_output_file, output_file_format

    if not names_output_file(output):
        return requested or "png"
    named = output_file_format(output)
    if requested is not None and requested != named:
        suffix = Path(output).suffix.lower()
        raise FlowliftError(
            f"-o {output} is a .{suffix.lstrip('.')} file name but --format {requested} was given; "
            "drop one, or give -o a folder"
        )
    return named


def save_image_atomic(
    image: Image.Image,
    path: str | os.PathLike,
    metadata: Mapping[str, object] | None = None,
    *,
    source: SourceProfile | str | os.PathLike | None = None,
    quality: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Save ``image`` to ``path`` (its suffix says the format) via a temporary file beside it and an atomic rename.

    ``metadata`` goes into PNG text chunks (non-strings as JSON) and the EXIF UserComment (one JSON object) of JPEG
    and WebP; ``source`` (an input path or its :class:`SourceProfile`) gives the ICC profile and EXIF to carry over.
    ``quality`` (an int in 1-100, default :data:`DEFAULT_QUALITY`): JPEG and WebP (lossless at 100). A file at
    ``path`` is replaced only when it is empty, flowlift wrote it, or ``overwrite`` is ``True`` (a bool)."""
    path = Path(check_path("path", path))
    check_output_suffix(path, "path")
    if not isinstance(image, Image.Image) or 0 in image.size:
        got = f"{image.width}x{image.height}" if isinstance(image, Image.Image) else f"a {type(image).__name__}"
        raise FlowliftError(f"image must be a Pillow image of at least 1x1 pixels, got {got}", field="image")
    suffix = path.suffix.lower()
    check_kind("metadata", metadata, Mapping, "a mapping (name -> text or JSON-able value)", optional=True)
    check_output_metadata(metadata, suffix)
    check_quality(quality)
    if not check_overwrite(overwrite) and is_users_file(path):  # a link, folder or FIFO: atomic_output's line
        raise FlowliftError(f"{path} exists and was not written by flowlift; pass overwrite=True to replace it")
    profile = source if isinstance(source, SourceProfile) else read_source_profile(source)
    kwargs = _save_options(image, suffix, metadata, profile, quality)  # every check done: now convert and write
    if image.mode in ("RGBA", "LA", "PA") and suffix not in ALPHA_SUFFIXES:
        warn_alpha_dropped(path)
        image = image.convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".png" and (data := _opencv_png(image, kwargs, metadata)) is not None:
        with atomic_output(path) as temporary:
            temporary.write_bytes(data)
        return path
    with atomic_output(path) as temporary:
        image.save(temporary, format=Image.registered_extensions()[suffix], **kwargs)
    return path


def _save_options(
    image: Image.Image, suffix: str, metadata: Mapping[str, object] | None, profile: SourceProfile, quality: int | None
) -> dict:
    """Pillow's save options for a ``suffix`` file, or one line naming ``image``, ``metadata`` or ``source`` where
    the format cannot hold them (:func:`flowlift.files.output_checks.check_encodable`; nothing written yet)."""
    kwargs: dict = {}
    exif = profile.exif
    if suffix == ".png":
        kwargs["compress_level"] = PNG_COMPRESS_LEVEL
        kwargs["compress_type"] = PNG_ZLIB_STRATEGY
        if metadata:
            kwargs["pnginfo"] = png_info(metadata)
    elif suffix in (".jpg", ".jpeg", ".webp"):
        exif = _exif_with_metadata(exif, metadata)
        kwargs["quality"] = int(quality if quality is not None else DEFAULT_QUALITY)
        if suffix == ".webp" and kwargs["quality"] == 100:
            kwargs["lossless"] = True
    elif suffix in (".tif", ".tiff") and metadata:
        kwargs["description"] = metadata_json(metadata)
        if isinstance(metadata.get("Software"), str):
            kwargs["software"] = metadata["Software"]
    if suffix in (".png", ".jpg", ".jpeg", ".webp", ".tif", ".tiff"):
        if profile.icc_profile:
            kwargs["icc_profile"] = profile.icc_profile
        if exif is not None:
            kwargs["exif"] = exif.tobytes()
    dropped = image.mode in ("RGBA", "LA", "PA") and suffix not in ALPHA_SUFFIXES  # written as RGB
    check_encodable("RGB" if dropped else image.mode, image.size, suffix, kwargs.get("exif"), metadata)
    return kwargs


def _opencv_png(image: Image.Image, kwargs: dict, metadata: Mapping[str, object] | None) -> bytes | None:
    """The PNG bytes of an 8-bit RGB(A) ``image`` by :func:`flowlift.files.png_encoder.encode_8bit_image` (Paeth
    filter, 0.6x Pillow's CPU time at the same size), with the same chunks Pillow would write; else None."""
    from flowlift.files.png_encoder import encode_8bit_image

    texts = {str(key): metadata_text(value, key) for key, value in (metadata or {}).items()}
    icc, exif = kwargs.get("icc_profile"), kwargs.get("exif")
    return encode_8bit_image(image, icc, exif, texts, PNG_COMPRESS_LEVEL, PNG_ZLIB_STRATEGY)


def warn_alpha_dropped(path: str | os.PathLike) -> None:
    """One warning line: ``path``'s format keeps no alpha channel, so the transparency is lost."""
    from flowlift.errors import FlowliftWarning

    fmt = Path(path).suffix.lstrip(".").upper() or "this format"
    warnings.warn(
        FlowliftWarning(
            f"{path}: {fmt} has no alpha channel, the transparency is dropped (use --format png|webp to keep it)"
        ),
        stacklevel=3,
    )


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


def check_single_output(
    path: Path, overwrite: bool = False, option: str = "--output", inputs: dict[str, Any] | None = None
) -> None:
    """One output image ``path`` (a refine's) can be written, and writing it destroys nothing of the user's.

    Writable in a format flowlift writes (name length, folder, what is there:
    :func:`flowlift.files.output_paths.output_file_problem`); none of ``inputs`` (a role -> a path or paths, by
    identity: :func:`flowlift.files.output_paths.same_file_error`, ``overwrite`` or not, issue 36.2); only a
    regular file may be replaced, and one without
    flowlift's metadata needs ``overwrite`` (an empty file, and flowlift's own earlier results, are replaced). A
    killed run's debris beside it is removed (never a live writer's). Checked before any model loads; ``option``
    names the output in the one error line.
    """
    from flowlift.files.atomic import remove_stale_temporaries
    from flowlift.files.output_paths import check_not_an_input, output_file_problem

    overwrite = check_overwrite(overwrite)
    named = {"field": "output"} if option == FIELD_MARK else {}  # a door words the mark: "-o"/"--output", "output"
    if os.path.isdir(path) or path.suffix.lower() not in OUTPUT_SUFFIXES:  # os: a name too long is no folder
        said = " is a folder" if os.path.isdir(path) else f": unsupported image format {path.suffix or '(none)'}"
        raise FlowliftError(f"{option} {path}{said}: give a file name ending {', '.join(OUTPUT_SUFFIXES)}", **named)
    check_not_an_input(path, inputs or {})
    if problem := output_file_problem(path):  # first: a name too long cannot even be looked at
        raise FlowliftError(problem)
    remove_stale_temporaries(path.parent)
    if not overwrite and is_users_file(path):
        use, fields = (FIELD_MARK, {"field": ("output", "overwrite")}) if named else ("--overwrite", {})
        raise FlowliftError(
            f"{option} {path} exists and was not written by flowlift; use {use} to replace it", **fields
        )

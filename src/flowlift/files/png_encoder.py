"""PNG files written with OpenCV's encoder and flowlift's own ancillary chunks (ICC profile, EXIF, text).

Pillow cannot write 16-bit RGB, and for 8-bit RGB(A) its encoder picks a filter per row by trying all five (PNG
spec, section 9): most of its time at 6 MP. :func:`encode_png` takes the samples as an (H, W, 3|4) ``uint8`` or
``uint16`` array, lets OpenCV's libpng compress them (``params``: :data:`FAST_8BIT_PARAMS` for 8-bit outputs) and
puts the chunks after IHDR as Pillow's ``PngInfo.add_text`` would write them (tEXt, or iTXt beyond Latin-1), so
:func:`flowlift.files.image_outputs.read_metadata` and Pillow read them back alike. Lossless whatever the filter.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping

import numpy as np

from flowlift.errors import FlowliftError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ICC_KEYWORD = b"ICC profile"


def fast_8bit_params(compress_level: int, strategy: int) -> list[int]:
    """OpenCV ``imencode`` parameters of flowlift's 8-bit PNG outputs: zlib ``compress_level`` and ``strategy``
    (``Z_RLE`` = 3), and the Paeth filter on every row where this OpenCV can choose one (4.11 on; else libpng's
    own choice). Paeth alone: files within 0.5% of the adaptive choice's size on photos and model outputs, in
    0.6x the CPU time (docs/cpu.md, issue 47)."""
    import cv2

    params = [cv2.IMWRITE_PNG_COMPRESSION, int(compress_level), cv2.IMWRITE_PNG_STRATEGY, int(strategy)]
    if hasattr(cv2, "IMWRITE_PNG_FILTER") and hasattr(cv2, "IMWRITE_PNG_FILTER_PAETH"):
        params += [cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_PAETH]
    return params


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """``length, type, data, CRC-32(type + data)``: one PNG chunk (PNG spec, section 5.3)."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def text_chunk(key: str, text: str) -> bytes:
    """tEXt when both fit Latin-1, else iTXt (UTF-8, uncompressed), as Pillow's ``PngInfo.add_text``."""
    try:
        return png_chunk(b"tEXt", key.encode("latin-1") + b"\0" + text.encode("latin-1"))
    except UnicodeEncodeError:
        return png_chunk(b"iTXt", key.encode("latin-1", "replace") + b"\0\0\0\0\0" + text.encode("utf-8"))


def encode_png(
    array: np.ndarray,
    icc: bytes | None,
    exif: bytes | None,
    texts: Mapping[str, str],
    params: list[int] | None = None,
) -> bytes:
    """The PNG file of ``array`` (H, W, 3) RGB or (H, W, 4) RGBA, ``uint8`` or ``uint16``: OpenCV's encoding with
    ``params``, then ``icc`` (iCCP), ``exif`` (eXIf) and ``texts`` (key -> text) as chunks after IHDR."""
    import cv2

    if array.ndim != 3 or array.shape[-1] not in (3, 4) or array.dtype not in (np.uint8, np.uint16):
        raise FlowliftError(f"encode_png: expected (H, W, 3|4) uint8 or uint16, got {array.dtype} {array.shape}")
    code = cv2.COLOR_RGBA2BGRA if array.shape[-1] == 4 else cv2.COLOR_RGB2BGR
    ok, encoded = cv2.imencode(".png", cv2.cvtColor(np.ascontiguousarray(array), code), params or [])
    if not ok:
        raise FlowliftError("OpenCV could not encode the PNG")
    data = encoded.tobytes()
    ihdr_end = len(PNG_SIGNATURE) + 8 + 13 + 4
    if not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        raise FlowliftError("OpenCV wrote an unexpected PNG layout")
    extra = b""
    if icc:
        extra += png_chunk(b"iCCP", _ICC_KEYWORD + b"\0\0" + zlib.compress(icc))
    if exif:
        extra += png_chunk(b"eXIf", exif[6:] if exif.startswith(b"Exif\0\0") else exif)
    for key, text in texts.items():
        extra += text_chunk(str(key), text)
    return data[:ihdr_end] + extra + data[ihdr_end:]


def encode_8bit_image(
    image, icc: bytes | None, exif: bytes | None, texts: Mapping[str, str], compress_level: int, strategy: int
) -> bytes | None:
    """:func:`encode_png` of a Pillow ``RGB`` / ``RGBA`` image with :func:`fast_8bit_params`; None for any other
    mode, for an image whose ``info`` Pillow would write as chunks of its own (transparency, dpi, gamma, ...), or
    without OpenCV: the caller then lets Pillow write it."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        return None
    if image.mode not in ("RGB", "RGBA") or image.info:
        return None
    return encode_png(np.asarray(image), icc, exif, texts, fast_8bit_params(compress_level, strategy))

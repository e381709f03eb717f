"""Image files in, the package's one place for reading pixels with Pillow.

* :func:`load_image` opens a file as an 8-bit RGB image plus its alpha channel (if any): EXIF
  orientation applied, palette/grayscale/CMYK/16-bit modes converted (16-bit colour rounded to 8 bits:
  :mod:`flowlift.files.deep_images`), and every failure (missing,
  not an image, truncated, decompression bomb) raised as one :class:`FlowliftError` line.
* :data:`IMAGE_SUFFIXES` lists every format the loader reads; multi-frame files (GIF, APNG, TIFF pages)
  use their first frame, with one warning. :func:`list_images` expands files, folders and patterns.
* :func:`to_tensor` / :func:`tensor_to_pil` convert between Pillow/NumPy and the package's tensor
  convention (float [0, 1], NCHW, RGB).

Writing images (formats, metadata, ICC/EXIF carried over, atomic saves) is :mod:`flowlift.files.image_outputs`.
"""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from flowlift.errors import FlowliftError, FlowliftWarning
from flowlift.files.atomic import is_temporary
from flowlift.files.deep_images import DEEP_FALLBACK, INTEGER_MODES, integer_white, is_deep_colour, read_deep_colour

#: Formats the loader reads, by suffix: everything common that Pillow opens as a still or first frame
#: (AVIF and JPEG 2000 only where this Pillow was built with them). Folders are listed by these.
_READ_CANDIDATES = {
    "PNG": (".png", ".apng"),
    "JPEG": (".jpg", ".jpeg", ".jpe", ".jfif"),
    "WEBP": (".webp",),
    "BMP": (".bmp", ".dib"),
    "TIFF": (".tif", ".tiff"),
    "GIF": (".gif",),
    "AVIF": (".avif", ".avifs"),
    "JPEG2000": (".jp2", ".j2k", ".jpx", ".jpf"),
    "TGA": (".tga",),
    "PPM": (".ppm", ".pgm", ".pbm", ".pnm"),
    "QOI": (".qoi",),
    "PSD": (".psd",),
    "SGI": (".sgi", ".rgb", ".bw"),
    "PCX": (".pcx",),
}
_FEATURES = {"WEBP": "webp", "AVIF": "avif", "JPEG2000": "jpg_2000"}


def _readable_suffixes() -> tuple[str, ...]:
    from PIL import features

    suffixes: list[str] = []
    for format_name, names in _READ_CANDIDATES.items():
        feature = _FEATURES.get(format_name)
        if feature is None or features.check(feature):
            suffixes.extend(names)
    return tuple(suffixes)


IMAGE_SUFFIXES = _readable_suffixes()
#: Pixels per row strip of :func:`tensor_to_uint8` (its float32 temporaries stay in the CPU's caches).
_UINT8_STRIP_PIXELS = 1 << 16
#: Pillow's own limit (~89 Mpx) would be raised to a warning only; flowlift refuses anything larger.
MAX_INPUT_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


def rgb_and_alpha(image: Image.Image, *, white: float | None = None) -> tuple[Image.Image, Image.Image | None]:
    """Convert any Pillow mode to 8-bit RGB, splitting off alpha (palette transparency included); integer grey by
    ``white`` (default :func:`~flowlift.files.deep_images.integer_white`, asked before the pixels load)."""
    if image.mode in INTEGER_MODES:
        # Pillow's convert("RGB") clips instead of scaling, so scale by hand, by the white the file says.
        top = integer_white(image) if white is None else white
        array = np.asarray(image, dtype=np.float64)
        grey = np.clip(np.round(array / top * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB"), None
    if image.mode == "F":
        values = np.asarray(image, dtype=np.float64)
        if not np.isfinite(values).all():
            # NaN would become 0 (black) through the uint8 cast, with numpy's RuntimeWarning on stderr
            raise FlowliftError("floating-point image holds NaN or Inf pixel values")
        if values.size and (values.min() < -0.5 / 255 or values.max() > 1 + 0.5 / 255):  # 0..255 would be clipped white
            raise FlowliftError(
                f"floating-point image holds values in [{values.min():g}, {values.max():g}]; flowlift reads float "
                "pixels as 0..1 (scale it, or save it as 8 or 16 bits)"
            )
        grey = np.clip(np.round(values * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB"), None
    has_alpha = image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (image.mode == "P" and "transparency" in image.info)
    if has_alpha:
        rgba = image.convert("RGBA")
        return rgba.convert("RGB"), rgba.getchannel("A")
    return image.convert("RGB"), None


#: What Pillow raises on damaged bytes, beyond OSError: a truncated GIF or TIFF page table fails with
#: IndexError, struct.error or TypeError while its frames are counted or decoded.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, IndexError, EOFError, struct.error)


#: Everything reading an image may raise that is the file's fault (a decompression bomb, damaged bytes).
_READ_ERRORS = (Image.DecompressionBombError, Image.DecompressionBombWarning, *DECODE_ERRORS)


def _read_error(path: Path, error: BaseException) -> FlowliftError:
    """The one line for what reading ``path`` raised (one of :data:`_READ_ERRORS`)."""
    if isinstance(error, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return FlowliftError(f"{path}: refused as a decompression bomb ({error})")
    if isinstance(error, UnidentifiedImageError):
        return FlowliftError(f"{path}: not an image file Pillow can read")
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return FlowliftError(f"{path}: unreadable or truncated image ({message})")


def _check_pixels(path: Path, width: int, height: int) -> None:
    """One FlowliftError line for an image over :data:`MAX_INPUT_PIXELS` (the decompression-bomb guard)."""
    if width * height > MAX_INPUT_PIXELS:
        raise FlowliftError(
            f"{path}: {width}x{height} exceeds the {MAX_INPUT_PIXELS} pixel limit (decompression-bomb guard)"
        )


def _frame_count(opened: Image.Image) -> int:
    """How many frames ``opened`` holds. Pillow counts them by seeking through the file, so a damaged
    later frame fails here; it raises ValueError then (a file cut short is refused, not half-read)."""
    try:
        return int(getattr(opened, "n_frames", 1))
    except (*DECODE_ERRORS, TypeError, KeyError) as error:  # TypeError: a TIFF page without its size tags
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"its frames cannot be counted: {message}") from None


def load_image(path: str | os.PathLike) -> tuple[Image.Image, Image.Image | None]:
    """Open ``path`` as (8-bit RGB image, alpha ``"L"`` image or None), EXIF orientation applied."""
    from flowlift.knobs import check_path

    path = Path(check_path("path", path))  # "" would be the working folder, 5 a TypeError from pathlib
    if not path.is_file():
        raise FlowliftError(f"{path} is a folder: give an image file" if path.is_dir() else f"{path}: no such file")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                frames = _frame_count(opened)
                if frames > 1 and opened.format != "MPO":  # MPO: a JPEG with a preview/depth frame attached
                    warnings.warn(f"{path}: has {frames} frames, only the first is used", UserWarning, stacklevel=2)
                _check_pixels(path, *opened.size)
                deep = read_deep_colour(path, opened) if is_deep_colour(opened) else None
                if deep is not None:  # 16 bits a channel: rounded, where Pillow would truncate
                    rgb, alpha = deep
                else:
                    if is_deep_colour(opened):
                        warnings.warn(f"{path}: {DEEP_FALLBACK}", FlowliftWarning, stacklevel=2)
                    white = integer_white(opened) if opened.mode in INTEGER_MODES else None  # before load
                    opened.load()
                    rgb, alpha = rgb_and_alpha(ImageOps.exif_transpose(opened), white=white)
    except FlowliftError as error:
        text = str(error)
        raise FlowliftError(text if text.startswith(str(path)) else f"{path}: {text}") from None
    except _READ_ERRORS as error:
        raise _read_error(path, error) from None
    _report_reader_warnings(path, caught)
    return rgb, alpha


def _report_reader_warnings(path: Path, caught: list[warnings.WarningMessage]) -> None:
    """Turn what Pillow/numpy said while reading ``path`` into at most one :class:`FlowliftWarning`.

    Pillow's EXIF/metadata complaints are worth one line (the orientation or colour tags may be
    wrong); everything else (numpy casts, libraries' FutureWarnings) is noise the user cannot act on.
    """
    notes = []
    for warning in caught:
        if str(warning.message).startswith(str(path)):
            warnings.warn(warning.message, warning.category, stacklevel=3)  # flowlift's own (multi-frame files)
            continue
        text = str(warning.message).splitlines()[0] if str(warning.message) else warning.category.__name__
        if issubclass(warning.category, UserWarning) and any(k in text.lower() for k in ("exif", "metadata", "tag")):
            if text not in notes:
                notes.append(text)
    if notes:
        warnings.warn(
            FlowliftWarning(f"{path}: {'; '.join(notes)} (image read, metadata may be ignored)"), stacklevel=3
        )


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of an image file as :func:`load_image` would return it, from its header only.

    EXIF orientations 5-8 (rotations by 90 degrees) swap the sides. Unreadable files and images over
    :data:`MAX_INPUT_PIXELS` (decompression bombs) raise one FlowliftError line, like ``load_image``.
    """
    path = Path(path)
    if not path.is_file():
        raise FlowliftError(f"{path} is a folder: give an image file" if path.is_dir() else f"{path}: no such file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as opened:
                width, height = opened.size
                orientation = opened.getexif().get(0x0112, 1)
    except _READ_ERRORS as error:
        raise _read_error(path, error) from None
    _check_pixels(path, width, height)
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


#: How far a float image may stray outside [0, 1] and still be taken (clamped): half an 8-bit level,
#: i.e. rounding noise that cannot change the image once quantized. Anything further is not an image
#: in the package's convention (a 0..255 float image would otherwise saturate to white).
FLOAT_RANGE_TOLERANCE = 0.5 / 255.0


def _integer_scale(dtype_name: str) -> float | None:
    """The full-scale value of an unsigned integer image dtype (uint8 -> 255, uint16 -> 65535), else None."""
    return {"uint8": 255.0, "uint16": 65535.0}.get(dtype_name)


def _check_float_range(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """Refuse NaN/Inf and values outside [0, 1] beyond :data:`FLOAT_RANGE_TOLERANCE`; clamp the rest.

    One min/max reduction per image: the pixels are checked once, where they enter.
    """
    if tensor.numel() == 0:
        raise FlowliftError(f"{what} is empty (shape {tuple(tensor.shape)})")
    from flowlift.devices import non_finite_kind

    values = tensor.detach().float()
    if kind := non_finite_kind(values):
        raise FlowliftError(f"{what} contains {kind} pixel values")
    low, high = (float(v) for v in torch.aminmax(values))
    if low < -FLOAT_RANGE_TOLERANCE or high > 1.0 + FLOAT_RANGE_TOLERANCE:
        raise FlowliftError(
            f"{what} has values in [{low:.4g}, {high:.4g}]; float images must lie in [0, 1] "
            "(pass uint8/uint16 data as integers, or divide by 255)"
        )
    return tensor.clamp(0.0, 1.0)


def to_tensor(
    image: Image.Image | np.ndarray | torch.Tensor,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Any image-like input -> float (B, 3, H, W) in [0, 1].

    Accepts a Pillow image (converted to RGB), an HW / HWC / NHWC array, or a CHW / NCHW tensor.
    uint8 and uint16 data are scaled by their full range (255, 65535); float data must already lie in
    [0, 1] (within half an 8-bit level, then clamped) and be finite. Any other dtype (signed or wider
    integers, bool, complex) raises :class:`FlowliftError`.
    """
    if isinstance(image, Image.Image):
        image = rgb_and_alpha(image)[0]
        array = np.asarray(image)
        tensor = torch.from_numpy(array.copy()).permute(2, 0, 1)[None].float() / 255.0
    elif isinstance(image, np.ndarray):
        array = image
        if array.ndim == 2:
            array = np.repeat(array[..., None], 3, axis=-1)
        if array.ndim == 3:
            array = array[None]
        if array.ndim == 4 and array.shape[-1] == 4:
            array = array[..., :3]
        if array.ndim != 4 or array.shape[-1] != 3:
            raise FlowliftError(f"expected an HWC RGB array, got shape {image.shape}")
        full_scale = _integer_scale(array.dtype.name)
        if full_scale is not None:
            scaled = array.astype(np.float32) / full_scale
            tensor = torch.from_numpy(np.ascontiguousarray(scaled)).permute(0, 3, 1, 2)
        elif array.dtype.kind == "f":
            tensor = torch.from_numpy(np.ascontiguousarray(array.astype(np.float32))).permute(0, 3, 1, 2)
            tensor = _check_float_range(tensor, "image array")
        else:
            raise FlowliftError(f"image arrays must be uint8, uint16 or float in [0, 1], got {array.dtype}")
    elif isinstance(image, torch.Tensor):
        from flowlift.devices import check_holds_values

        check_holds_values(image, "the image")  # before the uint8 scaling, which would keep it a meta tensor
        tensor = image if image.ndim == 4 else image[None]
        if tensor.ndim != 4 or tensor.shape[1] != 3:
            raise FlowliftError(f"expected an NCHW RGB tensor, got shape {tuple(image.shape)}")
        full_scale = _integer_scale(str(tensor.dtype).removeprefix("torch."))
        if full_scale is not None:
            tensor = tensor.float() / full_scale
        elif tensor.is_floating_point():
            tensor = _check_float_range(tensor, "image tensor")
        else:
            raise FlowliftError(f"image tensors must be uint8, uint16 or float in [0, 1], got {tensor.dtype}")
    else:
        raise FlowliftError(f"unsupported image type {type(image).__name__}")
    if not tensor.numel():  # a batch of 0 or a side of 0: nothing to encode
        raise FlowliftError(f"the image is empty: shape {tuple(tensor.shape)} (B, 3, H, W)")
    return tensor.to(device=device, dtype=dtype)


def tensor_to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) or (3, H, W) float in [0, 1] -> uint8 (B, H, W, 3), clamped and rounded (``round(255 x)``).

    Row strips of :data:`_UINT8_STRIP_PIXELS`, in one CPU thread: each strip is scaled and rounded in float32 while
    it is in the caches and written straight into the interleaved (H, W, 3) array a Pillow image or a PNG encoder
    takes (no full-size float temporaries, no transposing copy afterwards; docs/cpu.md, issue 47).
    """
    from flowlift.devices import non_finite_kind, one_thread

    if images.ndim == 3:
        images = images[None]
    values = images.detach()
    if kind := non_finite_kind(values):
        # clamp keeps NaN and the uint8 cast turns it into 0: a black image that looks like a result
        raise FlowliftError(f"the image to write contains {kind} pixel values; nothing was written")
    if values.device.type != "cpu":  # on the device, whole: one transfer of the 8-bit result
        scaled = values.float().clamp(0, 1).mul(255.0).round().to(torch.uint8)
        return scaled.permute(0, 2, 3, 1).contiguous().cpu().numpy()
    batch, channels, height, width = values.shape
    out = torch.empty(batch, height, width, channels, dtype=torch.uint8)
    rows = max(1, _UINT8_STRIP_PIXELS // max(width, 1))
    with one_thread(values.device):
        for r0 in range(0, height, rows):
            strip = values[:, :, r0 : r0 + rows].to(torch.float32, copy=True)
            out[:, r0 : r0 + rows].permute(0, 3, 1, 2).copy_(strip.clamp_(0, 1).mul_(255.0).round_())
    return out.numpy()


def tensor_to_pil(image: torch.Tensor) -> Image.Image:
    """One image tensor (3, H, W) or (1, 3, H, W) in [0, 1] -> Pillow RGB (clamped, rounded)."""
    if image.ndim == 4 and image.shape[0] != 1:
        raise ValueError(f"tensor_to_pil takes one image, got a batch of {image.shape[0]}")
    return Image.fromarray(tensor_to_uint8(image)[0], "RGB")


def array_alpha(array: np.ndarray) -> Image.Image | None:
    """The alpha of an RGBA (H, W, 4) or (1, H, W, 4) array as an 8-bit Pillow ``"L"`` image (uint8 as is, uint16
    and float in [0, 1] by their range, as :func:`to_tensor` reads the colour); None for any other shape. A batch of
    RGBA arrays is refused: one output image per alpha is the upscale's rule (upscale them one by one)."""
    if array.ndim not in (3, 4) or array.shape[-1] != 4:
        return None
    if array.ndim == 4 and array.shape[0] != 1:
        raise FlowliftError(
            f"a batch of {array.shape[0]} RGBA arrays would lose its alpha: pass them one by one, or RGB (..., 3)"
        )
    alpha = array.reshape(array.shape[-3], array.shape[-2], 4)[..., 3]
    full_scale = _integer_scale(alpha.dtype.name)
    if full_scale is None and alpha.dtype.kind != "f":
        return None  # to_tensor refuses the dtype with the colour
    values = torch.from_numpy(np.ascontiguousarray(alpha, dtype=np.float32))
    values = values / full_scale if full_scale is not None else _check_float_range(values, "the image array's alpha")
    return Image.fromarray(values.mul(255.0).round_().to(torch.uint8).numpy(), "L")


def list_images(inputs: list[str], problems: list[tuple[str, str]] | None = None) -> list[Path]:
    """Expand files, folders (non-recursive, image suffixes) and glob patterns, sorted, unique.

    An item that matches nothing, or names something that is not a regular file or folder (a FIFO,
    a socket, a device), raises FlowliftError — or, when a ``problems`` list is given, is appended to
    it as ``(item, message)`` so that a batch can report it in one line and go on with the rest.
    Temporary files of interrupted writes are never listed.
    """
    import glob

    def problem(item: str, message: str) -> None:
        if problems is None:
            raise FlowliftError(f"{item}: {message}")
        problems.append((item, message))

    found: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            # temporary files of a killed run (.name.XXXX.partial.png in older releases) are never inputs
            found.extend(
                sorted(
                    p
                    for p in path.iterdir()
                    if p.suffix.lower() in IMAGE_SUFFIXES and not is_temporary(p) and p.is_file()
                )
            )
        elif path.is_file():
            found.append(path)
        elif path.exists():
            problem(item, "not a regular file or folder (a FIFO, socket or device cannot be read as an image)")
        else:
            matches = sorted(Path(m) for m in glob.glob(str(path)) if not is_temporary(m))
            files = [m for m in matches if m.is_file()]
            for odd in matches:
                if not odd.is_file() and odd.suffix.lower() in IMAGE_SUFFIXES:
                    problem(str(odd), "not a regular file")
            if not matches:
                problem(item, "no such file, folder or matching pattern")
            found.extend(files)
    unique: list[Path] = []
    seen: set[Path] = set()
    for p in found:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique

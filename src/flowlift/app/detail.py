"""The detail view of ``flowlift app``: a region of the result at 100% or 200%, beside the same region of
the input resized to match, so a 4x or 8x result is seen pixel for pixel (the before/after slider
shows the whole image shrunk to the page).

Everything here is Pillow on files, no Gradio: :func:`detail_box` picks the output region,
:func:`detail_view` cuts both crops from the written PNG and the uploaded input, :func:`detail_html`
shows them at a fixed CSS size (one image pixel per CSS pixel at 100%), and :func:`overview` draws the
region on a thumbnail of the result that the user clicks to move it.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from flowlift.errors import FlowliftError

#: Side of each crop on the page, in CSS pixels (two fit side by side in a 1100 px wide page).
VIEW_SIDE = 512
#: Zoom choices on the page: label -> screen pixels per output pixel.
ZOOMS = {"100%": 1, "200%": 2}
#: How the input is brought to the output's size: label -> Pillow filter.
INPUT_FILTERS = {"nearest": Image.Resampling.NEAREST, "Lanczos": Image.Resampling.LANCZOS}
#: Longest side of the clickable overview thumbnail.
OVERVIEW_SIDE = 384
#: Colour of the region's frame on the overview (magenta: rare in photos).
FRAME_COLOUR = (255, 0, 255)


@dataclass(frozen=True)
class DetailView:
    """Both crops of one region: ``box`` (x0, y0, x1, y1) in output pixels, both crops at ``zoom``."""

    input_crop: Image.Image
    output_crop: Image.Image
    box: tuple[int, int, int, int]
    zoom: int
    scale: int
    input_filter: str


def integer_scale(input_size: tuple[int, int], output_size: tuple[int, int]) -> int:
    """``s`` with ``output = s * input`` on both sides (flowlift's outputs are exactly ``2**n`` times
    their input); anything else is not a pair the detail view can line up."""
    (w0, h0), (w1, h1) = input_size, output_size
    if w0 <= 0 or h0 <= 0 or w1 % w0 or h1 % h0 or w1 // w0 != h1 // h0:
        raise FlowliftError(f"the result ({w1}x{h1}) is not a whole multiple of the input ({w0}x{h0})")
    return w1 // w0


def detail_box(
    centre: tuple[float, float] | None, zoom: int, output_size: tuple[int, int], scale: int
) -> tuple[int, int, int, int]:
    """The output region a ``VIEW_SIDE`` px view shows at ``zoom``: ``side = VIEW_SIDE // zoom`` output
    pixels (fewer where the image is smaller), centred on ``centre`` (the image centre when None) as
    far as the borders allow, with every corner on a multiple of ``scale``, so that the region is
    exactly ``scale`` times a region of the input (its pixels map one to ``scale x scale``)::

        side_x = min(W, floor(VIEW_SIDE / zoom / scale) * scale)     (likewise side_y with H)
        x0 = clamp(round_to_scale(cx - side_x / 2), 0, W - side_x)
    """
    width, height = output_size
    cx, cy = centre if centre is not None else (width / 2, height / 2)
    per_side = max(scale, (VIEW_SIDE // zoom) // scale * scale)
    side_x, side_y = min(width, per_side), min(height, per_side)

    def start(c: float, side: int, length: int) -> int:
        aligned = round((c - side / 2) / scale) * scale
        return int(min(max(aligned, 0), (length - side) // scale * scale))

    x0, y0 = start(cx, side_x, width), start(cy, side_y, height)
    return x0, y0, x0 + side_x, y0 + side_y


def load_input(path: Path) -> Image.Image:
    """The uploaded input as flowlift reads it (EXIF orientation, any mode -> 8-bit RGB)."""
    from flowlift.files.images import load_image

    try:
        rgb, _alpha = load_image(path)
    except FlowliftError:
        raise FlowliftError(f"{path.name} is no longer on the server; upload it again") from None
    return rgb


def load_result(path: Path) -> Image.Image:
    """The result PNG flowlift wrote, as 8-bit RGB (16-bit files by their high byte, alpha dropped).

    Read whole without Pillow's decompression-bomb limit, which is for uploads: results are larger
    by design (up to 16384 px a side, ~800 MB of RGB), and the path comes from the server's own
    state, never from the browser. A PNG cannot be cropped without decoding the rows above the crop,
    so each view of a region reads the file once.
    """
    from PIL import PngImagePlugin

    try:
        image = PngImagePlugin.PngImageFile(str(path))
    except (OSError, SyntaxError):
        raise FlowliftError(f"{path.name} is no longer on the server; upscale it again") from None
    try:
        image.load()
        if image.mode in ("I;16", "I;16B", "I"):  # 16-bit grey: scale, do not clip
            grey = np.clip(np.round(np.asarray(image, dtype=np.float64) / 257.0), 0, 255).astype(np.uint8)
            return Image.fromarray(grey, "L").convert("RGB")
        return image.convert("RGB")
    except (OSError, SyntaxError):
        raise FlowliftError(f"{path.name} is no longer readable on the server; upscale it again") from None
    finally:
        image.close()


def detail_view(
    source: Path,
    output: Path,
    centre: tuple[float, float] | None,
    zoom_label: str = "100%",
    input_filter: str = "nearest",
) -> tuple[DetailView, Image.Image]:
    """Cut the region :func:`detail_box` picks from ``output`` (the written PNG) and the matching
    region of ``source`` (the upload), both enlarged to ``zoom``: the output by pixel repetition, the
    input to the output's scale with ``input_filter`` (nearest: each input pixel a ``scale x scale``
    block; Lanczos: as the slider's "before") and then by pixel repetition. Also returns the
    :func:`overview` with the region framed (the result is read once)."""
    if zoom_label not in ZOOMS:
        raise FlowliftError(f"zoom must be one of {', '.join(ZOOMS)}, got {zoom_label!r}")
    if input_filter not in INPUT_FILTERS:
        raise FlowliftError(f"input resampling must be one of {', '.join(INPUT_FILTERS)}, got {input_filter!r}")
    zoom = ZOOMS[zoom_label]
    result = load_result(output)
    image = load_input(source)
    scale = integer_scale(image.size, result.size)
    box = detail_box(centre, zoom, result.size, scale)
    x0, y0, x1, y1 = box
    size = ((x1 - x0) * zoom, (y1 - y0) * zoom)
    nearest = Image.Resampling.NEAREST
    output_crop = result.crop(box).resize(size, nearest)
    input_box = (x0 / scale, y0 / scale, x1 / scale, y1 / scale)
    at_scale = image.resize((x1 - x0, y1 - y0), INPUT_FILTERS[input_filter], box=input_box)
    view = DetailView(at_scale.resize(size, nearest), output_crop, box, zoom, scale, input_filter)
    return view, overview(result, box)


def png_data_uri(image: Image.Image) -> str:
    """``data:image/png;base64,...`` of ``image`` (lossless: what the page shows is these pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def detail_html(view: DetailView, output_name: str) -> str:
    """The two crops side by side at their own size in CSS pixels (``image-rendering: pixelated``, no
    scaling by the page), each with a caption saying what it is."""
    x0, y0, x1, y1 = view.box
    percent = f"{100 * view.zoom}%"
    region = f"x {x0}-{x1}, y {y0}-{y1} of the result"
    captions = (
        f"Input, {view.input_filter}-resized {view.scale}x, at {percent}",
        f"Result {html.escape(output_name)}, at {percent}",
    )
    figures = []
    for element_id, crop, caption in zip(
        ("detail-input", "detail-output"), (view.input_crop, view.output_crop), captions, strict=True
    ):
        width, height = crop.size
        figures.append(
            f'<figure class="flowlift-detail-figure" style="margin:0">'
            f'<img id="{element_id}" src="{png_data_uri(crop)}" width="{width}" height="{height}" '
            f'data-box="{x0},{y0},{x1},{y1}" data-zoom="{view.zoom}" alt="{caption}" '
            f'style="width:{width}px;height:{height}px;max-width:none;image-rendering:pixelated;display:block">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    return (
        f'<div class="flowlift-detail"><p>Region {region} ({x1 - x0}x{y1 - y0} px). Click the overview to move it; '
        "100% is one image pixel per screen pixel at the browser's 100% zoom.</p>"
        f'<div style="display:flex;gap:16px;flex-wrap:wrap;overflow-x:auto">{"".join(figures)}</div></div>'
    )


def overview_size(output_size: tuple[int, int], max_side: int = OVERVIEW_SIDE) -> tuple[int, int]:
    """Size of the overview thumbnail of a result: longest side ``max_side`` (never enlarged)."""
    width, height = output_size
    shrink = min(1.0, max_side / max(width, height))
    return max(1, round(width * shrink)), max(1, round(height * shrink))


def overview(result: Image.Image, box: tuple[int, int, int, int]) -> Image.Image:
    """A thumbnail of ``result`` (:func:`overview_size`) with ``box`` framed on it."""
    size = overview_size(result.size)
    thumbnail = result.resize(size, Image.Resampling.BOX) if size != result.size else result.copy()
    sx, sy = size[0] / result.width, size[1] / result.height
    x0, y0 = math.floor(box[0] * sx), math.floor(box[1] * sy)
    x1, y1 = max(x0, math.ceil(box[2] * sx) - 1), max(y0, math.ceil(box[3] * sy) - 1)
    ImageDraw.Draw(thumbnail).rectangle((x0, y0, x1, y1), outline=FRAME_COLOUR, width=2)
    return thumbnail


def overview_to_output(point: tuple[float, float], output_size: tuple[int, int]) -> tuple[float, float]:
    """A click on the overview, in thumbnail pixels, as a point of the result: ``(p + 0.5) * W / w``
    (the centre of the clicked thumbnail pixel)."""
    (x, y), (width, height) = point, output_size
    w, h = overview_size(output_size)
    return (x + 0.5) * width / w, (y + 0.5) * height / h

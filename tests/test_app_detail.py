"""``flowlift app``'s detail view without a browser: the region, both crops pixel for pixel, the overview."""

from __future__ import annotations

import base64
import io
import re
import warnings

import numpy as np
import pytest
from PIL import Image

from flowlift.app.detail import (
    FRAME_COLOUR,
    VIEW_SIDE,
    detail_box,
    detail_html,
    detail_view,
    overview_size,
    overview_to_output,
)
from flowlift.errors import FlowliftError


@pytest.fixture(scope="module")
def pair(shared, tmp_path_factory):
    """A 100x60 input and a 4x 'result' (400x240, not a plain resize of it: detail must read the file)."""
    folder = tmp_path_factory.mktemp("detail")
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as image:
        source = image.convert("RGB").resize((100, 60), Image.Resampling.BOX)
        result = image.convert("RGB").resize((400, 240), Image.Resampling.BICUBIC)
    source.save(folder / "parrots.png")
    result.save(folder / "parrots_x4.png")
    return folder / "parrots.png", folder / "parrots_x4.png"


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def test_detail_box_is_centred_aligned_and_clamped():
    assert detail_box(None, 1, (2000, 1000), 4) == (744, 244, 1256, 756)  # 512 px around the centre
    assert detail_box(None, 2, (2000, 1000), 4) == (872, 372, 1128, 628)  # 256 px at 200%
    assert detail_box((10, 990), 1, (2000, 1000), 4) == (0, 488, 512, 1000)  # clamped into the image
    assert detail_box((1001, 503), 1, (2000, 1000), 8) == (744, 248, 1256, 760)  # corners on multiples of 8
    assert detail_box(None, 1, (384, 256), 2) == (0, 0, 384, 256)  # smaller than the view: all of it
    for box in (detail_box((777.7, 333.3), zoom, (3000, 2000), 8) for zoom in (1, 2)):
        assert all(v % 8 == 0 for v in box)
    assert VIEW_SIDE == 512


def test_crops_are_the_written_pixels(pair):
    source, output = pair
    view, thumbnail = detail_view(source, output, (200, 120), "100%", "nearest")
    x0, y0, x1, y1 = view.box
    assert view.scale == 4 and (x1 - x0, y1 - y0) == (400, 240)  # smaller than 512: the whole result
    with Image.open(output) as png:
        assert np.array_equal(_pixels(view.output_crop), _pixels(png.crop(view.box)))
    with Image.open(source) as image:
        blocks = _pixels(image).repeat(4, axis=0).repeat(4, axis=1)  # nearest: each input pixel a 4x4 block
    assert np.array_equal(_pixels(view.input_crop), blocks)
    assert thumbnail.size == overview_size((400, 240)) == (384, 230)

    view, _ = detail_view(source, output, (300, 100), "200%", "nearest")
    x0, y0, x1, y1 = view.box
    assert view.box == (144, 0, 400, 240) and view.zoom == 2  # 256 px wide, clamped at the right; all 240 rows
    with Image.open(output) as png:
        region = _pixels(png.crop(view.box))
    assert np.array_equal(_pixels(view.output_crop), region.repeat(2, axis=0).repeat(2, axis=1))
    with Image.open(source) as image:
        inner = _pixels(image)[y0 // 4 : y1 // 4, x0 // 4 : x1 // 4]
    assert np.array_equal(_pixels(view.input_crop), inner.repeat(8, axis=0).repeat(8, axis=1))

    lanczos, _ = detail_view(source, output, (300, 100), "100%", "Lanczos")
    with Image.open(source) as image:
        whole = image.resize((400, 240), Image.Resampling.LANCZOS)  # the slider's 'before', then cropped
    assert np.array_equal(_pixels(lanczos.input_crop), _pixels(whole.crop(lanczos.box)))


def test_html_shows_the_crops_at_their_own_size(pair):
    source, output = pair
    view, _ = detail_view(source, output, None, "200%", "Lanczos")
    page = detail_html(view, output.name)
    for element_id, crop in (("detail-input", view.input_crop), ("detail-output", view.output_crop)):
        tag = re.search(rf'<img id="{element_id}" src="data:image/png;base64,([^"]+)"[^>]*>', page)
        assert tag, element_id
        with Image.open(io.BytesIO(base64.b64decode(tag.group(1)))) as shown:
            assert np.array_equal(_pixels(shown), _pixels(crop))
        w, h = crop.size
        assert f'width="{w}" height="{h}"' in tag.group(0) and f"width:{w}px;height:{h}px" in tag.group(0)
        assert "image-rendering:pixelated" in tag.group(0)
    assert "Lanczos-resized 4x, at 200%" in page and "parrots_x4.png, at 200%" in page


def test_overview_frames_the_region_and_clicks_map_back(pair):
    source, output = pair
    view, thumbnail = detail_view(source, output, (100, 60), "200%", "nearest")
    x0, y0, x1, y1 = view.box
    scale = thumbnail.width / 400
    frame = _pixels(thumbnail)[round(y0 * scale) + 1, round(x0 * scale) : round(x1 * scale) - 1]
    assert (frame == FRAME_COLOUR).all(axis=1).mean() > 0.9  # the frame's top edge is magenta
    x, y = overview_to_output((383, 229), (400, 240))  # the last thumbnail pixel: inside the result's last one
    assert 399 < x < 400 and 239 < y < 240
    clicked, _ = detail_view(source, output, overview_to_output((0, 0), (400, 240)), "200%", "nearest")
    assert clicked.box[:2] == (0, 0)


def test_errors_are_one_line(pair, tmp_path):
    source, output = pair
    with pytest.raises(FlowliftError, match="gone.png is no longer on the server; upload it again"):
        detail_view(tmp_path / "gone.png", output, None)
    odd = tmp_path / "odd.png"
    Image.new("RGB", (401, 240)).save(odd)
    with pytest.raises(FlowliftError, match=r"not a whole multiple of the input \(100x60\)"):
        detail_view(source, odd, None)
    with pytest.raises(FlowliftError, match="zoom must be one of 100%, 200%"):
        detail_view(source, output, None, "300%")


def test_results_past_the_upload_limit_and_16_bit_results_are_shown(pair, tmp_path, monkeypatch):
    """The result is read without the uploads' decompression-bomb limit (results are bigger by design),
    and a 16-bit PNG shows its 8-bit values (scaled, not clipped)."""
    source, output = pair
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40000)  # the 400x240 result is now a 'bomb' to Image.open
    with pytest.raises(Image.DecompressionBombError):
        Image.open(output)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # Pillow's warning on the 256x240 crop
        view, _ = detail_view(source, output, None, "200%")  # the 6000 px input is still an acceptable upload
    monkeypatch.undo()
    with Image.open(output) as png:
        assert np.array_equal(_pixels(view.output_crop)[::2, ::2], _pixels(png.crop(view.box)))
    with Image.open(output) as png:
        grey = np.asarray(png.convert("L"))
    sixteen = tmp_path / "grey_x4.png"
    Image.fromarray(grey.astype(np.uint16) * 257).save(sixteen)  # mode I;16
    view, _ = detail_view(source, sixteen, None)
    assert np.array_equal(_pixels(view.output_crop)[..., 0], grey)

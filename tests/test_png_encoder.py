"""8-bit PNG outputs through OpenCV's encoder (issue 47): the pixels, the text chunks, the ICC profile and the EXIF
that Pillow's own writer would have stored, read back by Pillow; other modes still go through Pillow."""

import numpy as np
import pytest
from PIL import Image, ImageCms

from flowlift.files.image_outputs import SourceProfile, read_metadata, save_image_atomic
from flowlift.files.png_encoder import encode_8bit_image


def _profile() -> SourceProfile:
    exif = Image.Exif()
    exif[0x010F] = "Maker"  # Make
    exif[0x0110] = "Model 7"  # Model
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    return SourceProfile(icc_profile=icc, exif=exif)


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_the_png_holds_what_pillow_would_have_written(tmp_path, mode, monkeypatch):
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (37, 53, len(mode)), dtype=np.uint8)
    array[:5] = 255  # runs and edges too
    metadata = {"seed": 3, "note": "héllo ✓ beyond Latin-1", "models": {"a": "b"}}
    image = Image.fromarray(array, mode)
    fast = save_image_atomic(image, tmp_path / "fast.png", metadata, source=_profile())
    monkeypatch.setattr("flowlift.files.png_encoder.encode_8bit_image", lambda *a, **k: None)  # Pillow's writer
    slow = save_image_atomic(image, tmp_path / "pillow.png", metadata, source=_profile())
    with Image.open(fast) as a, Image.open(slow) as b:
        assert a.mode == b.mode == mode
        assert np.array_equal(np.asarray(a), array) and np.array_equal(np.asarray(b), array)
        assert a.text == b.text and a.info["icc_profile"] == b.info["icc_profile"]
        assert dict(a.getexif()) == dict(b.getexif()) and a.getexif()[0x0110] == "Model 7"
    assert read_metadata(fast) == read_metadata(slow)
    assert read_metadata(fast)["note"] == "héllo ✓ beyond Latin-1"


def test_other_modes_and_images_with_their_own_chunks_are_left_to_pillow(tmp_path):
    grey = Image.fromarray(np.zeros((4, 4), np.uint8), "L")
    assert encode_8bit_image(grey, None, None, {}, 3, 3) is None
    keyed = Image.fromarray(np.zeros((4, 4, 3), np.uint8), "RGB")
    keyed.info["transparency"] = (0, 0, 0)  # Pillow writes a tRNS chunk for it
    assert encode_8bit_image(keyed, None, None, {}, 3, 3) is None
    path = save_image_atomic(keyed, tmp_path / "keyed.png")
    with Image.open(path) as back:
        assert back.info["transparency"] == (0, 0, 0)
    rgb = Image.fromarray(np.full((4, 4, 3), 7, np.uint8), "RGB")
    assert encode_8bit_image(rgb, None, None, {}, 3, 3).startswith(b"\x89PNG\r\n\x1a\n")

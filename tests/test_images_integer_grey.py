"""An integer grey image's white comes from the file (its mode, its raw 16-bit samples, the PGM's maxval), never from
its values: a 16-bit image whose values all lie at or below 255 was read as 8-bit, 257 times too bright, and one pixel
from 255 to 256 turned the whole image from white to black. A mode whose range no file says is one line."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.images import load_image, to_tensor
from flowlift.measure import metrics as M


def _pgm16(path, values: np.ndarray) -> str:
    """``values`` as a binary 16-bit PGM (maxval 65535): Pillow opens it as mode ``I``."""
    height, width = values.shape
    path.write_bytes(b"P5\n%d %d\n65535\n" % (width, height) + values.astype(">u2").tobytes())
    with Image.open(path) as opened:
        assert opened.mode == "I"
    return str(path)


def test_a_16_bit_image_of_low_values_is_read_dark_not_257_times_too_bright(tmp_path):
    values = np.full((16, 16), 200)
    rgb, alpha = load_image(_pgm16(tmp_path / "dark.pgm", values))
    assert alpha is None and np.asarray(rgb).max() == 1  # round(200 / 65535 * 255): near black, was 200
    ten_bit = tmp_path / "ten_bit.pgm"  # a maxval below 65535: Pillow scales it to 65535 for mode I
    ten_bit.write_bytes(b"P5\n4 2\n1023\n" + np.array([[0, 1023, 512, 1023]] * 2).astype(">u2").tobytes())
    assert np.asarray(load_image(ten_bit)[0])[0, :, 0].tolist() == [0, 255, 128, 255]


def test_one_value_past_255_moves_one_pixel_not_the_whole_image(tmp_path):
    rng = np.random.default_rng(0)
    values = rng.integers(0, 256, (32, 32))
    brighter = values.copy()
    brighter[5, 5] = 256
    a = np.asarray(load_image(_pgm16(tmp_path / "a.pgm", values))[0])
    b = np.asarray(load_image(_pgm16(tmp_path / "b.pgm", brighter))[0])
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    assert M.psnr_y(a, b) > 60  # was tens of dB apart: one image read at /255, the other at /65535


def test_a_32_bit_integer_tiff_has_no_known_white_and_is_refused_in_one_line(tmp_path):
    path = tmp_path / "int32.tif"
    Image.fromarray(np.full((8, 8), 100, np.int32)).save(path)
    with pytest.raises(FlowliftError) as caught:
        load_image(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: a 32-bit integer image (mode I, a TIFF file) has no known white level")
    assert "\n" not in message


def test_an_integer_image_made_in_memory_needs_its_white_said_by_its_mode():
    with pytest.raises(FlowliftError, match=r"mode I, made in memory\) has no known white level"):
        to_tensor(Image.fromarray(np.full((8, 8), 100, np.int32)))
    grey16 = Image.fromarray(np.full((8, 8), 65535, np.uint16))  # mode I;16: white is 65535
    assert grey16.mode == "I;16" and float(to_tensor(grey16).min()) == 1.0

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.image_outputs import file_sha256, save_image_atomic
from flowlift.files.images import (
    list_images,
    load_image,
    tensor_to_pil,
    to_tensor,
)


def _gradient(w=20, h=12):
    x = np.linspace(0, 255, w, dtype=np.float64)
    y = np.linspace(0, 255, h, dtype=np.float64)
    return np.stack([np.add.outer(y, x) / 2, np.tile(x, (h, 1)), np.tile(y[:, None], (1, w))], -1).astype(np.uint8)


def test_roundtrip_tensor_pil():
    arr = _gradient()
    t = to_tensor(Image.fromarray(arr))
    assert t.shape == (1, 3, 12, 20) and t.dtype == torch.float32
    assert np.array_equal(np.asarray(tensor_to_pil(t)), arr)
    assert torch.equal(to_tensor(arr), t)


def test_modes_and_alpha(tmp_path):
    arr = _gradient()
    rgba = np.dstack([arr, np.full(arr.shape[:2], 128, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    rgb, alpha = load_image(tmp_path / "a.png")
    assert rgb.mode == "RGB" and alpha is not None and np.asarray(alpha).max() == 128
    assert np.array_equal(np.asarray(rgb), arr)

    grey16 = (np.linspace(0, 65535, 20 * 12).reshape(12, 20)).astype(np.uint16)
    Image.fromarray(grey16).save(tmp_path / "g16.png")
    rgb16, _ = load_image(tmp_path / "g16.png")
    got = np.asarray(rgb16)[..., 0].astype(int)
    assert abs(got.max() - 255) <= 1 and got.min() == 0  # scaled, not clipped

    Image.fromarray(arr).convert("CMYK").save(tmp_path / "c.jpg")
    assert load_image(tmp_path / "c.jpg")[0].mode == "RGB"
    Image.fromarray(arr).convert("P").save(tmp_path / "p.png")
    assert load_image(tmp_path / "p.png")[0].mode == "RGB"


@pytest.mark.parametrize(("suffix", "channels"), [(".png", 3), (".png", 4), (".tif", 3)])
def test_sixteen_bit_colour_is_rounded_not_truncated(tmp_path, suffix, channels):
    """Pillow hands 16-bit colour over as each value's high byte (v >> 8, half a level low on average: a colour
    cast eval measured at -0.19/255); load_image rounds every value to round(v / 257)."""
    import cv2

    rng = np.random.default_rng(0)
    values = rng.integers(0, 65536, (12, 20, channels), dtype=np.uint16)
    values[0, :3] = [[0] * channels, [65535] * channels, [1928] * channels]  # the ends; 7.502 levels (high byte 7)
    path = tmp_path / f"deep{suffix}"
    assert cv2.imwrite(str(path), values)  # OpenCV's channel order: BGR(A)
    rgb, alpha = load_image(path)
    expected = np.floor(values.astype(np.float64) / 257 + 0.5).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(rgb), expected[..., 2::-1])
    assert (alpha is None) == (channels == 3)
    if alpha is not None:
        np.testing.assert_array_equal(np.asarray(alpha), expected[..., 3])
    with Image.open(path) as truncated:  # what Pillow alone gives: another image
        assert not np.array_equal(np.asarray(truncated.convert("RGB")), expected[..., 2::-1])
    assert np.asarray(rgb)[0, :3, 0].tolist() == [0, 255, 8]


def test_sixteen_bit_colour_keeps_the_exif_orientation():
    from flowlift.files.deep_images import oriented_like

    opened = Image.new("RGB", (3, 2))
    exif = opened.getexif()
    exif[0x0112] = 6  # turned 90 degrees clockwise to be seen
    opened.info["exif"] = exif.tobytes()
    opened = Image.open(_png_bytes(opened, exif))
    image = Image.fromarray(np.arange(18, dtype=np.uint8).reshape(2, 3, 3), "RGB")
    turned = oriented_like(opened, image)
    assert turned.size == (2, 3)
    np.testing.assert_array_equal(np.asarray(turned), np.asarray(image.transpose(Image.Transpose.ROTATE_270)))


def _png_bytes(image: Image.Image, exif: Image.Exif) -> io.BytesIO:
    buffer = io.BytesIO()
    image.save(buffer, "PNG", exif=exif.tobytes())
    buffer.seek(0)
    return buffer


def test_exif_orientation_is_respected(tmp_path):
    arr = _gradient(20, 12)
    image = Image.fromarray(arr)
    exif = image.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    image.save(tmp_path / "r.jpg", exif=exif.tobytes())
    rgb, _ = load_image(tmp_path / "r.jpg")
    assert rgb.size == (12, 20)


def test_bad_files_raise_one_line_errors(tmp_path):
    (tmp_path / "not.png").write_bytes(b"hello")
    with pytest.raises(FlowliftError, match="not an image"):
        load_image(tmp_path / "not.png")
    buf = io.BytesIO()
    Image.fromarray(_gradient(64, 64)).save(buf, format="PNG")
    (tmp_path / "cut.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(FlowliftError, match="truncated"):
        load_image(tmp_path / "cut.png")
    with pytest.raises(FlowliftError, match="no such file"):
        load_image(tmp_path / "missing.png")


def test_a_folder_given_as_an_image_is_named_a_folder(tmp_path):
    """It was "no such file" for a folder that is there (``flowlift hires --image imgs``)."""
    from flowlift.files.images import image_size

    for read in (load_image, image_size):
        with pytest.raises(FlowliftError, match=f"^{tmp_path} is a folder: give an image file$"):
            read(tmp_path)


def test_decompression_bomb_refused(tmp_path, monkeypatch):
    import flowlift.files.images as images

    Image.fromarray(_gradient(64, 64)).save(tmp_path / "big.png")
    monkeypatch.setattr(images, "MAX_INPUT_PIXELS", 1000)
    with pytest.raises(FlowliftError, match="decompression-bomb"):
        load_image(tmp_path / "big.png")


def test_atomic_save_with_metadata(tmp_path):
    out = save_image_atomic(Image.fromarray(_gradient()), tmp_path / "o" / "x.png", {"seed": 3, "note": "hi"})
    assert out.exists() and [p.name for p in out.parent.iterdir()] == ["x.png"]
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # the usual mode, not mkstemp's 0600
    with Image.open(out) as im:
        assert im.text["seed"] == "3" and im.text["note"] == "hi"
    assert len(file_sha256(out)) == 64


@pytest.mark.parametrize("name", ["y.png", "y.jpg", "y.tif"])
def test_atomic_save_leaves_nothing_on_failure(tmp_path, monkeypatch, name):
    """Pillow's writer (JPEG, TIFF) and the PNG bytes written by flowlift (OpenCV's encoding) both fail whole."""

    original_save = Image.Image.save

    def broken_save(self, fp, format=None, **params):
        if not isinstance(fp, (str, os.PathLike)):  # the encoder's one-pixel probe into memory (cached per mode):
            return original_save(self, fp, format, **params)  # it ran before only when no earlier test had run it
        with open(fp, "wb") as handle:
            handle.write(b"partial")
        raise OSError("disk full")

    def broken_write(self, data):
        with open(self, "wb") as handle:
            handle.write(data[:10])
        raise OSError("disk full")

    monkeypatch.setattr(Image.Image, "save", broken_save)
    monkeypatch.setattr(Path, "write_bytes", broken_write)
    with pytest.raises(OSError):
        save_image_atomic(Image.fromarray(_gradient()), tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_list_images(tmp_path):
    for name in ("b.png", "a.jpg", "c.txt"):
        (tmp_path / name).write_bytes(b"x")
    assert [p.name for p in list_images([str(tmp_path)])] == ["a.jpg", "b.png"]
    assert [p.name for p in list_images([str(tmp_path / "*.png")])] == ["b.png"]
    with pytest.raises(FlowliftError):
        list_images([str(tmp_path / "nothing*.png")])

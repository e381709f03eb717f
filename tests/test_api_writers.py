"""The Python API's two public writers keep a user's file (the rule every door holds): ``save_image_atomic`` replaces
a file at its path only when it is empty, flowlift wrote it, or ``overwrite=True``; ``save_upscaler`` only with
``overwrite=True``; a truthy non-bool (``"no"``) is refused, never read as yes. ``save_upscaler`` refuses a model
with a NaN or Inf weight (a file :func:`load_upscaler` would refuse), and ``quality`` is an integer in 1..100.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from flowlift import FlowliftError, load_upscaler, save_image_atomic, save_upscaler
from flowlift.models.upscaler_unet import FlowUpscalerUNet

TINY = {"base_channels": 16, "time_dim": 32, "cond_dim": 32}


@pytest.fixture
def picture():
    return Image.new("RGB", (8, 8), (200, 40, 10))


def _pixel(path):
    with Image.open(path) as image:
        return image.convert("RGB").getpixel((0, 0))


@pytest.mark.parametrize("name", ["photo.png", "photo.jpg", "photo.webp", "photo.tif"])
def test_a_users_image_is_kept_without_overwrite(tmp_path, picture, name):
    users = tmp_path / name
    Image.new("RGB", (8, 8), (1, 2, 3)).save(users)
    before = users.read_bytes()
    with pytest.raises(FlowliftError, match="was not written by flowlift; pass overwrite=True"):
        save_image_atomic(picture, users)
    assert users.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [name]
    save_image_atomic(picture, users, overwrite=True)
    assert users.read_bytes() != before


def test_any_other_users_file_is_kept_too(tmp_path, picture):
    notes = tmp_path / "notes.png"
    notes.write_text("not an image, but somebody's")
    with pytest.raises(FlowliftError, match="was not written by flowlift"):
        save_image_atomic(picture, notes)
    assert notes.read_text() == "not an image, but somebody's"


def test_flowlifts_own_image_and_an_empty_file_are_replaced(tmp_path, picture):
    own = save_image_atomic(Image.new("RGB", (8, 8), (9, 9, 9)), tmp_path / "own.png", {"flowlift": {"a": 1}})
    save_image_atomic(picture, own, {"flowlift": {"a": 2}})
    assert _pixel(own) == (200, 40, 10)
    empty = tmp_path / "empty.png"
    empty.touch()
    save_image_atomic(picture, empty)
    assert _pixel(empty) == (200, 40, 10)


@pytest.mark.parametrize("flag", ["no", "false", 1, 1.0, None])
def test_overwrite_is_a_bool(tmp_path, picture, flag):
    users = tmp_path / "photo.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(users)
    before = users.read_bytes()
    with pytest.raises(FlowliftError, match="overwrite"):
        save_image_atomic(picture, users, overwrite=flag)
    with pytest.raises(FlowliftError, match="overwrite"):
        save_upscaler(FlowUpscalerUNet(**TINY), tmp_path / "m.safetensors", overwrite=flag)
    assert users.read_bytes() == before and not (tmp_path / "m.safetensors").exists()


@pytest.mark.parametrize("quality", [True, 95.7, "95", 0, 101])
def test_quality_is_an_integer_in_range(tmp_path, picture, quality):
    with pytest.raises(FlowliftError, match="quality must be an integer in 1..100"):
        save_image_atomic(picture, tmp_path / "out.jpg", quality=quality)
    assert not (tmp_path / "out.jpg").exists()


def test_save_upscaler_keeps_an_existing_file_without_overwrite(tmp_path):
    torch.manual_seed(0)
    first, second = FlowUpscalerUNet(**TINY), FlowUpscalerUNet(**TINY)
    path = save_upscaler(first, tmp_path / "mine.safetensors")
    before = path.read_bytes()
    with pytest.raises(FlowliftError, match="exists; pass overwrite=True"):
        save_upscaler(second, path)
    assert path.read_bytes() == before
    save_upscaler(second, path, overwrite=True)
    loaded = load_upscaler(path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in second.state_dict().items())


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_save_upscaler_refuses_a_non_finite_model(tmp_path, value):
    model = FlowUpscalerUNet(**TINY)
    with torch.no_grad():
        model.in_conv.weight[0, 0, 0, 0] = value
    with pytest.raises(FlowliftError, match=r"the model has (NaN|Inf) in `in_conv.weight`; nothing written"):
        save_upscaler(model, tmp_path / "broken.safetensors")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda picture, tmp: save_image_atomic(picture, 5), "path must be a path, got 5"),  # was a TypeError
        (lambda picture, tmp: save_image_atomic(picture, ""), "path: an empty name names nothing"),  # was "." ...
        (lambda picture, tmp: save_image_atomic(picture, tmp / "a.png", source=5), "source must be a path or None"),
        (lambda picture, tmp: save_upscaler("unet", tmp / "u.safetensors"), "model must be a FlowUpscalerUNet"),
        (lambda picture, tmp: save_upscaler(FlowUpscalerUNet(**TINY), 5), "path must be a path, got 5"),
    ],
)
def test_the_writers_refuse_what_is_no_path_or_model_by_name(tmp_path, picture, call, words):
    with pytest.raises(FlowliftError, match=words.replace("(", r"\(")) as caught:
        call(picture, tmp_path)
    assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("path", "words"), [(5, "path must be a path, got 5"), ("", "an empty name names nothing")])
def test_load_image_refuses_what_is_no_path_by_name(path, words):
    from flowlift import load_image

    with pytest.raises(FlowliftError, match=words):  # 5: a TypeError; "": the working folder, ".: no such file"
        load_image(path)


@pytest.mark.parametrize(
    ("name", "image", "metadata", "words"),
    [
        ("a.png", None, {"a\0b": "x"}, r"^metadata key 'a\\x00b': a PNG keyword is printable Latin-1"),  # key "a"
        ("a.png", None, {"": "x"}, "^metadata key '': a PNG keyword is 1 to 79 characters, got 0"),  # was lost
        ("a.png", None, {"k" * 100: "x"}, "^metadata key 'k+': a PNG keyword is 1 to 79 characters, got 100"),
        (
            "a.png",
            None,
            {"ключ": "x"},
            "^metadata key 'ключ': a PNG keyword is printable Latin-1",
        ),  # UnicodeEncodeError
        ("a.png", None, {" lead": "x"}, "^metadata key ' lead': a PNG keyword has no leading, trailing or consec"),
        ("a.png", None, {"a": "b\0c"}, r"^metadata\['a'\]: a PNG text value is Unicode text without NUL"),
        ("a.png", None, {"a": "\ud800"}, r"^metadata\['a'\]: a PNG text value is Unicode text"),  # UnicodeEncodeError
        ("a.png", None, {1: "x", "1": "y"}, "^metadata: keys 1 and '1' are one entry"),  # one was lost
        ("a.png", None, {"a": {(1, 2): 3}}, r"^metadata\['a'\]: a key \(1, 2\) is not text"),  # TypeError
        # each was written as its str(), though JSON was promised
        ("a.png", None, {"a": {"b": [object()]}}, r"^metadata\['a'\]\['b'\]\[0\]: a value of type object cannot"),
        ("a.jpg", None, {"a": {1, 2}}, r"^metadata\['a'\]: a value of type set cannot be written as JSON"),
        ("a.tif", None, {"a": b"x"}, r"^metadata\['a'\]: a value of type bytes cannot be written as JSON"),
        ("a.jpg", None, {"a": "x" * 70000}, "^metadata is too long for a JPEG: .* at most 65533"),  # ValueError
        ("a.jpg", None, {"Software": "flöwlift"}, r"^metadata\['Software'\] must be ASCII text"),  # written fl?wlift
        ("a.tif", None, {"Software": "flöwlift"}, r"^metadata\['Software'\] must be ASCII text"),
        ("a.jpg", Image.new("F", (8, 8)), None, "^image has mode F, which a .jpg cannot hold"),  # no field
        ("a.png", Image.new("F", (8, 8)), None, "^image has mode F, which a .png cannot hold"),
        ("a.webp", Image.new("RGB", (16384, 1)), None, "^image is 16384x1 pixels; a .webp holds at most 16383"),
        ("a.png", "not an image", None, "^image must be a Pillow image of at least 1x1 pixels, got a str"),
        ("a.gif", None, None, "^path .*a.gif: unsupported output format .gif"),
    ],
)
def test_what_an_output_cannot_hold_is_refused_by_name_before_any_folder(
    tmp_path, picture, name, image, metadata, words
):
    """Each was written altered (key ``a\\0b`` as ``a``, ``""`` dropped, a 100-byte keyword, ``Software`` as
    ``fl?wlift``), escaped as another exception, or failed only after the output's folders were made."""
    field = "path" if name.endswith(".gif") else "image" if image is not None else "metadata"
    with pytest.raises(FlowliftError, match=words) as caught:
        save_image_atomic(picture if image is None else image, tmp_path / "new" / "deeper" / name, metadata)
    assert caught.value.fields == (field,)
    assert "\n" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no folder made, nothing written


@pytest.mark.parametrize("name", ["out.png", "out.jpg", "out.webp", "out.tif"])
def test_a_non_ascii_value_and_a_latin1_key_round_trip(tmp_path, picture, name):
    from flowlift.files.image_outputs import read_metadata

    metadata = {"prompt": "ключ ✓ 日本 café", "café": {"seed": 1}, "Software": "flowlift 0 test"}
    path = save_image_atomic(picture, tmp_path / "made" / name, metadata)
    assert read_metadata(path) == metadata
    if name.endswith(".png"):
        with Image.open(path) as opened:
            assert opened.text["prompt"] == "ключ ✓ 日本 café" and opened.text["café"] == '{"seed": 1}'


@pytest.mark.parametrize("name", ["a.png", "a.jpg", "a.webp", "a.tif", "deep.png", "deep.tif"])
def test_metadata_is_strict_json_with_non_finite_numbers_as_text(tmp_path, picture, name):
    """A NaN or Inf in the metadata was written as bare ``NaN``/``Infinity`` (no JSON: other tools' parsers refuse
    the text chunk); now as the strings eval's reports use (``"nan"``, ``"inf"``, ``"-inf"``), and a path as its
    text. Both writers (8-bit and 16-bit) hold to it."""
    import json
    from pathlib import Path

    import numpy as np

    from flowlift.files.image_outputs import read_metadata
    from flowlift.files.sixteen_bit import save_image16_atomic

    metadata = {
        "Software": "flowlift test",
        "flowlift": {"psnr": float("inf"), "low": -float("inf"), "gain": float("nan"), "vae": Path("/w/vae")},
        "psnr": float("inf"),
    }
    path = tmp_path / name
    if name.startswith("deep"):
        save_image16_atomic(np.full((8, 8, 3), 4000, np.uint16), None, path, metadata)
    else:
        save_image_atomic(picture, path, metadata)
    data = path.read_bytes()
    assert b"NaN" not in data and b"Infinity" not in data
    if name.endswith(".png"):
        with Image.open(path) as opened:
            texts = dict(opened.text)

        def refuse(word):
            raise AssertionError(f"not strict JSON: {word}")

        assert json.loads(texts["psnr"], parse_constant=refuse) == "inf"
        json.loads(texts["flowlift"], parse_constant=refuse)
    found = read_metadata(path)["flowlift"]
    assert (found["psnr"], found["low"], found["gain"], found["vae"]) == ("inf", "-inf", "nan", "/w/vae"), found

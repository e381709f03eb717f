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

"""``train`` and ``dataset`` tell the user what is off (issue 15, item 17). Fast: no model is trained."""

from __future__ import annotations

import csv
import warnings

import pytest
import torch
from PIL import Image

from builders import save_tiny_unet
from flowlift.errors import FlowliftError
from flowlift.training.config import TrainConfig


def test_steps_below_warmup_warn_with_the_peak_lr(tmp_path):
    from flowlift.training.trainer import Trainer

    config = TrainConfig(data=str(tmp_path), output=str(tmp_path / "run"), steps=4, warmup_steps=500, lr=1e-4)
    with pytest.warns(UserWarning, match=r"steps 4 < warmup_steps 500.*peaks at 8e-07"):
        Trainer(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(TrainConfig(data=str(tmp_path), output=str(tmp_path / "run"), steps=4, warmup_steps=4))


def test_init_contradicted_by_explicit_architecture_settings():
    from flowlift.training.checkpoints import init_contradictions

    init = {"base_channels": 32, "time_dim": 32, "cond_dim": 64}
    assert init_contradictions(TrainConfig(), init) == ""  # defaults follow the checkpoint
    assert init_contradictions(TrainConfig(base_channels=32), init) == ""
    message = init_contradictions(TrainConfig(base_channels=64, cond_dim=128), init)
    assert message == "base_channels 32 (not 64), cond_dim 64 (not 128)"


def test_init_contradiction_is_an_error_before_training(tmp_path):
    import torch

    from flowlift.training.trainer import Trainer

    torch.manual_seed(0)
    weights = save_tiny_unet(tmp_path / "i.safetensors", seed=None)
    config = TrainConfig(
        data=str(tmp_path), output=str(tmp_path / "run"), init=str(weights), base_channels=64, warmup_steps=1
    )
    with pytest.raises(FlowliftError, match="base_channels 32 \\(not 64\\)"):
        Trainer(config)._build_model()


def test_curves_of_one_point_are_drawn_with_a_marker(tmp_path, monkeypatch):
    import numpy as np

    from flowlift.training import validation

    assert validation.point_style(1) == {"marker": "o", "ms": 4} and validation.point_style(2) == {}
    log = tmp_path / "train_log.csv"
    with log.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "loss"])
        writer.writeheader()
        writer.writerow({"step": 1, "loss": 0.5})
    marked = np.asarray(Image.open(validation.plot_curves(log, None, tmp_path / "marked.png")).convert("L"))
    monkeypatch.setattr(validation, "point_style", lambda points: {})
    bare = np.asarray(Image.open(validation.plot_curves(log, None, tmp_path / "bare.png")).convert("L"))
    assert (marked != bare).sum() > 10  # the lone point is visible only as a marker


def test_dataset_names_each_skipped_image_and_the_differing_setting(tmp_path):
    from flowlift.training.datasets import build_images_dataset
    from flowlift.training.shards import prepare_dataset_dir

    small = []
    for index in range(2):
        path = tmp_path / f"small{index}.png"
        Image.new("RGB", (64, 64)).save(path)
        small.append(path)
    with pytest.warns(UserWarning) as caught, pytest.raises(FlowliftError, match="no image is at least"):
        build_images_dataset(tmp_path / "data", small, vae=_ConstantVAE(), crop=128)
    assert [str(w.message) for w in caught] == [f"{p}: smaller than the 128x128 crop, skipped" for p in small]

    root = tmp_path / "ds"
    prepare_dataset_dir(root, {"kind": "images", "source": {"crop": 512, "vae": "taef2"}, "num_items": 4})
    with pytest.raises(FlowliftError, match=r"other settings \(source.crop: 256 now, 512 there\)") as error:
        prepare_dataset_dir(root, {"kind": "images", "source": {"crop": 256, "vae": "taef2"}, "num_items": 8})
    assert "vae" not in str(error.value)


def test_a_crop_refusal_names_the_crop_field_and_its_fix(tmp_path, shared, capsys):
    """``crop must be a positive multiple of 32 pixels, got 100`` and ``no image is at least 512x512 pixels``: the
    field (``crop_px`` in PhotoCrops, ``--crop-px`` on the command line) and what to do."""
    from flowlift.commands.cli import main
    from flowlift.training.dataset_jobs import PhotoCrops

    with pytest.raises(
        FlowliftError, match=r"^crop_px must be a positive multiple of 32 px up to 16384, got 100; e.g. 96 or 128$"
    ):
        PhotoCrops(["photos"], crop_px=100)
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (200, 200)).save(tmp_path / "photos" / "a.png")
    common = ["--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    for crop, line in (
        ("100", "error: --crop-px must be a positive multiple of 32 px up to 16384, got 100; e.g. 96 or 128"),
        (
            "512",
            "error: no image is at least 512x512 px, the --crop-px 512 crop (1 skipped); lower --crop-px or add "
            "larger images",
        ),
    ):
        out = tmp_path / f"data{crop}"
        assert main(["dataset", "images", str(tmp_path / "photos"), "--crop-px", crop, *common, "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1].endswith(line), err


class _ConstantVAE:
    """A VAE stand-in (8x): zero latents, grey pixels; enough for a builder's shapes, in microseconds."""

    def encode(self, images):
        import torch

        return torch.zeros(images.shape[0], 32, images.shape[-2] // 8, images.shape[-1] // 8)

    def decode(self, latents):
        import torch

        return torch.full((latents.shape[0], 3, latents.shape[-2] * 8, latents.shape[-1] * 8), 0.5)


def _build(kind, root, photo, **arguments):
    """One small build of ``kind`` (``images``: one 64x64 photo, 32 px crops; ``distill``: one 4x4 item) into
    ``root``; ``arguments`` over the defaults (a ``writing`` given as a function is made here)."""
    from flowlift.training.datasets import ShardWriting, build_distill_dataset, build_images_dataset

    if callable(arguments.get("writing")) and not isinstance(arguments["writing"], ShardWriting):
        arguments["writing"] = arguments["writing"]()
    arguments = {"writing": ShardWriting(progress=False), **arguments}
    if kind == "images":
        given = {"image_paths": [photo], "vae": _ConstantVAE(), "crop": 32, "crops_per_image": 1, **arguments}
        return build_images_dataset(root, given.pop("image_paths"), given.pop("vae"), **given)
    given = {"teacher": lambda noise: noise, "vae": _ConstantVAE(), "num_items": 1, "latent_size": (4, 4), **arguments}
    return build_distill_dataset(root, given.pop("teacher"), given.pop("vae"), **given)


def _writing(**fields):
    from flowlift.training.datasets import ShardWriting

    return lambda: ShardWriting(**{"progress": False, **fields})


@pytest.fixture
def photo(tmp_path):
    path = tmp_path / "photo.png"
    Image.new("RGB", (64, 64), (100, 50, 20)).save(path)
    return path


@pytest.mark.parametrize(
    ("kind", "arguments", "field"),
    [
        ("images", {"flip": "no"}, "flip"),  # was read as on
        ("images", {"flip": None}, "flip"),
        ("images", {"seed": -1}, "seed"),  # was taken
        ("images", {"seed": 1.5}, "seed"),
        ("images", {"seed": True}, "seed"),
        ("images", {"seed": "0"}, "seed"),  # was a TypeError after dataset.json
        ("images", {"batch_size": True}, "batch_size"),
        ("images", {"batch_size": 2.5}, "batch_size"),  # was a TypeError after dataset.json
        ("images", {"crops_per_image": True}, "crops_per_image"),
        ("images", {"crops_per_image": "2"}, "crops_per_image"),  # was a TypeError
        ("images", {"vae_name": 5}, "vae_name"),  # was recorded in dataset.json
        ("images", {"degradation": "area"}, "degradation"),  # was an AttributeError
        ("images", {"writing": "x"}, "writing"),
        ("images", {"vae": None}, "vae"),  # was an AttributeError after dataset.json
        ("images", {"image_paths": []}, "image_paths"),
        ("distill", {"num_items": True}, "num_items"),
        ("distill", {"num_items": 1.5}, "num_items"),  # was a TypeError after dataset.json
        ("distill", {"latent_size": (4.0, 4.0)}, "latent_size"),  # was a TypeError after dataset.json
        ("distill", {"latent_size": 4}, "latent_size"),
        ("distill", {"latent_size": (4,)}, "latent_size"),
        ("distill", {"seed": "0"}, "seed"),
        ("distill", {"batch_size": True}, "batch_size"),
        ("distill", {"source": "x"}, "source"),  # was recorded in dataset.json
        ("distill", {"source": {"size": (4, 4)}}, "source"),  # a tuple comes back a list: no resume would match
        ("distill", {"teacher": None}, "teacher"),  # was a TypeError after dataset.json
    ],
)
def test_a_builders_wrong_argument_is_one_line_and_nothing_is_written(tmp_path, photo, kind, arguments, field):
    root = tmp_path / "data"
    with pytest.raises(FlowliftError) as caught:
        _build(kind, root, photo, **arguments)
    message = str(caught.value)
    assert caught.value.field == field and message.startswith(field) and "\n" not in message, message
    assert not root.exists()  # no dataset.json, no folder: nothing at all under the output root


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"shard_size": 2.5}, "shard_size", "an integer >= 1"),  # was a TypeError after dataset.json
        ({"shard_size": True}, "shard_size", "an integer >= 1"),  # was taken as 1
        ({"storage_dtype": "fp16"}, "storage_dtype", "torch.float16"),  # was a TypeError at the first shard
        ({"storage_dtype": "float16"}, "storage_dtype", "torch.float16"),  # a name is not a dtype
        ({"device": "bogus"}, "device", "not a torch device"),  # was a RuntimeError after dataset.json
        ({"progress": "no"}, "progress", "True, False or None"),  # was read as on
        ({"part": (1, 1)}, "part", "0 <= I < N"),  # was refused only after dataset.json
        ({"part": "0/2"}, "part", "two integers"),
    ],
)
def test_shard_writing_checks_its_fields_when_made(tmp_path, photo, fields, field, words):
    with pytest.raises(FlowliftError) as caught:
        _build("images", tmp_path / "data", photo, writing=_writing(**fields))
    assert caught.value.field == field and str(caught.value).startswith(field) and words in str(caught.value)
    assert not (tmp_path / "data").exists()


def test_the_builders_take_right_arguments_as_given(tmp_path, photo):
    """One ``str`` is one photo (it was read as its characters), a list is a latent size, a JSON ``source`` and
    the ``vae_name`` are recorded; ``ShardWriting`` keeps its device resolved and its part a tuple."""
    import json

    import torch

    writing = _writing(part=[0, 1], device="cpu")()
    assert writing.part == (0, 1) and writing.device == torch.device("cpu")
    manifest = _build("images", tmp_path / "images", photo, image_paths=str(photo), vae_name="taef2", flip=False)
    assert manifest["source"]["images"] == [str(photo)] and manifest["source"]["vae"] == "taef2"
    source = {"teacher": "tiny", "steps": [4], "guidance": None}
    manifest = _build("distill", tmp_path / "distill", photo, latent_size=[4, 8], source=source)
    assert manifest["target_shape"] == [32, 4, 8] and manifest["source"] == source
    assert json.loads((tmp_path / "distill" / "dataset.json").read_text())["source"] == source


def test_the_builders_sizes_hold_the_degradation_and_the_cap(tmp_path, vae):
    """A degradation by 3 met a 32 px target (decoded, then 32 / 3 px) mid-run, after ``dataset.json`` was written;
    ``latent_size`` had no upper bound (``(100000, 100000)`` went on to allocate its noise), a 100,000 px crop or
    teacher image neither."""
    from flowlift.training.builder_checks import check_crop, check_latent_size, latent_align
    from flowlift.training.dataset_jobs import PhotoCrops, TeacherSource
    from flowlift.training.datasets import build_distill_dataset, build_images_dataset
    from flowlift.training.degrade import Degradation

    assert [latent_align(factor) for factor in (1, 2, 3, 4)] == [4, 4, 12, 8]
    by_three = Degradation(factor=3)
    for call, field in (
        (
            lambda: build_distill_dataset(
                tmp_path / "d", torch.zeros_like, vae, num_items=1, latent_size=(4, 4), degradation=by_three
            ),
            "latent_size",
        ),
        (
            lambda: build_distill_dataset(tmp_path / "d", torch.zeros_like, vae, num_items=1, latent_size=(4096, 4)),
            "latent_size",
        ),
        (lambda: build_images_dataset(tmp_path / "d", ["a.png"], vae, crop=32, degradation=by_three), "crop"),
        (lambda: build_images_dataset(tmp_path / "d", ["a.png"], vae, crop=32768), "crop"),
        (lambda: PhotoCrops(["photos"], crop_px=16416), "crop_px"),
        (lambda: TeacherSource(teacher="t", num=1, width=1024, height=100000), "width"),
    ):
        with pytest.raises(FlowliftError) as caught:
            call()
        assert caught.value.field == field and "\n" not in str(caught.value), str(caught.value)
        assert not (tmp_path / "d").exists()  # refused before anything is written
    assert check_latent_size((12, 24), 3) == (12, 24) and check_latent_size((2048, 4)) == (2048, 4)
    assert check_crop(96, factor=3) == 96 and check_crop(16384) == 16384
    assert str(pytest.raises(FlowliftError, check_crop, 16400).value) == (
        "crop must be a positive multiple of 32 px up to 16384, got 16400; e.g. 16384"
    )

"""``train`` and ``dataset`` tell the user what is off (issue 15, item 17). Fast: no model is trained."""

from __future__ import annotations

import csv
import warnings

import pytest
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
        build_images_dataset(tmp_path / "data", small, vae=None, crop=128)
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

    with pytest.raises(FlowliftError, match=r"^crop_px must be a positive multiple of 32 px, got 100; e.g. 96 or 128$"):
        PhotoCrops(["photos"], crop_px=100)
    (tmp_path / "photos").mkdir()
    Image.new("RGB", (200, 200)).save(tmp_path / "photos" / "a.png")
    common = ["--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    for crop, line in (
        ("100", "error: --crop-px must be a positive multiple of 32 px, got 100; e.g. 96 or 128"),
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

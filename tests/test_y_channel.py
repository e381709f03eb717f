"""PSNR-Y / SSIM-Y on BasicSR's unrounded Y (``y_channel="basicsr"``: SwinIR's and HAT's tables) beside MATLAB's rounded
Y (the default), one knob (:data:`flowlift.measure.sr_metrics.Y_CHANNEL`) at every door that measures them: ``flowlift
eval --y-channel``, ``EvalRequest(y_channel=)``, ``MeasureSettings(y_channel=)`` (``evaluate_methods`` and
``evaluate_pairs``' ``measuring=``) and the metric functions. The unrounded figures are held to BasicSR's definition
written out here in NumPy: ``Y = 16 + 65.481 R + 128.553 G + 24.966 B`` on [0, 1] RGB, no rounding, the same border
shaved."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import build_parser, main
from flowlift.errors import FlowliftError
from flowlift.measure import evaluate as E
from flowlift.measure import methods as MT
from flowlift.measure import metrics as M
from flowlift.measure.eval_job import EvalRequest
from flowlift.measure.sr_metrics import Y_CHANNEL


def basicsr_psnr_y(out: np.ndarray, gt: np.ndarray, shave: int) -> float:
    """BasicSR's ``calculate_psnr(out, gt, crop_border=shave, test_y_channel=True)``, its definition in float64."""
    full = 65535.0 if out.dtype == np.uint16 else 255.0

    def y(rgb: np.ndarray) -> np.ndarray:
        rgb = rgb[shave : rgb.shape[0] - shave, shave : rgb.shape[1] - shave].astype(np.float64) / full
        return 16.0 + 65.481 * rgb[..., 0] + 128.553 * rgb[..., 1] + 24.966 * rgb[..., 2]

    mse = np.mean((y(out) - y(gt)) ** 2)
    return float(10.0 * np.log10(255.0**2 / mse))


def _photo(shared, name: str = "kodim23") -> np.ndarray:
    with Image.open(shared / "images" / "kodak" / f"{name}.png") as im:
        return np.asarray(im.convert("RGB").crop((256, 128, 448, 320)))


def _degraded(photo: np.ndarray) -> dict[str, np.ndarray]:
    """A bicubic 4x round trip (~30 dB) and a JPEG at quality 92 (~45 dB, where the rounding weighs most)."""
    small = Image.fromarray(photo).resize((photo.shape[1] // 4, photo.shape[0] // 4), Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    Image.fromarray(photo).save(buffer, "JPEG", quality=92)
    return {
        "bicubic": np.asarray(small.resize((photo.shape[1], photo.shape[0]), Image.Resampling.BICUBIC)),
        "jpeg": np.asarray(Image.open(buffer).convert("RGB")),
    }


@pytest.mark.parametrize("shave", [0, 4])
def test_unrounded_psnr_y_is_basicsrs_to_a_microdecibel(shared, shave):
    photo = _photo(shared)
    for name, out in _degraded(photo).items():
        expected = basicsr_psnr_y(out, photo, shave)
        assert M.psnr_y(out, photo, shave, y_channel="basicsr") == pytest.approx(expected, abs=1e-6), name
        rounded = M.psnr_y(out, photo, shave)  # the default: MATLAB's rounded Y, another number
        assert rounded == M.psnr_y(out, photo, shave, y_channel="matlab") and abs(rounded - expected) > 1e-3, name
    deep = (photo.astype(np.uint16) * 257 + 100).clip(0, 65535).astype(np.uint16)
    assert M.psnr_y(deep, photo.astype(np.uint16) * 257, shave, "basicsr") == pytest.approx(
        basicsr_psnr_y(deep, photo.astype(np.uint16) * 257, shave), abs=1e-6
    )


def test_unrounded_y_is_the_formula_and_ssim_y_takes_it_too(shared):
    pixels = np.array([[[255, 255, 255], [0, 0, 0], [12, 200, 77]]], np.uint8)
    expected = 16 + np.array([235 - 16, 0, (65.481 * 12 + 128.553 * 200 + 24.966 * 77) / 255])
    assert M.ycbcr_y(pixels, y_channel="basicsr")[0] == pytest.approx(expected, abs=1e-12)
    photo = _photo(shared)
    out = _degraded(photo)["jpeg"]
    assert M.ssim_y(out, photo, 4, "basicsr") != M.ssim_y(out, photo, 4)
    with pytest.raises(FlowliftError, match="y_channel must be one of matlab, basicsr, got 'BasicSR'"):
        M.psnr_y(out, photo, 4, "BasicSR")


def test_every_door_takes_the_one_knob():
    (action,) = [
        a for a in build_parser()._subparsers._group_actions[0].choices["eval"]._actions if a.dest == "y_channel"
    ]
    assert action.option_strings == ["--y-channel"] and tuple(action.choices) == Y_CHANNEL.choices
    assert action.default == Y_CHANNEL.default == EvalRequest(output="r").y_channel == E.MeasureSettings().y_channel
    assert EvalRequest(output="r", y_channel="basicsr").measuring == E.MeasureSettings(y_channel="basicsr")
    for make in (lambda: EvalRequest(output="r", y_channel="rgb"), lambda: E.MeasureSettings(y_channel=None)):
        with pytest.raises(FlowliftError, match="y_channel must be one of matlab, basicsr"):
            make()
    with pytest.raises(FlowliftError, match="measuring must be a MeasureSettings"):
        E.evaluate_methods(MT.parse_methods("bicubic"), ["x"], 2, measuring="basicsr")


def test_eval_measures_either_y_on_both_modes_and_says_which(shared, tmp_path, capsys):
    photo = _photo(shared, "kodim03")
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(photo).save(photos / "kodim03.png")
    tables = {}
    for y_channel in Y_CHANNEL.choices:
        out = tmp_path / y_channel
        argv = ["eval", "--run", "bicubic", "--dataset", str(photos), "--scale", "4", "--save-outputs", "-o", str(out)]
        assert main([*argv, "--y-channel", y_channel, "--no-progress"]) == 0
        data = json.loads((out / "results.json").read_text())
        saved = np.asarray(Image.open(out / "outputs" / "bicubic" / "kodim03_x4.png"))
        measured = data["images"]["bicubic"]["kodim03"]["psnr_y"]
        if y_channel == "basicsr":
            assert measured == pytest.approx(basicsr_psnr_y(saved, photo, 4), abs=1e-6)
        else:
            assert measured == pytest.approx(M.psnr_y(saved, photo, 4), abs=1e-9)
        assert data["config"]["y_channel"] == y_channel
        tables[y_channel] = (out / "table.md").read_text()
        pairs = tmp_path / f"pairs-{y_channel}"
        saved_dir = out / "outputs"
        pairs_argv = [str(saved_dir / "bicubic"), "--reference", str(saved_dir / "inputs")]
        pairs_argv += ["--ground-truth", str(saved_dir / "ground-truth"), "-o", str(pairs), "--y-channel", y_channel]
        assert main(["eval", *pairs_argv, "--no-progress"]) == 0
        again = json.loads((pairs / "results.json").read_text())["images"]["outputs"]["kodim03"]["psnr_y"]
        assert again == pytest.approx(measured, abs=1e-9)  # the pairs mode measures what the run measured
    assert "rounded as MATLAB's rgb2ycbcr" in tables["matlab"] and "unrounded as BasicSR's" in tables["basicsr"]
    assert not math.isclose(
        json.loads((tmp_path / "matlab" / "results.json").read_text())["images"]["bicubic"]["kodim03"]["psnr_y"],
        json.loads((tmp_path / "basicsr" / "results.json").read_text())["images"]["bicubic"]["kodim03"]["psnr_y"],
    )
    capsys.readouterr()

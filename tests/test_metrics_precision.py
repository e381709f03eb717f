"""The metrics measure an image at its own precision and say what they leave out: 16-bit samples are read as /65535,
not rounded to 8 bits (a ground truth 100/65535 away from the output measured PSNR inf and SSIM 1.0), in the Python
API and in ``flowlift eval``; an alpha channel is dropped with the command line's warning; an empty image is named."""

from __future__ import annotations

import json
import math
import warnings

import cv2
import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError, FlowliftWarning
from flowlift.measure import evaluate as E
from flowlift.measure import methods as MT
from flowlift.measure import metrics as M

#: PSNR of a difference of 100/65535 on every sample: 20 log10(65535 / 100).
PSNR_100 = 20 * math.log10(65535 / 100)


def _photo16(height: int = 64, width: int = 64, seed: int = 0) -> np.ndarray:
    """A blocky 16-bit RGB image of values ``257 k - 50``: each, and each plus 100, rounds to the 8-bit level ``k``."""
    rng = np.random.default_rng(seed)
    levels = rng.integers(5, 250, (height // 8, width // 8, 3))
    return (np.kron(levels, np.ones((8, 8, 1), np.int64)) * 257 - 50).astype(np.uint16)


def _save16(path, rgb: np.ndarray) -> str:
    assert cv2.imwrite(str(path), rgb[..., ::-1])  # OpenCV writes BGR; a 16-bit PNG
    return str(path)


def test_16_bit_images_are_measured_at_16_bits():
    truth = _photo16()
    output = truth + 100
    assert M.psnr(output, truth) == pytest.approx(PSNR_100)
    assert M.ssim(output, truth) < 1.0
    assert math.isfinite(M.psnr_y(output, truth, 2)) and M.ssim_y(output, truth, 2) < 1.0
    agreement = M.pixel_agreement(output, truth)
    assert agreement["identical_pct"] == 0.0 and agreement["l1"] == pytest.approx(100 / 257)
    assert M.psnr(M.as_uint8_rgb(output), M.as_uint8_rgb(truth)) == math.inf  # what rounding to 8 bits first hid


def test_an_8_bit_image_and_its_exact_16_bit_copy_measure_identical():
    eight = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    sixteen = eight.astype(np.uint16) * 257
    assert M.psnr(eight, sixteen) == math.inf and M.psnr_y(eight, sixteen) == math.inf
    assert M.pixel_agreement(eight, sixteen) == {"l1": 0.0, "identical_pct": 100.0}
    assert M.drift_at_input_scale(sixteen, eight)["psnr_input"] == math.inf


def test_eval_pairs_measure_a_16_bit_ground_truth_at_16_bits(tmp_path, capsys):
    truth = _photo16()
    for folder in ("outs", "refs", "gts"):
        (tmp_path / folder).mkdir()
    _save16(tmp_path / "gts" / "a.png", truth)
    _save16(tmp_path / "outs" / "a.png", truth + 100)
    _save16(tmp_path / "refs" / "a.png", cv2.resize(truth, (32, 32), interpolation=cv2.INTER_AREA))
    out = tmp_path / "report"
    argv = ["eval", str(tmp_path / "outs"), "--reference", str(tmp_path / "refs")]
    argv += ["--ground-truth", str(tmp_path / "gts"), "-o", str(out), "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    measured = json.loads((out / "results.json").read_text())["images"]["outputs"]["a"]
    assert measured["psnr_gt"] == pytest.approx(PSNR_100)  # was the string "inf"
    assert measured["ssim_gt"] < 1.0 and isinstance(measured["psnr_y"], float)


def test_eval_runs_measure_a_16_bit_photo_at_16_bits_and_save_it_so(tmp_path):
    from flowlift.measure.eval_job import EvalRequest, run_eval

    photos = tmp_path / "photos"
    photos.mkdir()
    _save16(photos / "a.png", _photo16())
    request = EvalRequest(output=tmp_path / "r", run=["bicubic"], dataset=[str(photos)], scale=2, save_outputs=True)
    run_eval(request)
    eight_bit_copy = E.evaluate_methods(
        MT.parse_methods("bicubic"), [photos], 2, method_fns={"bicubic": lambda low, gt: M.as_uint8_rgb(gt)}
    )
    assert 50 < eight_bit_copy.results["bicubic"]["a"]["psnr_gt"] < math.inf  # the 8-bit rounding is measured
    saved = cv2.imread(str(tmp_path / "r" / "outputs" / "ground-truth" / "a.png"), cv2.IMREAD_UNCHANGED)
    assert saved.dtype == np.uint16  # the pairs mode measures what the run measured


def test_an_rgba_image_given_to_the_metrics_warns_as_the_command_line_does():
    rgba = np.full((16, 16, 4), 200, np.uint8)
    rgba[0, 0, 3] = 0
    for image in (Image.fromarray(rgba, "RGBA"), rgba):
        with pytest.warns(FlowliftWarning, match="has transparent pixels; the metrics measure their colour as if"):
            assert M.psnr(image, rgba[..., :3]) == math.inf
    opaque = rgba.copy()
    opaque[..., 3] = 255
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert M.psnr(Image.fromarray(opaque, "RGBA"), opaque[..., :3]) == math.inf  # nothing left out: no warning


@pytest.mark.parametrize("metric", [M.psnr_y, M.ssim_y, M.psnr, M.ssim, M.pixel_agreement])
def test_an_empty_image_is_named_as_empty(metric):
    empty = np.zeros((5, 0, 3), np.uint8)
    with pytest.raises(FlowliftError, match=r"^image a is empty \(0x5 px, shape \(5, 0, 3\)\): nothing to measure$"):
        metric(empty, empty)
    with pytest.raises(FlowliftError, match=r"^the image is empty"):
        M.sharpness(np.zeros((0, 4, 3), np.uint8))

"""The super-resolution field's protocol in ``flowlift eval``: PSNR-Y / SSIM-Y (BT.601 Y as MATLAB's rgb2ycbcr,
``scale`` px shaved) recomputed independently from saved outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.measure import metrics as M


@pytest.fixture(scope="module")
def photos(tmp_path_factory, shared) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    for name in ("kodim03", "kodim23"):
        with Image.open(shared / "images" / "kodak" / f"{name}.png") as im:
            im.convert("RGB").crop((300, 200, 460, 328)).save(folder / f"{name}.png")
    return folder


def matlab_y(rgb_u8: np.ndarray) -> np.ndarray:
    """MATLAB ``rgb2ycbcr`` on uint8, Y only, written out: round(16 + [65.481 128.553 24.966] * rgb / 255),
    in exact rational arithmetic (thousandths over 255), halves rounded up."""
    from fractions import Fraction

    def one(rgb) -> int:
        y = 16 + Fraction(65481 * int(rgb[0]) + 128553 * int(rgb[1]) + 24966 * int(rgb[2]), 255000)
        return int(y + Fraction(1, 2))  # y > 0: int() floors

    flat = rgb_u8.reshape(-1, 3)
    cache: dict[bytes, int] = {}
    values = [cache.setdefault(p.tobytes(), one(p)) if p.tobytes() not in cache else cache[p.tobytes()] for p in flat]
    return np.asarray(values, dtype=np.float64).reshape(rgb_u8.shape[:2])


def independent_y_metrics(out: np.ndarray, gt: np.ndarray, shave: int) -> tuple[float, float]:
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    yo, yg = matlab_y(out), matlab_y(gt)
    yo, yg = yo[shave:-shave, shave:-shave], yg[shave:-shave, shave:-shave]
    psnr = peak_signal_noise_ratio(yg, yo, data_range=255)
    ssim = structural_similarity(yg, yo, data_range=255, gaussian_weights=True, sigma=1.5, use_sample_covariance=False)
    return psnr, ssim


def test_y_is_matlab_rgb2ycbcr():
    pixels = np.array([[[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 255, 0], [0, 0, 255], [12, 200, 77]]], np.uint8)
    # MATLAB: rgb2ycbcr(uint8([255 255 255; 0 0 0; 255 0 0; 0 255 0; 0 0 255])) -> Y 235, 16, 81, 145, 41
    assert M.ycbcr_y(pixels)[0, :5].tolist() == [235, 16, 81, 145, 41]
    assert M.ycbcr_y(pixels)[0, 5] == matlab_y(pixels)[0, 5]
    assert M.ycbcr_y(pixels.astype(np.float64) / 255).tolist() == M.ycbcr_y(pixels).tolist()


def test_y_metrics_equal_an_independent_computation():
    rng = np.random.default_rng(0)
    gt = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = np.clip(gt.astype(int) + rng.integers(-25, 25, gt.shape), 0, 255).astype(np.uint8)
    for shave in (1, 2, 4):
        psnr, ssim = independent_y_metrics(out, gt, shave)
        assert M.psnr_y(out, gt, shave) == pytest.approx(psnr, abs=1e-9)
        assert M.ssim_y(out, gt, shave) == pytest.approx(ssim, abs=1e-9)
    # the shave matters: a border-only error is invisible with it and visible without it
    framed = gt.copy()
    framed[:2] = 0
    assert M.psnr_y(framed, gt, 2) == float("inf") and M.psnr_y(framed, gt, 0) < 30
    with pytest.raises(FlowliftError, match="cannot shave"):
        M.psnr_y(out, gt, 24)


def test_eval_reports_y_metrics_that_recompute_from_saved_outputs(photos, tmp_path, capsys):
    out_dir = tmp_path / "report"
    code = main(["eval", "--run", "lanczos,bicubic", "--dataset", str(photos), "--scale", "4", "--save-outputs",
                 "--quiet", "-o", str(out_dir)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "PSNR-Y (dB)" in printed and "SSIM-Y" in printed
    data = json.loads((out_dir / "results.json").read_text())
    for method in ("lanczos", "bicubic"):
        values = data["images"][method]
        assert set(values) == {"kodim03", "kodim23"}
        for stem, metrics in values.items():
            out = np.asarray(Image.open(out_dir / "outputs" / method / f"{stem}_x4.png").convert("RGB"))
            gt = np.asarray(Image.open(out_dir / "outputs" / "ground-truth" / f"{stem}.png").convert("RGB"))
            psnr, ssim = independent_y_metrics(out, gt, 4)
            assert metrics["psnr_y"] == pytest.approx(psnr, abs=1e-9)
            assert metrics["ssim_y"] == pytest.approx(ssim, abs=1e-9)
        mean = data["summary"][method]["mean"]
        assert mean["psnr_y"] == pytest.approx(np.mean([m["psnr_y"] for m in values.values()]))
        assert data["summary"][method]["worst"]["ssim_y"] == min(m["ssim_y"] for m in values.values())
    # lanczos beats bicubic on luma fidelity here, as in every SR paper's baseline rows
    assert data["summary"]["lanczos"]["mean"]["psnr_y"] > data["summary"]["bicubic"]["mean"]["psnr_y"]

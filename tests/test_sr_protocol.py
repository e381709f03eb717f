"""The super-resolution field's protocol in ``flowlift eval``: PSNR-Y / SSIM-Y (BT.601 Y as MATLAB's rgb2ycbcr,
``scale`` px shaved) recomputed independently from saved outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from door_helpers import classic_eval_args
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
    code = main([*classic_eval_args(photos, 4), "--no-progress", "-o", str(out_dir)])
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


@pytest.fixture(scope="module")
def sesqui_file(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    from sesqui_reference import random_state

    path = tmp_path_factory.mktemp("sesqui") / "upscaler_Flux2.safetensors"
    save_file(random_state(0), str(path))
    return path


@pytest.fixture(scope="module")
def flux2_vae_dir(tmp_path_factory) -> Path:
    from tiny_flux2 import tiny_vae

    folder = tmp_path_factory.mktemp("vae") / "tiny-flux2-vae"
    tiny_vae().save_pretrained(folder)
    return folder


def test_fractional_scale_inputs_are_lanczos_downsampled_multiples_of_16():
    from flowlift.measure import inputs as IN

    photo = np.random.default_rng(0).integers(0, 256, (150, 200, 3), dtype=np.uint8)
    gt, low = IN.prepare_pair(photo, 1.5)
    assert gt.shape == (144, 192, 3) and low.shape == (96, 128, 3)
    expected = np.asarray(Image.fromarray(gt).resize((128, 96), Image.Resampling.LANCZOS))
    assert np.array_equal(low, expected)
    gt4, low4 = IN.prepare_pair(photo, 4)  # whole scales keep the exact box mean
    assert low4.shape == (32, 48, 3) and np.array_equal(low4, IN.box_downscale_uint8(gt4, 4))
    text = IN.check_scale("2.0", loose=True)  # the command line's text
    assert text == 2 and isinstance(text, int) and IN.check_scale(1.25) == 1.25
    for bad in ("1", "0.5", "17", "nan", "1.333", "x"):
        with pytest.raises(FlowliftError):
            IN.check_scale(bad, loose=True)
    with pytest.raises(FlowliftError, match="scale must be a number"):
        IN.check_scale("2.0")  # the Python API's scale is a number


def test_unreachable_methods_are_skipped_with_their_reason():
    from flowlift.measure import methods as MT

    specs = {s.name: s for s in MT.parse_methods("flow,sesqui:w.safetensors:mine,lanczos,latent-bicubic")}
    assert specs["sesqui"].label == "sesqui:mine" and specs["sesqui"].needs_vae
    assert MT.unreachable(specs["flow"], 3) and MT.unreachable(specs["flow"], 1.5)
    assert MT.unreachable(specs["flow"], 4) is None and MT.unreachable(specs["flow"], 2) is None
    assert MT.unreachable(specs["sesqui"], 1.5) is None and MT.unreachable(specs["sesqui"], 2) is None
    assert "[1, 2]" in MT.unreachable(specs["sesqui"], 3)
    assert MT.unreachable(specs["lanczos"], 3) is None and MT.unreachable(specs["latent-bicubic"], 1.5) is None
    with pytest.raises(FlowliftError, match="safetensors"):
        MT.parse_methods("sesqui:weights.pth")


def _eval(args, tmp_path, name):
    out_dir = tmp_path / name
    assert main(["eval", *args, "--no-progress", "--device", "cpu", "-o", str(out_dir)]) == 0
    return out_dir, json.loads((out_dir / "results.json").read_text())


def test_eval_runs_sesqui_beside_the_others_at_1_5x(photos, sesqui_file, flux2_vae_dir, tmp_path, capsys):
    run = f"lanczos,latent-bicubic,flow,sesqui:{sesqui_file}"
    out_dir, data = _eval(
        ["--run", run, "--dataset", str(photos), "--scale", "1.5", "--vae", str(flux2_vae_dir), "--save-outputs"],
        tmp_path,
        "r15",
    )
    table = capsys.readouterr().out
    assert data["config"]["methods"] == ["lanczos", "latent-bicubic", "sesqui:upscaler_Flux2"]
    assert "power of 2" in data["config"]["skipped"]["flow"] and "flow: skipped" in table
    for method in ("lanczos", "latent-bicubic", "sesqui:upscaler_Flux2"):
        folder = out_dir / "outputs" / method.replace(":", "_")
        for stem, metrics in data["images"][method].items():
            out = np.asarray(Image.open(folder / f"{stem}_x1.5.png").convert("RGB"))
            gt = np.asarray(Image.open(out_dir / "outputs" / "ground-truth" / f"{stem}.png").convert("RGB"))
            low = np.asarray(Image.open(out_dir / "outputs" / "inputs" / f"{stem}.png").convert("RGB"))
            assert out.shape == gt.shape == (low.shape[0] * 3 // 2, low.shape[1] * 3 // 2, 3)
            psnr, ssim = independent_y_metrics(out, gt, 2)  # ceil(1.5) px shaved
            assert metrics["psnr_y"] == pytest.approx(psnr, abs=1e-9)
            assert metrics["ssim_y"] == pytest.approx(ssim, abs=1e-9)
    # the SesquiLSR output is the network's on the raw latents, not latent bicubic's
    sesqui, bicubic = data["images"]["sesqui:upscaler_Flux2"], data["images"]["latent-bicubic"]
    assert all(sesqui[k]["psnr_gt"] != bicubic[k]["psnr_gt"] for k in sesqui)


def test_eval_at_3x_skips_what_cannot_reach_it(photos, sesqui_file, flux2_vae_dir, tmp_path, capsys):
    _, data = _eval(
        [
            "--run",
            f"lanczos,flow,sesqui:{sesqui_file}",
            "--dataset",
            str(photos),
            "--scale",
            "3",
            "--vae",
            str(flux2_vae_dir),
        ],
        tmp_path,
        "r3",
    )
    assert data["config"]["methods"] == ["lanczos"]
    assert set(data["config"]["skipped"]) == {"flow", "sesqui:upscaler_Flux2"}
    assert "sesqui:upscaler_Flux2: skipped, SesquiLSR reaches factors in [1, 2]" in capsys.readouterr().out


def test_eval_sesqui_needs_the_flux2_vae_and_its_file(photos, sesqui_file, flux2_vae_dir, shared, tmp_path, capsys):
    args = ["--dataset", str(photos), "--scale", "2", "--no-progress", "--device", "cpu", "-o", str(tmp_path / "o")]
    code = main(["eval", "--run", f"sesqui:{sesqui_file}", "--vae", str(shared / "models" / "taef2"), *args])
    err = capsys.readouterr().err
    assert code != 0 and "BN statistics" in err and len(err.strip().splitlines()) == 1
    missing = tmp_path / "upscaler_Flux2.safetensors"
    code = main(["eval", "--run", f"sesqui:{missing}", "--vae", str(flux2_vae_dir), *args])
    err = capsys.readouterr().err
    assert code != 0 and "models/ folder" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o" / "results.json").exists()

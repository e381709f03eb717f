"""`flowlift eval --run spandrel:...` with a real spandrel model, in the ComfyUI venv.

spandrel needs torchvision, which cannot live next to this environment's CPU torch (see the README,
"Choosing an upscaler"), so these tests run flowlift as subprocesses in the venv that
tests/comfy_venv.py builds from ComfyUI's requirements (spandrel and torchvision included), with the
CPU shim and this checkout's src on PYTHONPATH. The model is a randomly initialised small ESRGAN
(spandrel's RRDBNet architecture) made by tests/spandrel_check.py and saved as a state dict.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from comfy_venv import comfy_env, comfy_python

TESTS = Path(__file__).resolve().parent
PHOTOS = ("kodim05", "kodim23")


@pytest.fixture(scope="module")
def venv_run(shared, tmp_path_factory):
    """``run(*args)`` -> CompletedProcess of the venv's python in a scratch folder."""
    python = comfy_python()
    env = comfy_env(OMP_NUM_THREADS="1")
    cwd = tmp_path_factory.mktemp("spandrel")

    def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(python), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)

    run.cwd = cwd
    return run


@pytest.fixture(scope="module")
def photos(shared, venv_run) -> Path:
    """Two Kodak images at 192x128 (eval builds 48x32 low-res inputs from them at 4x)."""
    folder = venv_run.cwd / "photos"
    folder.mkdir()
    for name in PHOTOS:
        image = Image.open(shared / "images" / "kodak" / f"{name}.png").convert("RGB")
        image.resize((192, 128), Image.Resampling.BOX).save(folder / f"{name}.png")
    return folder


@pytest.fixture(scope="module")
def model_checks(venv_run, photos) -> dict:
    result = venv_run(str(TESTS / "spandrel_check.py"), "models", *(str(photos / f"{n}.png") for n in PHOTOS))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eval_report(venv_run, photos, model_checks) -> dict:
    model = venv_run.cwd / "models" / "esrgan.safetensors"
    result = venv_run(
        "-m",
        "flowlift",
        "eval",
        "--run",
        f"lanczos,spandrel:{model}:tiny,spandrel:{model}:tiny+colorfix",
        "--dataset",
        str(photos),
        "--scale",
        "4",
        "-o",
        "report",
        "--no-progress",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((venv_run.cwd / "report" / "results.json").read_text())
    report["stdout"] = result.stdout
    report["crops_png_bytes"] = (venv_run.cwd / "report" / "crops.png").stat().st_size
    return report


def test_spandrel_model_has_its_row_and_crop_column(eval_report):
    assert set(eval_report["summary"]) >= {"lanczos", "spandrel:tiny", "spandrel:tiny+colorfix"}
    for label in ("spandrel:tiny", "spandrel:tiny+colorfix"):
        assert sorted(eval_report["images"][label]) == sorted(PHOTOS)
        assert eval_report["figure"]["crop_columns"][label] == sorted(PHOTOS)
    assert "| spandrel:tiny | mean |" in eval_report["stdout"]
    assert "| spandrel:tiny+colorfix | worst |" in eval_report["stdout"]
    # the report states how the model ran (native scale, tiling)
    assert "ESRGAN, native 4x" in eval_report["stdout"]
    assert eval_report["config"]["spandrel"]
    assert eval_report["crops_png_bytes"] > 0


def test_plain_row_is_the_models_own_cast_and_colorfix_removes_it(eval_report, model_checks):
    plain = eval_report["images"]["spandrel:tiny"]
    fixed = eval_report["images"]["spandrel:tiny+colorfix"]
    for name in PHOTOS:
        direct = model_checks["direct"][name]
        for key in ("cast_r", "cast_g", "cast_b", "c_mean_change_pct", "l_std_change"):
            assert plain[name][key] == pytest.approx(direct[key], abs=1e-6), (name, key)
        assert plain[name]["cast_max"] > 10  # a random network's colours are far off
        assert fixed[name]["cast_max"] <= 0.1, fixed[name]


def test_tiled_inference_matches_untiled(model_checks):
    tiling = model_checks["tiling"]
    assert tiling["untiled_shape"] == [1, 3, 224, 288]
    # 56x72 in 40 px tiles: 2x3 tiles with overlap 2 (core 36), 3x3 with overlap 16 (core 8)
    print(f"tiled vs untiled, max |difference|: overlap 2: {tiling['2']:.3g}, overlap 16: {tiling['16']:.3g}")
    assert tiling["16"] <= 1e-6  # the tiny model's receptive field fits in 16 px: float noise only
    assert tiling["2"] <= 1e-3  # seams from cut context stay small


def test_bad_model_files_are_one_line_naming_the_file_and_what_is_wrong(venv_run, photos):
    """int8 weights (issue 22 item 5: once a +150/255 cast and exit 0), a NaN, and an SCUNet that builds
    but cannot run (item 9: once an EinopsError traceback), at load (auto tiles probe the model) and
    on the first photo (--tile none): exit 2, one line naming the file, no report."""
    result = venv_run(str(TESTS / "spandrel_check.py"), "--bad-files", "bad", str(photos))
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "int8-auto": "weights do not fit ESRGAN: `model.0.bias` has dtype int8, expected floating point",
        "nan-auto": f"contain NaN in `{cases['poisoned']}`",
        "scunet-auto": "SCUNet cannot run on a 64x64 input",
        "scunet-none": "SCUNet cannot run on a 32x48 input",
    }
    for case, text in expected.items():
        outcome = cases[case]
        assert outcome["escaped"] is None, (case, outcome)
        assert outcome["code"] == 2 and len(outcome["err"]) == 1, (case, outcome)
        line = outcome["err"][0]
        assert line.startswith("flowlift eval: error: ") and outcome["path"] in line and text in line, (case, line)
        assert not outcome["report"], case
    assert "EinopsError" in cases["scunet-none"]["err"][0]  # what the model said, on the same line

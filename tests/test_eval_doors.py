"""``flowlift eval --run`` refuses what it can before any model loads and never writes a report of nothing measured:
a run whose every method is skipped at the scale, a SesquiLSR or spandrel file that is not there, a box past the
photos (the command line and the Python API alike: one line, nothing written, no loader called)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError


@pytest.fixture
def photos(tmp_path) -> Path:
    """Two small random photos (96x64: a 96x64 ground truth at scale 2)."""
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    return folder


@pytest.fixture
def no_loading(monkeypatch):
    """Every model loader eval may call fails the test if it is called."""
    from builders import forbid_call

    for loader in (
        "flowlift.models.vae_loading.load_vae",
        "flowlift.models.sesqui_lsr.load_sesqui_lsr",
        "flowlift.measure.pixel_upscaler.load_pixel_upscaler",
        "flowlift.upscale.pipeline.FlowUpscalerPipeline",
    ):
        forbid_call(monkeypatch, loader, "a model was loaded before the user error was refused")


def _refused(argv: list[str], capsys) -> str:
    """``flowlift eval ARGV``'s one error line (exit 2, no traceback)."""
    assert main(["eval", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("methods", "scale", "reasons"),
    [
        ("flow", "3", ["flow: the Flow Upscaler runs 2x per pass: x3 is not a power of 2"]),
        ("sesqui:up.safetensors", "3", ["sesqui:up: SesquiLSR reaches factors in [1, 2] in one forward, not x3"]),
        ("flow,sesqui:up.safetensors", "3", ["flow: the Flow Upscaler runs", "; sesqui:up: SesquiLSR reaches"]),
    ],
)
def test_a_run_whose_every_method_is_skipped_is_one_line_and_writes_nothing(
    photos, tmp_path, capsys, no_loading, methods, scale, reasons
):
    out = tmp_path / "report"
    argv = ["--run", methods, "--dataset", str(photos), "--scale", scale, "-o", str(out)]
    err = _refused(argv, capsys)
    assert "no method of --run reaches --scale" in err and "nothing would be measured" in err, err
    assert all(reason in err for reason in reasons), err
    assert not out.exists()


def test_evaluate_methods_refuses_a_run_of_skipped_methods_from_python(photos):
    from flowlift.measure.evaluate import evaluate_methods
    from flowlift.measure.methods import parse_methods

    with pytest.raises(FlowliftError, match=r"nothing would be measured \(flow: .*; sesqui:up: SesquiLSR"):
        evaluate_methods(parse_methods("flow,sesqui:up.safetensors"), [photos], 3)


def test_a_missing_sesqui_file_is_refused_before_the_vae_loads(shared, photos, tmp_path, capsys, no_loading):
    out = tmp_path / "report"
    missing = tmp_path / "nonexist.safetensors"
    vae = str(shared / "models" / "taef2")
    err = _refused(
        ["--run", f"lanczos,sesqui:{missing}", "--dataset", str(photos), "--scale", "2", "--vae", vae, "-o", str(out)],
        capsys,
    )
    assert f"{missing}: no such file" in err, err
    assert not out.exists()


def test_a_missing_spandrel_file_is_refused_before_the_vae_loads(shared, photos, tmp_path, capsys, no_loading):
    missing = tmp_path / "none.pth"
    vae = str(shared / "models" / "taef2")
    argv = ["--run", f"vae-roundtrip,spandrel:{missing}", "--dataset", str(photos), "--scale", "2", "--vae", vae]
    err = _refused([*argv, "-o", str(tmp_path / "report")], capsys)
    assert f"--run spandrel:{missing}: no such model file" in err, err


def test_a_box_past_the_photos_is_refused_before_any_model_loads(shared, photos, tmp_path, capsys, no_loading):
    out = tmp_path / "report"
    vae = str(shared / "models" / "taef2")
    argv = ["--run", "lanczos,latent-bicubic", "--dataset", str(photos), "--scale", "2", "--vae", vae]
    err = _refused([*argv, "--box", "0,0,1000,1000", "-o", str(out)], capsys)
    assert "--box x,y,w,h = 0,0,1000,1000 is not inside the 96x64 ground truth cropped from" in err, err
    assert "a.png" in err and not out.exists()


def test_a_photo_too_small_for_the_scale_is_refused_before_any_model_loads(shared, tmp_path, capsys, no_loading):
    folder = tmp_path / "photos"
    folder.mkdir()
    Image.new("RGB", (64, 64)).save(folder / "a.png")
    Image.new("RGB", (24, 24)).save(folder / "small.png")
    vae = str(shared / "models" / "taef2")
    argv = ["--run", "vae-roundtrip", "--dataset", str(folder), "--scale", "2", "--vae", vae, "-o", str(tmp_path / "o")]
    err = _refused(argv, capsys)
    assert "small.png (24x24) is too small for --scale 2" in err, err


def test_run_eval_refuses_a_box_past_the_photos_before_any_model_loads(shared, photos, tmp_path, no_loading):
    from flowlift.measure.eval_job import EvalRequest, run_eval

    request = EvalRequest(
        output=tmp_path / "r",
        run=["vae-roundtrip"],
        dataset=[str(photos)],
        scale=2,
        vae=str(shared / "models" / "taef2"),
        box=(0, 0, 97, 10),
        no_cache=True,
    )
    with pytest.raises(FlowliftError, match=r"box x,y,w,h = 0,0,97,10 is not inside the 96x64 ground truth"):
        run_eval(request)
    assert not (tmp_path / "r").exists()


def test_pairs_refuse_a_box_past_an_output_before_measuring(tmp_path, monkeypatch):
    from flowlift.measure import pairs as P
    from flowlift.measure.evaluate import MeasureSettings

    for folder, size in (("outs", (64, 64)), ("refs", (32, 32))):
        (tmp_path / folder).mkdir()
        for name in ("a", "b"):
            Image.new("RGB", size if name == "a" else (size[0] // 2, size[1] // 2)).save(
                tmp_path / folder / f"{name}.png"
            )
    measured = []
    monkeypatch.setattr(P, "measure", lambda *args, **kwargs: measured.append(args) or {})
    with pytest.raises(FlowliftError, match=r"box x,y,w,h = 0,0,40,40 is not inside the 32x32 output .*b\.png"):
        P.evaluate_pairs([str(tmp_path / "outs")], tmp_path / "refs", measuring=MeasureSettings(box=(0, 0, 40, 40)))
    assert measured == []


def test_a_sesqui_method_without_the_flux2_vae_names_the_vae_field_in_each_doors_words(
    shared, photos, tmp_path, capsys
):
    """TAEF2 has no BN statistics for SesquiLSR's raw latents: the command line says ``--vae``, the Python API its
    ``vae`` keyword (it said ``--vae flux2`` to both)."""
    from types import SimpleNamespace

    from flowlift.measure.methods import make_method_fn, parse_methods
    from sesqui_reference import save_random_sesqui

    sesqui = save_random_sesqui(tmp_path)
    (spec,) = parse_methods(f"sesqui:{sesqui}")
    with pytest.raises(FlowliftError) as info:
        make_method_fn(spec, 1.5, vae=SimpleNamespace(bn_mean=None))
    assert info.value.fields == ("vae",) and "(set vae to flux2 or its file)" in str(info.value)
    assert "--vae" not in str(info.value)
    vae = str(shared / "models" / "taef2")
    argv = ["--run", f"sesqui:{sesqui}", "--dataset", str(photos), "--scale", "1.5", "--vae", vae]
    err = _refused([*argv, "-o", str(tmp_path / "report")], capsys)
    assert "(set --vae to flux2 or its file)" in err, err


@pytest.mark.parametrize("vae", ["taef2", "folder", "file"])
def test_a_sesqui_method_with_taef2_is_refused_before_anything_loads(shared, photos, tmp_path, capsys, no_loading, vae):
    """``--vae taef2`` (the name, cached or not), the TAEF2 folder or one of its files: refused before the VAE loads
    (it loaded the VAE first, or with the name not cached said to download TAEF2, which would not help)."""
    from sesqui_reference import save_random_sesqui

    sesqui = save_random_sesqui(tmp_path)
    spec = {
        "taef2": "taef2",
        "folder": shared / "models" / "taef2",
        "file": shared / "models" / "taef2" / "taef2_decoder.pth",
    }
    out = tmp_path / "report"
    argv = ["--run", f"lanczos,sesqui:{sesqui}", "--dataset", str(photos), "--scale", "1.5", "--vae", str(spec[vae])]
    err = _refused([*argv, "-o", str(out)], capsys)
    assert "method sesqui:upscaler_Flux2 works on raw FLUX.2 VAE latents" in err, err
    assert "(set --vae to flux2 or its file)" in err and not out.exists()

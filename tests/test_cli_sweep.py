"""A hostile sweep of the command line's other commands (not ``upscale``) found runs that ended with exit 0 and a result
that was not what was asked, or failed only after a model loaded; each is refused in one line, before the work:

* ``bands DIR -o DIR`` / ``eval --dataset DIR -o DIR`` wrote their report into the folder they read, and the next run
  measured the report's own images as photos;
* ``hires --image ... --width 128`` (or ``--height``, ``--base-steps``) silently ignored the option;
* ``img2img --outpaint ""`` ran a plain img2img;
* ``--negative-prompt`` at the default ``--cfg-scale 1`` was ignored without a word, and ``--cfg-scale 1e30`` ran to
  an image of overflow;
* ``bands`` on 128 px images failed after its VAE loaded ("holds no frequency"), and ``--max-side 64`` passed its check;
  under 16 px a side it ended in a ZeroDivisionError traceback.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from PIL import Image

from builders import forbid_call, refine_inputs
from flowlift.commands.cli import main
from tiny_flux2 import write_model_dir


def _photos(folder, side=160, count=2):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = np.random.default_rng(i).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"p{i}.png")
    return folder


def _one_line(capsys, command):
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"flowlift {command}: error: "), err
    return err


@pytest.mark.parametrize("spelled", ["{d}", "{d}/../{name}", "{d}/."])
def test_a_report_is_never_written_into_the_folder_it_reads(tmp_path, shared, spelled, monkeypatch, capsys):
    photos = _photos(tmp_path / "ds")
    out = spelled.format(d=photos, name="ds")
    forbid_call(monkeypatch, "flowlift.models.vae_loading.load_vae", "the VAE loaded first")
    assert main(["bands", str(photos), "--vae", str(shared / "models" / "taef2"), "-o", out, "--no-progress"]) == 2
    assert "is the IMAGES folder" in _one_line(capsys, "bands")
    assert main(["eval", "--run", "lanczos", "--dataset", str(photos), "-o", out, "--no-progress"]) == 2
    assert "is the --dataset folder" in _one_line(capsys, "eval")
    assert sorted(p.name for p in photos.iterdir()) == ["p0.png", "p1.png"]


@pytest.mark.parametrize(("side", "max_side"), [(128, None), (15, None), (8, None), (512, 128)])
def test_bands_refuses_images_too_small_for_a_band_before_its_vae_loads(tmp_path, shared, side, max_side, capsys):
    photos = _photos(tmp_path / "ds", side=side, count=1)
    argv = ["bands", str(photos), "--vae", str(shared / "models" / "taef2"), "-o", str(tmp_path / "r"), "--no-progress"]
    with pytest.raises(SystemExit) if max_side else contextlib.nullcontext():  # argparse's type refuses it
        assert main(argv + (["--max-side", str(max_side)] if max_side else [])) == 2
    err = _one_line(capsys, "bands")
    assert ("--max-side: must be an integer >= 144" in err) if max_side else ("too small" in err and "144 px" in err)
    assert not (tmp_path / "r").exists()


def test_bands_help_says_the_domains_its_options_are_refused_outside(capsys):
    """``--max-side`` refused below 144 and ``--amplitude`` outside (0, 10] without the help saying so (it read
    "(0.1) (default: 0.1)"): both are knobs now, their help and their check one declaration."""
    from flowlift.commands.cli import build_parser

    text = " ".join(build_parser()._subparsers._group_actions[0].choices["bands"].format_help().split())
    assert "in (0, 10] (default: 0.1)" in text and "(0.1) (default" not in text, text
    assert "an integer >= 144 or none (default: none)" in text, text
    for option, value in (("--amplitude", "0"), ("--amplitude", "10.5"), ("--max-side", "143")):
        with pytest.raises(SystemExit, match="2"):
            main(["bands", "x.png", "--vae", "taef2", "-o", "r", option, value])
        assert option in _one_line(capsys, "bands")


@pytest.fixture(scope="module")
def refine_dir(tmp_path_factory):
    folder = refine_inputs(tmp_path_factory.mktemp("sweep"), "square.png", (64, 64), seed=4)
    write_model_dir(folder / "model")
    return folder


@pytest.mark.parametrize("given", [["--width", "128"], ["--height", "64"], ["--base-steps", "5"]])
def test_hires_from_an_image_refuses_the_txt2img_base_options(refine_dir, given, monkeypatch, capsys):
    monkeypatch.chdir(refine_dir)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "the FLUX.2 model loaded first")
    argv = ["hires", "--image", "square.png", "--model", "model", "--prompt-embeds", "prompt.safetensors"]
    assert main([*argv, *given, "-o", "never.png"]) == 2
    assert given[0] in _one_line(capsys, "hires") and not (refine_dir / "never.png").exists()


def test_an_empty_outpaint_is_refused_not_run_as_img2img(refine_dir, monkeypatch, capsys):
    monkeypatch.chdir(refine_dir)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "the FLUX.2 model loaded first")
    argv = ["img2img", "square.png", "--model", "model", "--prompt-embeds", "prompt.safetensors", "--outpaint", ""]
    assert main([*argv, "-o", "never.png"]) == 2
    assert "--outpaint" in _one_line(capsys, "img2img") and not (refine_dir / "never.png").exists()


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--negative-prompt", "blur"], ("--negative-prompt", "--cfg-scale")),
        (["--negative-prompt", "blur", "--cfg-scale", "1"], ("--negative-prompt", "--cfg-scale")),
        (["--cfg-scale", "1e30", "--negative-prompt", "blur"], ("--cfg-scale", "at most 100")),
    ],
)
def test_a_negative_prompt_without_true_cfg_and_an_absurd_cfg_are_refused(
    refine_dir, given, named, monkeypatch, capsys
):
    monkeypatch.chdir(refine_dir)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "the FLUX.2 model loaded first")
    argv = ["img2img", "square.png", "--model", "model", "--prompt-embeds", "prompt.safetensors", *given]
    assert main([*argv, "-o", "never.png"]) == 2
    line = _one_line(capsys, "img2img")
    assert all(word in line for word in named), line
    assert not (refine_dir / "never.png").exists()


@pytest.mark.parametrize(
    ("cfg", "negative", "file_has_negative", "used"),
    [
        (3.0, "blur", True, "E(blur)"),  # the text given wins over the file's negative (was: the file's, silently)
        (3.0, None, True, "file"),
        (3.0, None, False, "E()"),  # true CFG without a negative: the empty prompt
        (1.0, None, True, None),  # no true CFG: no negative at all
    ],
)
def test_the_negative_a_job_uses_is_the_one_given(tmp_path, cfg, negative, file_has_negative, used):
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file

    from flowlift.refine.jobs import job_conditioning
    from flowlift.refine.request import PromptRequest

    tensors = {"prompt_embeds": torch.zeros(1, 2, 4)}
    if file_has_negative:
        tensors["negative_prompt_embeds"] = torch.ones(1, 2, 4)
    save_file(tensors, str(tmp_path / "p.safetensors"))
    prompt = PromptRequest(embeds=tmp_path / "p.safetensors", negative=negative, cfg_scale=cfg)
    got = job_conditioning(
        SimpleNamespace(request=SimpleNamespace(prompt=prompt)), embed=lambda t: [f"E({x})" for x in t]
    )
    negative_used = got["negative_prompt_embeds"]
    if used == "file":
        assert torch.equal(negative_used, torch.ones(1, 2, 4))
    else:
        assert negative_used == used


def test_absurd_numbers_are_refused_where_a_plausible_result_came_back():
    import torch

    from flowlift.errors import FlowliftError
    from flowlift.measure.bands_job import BandsRequest, run_bands_report
    from flowlift.models.prompt_embeds import check_prompt_embeds
    from flowlift.refine.settings import TILE_SIZE
    from flowlift.training.degrade import Degradation

    with pytest.raises(FlowliftError, match=r"noise_std must be in \[0, 1\]"):
        Degradation(noise_std=1e30)
    with pytest.raises(FlowliftError, match=r"^amplitude must be in \(0, 10\]"):  # the Python API's words
        run_bands_report(BandsRequest(images=["none"], vae="taef2", output="out", amplitude=1e30))
    with pytest.raises(FlowliftError, match="at least one token"):
        check_prompt_embeds({"prompt_embeds": torch.zeros(1, 0, 32)}, origin="e.safetensors")
    with pytest.raises(FlowliftError, match="tile_size"):
        TILE_SIZE.check(100000)
    assert TILE_SIZE.check(1024) == 1024 and Degradation(noise_std=0.05).noise_std == 0.05


@pytest.mark.parametrize("limit", [1e30, float("nan"), 0])
def test_the_apps_upload_limit_is_refused_before_it_serves(tmp_path, limit):
    from flowlift.app.service import AppConfig
    from flowlift.errors import FlowliftError

    with pytest.raises(FlowliftError, match=r"^max_upload_mb must be"):  # Python's words: the field, not the option
        AppConfig(upscaler="unused", vaes=["taef2"], max_upload_mb=limit, work_dir=tmp_path / "w")


def test_a_refine_output_refusal_names_its_option(refine_dir, monkeypatch, capsys):
    monkeypatch.chdir(refine_dir)
    (refine_dir / "outdir").mkdir(exist_ok=True)
    Image.new("RGB", (8, 8)).save(refine_dir / "theirs.png")
    argv = ["img2img", "square.png", "--model", "model", "--prompt-embeds", "prompt.safetensors"]
    for output, said in (
        ("outdir", "outdir is a folder: give a file name ending .png"),
        ("theirs.png", "was not written by flowlift"),
    ):
        assert main([*argv, "-o", output]) == 2
        err = _one_line(capsys, "img2img")
        assert err.startswith(f"flowlift img2img: error: --output {output}") and said in err, err


def test_a_learning_rate_past_one_is_refused_before_training():
    from flowlift.errors import FlowliftError
    from flowlift.training.config import build_config

    with pytest.raises(FlowliftError, match=r"lr must be in \(0, 1\]"):
        build_config(None, {"lr": "1e30", "data": "unused"})


def test_a_negative_value_gets_the_equals_form_and_a_bad_budget_its_option(tmp_path, capsys):
    Image.new("RGB", (16, 16)).save(tmp_path / "p.png")
    with pytest.raises(SystemExit) as exited:
        main(["upscale", str(tmp_path / "p.png"), "--max-memory", "-1G"])
    err = _one_line(capsys, "upscale")
    assert exited.value.code == 2 and "(a value that starts with '-' is given as --max-memory=VALUE)" in err, err
    assert main(["upscale", str(tmp_path / "p.png"), "--max-memory=-1G"]) == 2
    assert _one_line(capsys, "upscale").startswith("flowlift upscale: error: --max-memory must be a size like 6GB")
    with pytest.raises(SystemExit):
        main(["upscale", str(tmp_path / "p.png"), "-o"])
    assert "starts with '-'" not in _one_line(capsys, "upscale")  # no value at all: no such hint


def test_a_size_off_the_16_px_grid_names_the_nearest_on_it():
    from flowlift.errors import FlowliftError
    from flowlift.refine.settings import check_txt2img_size

    with pytest.raises(FlowliftError, match=r"got 4097x3; crop or resize the image to 4096x16$"):
        check_txt2img_size(4097, 3, "image")
    with pytest.raises(FlowliftError, match=r"got 1000x1000; e.g. 992x992$"):
        check_txt2img_size(1000, 1000)


@pytest.mark.parametrize(("option", "value"), [("--noise-std", "2"), ("--part", "3/2")])
def test_dataset_options_are_named_as_given(tmp_path, shared, capsys, option, value):
    """ "noise std must be in [0, 1]" and "part must be I/N" named no option the command has."""
    argv = ["dataset", "images", str(shared / "images" / "kodak" / "kodim03.png"), "--vae", "taef2"]
    assert main([*argv, "-o", str(tmp_path / "data"), option, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{option} must be" in err, err
    assert not (tmp_path / "data").exists()

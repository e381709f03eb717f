"""Issue 43 class 7: an empty ``-o``, ``--vae`` or model path names nothing and is refused in one line at every
door, before anything is read or written: ``Path("")`` is the working folder, so an empty output would write the
report or shards there and an empty model path would read it (or, in the app, fall back to the default VAE).
"""

from __future__ import annotations

import pytest

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError

#: (command line with the empty value last-but-one or last, the option named in the refusal)
CLI_CASES = {
    "eval -o": (["eval", "outs", "--reference", "ins", "-o", ""], "-o/--output"),
    "eval --vae": (["eval", "--run", "vae-roundtrip", "--dataset", "ins", "--vae", "", "-o", "r"], "--vae"),
    "eval --upscaler": (["eval", "--run", "flow", "--dataset", "ins", "--upscaler", "", "-o", "r"], "--upscaler"),
    "eval --reference": (["eval", "outs", "--reference", "", "-o", "r"], "--reference"),
    "bands -o": (["bands", "ins", "--vae", "taef2", "-o", ""], "-o/--output"),
    "bands --vae": (["bands", "ins", "--vae", "", "-o", "b"], "--vae"),
    "dataset -o": (["dataset", "images", "ins", "--vae", "taef2", "-o", ""], "-o/--output"),
    "dataset --vae": (["dataset", "images", "ins", "--vae", " ", "-o", "d"], "--vae"),
    "dataset --teacher": (
        ["dataset", "distill", "--teacher", "", "--num", "1", "--vae", "taef2", "-o", "d"],
        "--teacher",
    ),
    "train -o": (["train", "--data", "d", "-o", ""], "-o/--output"),
    "train --data": (["train", "--data", "", "-o", "t"], "--data"),
    "train --init": (["train", "--data", "d", "--init", "", "-o", "t"], "--init"),
    "train --vae": (["train", "--data", "d", "--vae", "", "-o", "t"], "--vae"),
    "status": (["status", ""], "OUT"),
    "upscale -o": (["upscale", "in.png", "-o", ""], "-o/--output"),
    "upscale --vae": (["upscale", "in.png", "--vae", ""], "--vae"),
    "upscale --upscaler": (["upscale", "in.png", "--upscaler", ""], "--upscaler"),
    "img2img --model": (["img2img", "--model", "", "--image", "in.png", "-o", "x.png"], "--model"),
    "img2img --transformer": (
        ["img2img", "--model", "m", "--transformer", "", "--image", "in.png", "-o", "x.png"],
        "--transformer",
    ),
    "hires -o": (["hires", "--model", "m", "--prompt", "p", "-o", ""], "-o/--output"),
    "colorfix -o": (["colorfix", "up.png", "--reference", "in.png", "-o", ""], "-o/--output"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_the_command_line_refuses_an_empty_name_in_one_line(case, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where an empty output would have landed
    argv, option = CLI_CASES[case]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2, err
    assert err.count("\n") == 1 and f"argument {option}: an empty value names no file, folder or model" in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("spec", ["", "  "])
def test_the_python_api_refuses_an_empty_vae_or_model(spec, tmp_path, monkeypatch):
    from flowlift import load_refiner, load_upscaler, load_vae
    from flowlift.models.vae_loading import check_vae_spec
    from flowlift.training.shards import prepare_dataset_dir

    monkeypatch.chdir(tmp_path)
    cases = {
        "load_vae": (lambda: load_vae(spec), "VAE: an empty name or path names no VAE"),
        "check_vae_spec": (lambda: check_vae_spec(spec), "VAE: an empty name or path names no VAE"),
        "load_upscaler": (lambda: load_upscaler(spec), "source: an empty name names nothing"),
        "load_refiner": (lambda: load_refiner(spec), "an empty name or path names no model"),
        "prepare_dataset_dir": (lambda: prepare_dataset_dir(spec, {"kind": "images"}), "an empty name"),
    }
    for name, (call, message) in cases.items():
        with pytest.raises(FlowliftError) as caught:
            call()
        assert message in str(caught.value) and "\n" not in str(caught.value), name
    assert list(tmp_path.iterdir()) == []


def test_the_apps_api_refuses_an_empty_vae_rather_than_using_the_default(tmp_path):
    from flowlift.app.service import AppConfig, AppService

    service = AppService(AppConfig(upscaler="unused", vaes=["taef2"], work_dir=tmp_path / "w"))
    assert service.vae_spec(None) == "taef2"  # not given: the first configured one
    for empty in ("", "   "):
        with pytest.raises(FlowliftError, match=r"VAE: an empty name names no VAE; choose one of taef2"):
            service.vae_spec(empty)
        with pytest.raises(FlowliftError, match=r"an empty name names no VAE"):
            service.upscale(tmp_path / "none.png", 2, 0, 1.0, 1.0, empty)

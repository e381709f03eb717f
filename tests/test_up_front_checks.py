"""What was checked late or not at all (issue 36, class 5): the hires fix's whole pass plan, ``--device cpu:N``,
``eval --tile`` without a spandrel method, ``flowlift app``'s device and host. Each is one line and exit 2 before
any model loads or any server starts."""

from __future__ import annotations

import pytest
from PIL import Image

from builders import command_line
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError


def _one_line(capsys, argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [err] and "Traceback" not in err, (code, err)
    return err


# ------------------------------------------------------------------------------------------ hires: the pass plan


@pytest.mark.parametrize(
    ("width", "height", "scale"),
    [
        (16400, 16, 2),
        (16384, 16, 2),
        (16, 16384, 2),
        (8208, 16, 2),
        (4112, 64, 4),
        (2064, 16, 8),
        (16, 2064, 8),
        (32768, 32768, 2),
    ],
)
def test_hires_txt2img_past_the_cap_is_refused_before_loading(capsys, tmp_path, width, height, scale):
    never = {"prompt": "p", "model": tmp_path / "never-loaded", "o": tmp_path / "x.png"}
    err = _one_line(capsys, command_line("hires", width=width, height=height, scale=scale, **never))
    assert "the 16384 px cap a side" in err and "MAX_OUTPUT_SIDE" not in err and "never-loaded" not in err, err
    if (width, height, scale) == (2064, 16, 8):  # a smaller scale fits: the scale is blamed, as the option
        assert err.endswith(
            "--scale 8 on a 2064x16 base would be 16512x128, over the 16384 px cap a side (a pass would be dropped); "
            "use --scale 4"
        ), err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("size", "scale", "hint"),
    [((2064, 16), 8, "; use --scale 4"), ((16, 8208), 2, "base of at most 8192"), ((4112, 16), 4, "; use --scale 2")],
)
def test_hires_image_past_the_cap_is_refused_before_loading(capsys, tmp_path, size, scale, hint):
    image = tmp_path / "strip.png"
    Image.new("RGB", size, (90, 40, 20)).save(image)
    never = {"prompt": "p", "model": tmp_path / "never-loaded", "o": tmp_path / "x.png"}
    err = _one_line(capsys, command_line("hires", image=image, scale=scale, **never))
    assert f"{size[0]}x{size[1]} image" in err and hint in err and "MAX_OUTPUT_SIDE" not in err, err
    if scale > 2:  # a smaller scale fits: the scale is blamed, as the option
        assert err.endswith(hint) and f"--scale {scale} on" in err, err
    else:
        assert err.endswith(f"{hint} px a side") and "--image: hires at" in err, err


@pytest.mark.parametrize(("width", "height", "scale"), [(8192, 16, 2), (16, 4096, 4), (2048, 2048, 8), (16, 16, 8)])
def test_hires_sizes_at_the_cap_pass_the_plan(width, height, scale):
    from flowlift.refine.settings import check_hires_size

    check_hires_size(width, height, scale)


@pytest.mark.parametrize(
    ("width", "height", "scale"), [(0, 16, 2), (8, 16, 2), (24, 16, 2), (16, 16, 9), (16, 16, 0.5)]
)
def test_hires_plan_refuses_bad_sides_and_scales(width, height, scale):
    from flowlift.refine.settings import check_hires_size

    with pytest.raises(FlowliftError):
        check_hires_size(width, height, scale)


def test_the_python_api_checks_the_plan_before_the_base_runs():
    from flowlift.refine.refiner import Flux2Refiner

    class NoModels(Flux2Refiner):
        def __init__(self):  # nothing loaded: the plan must be refused before anything would run
            pass

    from flowlift.refine.request import HiresSettings
    from tiny_flux2 import AsUpscaler

    def never(latents):
        raise AssertionError("the upscaler ran")

    # a direct caller's words: the scale is its HiresSettings' (settings=), the cap said as its value
    with pytest.raises(FlowliftError, match=r"^settings.scale 8 on a 2064x16 base .*16384 px cap.*settings.scale 4$"):
        NoModels().hires(AsUpscaler(never), HiresSettings(base_size=(2064, 16), scale=8))


# ------------------------------------------------------------------------------------------ --device cpu:N


@pytest.mark.parametrize("device", ["cpu:1", "cpu:7", "cpu:-1", " cpu:2 ", "CPU:3"])
def test_cpu_with_an_index_other_than_0_is_refused(device):
    from flowlift.devices import resolve_device

    with pytest.raises(FlowliftError) as caught:
        resolve_device(device)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", " cpu:0", "CPU"])
def test_the_cpu_is_one_device_recorded_as_cpu(device):
    import torch

    from flowlift.devices import resolve_device

    try:
        resolved = resolve_device(device)
    except FlowliftError:
        assert device.strip() == "CPU"  # torch's own spelling is lower case
        return
    assert resolved == torch.device("cpu") and str(resolved) == "cpu" and resolved.index is None


@pytest.mark.parametrize(
    "command",
    [
        ["upscale", "a.png"],
        ["bands", "a.png", "--vae", "v", "-o", "o"],
        ["colorfix", "a.png", "--reference", "b.png"],
        ["app"],
        ["train", "--data", "d", "--output", "o"],
    ],
)
@pytest.mark.parametrize("device", ["cpu:1", "cpu:5"])
def test_every_door_refuses_cpu_n(capsys, tmp_path, monkeypatch, command, device):
    monkeypatch.chdir(tmp_path)
    err = _one_line(capsys, [*command, "--device", device])
    assert device in err, err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------------ eval --tile


BAD_TILING = [
    ("--tile", "-1"),
    ("--tile", "0"),
    ("--tile", "x"),
    ("--tile", "1.5"),
    ("--tile", "nan"),
    ("--tile-overlap", "-1"),
    ("--tile-overlap", "y"),
]


@pytest.mark.parametrize(("option", "value"), BAD_TILING)
def test_eval_tile_is_checked_without_any_spandrel_method(capsys, tmp_path, option, value):
    with pytest.raises(SystemExit) as caught:  # the pairs mode runs no spandrel model: still refused, at the parse
        main(["eval", str(tmp_path), "--reference", str(tmp_path), "-o", str(tmp_path / "r"), option, value])
    err = capsys.readouterr().err.strip()
    assert caught.value.code == 2 and err.splitlines() == [err] and f"argument {option}" in err, err
    assert not (tmp_path / "r").exists()


def test_eval_tile_must_exceed_twice_its_overlap_in_every_mode(capsys, tmp_path):
    err = _one_line(
        capsys,
        ["eval", tmp_path, "--reference", tmp_path, "-o", tmp_path / "r", "--tile", "64", "--tile-overlap", "32"],
    )
    assert "--tile 64 must exceed twice the --tile-overlap (32)" in err and not (tmp_path / "r").exists()


def test_the_tile_knobs_match_the_tiling_code():
    from flowlift.measure.methods import SPANDREL_TILE_OVERLAP, spandrel_tiling
    from flowlift.measure.tiled_inference import DEFAULT_OVERLAP

    assert SPANDREL_TILE_OVERLAP.default == DEFAULT_OVERLAP
    assert spandrel_tiling("none", None) == (None, DEFAULT_OVERLAP)
    assert spandrel_tiling("AUTO", 0) == ("auto", 0) and spandrel_tiling(65, 32) == (65, 32)


# ------------------------------------------------------------------------------------------ flowlift app


def _app_exits(tmp_path, *options: str) -> tuple[int, str]:
    """``flowlift app OPTIONS`` as its own process: it must exit by itself, well within the timeout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("gradio")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo / "src"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "flowlift", "app", *options],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=90,
    )
    return done.returncode, done.stderr.strip()


@pytest.mark.parametrize("host", ["bogus.invalid", "no-such-host.example.invalid", "8.8.8.8", "999.1.1.1"])
def test_app_on_a_host_it_cannot_serve_on_exits_at_once_with_one_line(tmp_path, host):
    code, err = _app_exits(tmp_path, "--host", host, "--device", "cpu")
    assert code == 2 and err.splitlines() == [err] and err.startswith(f"flowlift app: error: cannot serve on {host}")


@pytest.mark.parametrize("device", ["cuda", "cuda:3", "mps", "xpu", "bogus"])
def test_app_checks_its_device_before_serving(tmp_path, device):
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    code, err = _app_exits(tmp_path, "--device", device)
    assert code == 2 and err.splitlines() == [err] and err.startswith(f"flowlift app: error: --device {device}"), err


def test_check_bind_address_takes_what_this_machine_has():
    from flowlift.app.page import check_bind_address

    check_bind_address("127.0.0.1")
    check_bind_address("localhost")
    check_bind_address("0.0.0.0")
    with pytest.raises(FlowliftError, match="does not resolve"):
        check_bind_address("bogus.invalid")


# ------------------------------------------------------------------------------------------ -o: not a folder


@pytest.mark.parametrize("command", ["colorfix", "upscale"])
def test_an_output_that_is_a_plain_file_is_refused_for_the_whole_run(capsys, tmp_path, monkeypatch, command):
    """``-o notes.txt`` (an existing file without an image suffix) is a bad setting for the whole run: one line,
    exit 2, before any image, naming the fix (not "N of N image(s) failed")."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "c.png", "a_x2.png", "c_x2.png"):
        Image.new("RGB", (32, 32)).save(tmp_path / name)
    (tmp_path / "notes.txt").write_text("notes")
    refs = (
        ["--reference", "a.png", "--reference", "c.png"] if command == "colorfix" else ["--upscaler", tmp_path / "no"]
    )
    err = _one_line(capsys, [command, "a_x2.png", "c_x2.png", *refs, "-o", "notes.txt"])
    assert err.endswith(
        "--output notes.txt exists and is not a folder: give a folder, or an image file name "
        "(.png/.jpg/.webp...) for one input"
    ), err
    err = _one_line(capsys, [command, "a_x2.png", *refs[:2], "-o", "notes.txt/sub"])
    assert "notes.txt is not a folder; give a folder" in err, err
    assert (tmp_path / "notes.txt").read_text() == "notes" and not list(tmp_path.glob("*_x2_*"))


@pytest.fixture
def read_only(tmp_path, monkeypatch):
    """A folder no file can be created in, as a read-only mount is (chmod does not stop root): the write probe of
    ``flowlift.files.output_paths.folder_problem`` fails there with EROFS, as it does on such a mount."""
    import errno
    import os
    import tempfile

    folder = tmp_path / "ro"
    folder.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.samefile(dir, folder):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return folder


@pytest.mark.parametrize("command", ["colorfix", "upscale", "bands"])
@pytest.mark.parametrize("below", ["", "out"])
def test_an_output_folder_that_takes_no_file_is_refused_up_front(
    capsys, tmp_path, monkeypatch, read_only, command, below
):
    """``-o`` on a read-only file system (or its folder-to-be under one) is one line and exit 2 before any image is
    read or model loads: upscale and colorfix printed one failure per image and a summary (exit 1), and bands
    measured every image first (the VAE given here does not exist, so a later check would name it instead)."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "c.png", "a_x2.png", "c_x2.png"):
        Image.new("RGB", (160, 160)).save(tmp_path / name)
    out = read_only / below if below else read_only
    options = {
        "colorfix": ["a_x2.png", "c_x2.png", "--reference", "a.png", "--reference", "c.png"],
        "upscale": ["a.png", "c.png", "--upscaler", tmp_path / "no-upscaler", "--vae", tmp_path / "no-vae"],
        "bands": ["a.png", "c.png", "--vae", tmp_path / "no-vae", "--no-progress"],
    }[command]
    err = _one_line(capsys, [command, *options, "-o", out])
    assert err == f"flowlift {command}: error: cannot write outputs into {out}: Read-only file system", err
    assert list(read_only.iterdir()) == []


@pytest.mark.parametrize("command", ["colorfix", "upscale", "img2img", "hires"])
@pytest.mark.parametrize("below", ["", "out"])
def test_an_output_file_whose_folder_takes_no_file_is_refused_up_front(
    capsys, tmp_path, monkeypatch, read_only, command, below
):
    """``-o FILE`` in a folder no file can be created in is the same one line and exit 2 as ``-o FOLDER`` there:
    upscale and colorfix (``output_target``) reported it as their one input failing, and a summary (exit 1)."""
    monkeypatch.chdir(tmp_path)
    for name in ("a.png", "a_x2.png"):
        Image.new("RGB", (160, 160)).save(tmp_path / name)
    folder = read_only / below if below else read_only
    options = {
        "colorfix": ["a_x2.png", "--reference", "a.png"],
        "upscale": ["a.png", "--upscaler", tmp_path / "no-upscaler", "--vae", tmp_path / "no-vae"],
        "img2img": ["a.png", "--model", tmp_path / "no-model", "--vae", tmp_path / "no-vae", "--prompt", "a cat"],
        "hires": ["--image", "a.png", "--model", tmp_path / "no-model", "--vae", tmp_path / "no-vae", "--prompt", "a"],
    }[command]
    err = _one_line(capsys, [command, *options, "-o", folder / "r.png"])
    assert err == f"flowlift {command}: error: cannot write outputs into {folder}: Read-only file system", err
    assert list(read_only.iterdir()) == []


def test_hires_size_refusals_suggest_sizes_that_pass():
    """The fix a size refusal suggests is one the same check takes: a side rounded to the grid stays within the
    16384 px cap, and the largest base is the one at the scale asked for (not at the smallest preset, 2)."""
    from flowlift.refine.settings import check_hires_size, check_txt2img_size

    with pytest.raises(FlowliftError) as refused:
        check_txt2img_size(16410, 1024)
    assert str(refused.value).endswith("e.g. 16384x1024"), refused.value
    check_txt2img_size(16384, 1024)
    for scale, most in ((8, 2048), (2.5, 5456), (2, 8192)):
        with pytest.raises(FlowliftError) as refused:
            check_hires_size(8208, 16, scale)
        assert str(refused.value).endswith(f"use a base of at most {most} px a side"), refused.value
        check_hires_size(most, 16, scale)

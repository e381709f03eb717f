"""CLI details (issue 21, items 15, 17-19; issue 22, items 7, 10, 12): summary times, one progress
convention, eval's defaults, install hints for the install at hand, the repository root importable from
its parent, colorfix's device check, public API inputs checked at the door, every count option checked."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowlift.commands.cli import build_parser, main
from flowlift.errors import FlowliftError

REPO_ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser: argparse.ArgumentParser, name: str = "flowlift"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                    yield from _subparsers(sub, f"{name} {sub_name}")
                else:
                    yield f"{name} {sub_name}", sub


COMMANDS = dict(_subparsers(build_parser()))


# ------------------------------------------------------------------------------ 15. summary times


def test_summary_line_gives_the_total_and_the_per_image_time():
    from flowlift.jobs.batch import BatchResult, format_seconds, summary_line

    assert [format_seconds(s) for s in (0.4201, 12.34, 245.0, 7380.0)] == [
        "0.42 s",
        "12.3 s",
        "4 min 05 s",
        "2 h 03 min",
    ]
    done = BatchResult(total=4, done=3, skipped=1, seconds=41.04, image_seconds=36.3)
    assert summary_line("upscale", done) == (
        "flowlift upscale: 3 written, 1 skipped, 0 failed (4 inputs) in 41.0 s, 12.1 s per image"
    )
    nothing = BatchResult(total=1, skipped=1, seconds=0.5)
    assert summary_line("colorfix", nothing) == "flowlift colorfix: 0 written, 1 skipped, 0 failed (1 input) in 0.50 s"


def test_run_jobs_times_the_run_from_its_start_and_each_written_image(tmp_path, capsys):
    import time

    from flowlift.jobs.batch import Job, run_jobs

    jobs = [Job(tmp_path / f"{n}.png", tmp_path / f"{n}_x2.png") for n in "ab"]

    def process(source: Path, output: Path) -> None:
        time.sleep(0.2)
        output.write_bytes(b"x")

    result = run_jobs(jobs, process, command="test", progress=False, started=time.perf_counter() - 5.0)
    assert result.done == 2 and result.seconds >= 5.4 and 0.4 <= result.image_seconds < result.seconds - 5.0
    assert capsys.readouterr().out.splitlines()[-1].endswith("s per image")


# ------------------------------------------------------------------ 17. one progress convention


#: Commands that draw no progress: ``-v`` only (issue 48: ``status`` and ``launch`` offered ``--progress``).
NO_PROGRESS = {"flowlift status", "flowlift launch"}


def test_every_command_has_progress_options_and_no_second_spelling():
    assert NO_PROGRESS <= set(COMMANDS)
    for name, parser in COMMANDS.items():
        options = {s for a in parser._actions for s in a.option_strings}
        if name in NO_PROGRESS:
            assert "-v" in options and not {"--progress", "--no-progress"} & options, name
            continue
        assert {"--progress", "--no-progress", "-v"} <= options, name
        progress = [a for a in parser._actions if a.dest == "progress"]
        assert len(progress) == 1 and progress[0].option_strings == ["--progress", "--no-progress"], name


def test_eval_vae_and_upscaler_default_like_upscale():
    from flowlift.commands._options import DEFAULT_VAE

    eval_args = COMMANDS["flowlift eval"].parse_args(["-o", "x"])
    upscale_args = COMMANDS["flowlift upscale"].parse_args([])
    assert eval_args.vae == upscale_args.vae == DEFAULT_VAE
    assert eval_args.upscaler is None and upscale_args.upscaler is None  # both: TensorForger/FlowUpscaler
    assert "TensorForger/FlowUpscaler" in COMMANDS["flowlift eval"].format_help()


# ------------------------------------------------------------------------ 18. install hints


def test_install_command_fits_a_checkout_and_a_package(tmp_path, monkeypatch):
    import flowlift.console as console

    monkeypatch.chdir(REPO_ROOT)
    assert console.install_command("app") == 'pip install -e ".[app]"'
    monkeypatch.chdir(tmp_path)
    assert console.install_command("app") == f'pip install -e "{REPO_ROOT}[app]"'
    site = tmp_path / "lib" / "python3.11" / "site-packages" / "flowlift"
    site.mkdir(parents=True)
    monkeypatch.setattr(console, "__file__", str(site / "console.py"))
    assert console.install_command("app") == 'pip install "flowlift[app]"'


def test_app_without_gradio_names_the_install_command(capsys, monkeypatch):
    import importlib.util

    from flowlift.console import install_command

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gradio" else real_find_spec(name, *a)
    )
    assert main(["app"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"flowlift app: error: the app needs Gradio 6: {install_command('app')}"


# ----------------------------------------------------------- 19. import flowlift from the parent folder


def test_import_flowlift_from_the_folder_above_a_checkout_named_flowlift(tmp_path):
    """``sys.path[0]`` is the current folder, so a checkout named flowlift there is found first; its
    ``__init__.py`` (the ComfyUI entry point) must hand over to the package instead of shadowing it."""
    (tmp_path / "flowlift").symlink_to(REPO_ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = (
        "import sys, flowlift; from flowlift import FlowliftError, __version__;"
        "heavy = sorted(m for m in ('torch', 'diffusers') if m in sys.modules);"
        "import flowlift.upscale.sizes as sizes;"
        "print(flowlift.__path__[0]); print(sizes.__file__); print(FlowliftError.__module__, __version__);"
        "print(heavy)"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    package, sizes_file, names, heavy = run.stdout.splitlines()
    assert Path(package).resolve() == REPO_ROOT / "src" / "flowlift"
    assert Path(sizes_file).resolve() == REPO_ROOT / "src" / "flowlift" / "upscale" / "sizes.py"
    assert names.startswith("flowlift.errors ") and heavy == "[]"  # still torch-free
    run = subprocess.run(
        [sys.executable, "-m", "flowlift", "--version"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.startswith("flowlift "), run.stderr


def test_the_root_entry_point_loaded_by_path_exports_no_nodes_outside_comfyui():
    import importlib.util

    spec = importlib.util.spec_from_file_location("custom_nodes.flowlift_pack", REPO_ROOT / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.NODE_CLASS_MAPPINGS == {}
    assert module.__all__ == ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]


# ------------------------------------------------------------------------ 22.7 colorfix --device


@pytest.mark.parametrize("device", ["bogus", "cuda", "cuda:7", "meta"])
def test_colorfix_checks_the_device_before_any_work(tmp_path, capsys, device):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    Image.new("RGB", (16, 16), (90, 60, 30)).save(tmp_path / "photo.png")
    Image.new("RGB", (32, 32), (95, 60, 30)).save(tmp_path / "photo_x2.png")
    out = tmp_path / "out"
    rc = main(
        [
            "colorfix",
            str(tmp_path / "photo_x2.png"),
            "--reference",
            str(tmp_path / "photo.png"),
            "-o",
            str(out),
            "--device",
            device,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and "AssertionError" not in err
    assert err.strip().splitlines() == [err.strip()] and err.startswith(f"flowlift colorfix: error: --device {device}:")
    assert not out.exists()


# --------------------------------------------------------------------- 22.10 public API inputs


class _ZeroVelocity:
    def __call__(self, sample, timestep, latents_small):
        return torch.zeros_like(sample)


class _AverageVAE:
    spatial_factor = 8

    def encode(self, images, tiled=None):
        return torch.nn.functional.avg_pool2d(images, 8).repeat(1, 11, 1, 1)[:, :32]

    def decode(self, latents, tiled=None):
        return torch.nn.functional.interpolate(latents[:, :3], scale_factor=8, mode="nearest").clamp(0, 1)


def _pipeline():
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    return FlowUpscalerPipeline(_ZeroVelocity(), _AverageVAE(), device="cpu", dtype=torch.float32)


def _refine(steps=2, seed=0, **kwargs):
    from flowlift.refine.loop import refine_latents
    from flowlift.refine.settings import SamplingSettings

    sampling = SamplingSettings(steps=steps, seed=seed)
    return refine_latents(lambda z, sigma: torch.zeros_like(z), sampling=sampling, **kwargs)


def _color_fix(upscaled, reference, *args, **kwargs):
    from flowlift.upscale.colorfix_image import color_fix_image

    return color_fix_image(upscaled, reference, *args, **kwargs)


_LATENTS = torch.zeros(1, 32, 4, 4)
_BIG, _SMALL = Image.new("RGB", (32, 32)), Image.new("RGB", (16, 16))
API_CASES = {
    "3-D latents": (lambda: _pipeline().upscale_latents(torch.zeros(32, 4, 4), 1), r"shape \(B, 32, h, w\)"),
    "16 channels": (lambda: _pipeline().upscale_latents(torch.zeros(1, 16, 4, 4), 1), r"shape \(B, 32, h, w\)"),
    "int latents": (
        lambda: _pipeline().upscale_latents(torch.zeros(1, 32, 4, 4, dtype=torch.long), 1),
        "floating point",
    ),
    "bool latents": (
        lambda: _pipeline().upscale_latents(torch.zeros(1, 32, 4, 4, dtype=torch.bool), 1),
        "floating point",
    ),
    "NaN latents": (
        lambda: _pipeline().upscale_latents(torch.full((1, 32, 4, 4), float("nan")), 1),
        "input latents contain non-finite",
    ),
    "empty batch": (lambda: _pipeline().upscale_latents(torch.zeros(0, 32, 4, 4), 1), "empty"),
    "numpy latents": (lambda: _pipeline().upscale_latents(np.zeros((1, 32, 4, 4), np.float32), 1), "torch.Tensor"),
    "strength str": (lambda: _pipeline().upscale_latents(_LATENTS, 1, transplant_strength="1"), "transplant_strength"),
    "image strength": (lambda: _pipeline().upscale_image(_SMALL, color_fix_strength=None), "color_fix_strength"),
    "fix strength": (lambda: _color_fix(_BIG, _SMALL, "1"), "strength must be in"),
    "fix device": (lambda: _color_fix(_BIG, _SMALL, device="bogus"), "not a torch device"),
    "fix array": (lambda: _color_fix(np.zeros((32, 32, 3), np.float32), _SMALL), "uint8 HWC RGB"),
    "refine 3-D": (lambda: _refine(init_latents=torch.zeros(32, 4, 4), denoising_start=0.5), r"shape \(B, 32, h, w\)"),
    "refine odd": (lambda: _refine(init_latents=torch.zeros(1, 32, 3, 4), denoising_start=0.5), "even height"),
    "refine int": (
        lambda: _refine(init_latents=torch.zeros(1, 32, 4, 4, dtype=torch.int32), denoising_start=0.5),
        "floating point",
    ),
    "refine NaN": (
        lambda: _refine(init_latents=torch.full((1, 32, 4, 4), float("inf")), denoising_start=0.5),
        "non-finite",
    ),
    "refine shape": (lambda: _refine(shape=(1, 32, 4)), "four positive integers"),
    "refine steps": (lambda: _refine(shape=(1, 32, 4, 4), steps=1.5), "steps"),
    "refine seed": (lambda: _refine(shape=(1, 32, 4, 4), seed=-1), "seed"),
    "refine mask": (
        lambda: _refine(init_latents=_LATENTS, denoising_start=0.5, mask=torch.zeros(1, 2, 4, 4)),
        "latent mask",
    ),
    "refine bn": (lambda: _refine(init_latents=_LATENTS, bn_mean=torch.zeros(128)), "bn_mean and bn_std"),
    "refine start": (lambda: _refine(init_latents=_LATENTS, denoising_start=float("nan")), "denoising_start"),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_public_entry_points_refuse_bad_inputs_with_one_line(case):
    call, message = API_CASES[case]
    with pytest.raises(FlowliftError, match=message) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_good_latents_still_pass_the_door():
    out = _pipeline().upscale_latents(torch.zeros(2, 32, 4, 4, dtype=torch.float16), np.int64(1), seed=[1, 2])
    assert out.shape == (2, 32, 8, 8) and out.dtype == torch.float32
    assert _refine(init_latents=_LATENTS, denoising_start=0.5).latents.shape == (1, 32, 4, 4)


# ---------------------------------------------------------------------- 22.12 count options


def _is_count(action: argparse.Action) -> bool:
    """An option whose value converts to an integer (a count, size, seed or quality)."""
    if not action.option_strings or action.type is None:
        return False
    try:
        return isinstance(action.type("3"), int)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False


def test_every_count_option_of_every_command_refuses_a_negative_value():
    counts = [(name, action) for name, parser in COMMANDS.items() for action in parser._actions if _is_count(action)]
    names = {f"{name} {action.option_strings[-1]}" for name, action in counts}
    assert {
        "flowlift eval --figure-images",
        "flowlift eval --limit",
        "flowlift upscale --batch-size",
        "flowlift train --steps",
        "flowlift dataset images --crops-per-image",
    } <= names
    for name, action in counts:
        option = f"{name} {action.option_strings[-1]}"
        if action.choices is not None:  # e.g. --scale {2,4,8}: argparse refuses anything else
            assert -1 not in action.choices, option
            continue
        assert action.type is not int, f"{option}: a bare int accepts -1"
        with pytest.raises(argparse.ArgumentTypeError):
            action.type("-1")


def test_eval_figure_images_minus_one_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["eval", str(tmp_path), "--reference", str(tmp_path), "-o", str(tmp_path / "r"), "--figure-images", "-1"])
    assert caught.value.code == 2
    assert "argument --figure-images: must be >= 1, got -1" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "soon"])
def test_barrier_timeout_must_be_a_finite_positive_number_of_seconds(tmp_path, capsys, value):
    with pytest.raises(SystemExit) as caught:  # inf would wait forever for a dead rank
        main(["upscale", str(tmp_path / "x.png"), "--barrier-timeout", value])
    assert caught.value.code == 2 and "argument --barrier-timeout" in capsys.readouterr().err


# ------------------------------------------------------------- bad arguments: one line, exit 2 (issue 29)

#: Each command's required arguments (nothing is run: a bad option stops the parse first), and one option value
#: its parser refuses.
GOOD_AND_BAD = {
    "upscale": (["x.png"], ["--seed", str(2**64)]),
    "img2img": (["x.png", "--model", "m", "--prompt", "p"], ["--steps", "x"]),
    "hires": (["--model", "m"], ["--steps", "0"]),
    "eval": (["a", "--reference", "b", "-o", "r"], ["--figure-images", "-1"]),
    "status": (["out"], ["out2"]),  # status has no option with a value: one folder too many
    "bands": (["a.png", "--vae", "v", "-o", "o"], ["--amplitude", "soon"]),
    "colorfix": (["a.png", "--reference", "b"], ["--quality", "101"]),
    "train": ([], ["--steps", "0"]),
    "app": ([], ["--port", "x"]),
    "dataset images": (["a", "-o", "o", "--vae", "v"], ["--batch-size", "0"]),
    "dataset distill": (["-o", "o", "--vae", "v", "--teacher", "t", "--num", "1"], ["--num", "0"]),
    "launch": (["--", "upscale", "x.png"], ["--scale", "9"]),  # the launched command's own parser
}


def test_the_bad_argument_table_covers_every_command():
    assert sorted(f"flowlift {name}" for name in GOOD_AND_BAD) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(GOOD_AND_BAD))
@pytest.mark.parametrize("mistake", ["a bad value", "an unknown option"])
def test_a_bad_argument_is_one_error_line_and_exit_2(name, mistake, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # nothing may be written, and nothing is: the parse stops first
    needed, bad = GOOD_AND_BAD[name]
    if mistake == "a bad value":
        argv = [*name.split(), *needed, *bad]
    else:  # before the arguments: after launch's `--` it would be the launched command's
        argv = [*name.split(), "--no-such-option", *needed]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    out, err = capsys.readouterr()
    prog = "flowlift upscale" if name == "launch" and mistake == "a bad value" else f"flowlift {name}"
    assert caught.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.endswith(f" ({prog} -h lists the options)\n"), err
    assert err.startswith(f"{prog}: error: "), err
    if mistake == "an unknown option":
        assert "unrecognized arguments: --no-such-option" in err
    assert "usage:" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_command_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["upscal", "x.png"])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("flowlift: error: argument COMMAND: invalid choice: 'upscal'"), err


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["upscal", "a.png"], "; did you mean upscale?"),
        (["upscale", "a.png", "--sclae", "4"], "; did you mean --scale?"),
    ],
)
def test_a_misspelled_command_or_option_gets_a_did_you_mean(capsys, argv, hint):
    """Python 3.11's argparse names no near spelling; the hint stays on the one error line."""
    from flowlift.commands.cli import main as cli_main

    with pytest.raises(SystemExit, match="2"):
        cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and hint in err, err

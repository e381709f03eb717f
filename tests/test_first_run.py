"""The first ten minutes (issue 15, items 1-7, 15, 16): download advice, path-or-repo, inputs checked
before any model loads, one-line model errors, quiet libraries, float16 on the CPU, ``python -m
flowlift``, help texts. All fast: no model is loaded except tiny random ones."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image

from builders import command_line, prompt_embeds_file
from flowlift.commands.cli import build_parser, main
from flowlift.errors import FlowliftError

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def photo(tmp_path):
    path = tmp_path / "photo.png"
    Image.new("RGB", (32, 32), (120, 80, 40)).save(path)
    return path


# ------------------------------------------------------------------------------ 1. download advice


def test_download_command_is_the_one_the_installed_hub_ships(monkeypatch):
    import huggingface_hub

    from flowlift.models import hub

    monkeypatch.setattr(huggingface_hub, "__version__", "1.2.0")
    assert hub.download_command("o/r", ["f.safetensors"]) == "hf download o/r f.safetensors"
    monkeypatch.setattr(huggingface_hub, "__version__", "0.30.2")
    assert hub.download_command("o/r", ["f.safetensors"]) == "huggingface-cli download o/r f.safetensors"
    monkeypatch.setattr(huggingface_hub, "__version__", "0.36.0.rc1")
    assert hub.download_command("o/r", include="vae/*") == "hf download o/r --include 'vae/*'"


def test_missing_upscaler_says_once_how_to_download_and_where_it_goes():
    from flowlift.models.hub import cache_folder
    from flowlift.upscale.loading import resolve_upscaler_file

    with pytest.raises(FlowliftError) as caught:
        resolve_upscaler_file("TensorForger/NoSuchRepoCached")
    message = str(caught.value)
    assert "hf download TensorForger/NoSuchRepoCached flow_upscaler.safetensors" in message
    assert cache_folder() in message and "{" not in message and "huggingface-cli" not in message
    assert message.count("hf download") == 1 and "\n" not in message


def test_no_huggingface_cli_advice_left_in_code_or_docs():
    root = SRC.parent
    files = [p for p in SRC.rglob("*.py") if p.name != "hub.py"]  # hub.py names it for huggingface_hub < 0.34
    texts = [p.read_text() for p in [*files, root / "README.md", *root.joinpath("docs").glob("*.md")]]
    assert not any("huggingface-cli download" in text for text in texts)


# ---------------------------------------------------------------------- 4. path-looking arguments


@pytest.mark.parametrize(
    "source, is_path",
    [
        ("models/fu.safetensors", True),
        ("./fu", True),
        ("~/fu", True),
        ("/abs/fu", True),
        ("a/b/c", True),
        ("fu.safetensors", True),
        ("TensorForger/FlowUpscaler", False),
        ("black-forest-labs/FLUX.2-klein-4B", False),
    ],
)
def test_looks_like_path(source, is_path):
    from flowlift.models.hub import looks_like_path
    from flowlift.models.weights import looks_like_repo_id

    assert looks_like_path(source) is is_path
    assert looks_like_repo_id(source) is (not is_path)


def test_mistyped_local_paths_say_no_such_file(tmp_path):
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.loading import load_transformer
    from flowlift.upscale.loading import resolve_upscaler_file

    for call in (
        lambda: resolve_upscaler_file("models/fu.safetensors"),
        lambda: load_vae("models/vae.safetensors"),
        lambda: load_transformer("models/flux2.safetensors", dtype=torch.float32),
    ):
        with pytest.raises(FlowliftError, match="no such file") as caught:
            call()
        assert "Hugging Face cache" not in str(caught.value)


# ----------------------------------------------------------- 3. inputs checked before models load


def test_missing_vae_fails_before_the_unet_loads(tmp_path, monkeypatch):
    import flowlift.models.upscaler_weights as weights_module
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    def must_not_load(*args, **kwargs):
        raise AssertionError("the UNet was loaded before the VAE was checked")

    monkeypatch.setattr(weights_module, "load_upscaler", must_not_load)
    weights = tmp_path / "flow_upscaler.safetensors"
    weights.write_bytes(b"not read")
    with pytest.raises(FlowliftError, match="VAE: .*no such file"):
        FlowUpscalerPipeline(weights, tmp_path / "missing" / "vae.safetensors", device="cpu")
    with pytest.raises(FlowliftError, match="VAE 'flux2'.*hf download"):
        FlowUpscalerPipeline(weights, "flux2", device="cpu")  # offline, not cached


@pytest.fixture
def no_model_loads(monkeypatch):
    import flowlift.refine.loading as loading

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the inputs were checked")

    monkeypatch.setattr(loading, "load_refiner", must_not_load)
    monkeypatch.setattr(loading, "load_transformer", must_not_load)


def test_img2img_checks_every_input_before_loading(tmp_path, photo, capsys, monkeypatch, no_model_loads):
    import importlib.util

    embeds = prompt_embeds_file(tmp_path)
    model = tmp_path / "model"
    (model / "transformer").mkdir(parents=True)
    base = ["img2img", str(photo), "--model", str(model), "-o", str(tmp_path / "o.png")]
    cases = [
        (["--outpaint", "0,0,0,0", "--prompt-embeds", str(embeds)], "every border is 0"),
        (["--prompt-embeds", str(embeds), "--vae", str(tmp_path / "nope" / "vae.safetensors")], "no such file"),
        (["--prompt-embeds", str(embeds), "--model", "models/flux2.safetensors"], "no such file"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real_find_spec(name, *a)
    )
    assert main(base + ["--prompt", "a cat"]) == 2
    err = capsys.readouterr().err
    from flowlift.console import install_command

    assert install_command("text") in err and "--prompt-embeds" in err  # the command for this install (item 18)


def test_hires_checks_the_upscaler_before_loading(tmp_path, capsys, no_model_loads):
    embeds = prompt_embeds_file(tmp_path)
    argv = command_line(
        "hires", model=tmp_path, prompt_embeds=embeds, upscaler="models/fu.safetensors", o=tmp_path / "o.png"
    )
    assert main(argv) == 2
    assert "no such file" in capsys.readouterr().err


# ------------------------------------------------------------------------- 5. --model errors


def test_offline_hub_model_error_says_cache_and_command():
    from flowlift.refine.loading import load_transformer

    with pytest.raises(FlowliftError) as caught:
        load_transformer("someone/flux2-not-cached", dtype=torch.float32)
    message = str(caught.value)
    assert "not in the Hugging Face cache" in message and "hf download someone/flux2-not-cached" in message
    assert "config.json" not in message


def test_wrong_single_file_is_named_as_not_a_flux2_transformer(tmp_path):
    from safetensors.torch import save_file

    from flowlift.refine.loading import load_transformer

    path = tmp_path / "unet.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(2, 2)}, str(path))
    with pytest.raises(FlowliftError, match="not a FLUX.2 transformer checkpoint") as caught:
        load_transformer(str(path), dtype=torch.float32)
    assert "stable-diffusion" not in str(caught.value)


# -------------------------------------------------------------------------- 6. library noise


def test_library_noise_is_silenced_unless_verbose(monkeypatch, capsys):
    from diffusers.utils import logging as diffusers_logging

    from flowlift.console import quiet_libraries

    logger = diffusers_logging.get_logger("diffusers.models.modeling_utils")
    root = logging.getLogger("diffusers")
    level = root.level
    for variable in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "HF_HUB_VERBOSITY"):
        monkeypatch.delenv(variable, raising=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            quiet_libraries(verbose=True)
            warnings.warn_explicit(
                "local_dir_use_symlinks is deprecated",
                FutureWarning,
                "x.py",
                1,
                module="huggingface_hub.utils._validators",
            )
            assert len(caught) == 1  # -v: the library's warning stays visible
            quiet_libraries(verbose=False)
            warnings.warn_explicit(
                "local_dir_use_symlinks is deprecated",
                FutureWarning,
                "x.py",
                2,
                module="huggingface_hub.utils._validators",
            )
            warnings.warn_explicit("flowlift's own", UserWarning, "y.py", 3, module="flowlift.files.images")
        assert [str(w.message) for w in caught] == ["local_dir_use_symlinks is deprecated", "flowlift's own"]
        capsys.readouterr()
        logger.warning("Cannot initialize model with low cpu memory usage because `accelerate` was not found")
        assert "accelerate" not in capsys.readouterr().err
        assert os.environ["DIFFUSERS_VERBOSITY"] == "error"
    finally:
        root.setLevel(level)


def test_warnings_reach_the_user_as_one_flowlift_line(capsys):
    from flowlift.console import format_warnings

    saved = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            format_warnings("upscale")
            warnings.warn("a.gif: has 3 frames, only the first is used", UserWarning, stacklevel=1)
            warnings.warn("a.gif: has 3 frames, only the first is used", UserWarning, stacklevel=1)
        err = capsys.readouterr().err
        assert err == "flowlift upscale: warning: a.gif: has 3 frames, only the first is used\n"
    finally:
        warnings.showwarning = saved


# -------------------------------------------------------------------------- 7. float16 on the CPU


def test_float16_on_cpu_warns_and_bad_devices_are_one_line():
    from flowlift.commands._options import resolve_device_dtype

    with pytest.warns(UserWarning, match="float16 on the CPU"):
        assert resolve_device_dtype("cpu", "float16") == (torch.device("cpu"), torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_device_dtype("cpu", "auto") == (torch.device("cpu"), torch.float32)
        assert resolve_device_dtype("cpu", "bfloat16")[1] == torch.bfloat16
    with pytest.raises(FlowliftError, match="not a torch device"):
        resolve_device_dtype("bogus", "auto")
    if not torch.cuda.is_available():
        with pytest.raises(FlowliftError, match="CUDA is not available"):
            resolve_device_dtype("cuda", "auto")


# ---------------------------------------------------------------- 15. python -m flowlift, 16. help


def test_python_m_flowlift_is_the_flowlift_command():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "flowlift", "--version"], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.startswith("flowlift ")
    run = subprocess.run(
        # a user error of the whole run (a missing input alone is one failed image, exit 1: issue 14, item 8)
        [sys.executable, "-m", "flowlift", "upscale", str(SRC / "missing.png"), "--device", "bogus"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2 and run.stderr.startswith("flowlift upscale: error:") and "Traceback" not in run.stderr


def _subparsers(parser: argparse.ArgumentParser, name: str = "flowlift"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
                if nested:
                    yield from _subparsers(sub, f"{name} {sub_name}")
                else:
                    yield f"{name} {sub_name}", sub


def test_every_subcommand_has_examples_and_every_option_its_default():
    commands = dict(_subparsers(build_parser()))
    expected = {"flowlift upscale", "flowlift eval", "flowlift img2img", "flowlift dataset images", "flowlift train"}
    assert expected <= set(commands)
    for name, parser in commands.items():
        text = parser.format_help()
        examples = text.split("examples:\n", 1)
        assert len(examples) == 2, f"{name} has no examples"
        lines = [line for line in examples[1].splitlines() if line.strip().startswith(("flowlift", "python"))]
        assert 1 <= len(lines) <= 3, name
        assert parser.description and parser.description[0].islower() and not parser.description.endswith("."), name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.required or action.help in (None, argparse.SUPPRESS):
                continue
            if isinstance(action, (argparse._HelpAction, argparse._StoreConstAction)):
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in shown.lower(), f"{name} {action.option_strings[-1]}: {shown}"


def test_eval_run_help_wraps_between_words(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    commands = dict(_subparsers(build_parser()))
    text = commands["flowlift eval"].format_help()
    for token in ("flow:transplant=F,", "flow:color_fix=F,", "flow:color=on|off,", "flow:seed=N"):
        assert token in text, token


def test_the_first_commands_weights_are_found_offline_without_the_hub_download_client(tmp_path, shared, monkeypatch):
    """Offline, the README's first command finds the Flow Upscaler and TAEF2 in the hub cache from its layout
    (``models.hub.cached_file``, the answers of ``try_to_load_from_cache``), and its provenance reads their SHA-256
    from their blobs' names: no ``huggingface_hub.file_download`` import (~0.15 CPU-s) and no second read."""
    import hashlib

    from huggingface_hub import constants, try_to_load_from_cache

    from builders import fake_hub_cache, run_offline_with_hub_cache, save_tiny_unet
    from flowlift.models.hub import cached_file

    cache = tmp_path / "hub"
    unet = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    taef2 = {name: shared / "models" / "taef2" / name for name in ("taef2_encoder.pth", "taef2_decoder.pth")}
    fake_hub_cache(cache, "TensorForger/FlowUpscaler", {"flow_upscaler.safetensors": unet})
    fake_hub_cache(cache, "madebyollin/taef2", {**taef2, "sub/config.json": b"{}"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for repo, name, revision in [
        ("TensorForger/FlowUpscaler", "flow_upscaler.safetensors", "main"),
        ("madebyollin/taef2", "sub/config.json", "main"),
        ("madebyollin/taef2", "taef2_encoder.pth", "0" * 40),
        ("madebyollin/taef2", "missing.pth", "main"),
        ("madebyollin/taef2", "taef2_encoder.pth", "dev"),
        ("owner/absent", "flow_upscaler.safetensors", "main"),
    ]:
        expected = try_to_load_from_cache(repo, name, revision=revision)
        assert cached_file(repo, name, revision) == (expected if isinstance(expected, str) else None), name
    script = (
        "import sys\n"
        "from flowlift.models.vae_loading import load_vae\n"
        "from flowlift.upscale.loading import DEFAULT_UPSCALER, resolve_upscaler_file, vae_spec_files\n"
        "from flowlift.upscale.outputs import model_hashes\n"
        "class Pipeline:\n"
        "    def model_files(self):\n"
        "        return {'upscaler': [resolve_upscaler_file(DEFAULT_UPSCALER)], 'vae': vae_spec_files('taef2')}\n"
        "load_vae('taef2')\n"
        "print(sorted((n, h) for files in model_hashes(Pipeline()).values() for n, h in files.items()))\n"
        "print(sorted(m for m in sys.modules if m.startswith('huggingface_hub.')))\n"
    )
    hashes, modules = run_offline_with_hub_cache(script, cache)
    files = {"flow_upscaler.safetensors": unet, **taef2}
    assert hashes == str(sorted((n, hashlib.sha256(p.read_bytes()).hexdigest()) for n, p in files.items()))
    assert "file_download" not in modules and "hf_api" not in modules, modules

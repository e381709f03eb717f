"""A Flow Upscaler or SesquiLSR file that cannot load is refused before any model loads: its safetensors header
(names, shapes, dtypes) is checked against the network where the command finds its weights, with the loader's
own line. Before, ``flowlift hires`` loaded the FLUX.2 model (minutes for a real one) and then refused a wrong
``--upscaler`` or ``--latent-upscaler`` file; ``flowlift upscale`` showed its loading line before refusing a
missing SesquiLSR file.
"""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from builders import forbid_call, refine_inputs, save_tiny_unet
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.models.sesqui_lsr import check_sesqui_file, load_sesqui_lsr
from flowlift.models.upscaler_weights import check_upscaler_file, load_upscaler
from flowlift.models.weights import header_state
from sesqui_reference import save_random_sesqui
from tiny_flux2 import write_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("flux2-tiny"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = refine_inputs(tmp_path_factory.mktemp("early"), "square.png", (64, 64), seed=4)
    unet = save_tiny_unet(folder / "flow_upscaler.safetensors")
    sesqui = save_random_sesqui(folder)
    save_file({"foo": torch.zeros(3)}, str(folder / "other.safetensors"))
    (folder / "garbage.safetensors").write_bytes(b"not a safetensors file")
    state = load_file(str(unet))
    state["in_conv.weight"] = state["in_conv.weight"].to(torch.int16)  # a quantized or corrupt file
    save_file(state, str(folder / "int_unet.safetensors"))
    state = load_file(str(sesqui))
    state.pop(sorted(state)[0])
    save_file(state, str(folder / "short_sesqui.safetensors"))
    return folder


def _refusal(load, path) -> str:
    with pytest.raises(FlowliftError) as caught:
        load(path)
    return str(caught.value)


UPSCALER = (load_upscaler, check_upscaler_file, "flow_upscaler.safetensors")
SESQUI = (load_sesqui_lsr, check_sesqui_file, "upscaler_Flux2.safetensors")


@pytest.mark.parametrize(
    ("network", "name"),
    [(UPSCALER, "other.safetensors"), (UPSCALER, "int_unet.safetensors"), (SESQUI, "other.safetensors")]
    + [(SESQUI, "short_sesqui.safetensors")],
)
def test_a_header_check_is_its_loaders_line_without_reading_a_tensor(files, network, name, monkeypatch):
    load, check, good = network
    expected = _refusal(load, files / name)
    forbid_call(monkeypatch, "safetensors.torch.load_file", "the header check read the tensors")
    assert _refusal(check, files / name) == expected
    assert check(files / good) == files / good


def test_the_header_state_is_meta_tensors_of_the_files_shapes_and_dtypes(files):
    state, metadata = header_state(files / "int_unet.safetensors", what="test")
    real = load_file(str(files / "int_unet.safetensors"))
    assert set(state) == set(real) and all(t.device.type == "meta" for t in state.values())
    assert all(state[k].shape == real[k].shape and state[k].dtype == real[k].dtype for k in real)
    assert header_state(files / "weights.pth", what="test") is None  # a pickle tells its tensors only when read
    with pytest.raises(FlowliftError, match="^test: not a readable safetensors file"):
        header_state(files / "garbage.safetensors", what="test")


def _hires(model_dir, files, *extra):
    return [
        "hires",
        "--image",
        str(files / "square.png"),
        "--model",
        str(model_dir),
        "--prompt-embeds",
        str(files / "prompt.safetensors"),
        "--steps",
        "2",
        "--no-progress",
        "-o",
        str(files / "never.png"),
        *extra,
    ]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--upscaler", "other.safetensors"], "Flow Upscaler weights from .* does not match the architecture"),
        (["--upscaler", "garbage.safetensors"], "Flow Upscaler weights .*: not a readable safetensors file"),
        (
            [
                "--upscaler",
                "flow_upscaler.safetensors",
                "--scale",
                "1.5",
                "--latent-upscaler",
                "sesqui:other.safetensors",
            ],
            "SesquiLSR weights from .* do not match the FLUX.2 SesquiLSR network",
        ),
    ],
)
def test_the_hires_fix_refuses_an_unusable_upscaler_before_the_flux2_model_loads(
    model_dir, files, options, said, monkeypatch, capsys
):
    monkeypatch.chdir(files)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "the FLUX.2 model loaded before the refusal")
    assert main(_hires(model_dir, files, *options)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert re.search(f"^flowlift hires: error: {said}", err), err
    assert not (files / "never.png").exists()


def test_the_upscale_command_refuses_a_missing_sesquilsr_before_its_loading_line(files, shared, monkeypatch, capsys):
    monkeypatch.chdir(files)
    taef2 = str(shared / "models" / "taef2")
    argv = ["upscale", "square.png", "--upscaler", "flow_upscaler.safetensors", "--vae", taef2, "--scale", "1.5"]
    assert main([*argv, "--latent-upscaler", "sesqui:missing.safetensors", "-o", "never.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "SesquiLSR weights: missing.safetensors: no such file" in err, err
    assert "loading" not in err and not (files / "never.png").exists()


def test_the_app_refuses_an_unusable_upscaler_at_start_up(files, shared, monkeypatch, capsys):
    forbid_call(monkeypatch, "flowlift.app.page.build_app", "the page was built with an unusable upscaler")
    taef2 = str(shared / "models" / "taef2")
    assert main(["app", "--upscaler", str(files / "other.safetensors"), "--vae", taef2]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "does not match the architecture" in err, err


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--lora", "garbage.safetensors"], "--lora garbage.safetensors: not a readable safetensors file"),
        (["--vae", "other.safetensors"], "neither a TAEF2, a FLUX.2 VAE nor a Mage-VAE"),
        (["--vae", "garbage.safetensors"], "VAE weights .*: not a readable safetensors file"),
    ],
)
def test_refine_refuses_an_unusable_lora_or_vae_file_before_the_transformer_loads(
    model_dir, files, options, said, monkeypatch, capsys
):
    monkeypatch.chdir(files)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "the FLUX.2 model loaded before the refusal")
    argv = ["img2img", "square.png", "--model", str(model_dir), "--prompt-embeds", "prompt.safetensors"]
    assert main([*argv, *options, "-o", "never.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(said, err), err


def test_prompt_embeddings_of_another_width_are_refused_before_the_transformer_loads(
    model_dir, files, monkeypatch, capsys
):
    save_file({"prompt_embeds": torch.zeros(1, 4, 7)}, str(files / "narrow.safetensors"))
    monkeypatch.chdir(files)
    forbid_call(monkeypatch, "flowlift.refine.loading.load_refiner", "the transformer loaded before the refusal")
    argv = ["img2img", "square.png", "--model", str(model_dir), "--prompt-embeds", "narrow.safetensors"]
    assert main([*argv, "-o", "never.png"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("flowlift img2img: error: --prompt-embeds: prompt embeddings have dim 7") and "32" in err


def test_cfg_without_a_negative_to_embed_is_refused_before_any_load(model_dir, files, monkeypatch, capsys):
    """The embeddings file has no negative_prompt_embeds and the model no text encoder: before, diffusers' raw
    'expected [...] text_encoder' line came after 8 s; now one line names the two fixes."""
    monkeypatch.chdir(files)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "a model loaded before the refusal")
    argv = ["img2img", "square.png", "--model", str(model_dir), "--prompt-embeds", "prompt.safetensors"]
    assert main([*argv, "--cfg-scale", "3", "-o", "never.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--cfg-scale 3 embeds a negative prompt" in err, err
    assert "negative_prompt_embeds in the --prompt-embeds file" in err


def test_a_negative_text_without_a_text_encoder_names_the_option(model_dir, files, monkeypatch, capsys):
    monkeypatch.chdir(files)
    forbid_call(monkeypatch, "flowlift.refine.jobs.load_for_job", "a model loaded before the refusal")
    argv = ["img2img", "square.png", "--model", str(model_dir), "--prompt-embeds", "prompt.safetensors"]
    assert main([*argv, "--cfg-scale", "3", "--negative-prompt", "blur", "-o", "never.png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("flowlift img2img: error: --negative-prompt needs"), err
    assert "negative_prompt_embeds in the --prompt-embeds file" in err


def test_the_app_refuses_a_model_file_that_is_no_transformer_at_start_up(files, shared, monkeypatch, capsys):
    forbid_call(monkeypatch, "flowlift.app.page.build_app", "the page was built with an unusable model")
    taef2 = str(shared / "models" / "taef2")
    garbage, unet = str(files / "garbage.safetensors"), str(files / "flow_upscaler.safetensors")
    assert main(["app", "--model", garbage, "--upscaler", unet, "--vae", taef2]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "--model " in err and "not a readable safetensors file" in err, err


def test_the_two_upscalers_files_swapped_say_which_is_which(files):
    """A ComfyUI user picks from one folder holding both: the line listed 166 missing and 80 unexpected tensors."""
    for load in (load_upscaler, check_upscaler_file):
        line = _refusal(load, files / "upscaler_Flux2.safetensors")
        assert line.endswith(
            "this file is SesquiLSR (a latent upscaler for factors in [1, 2]), not the Flow Upscaler: "
            "give it as latent_upscaler sesqui:PATH"
        ), line
        with pytest.raises(FlowliftError) as caught:
            load(files / "upscaler_Flux2.safetensors")
        said = caught.value.worded({"latent_upscaler": "--latent-upscaler"})
        assert said.endswith("give it as --latent-upscaler sesqui:PATH"), said
    for load in (load_sesqui_lsr, check_sesqui_file):
        line = _refusal(load, files / "flow_upscaler.safetensors")
        assert line.endswith("the Flow Upscaler (the 2x-pass UNet), not SesquiLSR: give it as upscaler PATH"), line
        with pytest.raises(FlowliftError) as caught:
            load(files / "flow_upscaler.safetensors")
        assert caught.value.worded({"upscaler": "--upscaler"}).endswith("give it as --upscaler PATH")


def test_a_vae_given_as_the_upscaler_is_named_a_vae_in_one_short_line(files, shared, tmp_path):
    """A Mage-VAE file given as the upscaler printed ~600 characters of key names; a VAE is said to be one, and any
    other file's key differences are a count and the first few names."""
    mage = tmp_path / "mage_vae.safetensors"
    save_file({"student.dconv_encoder.conv_in.weight": torch.zeros(2, 2, 1, 1)}, str(mage))
    flux2 = tmp_path / "flux2_vae.safetensors"
    save_file({"encoder.down.0.block.0.conv1.weight": torch.zeros(2, 2, 3, 3)}, str(flux2))
    taef2 = shared / "models" / "taef2" / "taef2_decoder.pth"
    for path, kind in ((mage, "Mage-VAE"), (flux2, "FLUX.2 VAE"), (taef2, "TAEF2")):
        loads = (load_upscaler, check_upscaler_file) if path.suffix == ".safetensors" else (load_upscaler,)
        for load in loads:
            with pytest.raises(FlowliftError) as caught:
                load(path)
            line = caught.value.worded({"vae": "--vae"})
            assert (
                line == f"Flow Upscaler weights from {path}: this file is a VAE ({kind}), not the Flow Upscaler: "
                "give it as --vae PATH"
            ), line
            assert caught.value.field == "vae"
    line = _refusal(load_upscaler, files / "other.safetensors")
    assert "missing 166: " in line and "(+163 more)" in line and "unexpected 1: foo" in line and len(line) < 300, line


def test_a_vae_given_as_sesqui_lsr_is_named_a_vae_in_one_short_line(tmp_path):
    """A VAE file given as SesquiLSR listed the ~80 missing and the VAE's unexpected tensors."""
    mage = tmp_path / "mage_vae.safetensors"
    save_file({"student.dconv_encoder.conv_in.weight": torch.zeros(2, 2, 1, 1)}, str(mage))
    flux2 = tmp_path / "flux2_vae.safetensors"
    save_file({"encoder.down.0.block.0.conv1.weight": torch.zeros(2, 2, 3, 3)}, str(flux2))
    for path, kind in ((mage, "Mage-VAE"), (flux2, "FLUX.2 VAE")):
        for load in (load_sesqui_lsr, check_sesqui_file):
            with pytest.raises(FlowliftError) as caught:
                load(path)
            line = caught.value.worded({"vae": "--vae"})
            assert (
                line
                == f"SesquiLSR weights from {path}: this file is a VAE ({kind}), not SesquiLSR: give it as --vae PATH"
            )
            assert caught.value.field == "vae"


def test_a_truncated_or_foreign_checkpoint_says_so_in_words_a_user_can_act_on(files, shared, tmp_path):
    from flowlift.models.weights import read_state_dict

    truncated = tmp_path / "taef2_decoder.pth"
    truncated.write_bytes((shared / "models" / "taef2" / "taef2_decoder.pth").read_bytes()[:100_000])
    text = tmp_path / "notes.pth"
    text.write_text("101 not a checkpoint\n")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((files / "flow_upscaler.safetensors").read_bytes()[:5000])
    for path, kind in (
        (truncated, "PyTorch tensor checkpoint"),
        (text, "PyTorch tensor checkpoint"),
        (cut, "safetensors file"),
    ):
        line = _refusal(lambda p: read_state_dict(p, what="TAEF2"), path)
        assert line == f"TAEF2: cannot read {path}: not a complete {kind} (truncated, corrupt, or another format)"


def test_a_prompt_with_a_model_folder_without_a_text_encoder_names_both_fixes(model_dir):
    from flowlift.refine.prompts import PromptEncoder

    with pytest.raises(FlowliftError) as caught:
        PromptEncoder(str(model_dir), device="cpu", dtype=torch.float32)
    assert str(caught.value) == (
        f"source.model {model_dir} has no text_encoder/ folder to embed the prompt with; "
        "give prompt embeddings (prompt.embeds) instead"
    )

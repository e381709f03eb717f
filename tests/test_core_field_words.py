"""Core refusals that name a knob another door also has mark it (FIELD_MARK, ``field=``) instead of spelling the
command line's option: a LoRA or VAE given as the transformer, a folder without the text encoder a prompt needs, a
user's file at a refine's output or an eval's report. The command line still says ``--lora``, ``--prompt-embeds``,
``--overwrite``; a Python caller reads the field it wrote (``source.loras``, ``prompt.embeds``, ``overwrite``)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowlift.commands.cli import main
from flowlift.errors import FIELD_MARK, FlowliftError

NOT_CLI = ("--lora", "--vae", "--prompt", "--prompt-embeds", "--overwrite", "-o/--output", "--cache")


def _spells_no_option(error: FlowliftError) -> None:
    text = str(error)
    assert not any(option in text.split() or f"{option})" in text for option in NOT_CLI), text


@pytest.mark.parametrize(
    ("names", "field", "said"),
    [
        (["blocks.0.attn.lora_A.weight", "blocks.0.attn.lora_B.weight"], "source.loras", "pass it with source.loras"),
        (["decoder.conv_in.weight", "encoder.conv_in.weight"], "source.vae", "pass it with source.vae"),
    ],
)
def test_a_lora_or_vae_given_as_the_model_names_its_field(tmp_path, names, field, said):
    from flowlift.refine.loading import load_refiner

    path = tmp_path / "other.safetensors"
    save_file({name: torch.zeros(2, 2) for name in names}, str(path))
    with pytest.raises(FlowliftError) as caught:
        load_refiner(str(path))  # refused from the headers, before any weights load
    assert caught.value.fields == ("source.model", field), caught.value.fields
    assert str(caught.value).startswith(f"source.model {path}: ") and said in str(caught.value)
    _spells_no_option(caught.value)
    words = {"source.model": "--model", "source.loras": "--lora", "source.vae": "--vae"}
    assert f"pass it with {words[field]})" in caught.value.worded(words)


def test_the_command_line_still_says_lora(tmp_path, capsys):
    path = tmp_path / "lora.safetensors"
    save_file({"blocks.0.attn.lora_A.weight": torch.zeros(2, 2)}, str(path))
    Image.new("RGB", (64, 64)).save(tmp_path / "square.png")
    embeds = tmp_path / "prompt.safetensors"
    save_file({"prompt_embeds": torch.zeros(1, 4, 8)}, str(embeds))
    argv = ["img2img", str(tmp_path / "square.png"), "--transformer", str(path), "--model", str(tmp_path)]
    code = main([*argv, "--prompt-embeds", str(embeds), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"--transformer {path}: a LoRA (low-rank tensors; pass it with --lora)" in err, err


def test_the_app_says_its_refiner_vae_as_model_vae():
    from flowlift.commands import app
    from flowlift.commands._options import option_words

    parser = argparse.ArgumentParser()
    app.add_arguments(parser)
    words = option_words(parser)
    assert words["source.vae"] == "--model-vae" and words["vaes"] == "--vae"


def test_a_folder_without_the_text_encoder_names_the_prompt_fields(tmp_path):
    from flowlift.refine.source_checks import check_model_part

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text("{}")
    with pytest.raises(FlowliftError) as caught:
        check_model_part(str(tmp_path), "text_encoder")
    error = caught.value
    assert error.fields == ("source.model", "prompt.text", "prompt.embeds")
    assert str(error).startswith(f"source.model {tmp_path}: prompt.text needs the model's text encoder")
    assert str(error).endswith("or pass precomputed prompt.embeds")
    _spells_no_option(error)
    cli = error.worded({"source.model": "--model", "prompt.text": "--prompt", "prompt.embeds": "--prompt-embeds"})
    assert cli.startswith(f"--model {tmp_path}: --prompt needs") and cli.endswith("precomputed --prompt-embeds")


def test_a_users_file_at_a_refine_output_names_the_overwrite_field(tmp_path):
    from flowlift.files.image_outputs import check_single_output

    users = tmp_path / "mine.png"
    users.write_bytes(b"not flowlift's")
    with pytest.raises(FlowliftError) as caught:
        check_single_output(users, False, option=FIELD_MARK)
    assert caught.value.fields == ("output", "overwrite")
    assert str(caught.value) == f"output {users} exists and was not written by flowlift; use overwrite to replace it"
    assert "; use --overwrite to replace it" in caught.value.worded({"output": "-o", "overwrite": "--overwrite"})


def test_a_users_file_at_an_eval_report_names_the_fields(tmp_path, capsys):
    from flowlift.measure.eval_job import EvalRequest, run_eval

    out = tmp_path / "report"
    out.mkdir()
    (out / "table.md").write_text("my notes\n")
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (64, 64)).save(photos / "a.png")
    with pytest.raises(FlowliftError) as caught:
        run_eval(EvalRequest(output=out, run=["lanczos"], dataset=[str(photos)]))
    assert caught.value.fields == ("overwrite", "output")
    assert str(caught.value).endswith("use overwrite to replace it, or another output"), str(caught.value)
    assert main(["eval", "--run", "lanczos", "--dataset", str(photos), "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith("use --overwrite to replace it, or another --output"), err

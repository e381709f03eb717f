"""A FLUX.2 transformer with NaN or Inf weights is refused at load, one line naming the file and the tensor, as every
other loader refuses one (it ran every sampling step, then said "the velocity model ... gave NaN", naming no file):
single files (float, fp8), diffusers folders (one file or shards), a cached hub id, and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from flowlift.errors import FlowliftError
from flowlift.refine.loading import load_transformer
from flux2_files import write_fp8, write_single_file
from tiny_flux2 import prompt_embeds, tiny_transformer, tiny_vae

WEIGHTS = "diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_transformer()


def _poison(path: Path, name: str, value: float) -> None:
    state = load_file(str(path))
    state[name] = state[name].clone()
    state[name].view(-1)[3] = value
    save_file(state, str(path))


@pytest.fixture
def never_built(monkeypatch):
    """diffusers must not build a model from a file whose weights are refused."""
    import diffusers

    def built(*args, **kwargs):
        raise AssertionError("diffusers built the model from non-finite weights")

    monkeypatch.setattr(diffusers.Flux2Transformer2DModel, "from_single_file", built)


@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_single_file_with_non_finite_weights_is_one_line(model, tmp_path, value, kind, never_built):
    path = tmp_path / "flux-2-klein.safetensors"
    write_single_file(model, path)
    _poison(path, "img_in.weight", value)
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(path), dtype=torch.float32, option="--transformer")
    text = str(caught.value)
    assert text.startswith(f"--transformer {path}: its weights contain {kind} in `img_in.weight`"), text
    assert "fetch it again" in text and "\n" not in text


def test_an_fp8_file_with_nan_is_one_line(model, tmp_path, never_built):
    path = tmp_path / "fp8.safetensors"
    write_fp8(model, path)
    state = load_file(str(path))
    name = next(k for k, v in sorted(state.items()) if v.dtype == torch.float8_e4m3fn)
    raw = state[name].view(torch.uint8).clone()
    raw.view(-1)[0] = 0x7F  # float8_e4m3fn's NaN
    state[name] = raw.view(torch.float8_e4m3fn)
    save_file(state, str(path))
    with pytest.raises(FlowliftError, match=rf"^--transformer {path}: its weights contain NaN in `{name}`"):
        load_transformer(str(path), dtype=torch.bfloat16, option="--transformer")


def _diffusers_folder(model, root: Path, name: str, value: float) -> Path:
    folder = root / "transformer"
    model.save_pretrained(folder)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    _poison(folder / WEIGHTS, name, value)
    return folder


def test_a_diffusers_folder_with_nan_names_its_file(model, tmp_path):
    folder = _diffusers_folder(model, tmp_path / "klein", "x_embedder.weight", float("nan"))
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(tmp_path / "klein"), dtype=torch.float32)
    text = str(caught.value)
    assert text.startswith(f"source.model {tmp_path / 'klein'}: {folder / WEIGHTS}: its weights contain NaN"), text
    assert "`x_embedder.weight`" in text and "\n" not in text


def test_a_sharded_folder_names_the_shard_holding_the_tensor(model, tmp_path):
    folder = tmp_path / "sharded"
    model.save_pretrained(folder)
    state = load_file(str(folder / WEIGHTS))
    (folder / WEIGHTS).unlink()
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    bad = shards["model-00002-of-00002.safetensors"][2]
    state[bad] = state[bad].clone().fill_(float("inf"))
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / f"{WEIGHTS}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(folder), dtype=torch.float32)
    text = str(caught.value)
    assert f": {folder / 'model-00002-of-00002.safetensors'}: its weights contain Inf in `{bad}`" in text, text


def test_a_cached_hub_model_with_nan_says_how_to_fetch_it_again(model, tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--owner--nan-flux2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("a" * 40)  # a commit: huggingface_hub's cache lookup wants one
    _diffusers_folder(model, repo / "snapshots" / ("a" * 40), "proj_out.weight", float("nan"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FlowliftError) as caught:
        load_transformer("owner/nan-flux2", dtype=torch.float32)
    text = str(caught.value)
    assert text.startswith("source.model owner/nan-flux2: ") and "NaN in `proj_out.weight`" in text, text
    assert f"`hf download owner/nan-flux2 transformer/{WEIGHTS} --force-download`" in text, text


def test_the_command_refuses_it_in_one_line_before_sampling(model, tmp_path, capsys, monkeypatch):
    from flowlift.commands.cli import main

    path = tmp_path / "nan.safetensors"
    write_single_file(model, path)
    _poison(path, "img_in.weight", float("nan"))
    tiny_vae().save_pretrained(tmp_path / "vae")
    save_file({"prompt_embeds": prompt_embeds()}, str(tmp_path / "emb.safetensors"))
    Image.new("RGB", (64, 48), (100, 120, 140)).save(tmp_path / "img.png")
    out = tmp_path / "out.png"
    argv = ["img2img", str(tmp_path / "img.png"), "--model", str(path), "--vae", str(tmp_path / "vae")]
    argv += ["--prompt-embeds", str(tmp_path / "emb.safetensors"), "--steps", "1", "--no-progress", "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flowlift img2img: error: --model {path}: its weights contain NaN"), err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_finite_weights_still_load(model, tmp_path):
    path = tmp_path / "good.safetensors"
    write_single_file(model, path)
    assert load_transformer(str(path), dtype=torch.float32).config.num_layers == 1
    model.save_pretrained(tmp_path / "good")
    assert load_transformer(str(tmp_path / "good"), dtype=torch.float32).config.num_layers == 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_is_checked_on_its_bytes_as_float32_would_say(dtype):
    from flowlift.models.weights import first_non_finite

    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    as_float = every_byte.float()
    for byte in range(256):
        one = torch.zeros(8, dtype=torch.uint8)
        one[5] = byte
        value = as_float[byte]
        expected = None if value.isfinite() else f"{'NaN' if value.isnan() else 'Inf'} in `w`"
        assert first_non_finite({"w": one.view(dtype)}) == expected, byte

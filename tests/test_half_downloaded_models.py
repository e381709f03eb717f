"""A hub model whose download was cut short (its transformer/config.json cached, its weights or a shard not) says
how to finish the download, as the other hub errors do; it said "no diffusion_pytorch_model.safetensors (or
...index.json) beside its config.json" with no fix. A fake hub cache under a temporary HF_HOME; nothing reaches the
network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowlift.errors import FlowliftError
from tiny_flux2 import tiny_transformer

WEIGHTS = "diffusion_pytorch_model.safetensors"
REV = "a" * 40  # a commit: huggingface_hub's cache lookup wants one
SRC = Path(__file__).resolve().parents[1] / "src"


def _cached_repo(hub: Path, repo: str) -> Path:
    """``repo``'s snapshot in the hub cache ``hub``, with its model_index.json and a whole transformer/ folder."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(REV)
    snapshot = storage / "snapshots" / REV
    tiny_transformer().save_pretrained(snapshot / "transformer")
    (snapshot / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_cached_config_without_weights_says_how_to_finish_the_download(hub):
    from flowlift.refine.loading import load_transformer

    snapshot = _cached_repo(hub, "someone/partial")
    (snapshot / "transformer" / WEIGHTS).unlink()
    with pytest.raises(FlowliftError) as caught:
        load_transformer("someone/partial", dtype=torch.float32)
    text = str(caught.value)
    assert f"no {WEIGHTS} (or {WEIGHTS}.index.json) beside its config.json; an interrupted download?" in text, text
    assert f"`hf download someone/partial --include 'transformer/*'` (into {hub})" in text and "\n" not in text


def test_a_missing_shard_says_it_too(hub):
    from flowlift.models.flux2_transformer_folders import inspect_transformer_folder

    folder = _cached_repo(hub, "someone/sharded") / "transformer"
    (folder / WEIGHTS).rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"x_embedder.weight": "model-00001-of-00002.safetensors", "proj_out.weight": "model-00002.safetensors"}
    (folder / f"{WEIGHTS}.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FlowliftError) as caught:
        inspect_transformer_folder(folder, option="--model")
    text = str(caught.value)
    assert "names the shard 'model-00002.safetensors', which is not in the folder; an interrupted download?" in text
    assert "`hf download someone/sharded --include 'transformer/*'`" in text, text


def test_a_local_folder_gets_no_hub_advice(tmp_path):
    from flowlift.models.flux2_transformer_folders import inspect_transformer_folder

    tiny_transformer().save_pretrained(tmp_path / "transformer")
    (tmp_path / "transformer" / WEIGHTS).unlink()
    with pytest.raises(FlowliftError) as caught:
        inspect_transformer_folder(tmp_path / "transformer", option="--model")
    assert str(caught.value).endswith("beside its config.json"), str(caught.value)


def test_the_command_says_it_in_one_line(tmp_path):
    """The user's view: ``HF_HOME`` set, offline, the model's up-front checks pass (its config.json is cached)."""
    snapshot = _cached_repo(tmp_path / "hf" / "hub", "someone/partial")
    (snapshot / "transformer" / WEIGHTS).unlink()
    from PIL import Image
    from safetensors.torch import save_file

    from tiny_flux2 import prompt_embeds, tiny_vae

    tiny_vae().save_pretrained(tmp_path / "vae")
    save_file({"prompt_embeds": prompt_embeds()}, str(tmp_path / "emb.safetensors"))
    Image.new("RGB", (64, 48), (100, 120, 140)).save(tmp_path / "img.png")
    out = tmp_path / "out.png"
    argv = [sys.executable, "-m", "flowlift", "img2img", str(tmp_path / "img.png"), "--model", "someone/partial"]
    argv += ["--vae", str(tmp_path / "vae"), "--prompt-embeds", str(tmp_path / "emb.safetensors"), "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=str(SRC), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    run = subprocess.run([*argv, "--steps", "1", "--no-progress"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.splitlines()) == 1, run.stderr
    assert run.stderr.startswith("flowlift img2img: error: --model someone/partial: "), run.stderr
    assert "an interrupted download? download it once with `hf download someone/partial --include 'transformer/*'`" in (
        run.stderr
    )
    assert not out.exists()

"""Broken or mismatched FLUX.2 transformers are one line and exit 2 before any work (issue 32, classes A, B, J).

* A: single files whose header is broken (a list, a missing, non-integer, negative or huge shape, offsets past the
  end), a half-downloaded file (the line gives the command that fetches it again), fp8 scales of the wrong length,
  an output projection that does not give back the 128 latent channels (safetensors and GGUF);
* B: transformer folders whose config.json contradicts the weights (block counts 0, -3, 200000), with an extra,
  a missing or an int8 tensor: named, before anything is allocated;
* J: a folder without safetensors weights: flowlift's line only, none of diffusers' own.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from flowlift.errors import FlowliftError
from flowlift.refine.loading import load_transformer
from flux2_files import bfl_state_dict, write_fp8, write_gguf, write_single_file
from tiny_flux2 import prompt_embeds, tiny_transformer, tiny_vae

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A good transformer folder, a tiny VAE, an image and prompt embeddings to run img2img with."""
    root = tmp_path_factory.mktemp("strict")
    tiny_transformer().save_pretrained(root / "good")
    tiny_vae().save_pretrained(root / "vae")
    save_file({"prompt_embeds": prompt_embeds()}, str(root / "emb.safetensors"))
    Image.new("RGB", (64, 48), (100, 120, 140)).save(root / "img.png")
    return root


def _folder(files: Path, name: str, config: dict | None = None, change=None) -> Path:
    folder = files / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(files / "good", folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if change:
        weights = folder / "diffusion_pytorch_model.safetensors"
        save_file(change(load_file(str(weights))), str(weights))
    return folder


def _img2img(files: Path, out: Path, *model_args: str, limit_memory: bool = False) -> subprocess.CompletedProcess:
    """``flowlift img2img`` in a subprocess (address space capped at 6 GiB when ``limit_memory``: an unchecked
    config that allocates fails there instead of taking the machine)."""
    argv = [
        sys.executable,
        "-m",
        "flowlift",
        "img2img",
        str(files / "img.png"),
        *model_args,
        "--vae",
        str(files / "vae"),
        "--prompt-embeds",
        str(files / "emb.safetensors"),
        "--steps",
        "1",
        "--no-progress",
        "-o",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=120, preexec_fn=cap if limit_memory else None
    )


def _one_line(run: subprocess.CompletedProcess, out: Path) -> str:
    """Exit 2, stderr exactly one ``flowlift img2img: error:`` line, nothing written."""
    assert run.returncode == 2, run.stderr
    lines = run.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowlift img2img: error: "), run.stderr
    assert not out.exists() and not list(out.parent.glob(f".{out.stem}*"))
    return lines[0]


# ------------------------------------------------------------------------------------------------ B: folders


FOLDERS = {
    "no-double-blocks": ({"num_layers": 0}, None, "num_layers is 0, the weights hold 1"),
    "negative-blocks": ({"num_layers": -3}, None, "num_layers is -3, the weights hold 1"),
    "no-single-blocks": ({"num_single_layers": 0}, None, "num_single_layers is 0, the weights hold 1"),
    "200000-blocks": ({"num_layers": 200000}, None, "num_layers is 200000, the weights hold 1"),
    "float-count": ({"num_layers": 1.0}, None, "num_layers is 1.0"),
    "heads": ({"num_attention_heads": 4}, None, "num_attention_heads is 4, the weights hold 2"),
    "out-channels": ({"out_channels": 64}, None, "out_channels is 64"),
    "rope": ({"axes_dims_rope": [4, 4, 4]}, None, "axes_dims_rope is [4, 4, 4]"),
    "extra-tensor": (None, lambda s: {**s, "extra.weight": torch.zeros(3)}, "unexpected 1: extra.weight"),
    "missing-tensor": (None, lambda s: {k: v for k, v in s.items() if k != "proj_out.weight"}, "proj_out.weight"),
    "missing-block-tensor": (
        None,
        lambda s: {k: v for k, v in s.items() if k != "transformer_blocks.0.ff.linear_out.weight"},
        "missing 1: transformer_blocks.0.ff.linear_out.weight",
    ),
    "int8": (
        None,
        lambda s: {k: v.to(torch.int8) if k == "x_embedder.weight" else v for k, v in s.items()},
        "tensor x_embedder.weight is int8",
    ),
}


@pytest.mark.parametrize("case", sorted(FOLDERS))
def test_folders_load_as_strictly_as_files(files, case, monkeypatch):
    config, change, message = FOLDERS[case]
    folder = _folder(files, case, config, change)
    built = []
    import diffusers

    monkeypatch.setattr(diffusers.Flux2Transformer2DModel, "from_pretrained", lambda *a, **k: built.append(a))
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(folder), dtype=torch.float32)
    text = str(caught.value)
    assert text.startswith(f"source.model {folder}: ") and message in text and "\n" not in text, text
    assert not built  # refused before diffusers built (allocated) anything


def test_a_diffusers_layout_folder_is_checked_too(files, tmp_path):
    root = tmp_path / "model"
    (root / "transformer").parent.mkdir()
    shutil.copytree(_folder(files, "layout", {"num_single_layers": 0}), root / "transformer")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline"}))
    with pytest.raises(FlowliftError, match="num_single_layers is 0, the weights hold 1"):
        load_transformer(str(root), dtype=torch.float32)


def test_the_good_folder_still_loads(files):
    model = load_transformer(str(files / "good"), dtype=torch.float32)
    assert model.config.num_layers == 1 and model.config.num_single_layers == 1


@pytest.mark.parametrize("case", ["200000-blocks", "no-double-blocks", "int8"])
def test_cli_refuses_a_mismatched_folder_in_one_line(files, tmp_path, case):
    config, change, message = FOLDERS[case]
    folder = _folder(files, f"cli-{case}", config, change)
    out = tmp_path / "out.png"
    assert message in _one_line(_img2img(files, out, "--model", str(folder), limit_memory=True), out)


# ------------------------------------------------------------------------------------------ J: no safetensors


def test_a_folder_without_safetensors_is_flowlifts_line_only(files, tmp_path):
    folder = tmp_path / "nosafetensors"
    folder.mkdir()
    shutil.copy(files / "good" / "config.json", folder)
    torch.save({}, folder / "diffusion_pytorch_model.bin")
    out = tmp_path / "out.png"
    line = _one_line(_img2img(files, out, "--model", str(folder)), out)
    assert "no diffusion_pytorch_model.safetensors" in line and "never unpickles" in line
    assert "An error occurred" not in line


# ------------------------------------------------------------------------------------------ A: broken files


def _rewrite_header(good: Path, target: Path, change) -> Path:
    raw = good.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    header = change(header) or header
    encoded = json.dumps(header).encode()
    target.write_bytes(len(encoded).to_bytes(8, "little") + encoded + raw[8 + length :])
    return target


def _first(header: dict) -> str:
    return sorted(k for k in header if k != "__metadata__")[0]


def _last(header: dict) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


HEADERS = {
    "a-list": (lambda h: [1, 2], "its header is a list"),
    "no-shape": (lambda h: h[_first(h)].pop("shape") and None, "has no valid shape"),
    "text-shape": (lambda h: h[_first(h)].update(shape=["a", 2]), "has no valid shape"),
    "negative-shape": (lambda h: h[_first(h)].update(shape=[-1, 4]), "has no valid shape"),
    "huge-shape": (lambda h: h[_first(h)].update(shape=[2**40, 2**40]), "declares shape (1099511627776, 1099"),
    "bad-dtype": (lambda h: h[_first(h)].update(dtype="X9"), "unknown dtype 'X9'"),
    "offsets-past-end": (lambda h: h[_last(h)]["data_offsets"].__setitem__(1, 10**12), "but 9999"),
    "entry-not-object": (lambda h: h.update({_first(h): 3}), "is not an object"),
}


@pytest.fixture(scope="module")
def good_file(files) -> Path:
    path = files / "good.safetensors"
    write_single_file(tiny_transformer(), path)
    return path


@pytest.mark.parametrize("case", sorted(HEADERS))
def test_broken_headers_are_one_line(files, good_file, case):
    change, message = HEADERS[case]
    path = _rewrite_header(good_file, files / f"{case}.safetensors", change)
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(path), dtype=torch.float32, option="--transformer")
    text = str(caught.value)
    assert text.startswith(f"--transformer {path}: not a readable safetensors file (") and message in text, text


def _write_broken_files(files: Path, good_file: Path) -> dict[str, tuple[Path, str]]:
    """Each broken file with a piece of its expected message."""
    cases = {}
    half = files / "half.safetensors"
    half.write_bytes(good_file.read_bytes()[: good_file.stat().st_size // 2])
    cases["truncated"] = (
        half,
        f"truncated (136188 of the 274816 bytes of tensor data its header declares; an "
        f"interrupted download?); fetch it again, e.g. `hf download OWNER/REPO {half.name}",
    )
    model = tiny_transformer()
    rows = files / "rows.safetensors"
    write_fp8(model, rows, scale="rows")
    state = load_file(str(rows))
    key = "double_blocks.0.img_attn.proj.weight_scale"
    state[key] = state[key][:-1].contiguous()
    save_file(state, str(rows))
    cases["fp8-scale"] = (rows, f"fp8 scale {key} has shape (31,); expected 1 or 32")
    state = {k: v.contiguous() for k, v in bfl_state_dict(model.state_dict()).items()}
    state["final_layer.linear.weight"] = torch.zeros(64, state["final_layer.linear.weight"].shape[1])
    save_file(state, str(files / "out.safetensors"))
    cases["output-projection"] = (files / "out.safetensors", "maps 128 latent channels (img_in.weight) to 64")
    wide = tiny_transformer(  # diffusers' defaults but for these: 2 heads of 128, the output projection to 64
        guidance_embeds=True,
        text_dim=256,
        attention_head_dim=128,
        timestep_guidance_channels=256,
        axes_dims_rope=(32,) * 4,
        out_channels=64,
    )
    write_gguf(wide, files / "out.gguf", "Q8_0")
    cases["gguf-output-projection"] = (files / "out.gguf", "maps 128 latent channels (img_in.weight) to 64")
    return cases


def test_broken_files_fail_in_one_line_before_any_work(files, good_file, tmp_path):
    cases = _write_broken_files(files, good_file)
    for case, (path, message) in cases.items():
        with pytest.raises(FlowliftError) as caught:
            load_transformer(str(path), dtype=torch.float32, option="--transformer")
        assert str(caught.value).startswith(f"--transformer {path}: ") and message in str(caught.value), case
    out = tmp_path / "out.png"
    for case in ("truncated", "gguf-output-projection"):
        path, message = cases[case]
        run = _img2img(files, out, "--model", str(files / "good"), "--transformer", str(path))
        assert message in _one_line(run, out), case


def test_a_truncated_cached_file_names_its_repository(good_file, tmp_path):
    snapshot = tmp_path / "hub" / "models--owner--flux2" / "snapshots" / "abc123" / "transformer"
    snapshot.mkdir(parents=True)
    half = snapshot / "model.safetensors"
    half.write_bytes(good_file.read_bytes()[:1000])
    with pytest.raises(FlowliftError) as caught:
        load_transformer(str(half), dtype=torch.float32, option="--transformer")
    assert "`hf download owner/flux2 transformer/model.safetensors --force-download`" in str(caught.value)


def test_a_cached_hub_transformer_is_checked_the_same_way(files, tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--owner--bad-flux2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    shutil.copytree(_folder(files, "hub-bad", {"num_layers": 200000}), snapshot / "transformer")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    import diffusers

    def built(*args, **kwargs):
        raise AssertionError("diffusers built the model before its config was checked")

    monkeypatch.setattr(diffusers.Flux2Transformer2DModel, "from_pretrained", built)
    with pytest.raises(FlowliftError) as caught:
        load_transformer("owner/bad-flux2", dtype=torch.float32)
    text = str(caught.value)
    assert text.startswith("source.model owner/bad-flux2: "), text
    assert "num_layers is 200000, the weights hold 1" in text, text


def test_a_distillation_teacher_folder_is_checked_the_same_way(files, tmp_path, shared, capsys):
    from flowlift.commands.cli import main

    teacher = _folder(files, "teacher", {"num_single_layers": 0})
    save_file({"prompt_embeds": torch.randn(6, 32)}, str(tmp_path / "embeds.safetensors"))
    out = tmp_path / "distill"
    argv = [
        "dataset",
        "distill",
        "-o",
        str(out),
        "--vae",
        str(shared / "models" / "taef2"),
        "--teacher",
        str(teacher),
        "--prompt-embeds",
        str(tmp_path / "embeds.safetensors"),
        "--num",
        "2",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"flowlift dataset: error: --teacher {teacher}: config.json does not match its weights: "
        "num_single_layers is 0, the weights hold 1"
    ), err
    assert not (out / "dataset.json").exists()

"""Every door takes every named VAE (issue 37, item 5), parametrized over the VAE knob's one declaration.

``flowlift.models.vae_names.VAE_NAMES`` is where the names live; these tests run each name through each
door that chooses a VAE — ``load_vae`` / ``check_vae_spec`` and the output's provenance, ``flowlift upscale``,
``eval``'s VAE methods, ``dataset images``, ``img2img``, the web app's service, the command lines' help —
so a name added to the declaration is tested at every door without touching this file. (``colorfix``
takes no VAE; the ComfyUI and InvokeAI packs: tests/test_comfyui.py, tests/test_invokeai.py.)

Each name resolves through a fake Hugging Face cache (the layout huggingface_hub reads offline) holding a
small random checkpoint in that VAE's released layout under its first repository: TAEF2's two released
.pth files, a tiny diffusers ``AutoencoderKLFlux2`` folder under ``vae/``, and a narrow Mage-VAE in the
released single-file layout under ``vae/`` (tests/mage_files.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from builders import as_hub_blobs, resized_photo, save_tiny_unet
from door_helpers import one_crop_dataset_args
from flowlift.commands.cli import main
from flowlift.models.vae_names import NAMED_VAES, VAE_NAMES

COMMIT = "0" * 40
W, H = 48, 32


def _snapshot(cache: Path, repo_id: str) -> Path:
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    folder = repo_dir / "snapshots" / COMMIT
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_named_vae(cache: Path, name: str, shared: Path) -> None:
    """A small random (TAEF2: the real, small) checkpoint of ``name`` in its released layout, in ``cache``."""
    folder = _snapshot(cache, NAMED_VAES[name].repos[0])
    if name == "taef2":
        for file in ("taef2_encoder.pth", "taef2_decoder.pth"):
            shutil.copy(shared / "models" / "taef2" / file, folder / file)
    elif name == "flux2":
        from tiny_flux2 import tiny_vae

        tiny_vae().save_pretrained(folder / "vae")
    elif name == "mage":
        from mage_files import released_state, save_released

        (folder / "vae").mkdir()
        save_released(folder / "vae" / "mage_vae.safetensors", released_state())
    else:
        raise AssertionError(f"no test checkpoint for the VAE {name!r}: add one here")
    as_hub_blobs(folder.parent.parent)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, shared):
    cache = tmp_path_factory.mktemp("hub")
    for name in VAE_NAMES:
        write_named_vae(cache, name, shared)
    return cache


@pytest.fixture
def named_hub(hub_cache, monkeypatch):
    """The fake cache as huggingface_hub's (read at each call; HF_HUB_OFFLINE=1 from conftest)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


@pytest.fixture(scope="module")
def upscaler(tmp_path_factory):
    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def photo(tmp_path_factory, shared):
    return resized_photo(
        shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png", tmp_path_factory.mktemp("photo") / "photo.png", (W, H)
    )


def _run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


# --------------------------------------------------------------------------------------------------


def test_the_declaration_names_mage_and_every_native_vae_has_a_comfyui_loader():
    assert {"taef2", "flux2", "mage"} <= set(VAE_NAMES)
    for vae in NAMED_VAES.values():
        assert vae.repos and vae.patterns and vae.name == vae.name.lower()
        assert bool(vae.native) == bool(vae.comfy_node and vae.comfy_folder), vae.name
    # only VAE files are ever fetched for a name: never a transformer, never a pickle for Mage-VAE
    assert all(p.startswith("vae/") and not p.endswith((".bin", ".pt", ".pth")) for p in NAMED_VAES["mage"].patterns)


@pytest.mark.parametrize("name", VAE_NAMES)
def test_a_name_loads_through_load_vae_and_is_found_before_loading(named_hub, name):
    from flowlift.limits import vae_kind
    from flowlift.models.vae_loading import check_vae_spec, load_vae
    from flowlift.upscale.loading import vae_spec_files

    check_vae_spec(name)
    vae = load_vae(name)
    assert vae_kind(vae) == name
    images = torch.rand(1, 3, H, W)
    latents = vae.encode(images)
    assert latents.shape == (1, 32, H // 8, W // 8)
    assert vae.decode(latents).shape == images.shape
    files = vae_spec_files(name)  # the output's provenance: the cached weight files themselves
    assert files and all(Path(f).is_file() and str(named_hub) in str(f) for f in files)


@pytest.mark.parametrize("name", VAE_NAMES)
def test_a_name_missing_from_the_cache_is_one_line_with_its_download_command(tmp_path, monkeypatch, name):
    from huggingface_hub import constants

    from flowlift.app.results import first_line
    from flowlift.errors import FlowliftError
    from flowlift.models.hub import download_command
    from flowlift.models.vae_loading import check_vae_spec, load_vae

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    named = NAMED_VAES[name]
    for call in (check_vae_spec, load_vae):
        with pytest.raises(FlowliftError) as error:
            call(name)
        message = str(error.value)
        assert "\n" not in message and "HF_HUB_OFFLINE=1" in message and "set vae to a local path" in message
        assert download_command(named.repos[0], include=named.include) in message
        # the core speaks the Python name; each door says its own (it printed "(CLI: --vae PATH)" to every door)
        assert "CLI" not in message and "--vae" not in message and error.value.fields[0] == "vae"
        assert "set --vae to a local path" in error.value.worded({"vae": "--vae"})
        assert "set VAE to a local path" in first_line(error.value)  # the web app's label


@pytest.mark.parametrize("name", VAE_NAMES)
def test_upscale_takes_every_named_vae_end_to_end(named_hub, upscaler, photo, tmp_path, capsys, name):
    out = tmp_path / "out.png"
    code, err = _run(capsys, "upscale", photo, "--vae", name, "--upscaler", upscaler, "--device", "cpu", "-o", out)
    assert code == 0, err
    with Image.open(out) as image:
        assert image.size == (2 * W, 2 * H)
        parameters = json.loads(image.text["flowlift"])
        models = parameters["models"]
    assert parameters["vae"] == name
    # the named VAE's cached files are in the output's provenance, each with its content's SHA-256 (the name of its
    # blob in the hub cache, not read again: models.hub.cached_blob_sha256)
    snapshot = named_hub / f"models--{NAMED_VAES[name].repos[0].replace('/', '--')}" / "snapshots" / COMMIT
    weights = {p.name: p for p in snapshot.rglob("*") if p.suffix in (".safetensors", ".pth")}
    assert models["vae"] == {n: hashlib.sha256(p.read_bytes()).hexdigest() for n, p in weights.items()}, models


@pytest.mark.parametrize("name", VAE_NAMES)
def test_eval_vae_methods_take_every_named_vae(named_hub, photo, tmp_path, capsys, name):
    dataset = tmp_path / "photos"
    dataset.mkdir()
    shutil.copy(photo, dataset / "photo.png")
    out = tmp_path / "eval"
    code, err = _run(
        capsys,
        "eval",
        "--run",
        "vae-roundtrip,latent-bicubic",
        "--dataset",
        dataset,
        "--scale",
        "2",
        "--vae",
        name,
        "--device",
        "cpu",
        "-o",
        out,
    )
    assert code == 0, err
    assert any(out.rglob("*.json")), list(out.rglob("*"))


@pytest.mark.parametrize("name", VAE_NAMES)
def test_dataset_images_takes_every_named_vae(named_hub, shared, tmp_path, capsys, name):
    out = tmp_path / "data"
    code, err = _run(
        capsys,
        *one_crop_dataset_args(shared / "images" / "kodak" / "kodim05.png", name),
        "-o",
        out,
        "--no-progress",
    )
    assert code == 0, err
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["num_items"] == 1 and manifest["source"]["vae"] == name


@pytest.mark.parametrize("name", VAE_NAMES)
def test_img2img_takes_every_named_vae(named_hub, tmp_path, capsys, name):
    from safetensors.torch import save_file

    from tiny_flux2 import prompt_embeds, write_model_dir

    model = write_model_dir(tmp_path / "klein")
    embeds = tmp_path / "prompt.safetensors"
    save_file({"prompt_embeds": prompt_embeds()}, str(embeds))
    image = tmp_path / "in.png"
    Image.fromarray((torch.rand(48, 64, 3) * 255).to(torch.uint8).numpy(), "RGB").save(image)
    out = tmp_path / "out.png"
    code, err = _run(
        capsys,
        "img2img",
        image,
        "--model",
        model,
        "--vae",
        name,
        "--prompt-embeds",
        embeds,
        "--strength",
        "0.5",
        "--steps",
        "2",
        "-o",
        out,
    )
    assert code == 0, err
    with Image.open(out) as result:
        assert result.size == (64, 48)


@pytest.mark.parametrize("name", VAE_NAMES)
def test_the_web_app_offers_and_runs_every_named_vae(named_hub, upscaler, photo, tmp_path, name):
    from flowlift.app.service import AppConfig, AppService

    service = AppService(
        AppConfig(upscaler=str(upscaler), vaes=["taef2", name], device="cpu", work_dir=tmp_path / "work")
    )
    assert name in service.vae_labels
    result = service.upscale(str(photo), scale=2, vae=name)
    with Image.open(result.output) as image:
        assert image.size == (2 * W, 2 * H)


@pytest.mark.parametrize("command", ["upscale", "eval", "dataset images", "img2img", "hires", "app", "bands"])
def test_every_vae_option_lists_every_name(capsys, command):
    with pytest.raises(SystemExit):
        main([*command.split(), "-h"])
    text = " ".join(capsys.readouterr().out.split())
    for name in VAE_NAMES:
        assert f"{name} (" in text, (command, name)


def test_the_memory_plan_costs_mage_vae_as_mage():
    from flowlift.limits import decode_peak_bytes, vae_kind
    from flowlift.models.vae import MageVAE

    assert vae_kind(MageVAE.__new__(MageVAE)) == "mage"
    whole = decode_peak_bytes("mage", 4096, 4096, tiled=False)
    assert decode_peak_bytes("mage", 4096, 4096, tiled=True) < whole  # its exact tiled decode is bounded
    assert (
        decode_peak_bytes("taef2", 4096, 4096, tiled=False)
        < whole
        < decode_peak_bytes("flux2", 4096, 4096, tiled=False)
    )

"""The node pack's pure layout conversions and input checks (no ComfyUI needed), and its packaging."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tomllib
import torch

from flowlift.comfyui import layouts as L
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import patchify

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_scale_and_chunking_widgets():
    assert [L.passes_for(s) for s in L.SCALES] == [1, 2, 3]
    assert [L.chunked_flag(c) for c in L.CHUNKING] == [None, True, False]
    with pytest.raises(FlowliftError, match="scale must be one of"):
        L.passes_for("3x")


@pytest.mark.parametrize("channels", [4, 16, 32])
def test_non_flux2_latent_is_one_clear_error(channels):
    with pytest.raises(FlowliftError, match=r"needs a FLUX.2 LATENT \(batch, 128, h, w\)") as info:
        L.flux2_latents({"samples": torch.zeros(1, channels, 8, 8)}, "FlowliftUpscaleLatent")
    assert f"(1, {channels}, 8, 8)" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FlowliftError, match="got samples of shape"):
        L.flux2_latents({"samples": torch.zeros(1, 128, 2, 8, 8)}, "FlowliftUpscaleLatent")


def test_latent_round_trip_keeps_batch_index_and_resizes_the_mask():
    latents = torch.randn(2, 32, 8, 12)
    samples = patchify(latents)
    mask = torch.zeros(2, 1, 64, 96)
    mask[:, :, :32] = 1.0
    latent = {"samples": samples, "batch_index": [3, 4], "noise_mask": mask}
    assert torch.equal(L.flux2_latents(latent, "x"), latents)
    upscaled = torch.randn(2, 32, 32, 48)  # two passes
    out = L.upscaled_latent_dict(latent, upscaled, "cpu")
    assert torch.equal(out["samples"], patchify(upscaled)) and out["batch_index"] == [3, 4]
    assert out["noise_mask"].shape == (2, 1, 256, 384)
    assert out["noise_mask"][:, :, :120].min() == 1 and out["noise_mask"][:, :, 136:].max() == 0
    assert latent["samples"] is samples  # the input dict is not modified


def test_image_layouts_and_reference_matching():
    image = torch.rand(2, 16, 24, 4)  # NHWC with alpha
    nchw = L.image_to_nchw(image)
    assert nchw.shape == (2, 3, 16, 24) and torch.equal(nchw[:, 1], image[..., 1])
    assert torch.equal(L.nchw_to_image(nchw, "cpu"), image[..., :3])
    one = torch.rand(1, 3, 8, 12)
    assert L.matched_reference(nchw, one).shape == (2, 3, 8, 12)
    with pytest.raises(FlowliftError, match="integer multiple of the reference"):
        L.matched_reference(nchw, torch.rand(1, 3, 7, 6))
    with pytest.raises(FlowliftError, match="same integer scale on both axes"):  # 2x by 3x
        L.matched_reference(nchw, torch.rand(1, 3, 8, 8))
    with pytest.raises(FlowliftError, match="reference's own size"):
        L.matched_reference(nchw, nchw[:1])
    with pytest.raises(FlowliftError, match="3 reference images for 2 images"):
        L.matched_reference(nchw, torch.rand(3, 3, 8, 12))


def test_requirements_txt_is_pyproject_minus_torch():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    expected = [d for d in project["project"]["dependencies"] if not re.match(r"torch\b", d)]
    lines = [ln.strip() for ln in (REPO_ROOT / "requirements.txt").read_text().splitlines()]
    assert [ln for ln in lines if ln and not ln.startswith("#")] == expected
    assert project["tool"]["comfy"]["PublisherId"] and project["tool"]["comfy"]["DisplayName"]


def test_ui_copies_of_the_example_workflows_hold_the_same_nodes():
    folder = REPO_ROOT / "example_workflows"
    api_files = sorted(folder.glob("*.json"))
    assert len(api_files) == 3
    for path in api_files:
        api = json.loads(path.read_text())
        ui = json.loads((folder / "ui" / path.name).read_text())
        assert sorted(n["type"] for n in ui["nodes"]) == sorted(n["class_type"] for n in api.values()), path.name
        for node in ui["nodes"]:
            if node["type"] == "FlowliftUpscaleLatent":  # widget values in the saved order
                assert node["widgets_values"][0] == "4x" and node["widgets_values"][-1] == "auto"

"""Half a TAEF2 (a folder or file holding only the encoder or only the decoder): a run that encodes and decodes
refuses it once, when the VAE loads, in one line naming the missing half (each image failed with that line); a use
that needs one half (a decode-only node) still works. The halves are the real TAEF2's, split with safetensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.models.vae_loading import load_vae

pytestmark = pytest.mark.usefixtures("single_thread_torch")
HALVES = {"encoder": "taef2_encoder.pth", "decoder": "taef2_decoder.pth"}


def _half(shared: Path, root: Path, kept: str, how: str) -> Path:
    """A TAEF2 holding only ``kept``: the released .pth alone in a folder, or its tensors alone in a safetensors
    file (flowlift's ``encoder.{i}`` / ``decoder.{i}`` names)."""
    released = shared / "models" / "taef2" / HALVES[kept]
    folder = root / f"only-{kept}-{how}"
    folder.mkdir()
    if how == "pth":
        shutil.copy(released, folder / released.name)
        return folder
    state = torch.load(released, map_location="cpu", weights_only=True)
    save_file({f"{kept}.{k}": v.contiguous() for k, v in state.items()}, str(folder / "taef2.safetensors"))
    return folder / "taef2.safetensors"


@pytest.mark.parametrize("how", ["pth", "safetensors"])
@pytest.mark.parametrize("kept", ["encoder", "decoder"])
def test_a_run_that_needs_both_halves_refuses_one_at_load(shared, tmp_path, kept, how):
    spec = _half(shared, tmp_path, kept, how)
    from flowlift.models.vae_loading import ENCODE_DECODE

    missing = "decoder" if kept == "encoder" else "encoder"
    with pytest.raises(FlowliftError) as caught:
        load_vae(str(spec), needs=ENCODE_DECODE)
    text = str(caught.value)
    assert text.startswith(f"VAE {spec}: this TAEF2 has no {missing} (its weights hold only the {kept})"), text
    assert f"this run encodes and decodes: put taef2_{missing}.pth beside taef2_{kept}.pth" in text
    assert "\n" not in text and caught.value.fields == ("vae",)


def test_one_half_serves_a_use_that_needs_only_it(shared, tmp_path):
    decoder = load_vae(str(_half(shared, tmp_path, "decoder", "pth")), needs=("decode",))
    assert decoder.decode(torch.zeros(1, 32, 4, 4)).shape == (1, 3, 32, 32)
    plain = load_vae(str(_half(shared, tmp_path, "decoder", "safetensors")))  # a node's loader asks for nothing
    assert plain.decode(torch.zeros(1, 32, 4, 4)).shape == (1, 3, 32, 32)
    with pytest.raises(FlowliftError, match="this TAEF2 has no encoder"):
        plain.encode(torch.zeros(1, 3, 32, 32))  # a use that encodes still says so, once per call
    encoder = load_vae(str(_half(shared, tmp_path, "encoder", "pth")), needs=("encode",))
    assert encoder.encode(torch.zeros(1, 3, 32, 32)).shape == (1, 32, 4, 4)


def test_upscale_with_half_a_taef2_is_one_line_before_any_image(shared, tmp_path, capsys):
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    torch.manual_seed(0)
    weights = save_upscaler(
        FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0), tmp_path / "flow.safetensors"
    )
    images = tmp_path / "images"
    images.mkdir()
    for i in range(3):
        Image.new("RGB", (64, 48), (40 * i, 90, 160)).save(images / f"im{i}.png")
    vae = _half(shared, tmp_path, "encoder", "pth")
    out = tmp_path / "out"
    argv = ["upscale", str(images), "-o", str(out), "--vae", str(vae), "--upscaler", str(weights), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line or "failed" in line]
    assert len(lines) == 1 and lines[0].startswith(f"flowlift upscale: error: VAE {vae}: this TAEF2 has no decoder")
    assert "im0.png" not in err and not any(out.glob("*.png"))


@pytest.mark.parametrize("kept", ["encoder", "decoder"])
def test_a_dataset_with_half_a_taef2_is_one_line_before_any_shard(shared, tmp_path, capsys, kept):
    """Both dataset kinds encode the crops and decode them again for the conditioning."""
    vae = _half(shared, tmp_path, kept, "pth")
    out = tmp_path / "data"
    image = str(shared / "images" / "kodak" / "kodim03.png")
    argv = ["dataset", "images", image, "--vae", str(vae), "--crop-px", "64", "-o", str(out), "--device", "cpu"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"flowlift dataset: error: VAE {vae}: this TAEF2 has no" in err and "Traceback" not in err
    assert not any(out.glob("*.safetensors")) if out.exists() else True

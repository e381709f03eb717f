"""A diffusers FLUX.2 VAE folder whose config.json does not fit its weights (hand-edited to block_out_channels
[100000, ...]) is refused in one line naming config.json and the fix, before anything large is allocated: the
config is compared with the weights' shapes, and the model is built on the meta device (it was built at full size
first: gigabytes and seconds, or "can't allocate 360000000000 bytes" as the whole message)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.models.vae_loading import load_vae
from tiny_flux2 import tiny_vae

#: Parameters no layer of the tiny VAE comes near: one allocated off the meta device is the config's size.
LARGE = 1_000_000


@pytest.fixture
def nothing_large(monkeypatch):
    """Fail when a convolution or linear layer larger than :data:`LARGE` is given real memory."""
    for cls in (torch.nn.Conv2d, torch.nn.Linear):
        plain = cls.__init__

        def checked(self, *args, _plain=plain, **kwargs):
            _plain(self, *args, **kwargs)
            weight = self.weight
            assert weight.device.type == "meta" or weight.numel() < LARGE, f"allocated {tuple(weight.shape)}"

        monkeypatch.setattr(cls, "__init__", checked)


@pytest.fixture(scope="module")
def model():
    return tiny_vae()


def _folder(model, root: Path, **changes) -> Path:
    folder = root / "vae"
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    "changes, said",
    [
        (
            {"block_out_channels": [100000, 8, 8, 8]},
            "block_out_channels is [100000, 8, 8, 8], the weights hold [8, 8, 8, 8]",
        ),
        ({"block_out_channels": [4096, 8, 8, 8]}, "block_out_channels is [4096, 8, 8, 8]"),
        ({"layers_per_block": 5000}, "layers_per_block is 5000, the weights hold 1"),
        ({"latent_channels": 20000}, "latent_channels is 20000, the weights hold 32"),
        ({"decoder_block_out_channels": [8, 8, 8, 60000]}, "decoder_block_out_channels is [8, 8, 8, 60000]"),
        ({"down_block_types": ["DownEncoderBlock2D"] * 900}, "down_block_types lists 900 blocks, the weights hold 4"),
    ],
    ids=["huge width", "large width", "layers", "latent channels", "decoder widths", "block count"],
)
def test_a_config_that_contradicts_the_weights_is_one_line_naming_it(model, tmp_path, nothing_large, changes, said):
    folder = _folder(model, tmp_path, **changes)
    with pytest.raises(FlowliftError) as caught:
        load_vae(str(tmp_path))
    text = str(caught.value)
    assert text.startswith(f"FLUX.2 VAE config {folder / 'config.json'} does not match its weights: {said}"), text
    assert text.endswith("put back the config.json that came with these weights (fetch the folder again)")
    assert "\n" not in text


def test_a_config_missing_its_widths_is_checked_on_the_meta_model(model, tmp_path, nothing_large):
    """Without block_out_channels diffusers builds the released widths (128 to 512): the tensors are named, and
    that model is never given memory."""
    _folder(model, tmp_path, block_out_channels=None)
    with pytest.raises(
        FlowliftError, match=r"FLUX.2 VAE weights from .* does not match the architecture: .*mis-shaped"
    ):
        load_vae(str(tmp_path))


def test_a_matching_config_loads_the_weights_themselves(model, tmp_path):
    folder = _folder(model, tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        vae = load_vae(str(folder), dtype=dtype)
        loaded = vae.model.state_dict()
        assert all(t.device.type == "cpu" for t in loaded.values())
        for name, tensor in model.state_dict().items():
            assert loaded[name].dtype == (dtype if tensor.is_floating_point() else tensor.dtype), name
            assert torch.equal(loaded[name], tensor.to(loaded[name].dtype)), name

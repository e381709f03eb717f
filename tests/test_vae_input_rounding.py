"""A half-precision VAE's inputs are rounded once: ``2x - 1`` (the FLUX.2 VAE, Mage-VAE) and the latents' BatchNorm
(the FLUX.2 VAE's decode) are computed in float32 and only their result is rounded to the model's dtype.

Rounding the image to bfloat16 first and computing ``2x - 1`` in bfloat16 rounds every pixel under 1/4 twice
(bfloat16 has 8 bits; ``2x - 1`` of a dark value needs more), and rounding the normalized latents before
``z * bn_std + bn_mean`` rounds the raw latents twice. The pipeline hands flowlift's VAEs float32
(``vae_input_dtype``); a VAE object of the caller's own still gets its weights' dtype.
"""

from __future__ import annotations

import pytest
import torch

from builders import tiny_unet
from flowlift.flux2.latents import denormalize
from flowlift.models.mage_vae_files import mage_from_state_dict
from flowlift.models.vae import Flux2VAE
from flowlift.upscale.image_steps import vae_input_dtype
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from mage_files import released_state
from tiny_flux2 import tiny_vae

BF16 = torch.bfloat16


def dark_images() -> torch.Tensor:
    """Float32 images across [0, 1] with many values under 1/4, where bfloat16's ``2x - 1`` rounds a second time."""
    torch.manual_seed(3)
    return torch.rand(1, 3, 32, 48) ** 3


def captured_input(module: torch.nn.Module, call) -> torch.Tensor:
    """The first positional input ``module`` sees while ``call()`` runs."""
    seen: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach().clone()))
    try:
        call()
    finally:
        handle.remove()
    return seen[0]


def test_the_old_double_rounding_differs_so_these_tests_can_fail():
    images = dark_images()
    once = (images * 2 - 1).to(BF16)
    twice = images.to(BF16) * 2 - 1
    assert (once != twice).float().mean() > 0.05


def test_the_flux2_vae_encodes_two_x_minus_one_rounded_once():
    vae = Flux2VAE(tiny_vae().to(BF16))
    images = dark_images()
    seen = captured_input(vae.model.encoder, lambda: vae.encode(images))
    assert seen.dtype == BF16
    assert torch.equal(seen, (images * 2 - 1).to(BF16))


def test_the_flux2_vae_decodes_the_raw_latents_rounded_once():
    vae = Flux2VAE(tiny_vae().to(BF16))
    torch.manual_seed(4)
    latents = torch.randn(1, 32, 4, 6)
    seen = captured_input(vae.model.post_quant_conv, lambda: vae.decode(latents))
    assert torch.equal(seen, denormalize(latents, vae.bn_mean, vae.bn_std).to(BF16))
    rounded_first = denormalize(latents.to(BF16).float(), vae.bn_mean, vae.bn_std).to(BF16)
    assert not torch.equal(seen, rounded_first)


def test_mage_vae_encodes_two_x_minus_one_rounded_once():
    vae = mage_from_state_dict(released_state(seed=2), dtype=BF16)
    images = dark_images()
    seen = captured_input(vae.model.encoder, lambda: vae.encode(images, tiled=False))
    assert torch.equal(seen, (images * 2 - 1).to(BF16).contiguous(memory_format=torch.channels_last))


def test_float32_inputs_are_unchanged_in_float32_and_the_callers_images_untouched():
    vae = Flux2VAE(tiny_vae())
    images = dark_images()
    seen = captured_input(vae.model.encoder, lambda: vae.encode(images))
    assert seen.dtype == torch.float32 and torch.equal(seen, images * 2 - 1)
    assert torch.equal(images, dark_images())  # 2x - 1 is computed in place, on a copy


class _CallersVAE:
    """A VAE object of the caller's own, bfloat16 weights and no ``rounds_inputs_itself``: it gets its dtype."""

    spatial_factor = 8

    def __init__(self) -> None:
        self.scale = torch.ones((), dtype=BF16)
        self.dtypes: list[torch.dtype] = []

    def parameters(self):
        return iter([self.scale])

    def encode(self, images, tiled=None):
        self.dtypes.append(images.dtype)
        return (torch.nn.functional.avg_pool2d(images, 8).repeat(1, 11, 1, 1)[:, :32] * self.scale).float()

    def decode(self, latents, tiled=None):
        self.dtypes.append(latents.dtype)
        return torch.nn.functional.interpolate(latents[:, :3].float(), scale_factor=8, mode="nearest").clamp(0, 1)


def test_the_pipeline_hands_a_callers_vae_its_own_dtype():
    vae = _CallersVAE()
    assert vae_input_dtype(vae, torch.float32) == BF16
    pipeline = FlowUpscalerPipeline(tiny_unet(0), vae, device="cpu", dtype=BF16)
    pipeline.upscale_image(dark_images(), 1, output_type="pt")
    assert vae.dtypes == [BF16, BF16]


@pytest.mark.parametrize("method", ["encode", "decode"])
def test_the_pipeline_hands_flowlifts_vae_float32(monkeypatch, method):
    vae = Flux2VAE(tiny_vae().to(BF16))
    assert vae_input_dtype(vae, BF16) == torch.float32
    seen: list[torch.dtype] = []
    inner = getattr(Flux2VAE, method)

    def spy(self, x, **kwargs):
        seen.append(x.dtype)
        return inner(self, x, **kwargs)

    monkeypatch.setattr(Flux2VAE, method, spy)
    pipeline = FlowUpscalerPipeline(tiny_unet(0), vae, device="cpu", dtype=BF16)
    pipeline.upscale_image(dark_images(), 1, output_type="pt")
    assert seen == [torch.float32]

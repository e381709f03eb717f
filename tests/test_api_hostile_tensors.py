"""The Python API's tensor inputs that hold no usable values (a fifth hostile sweep's findings): a meta tensor (a
shape without data) given as an image, a mask, latents, prompt embeddings or a model's weights was a
``RuntimeError: Tensor.item() cannot be called on meta tensors`` (or ``NotImplementedError: Cannot copy out of meta
tensor``) from inside torch at every door; integer prompt embeddings were cast to float32 and run; and
``flux2_sigmas`` built a schedule of any length (``10**9`` steps: gigabytes of float64, the process killed). Each is
one FlowliftError line naming what to give.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flowlift import FlowliftError, FlowUpscalerPipeline, flux2_sigmas, refine_latents, save_upscaler
from test_api_arguments import _refused


def _meta(*shape):
    return torch.empty(*shape, device="meta")


@pytest.fixture(scope="module")
def refiner():
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.refiner import Flux2Refiner
    from tiny_flux2 import tiny_transformer, tiny_vae

    return Flux2Refiner(tiny_transformer(), load_vae(tiny_vae(), device="cpu", dtype=torch.float32))


def test_a_meta_tensor_is_one_line_at_the_upscalers_doors(unet, vae):
    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)
    _refused(lambda: pipe.upscale_image(_meta(1, 3, 64, 64), output_type="pt"), "the image", "meta tensor")
    _refused(lambda: pipe.upscale_image(_meta(1, 3, 64, 64).to(torch.uint8), output_type="pt"), "meta tensor")
    _refused(lambda: pipe.upscale_latents(_meta(1, 32, 8, 8)), "latents", "meta tensor")
    _refused(lambda: vae.encode(_meta(1, 3, 64, 64)), "VAE encode", "meta tensor")
    _refused(lambda: vae.decode(_meta(1, 32, 8, 8)), "VAE decode", "meta tensor")


def test_a_meta_tensor_is_one_line_at_the_refiners_doors(refiner):
    from flowlift.refine.settings import SamplingSettings
    from tiny_flux2 import prompt_embeds

    image, embeds, sampling = torch.rand(1, 3, 32, 32), prompt_embeds(), SamplingSettings(steps=2, seed=3)
    _refused(lambda: refiner.img2img(_meta(1, 3, 32, 32), strength=0.5, prompt_embeds=embeds), "images", "meta")
    _refused(lambda: refiner.inpaint(image, _meta(1, 1, 32, 32), prompt_embeds=embeds), "mask", "meta tensor")
    _refused(
        lambda: refiner.txt2img(height=32, width=32, sampling=sampling, prompt_embeds=_meta(*embeds.shape)),
        "prompt_embeds",
        "meta tensor",
    )
    _refused(lambda: refine_latents(lambda x, t: x, init_latents=_meta(1, 32, 4, 4)), "refine_latents", "meta")


def test_integer_prompt_embeddings_are_refused_not_cast(refiner):
    """They were cast to float32 and ran: embeddings are a text encoder's float output, never integers."""
    from flowlift.refine.settings import SamplingSettings
    from tiny_flux2 import prompt_embeds

    embeds = prompt_embeds().long()
    with pytest.raises(FlowliftError) as caught:
        refiner.txt2img(height=32, width=32, sampling=SamplingSettings(steps=2), prompt_embeds=embeds)
    assert caught.value.field == "prompt_embeds" and "float tensor" in str(caught.value), caught.value


def test_a_meta_model_is_one_line_and_nothing_is_written(tmp_path):
    from builders import tiny_unet

    target = tmp_path / "meta.safetensors"
    _refused(lambda: save_upscaler(tiny_unet(seed=0).to("meta"), target), "save_upscaler", "meta tensor")
    assert not target.exists()


def test_a_requires_grad_image_is_checked_without_torchs_warning():
    """``float(images.min())`` of a tensor that requires grad warned "Consider using tensor.detach() first"."""
    from flowlift.refine.canvas import checked_images

    images = torch.rand(1, 3, 16, 16).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked = checked_images(images)
    assert torch.equal(checked, images.detach())


@pytest.mark.parametrize("steps", [100_001, 2_000_000])
def test_flux2_sigmas_caps_its_step_count(steps):
    with pytest.raises(FlowliftError) as caught:
        flux2_sigmas(steps, 256)
    assert caught.value.field == "num_steps" and "at most 100000" in str(caught.value), caught.value
    assert len(flux2_sigmas(3000, 256)) == 3001  # a many-step reference schedule still builds


def test_refine_latents_names_a_meta_mask_statistic_or_velocity():
    """Each was a RuntimeError / NotImplementedError from torch, the velocity's after a whole step."""
    zero = lambda x, t: torch.zeros_like(x)  # noqa: E731
    init = torch.zeros(1, 32, 4, 4)
    _refused(
        lambda: refine_latents(zero, init_latents=init, denoising_start=0.5, mask=_meta(1, 1, 4, 4)), "mask", "meta"
    )
    _refused(lambda: refine_latents(zero, shape=(1, 32, 4, 4), bn_mean=torch.zeros(128), bn_std=_meta(128)), "bn_std")
    with pytest.raises(FlowliftError) as caught:
        refine_latents(lambda x, t: torch.empty(x.shape, device="meta"), shape=(1, 32, 4, 4))
    assert caught.value.field == "velocity_fn" and "input's device (cpu)" in str(caught.value), caught.value


class _Answers:
    """A caller's own latent upscaler that answers ``make(latents, passes)``."""

    def __init__(self, make):
        self.make = make

    def upscale_latents(self, latents, passes, **_):
        return self.make(latents, passes)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda z, n: [1], "latents must be a torch.Tensor"),  # was AttributeError: 'list' object has no 'float'
        (lambda z, n: torch.empty(1, 32, z.shape[2] << n, z.shape[3] << n, device="meta"), "meta tensor"),
        # the answer's NaN, named as the answer's: it said "the input latents", sending the user to their image
        (lambda z, n: torch.full((1, 32, z.shape[2] << n, z.shape[3] << n), float("nan")), "it returned contain non-"),
    ],
)
def test_the_hires_fix_checks_a_callers_upscalers_answer(refiner, make, words):
    from flowlift.refine.request import HiresSettings
    from flowlift.refine.settings import SamplingSettings
    from tiny_flux2 import prompt_embeds

    sampling = SamplingSettings(steps=2, seed=3)
    call = lambda: refiner.hires(  # noqa: E731
        _Answers(make),
        HiresSettings(),
        images=torch.rand(1, 3, 32, 32),
        sampling=sampling,
        prompt_embeds=prompt_embeds(),
    )
    _refused(call, "hires: the upscaler's upscale_latents", words)

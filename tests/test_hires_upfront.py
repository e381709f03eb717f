"""The hires fix refuses a memory budget its upscaler cannot meet before its base pass runs (issue 48 item 7's rule:
every plan a run cannot meet is refused before any work): the Flow Upscaler's passes and SesquiLSR, planned within
what the refiner's plan leaves them, asked through the upscaler's ``check_memory`` before the base latents exist.
"""

from __future__ import annotations

import pytest
import torch

from builders import save_tiny_unet
from flowlift.errors import FlowliftError
from flowlift.refine.refiner import Flux2Refiner
from flowlift.refine.request import HiresSettings
from flowlift.refine.settings import SamplingSettings
from flowlift.upscale.latent_source import FlowUpscalerSource, FractionalUpscaler
from flowlift.upscale.memory_plan import plan_latent_upscaler
from sesqui_reference import save_random_sesqui
from tiny_flux2 import Spy, prompt_embeds, tiny_transformer, tiny_vae


@pytest.fixture(scope="module")
def vae():
    from flowlift.models.vae_loading import load_vae

    return load_vae(tiny_vae(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def unet(tmp_path_factory):
    return str(save_tiny_unet(tmp_path_factory.mktemp("flow") / "flow_upscaler.safetensors", seed=0, cond_dim=32))


@pytest.fixture(scope="module")
def sesqui(tmp_path_factory):
    return f"sesqui:{save_random_sesqui(tmp_path_factory.mktemp('sesqui'))}"


class Refusing:
    """An upscaler whose memory plan refuses: it records what the hires fix asked, and never upscales."""

    def __init__(self):
        self.asked = []

    def check_memory(self, latent_size, num_passes, target, batch):
        self.asked.append((latent_size, num_passes, target, batch))
        raise FlowliftError("max_memory 1 MB is too small (a test's refusal)")

    def upscale_latents(self, latents, num_passes, **_):
        raise AssertionError("the hires fix upscaled after a refusal")


@pytest.mark.parametrize(("scale", "passes", "target"), [(4, 2, None), (3, 1, (12, 18))])
def test_the_hires_fix_asks_the_upscaler_before_its_base_pass(vae, scale, passes, target):
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae, device="cpu", dtype=torch.float32)
    upscaler = Refusing()
    with pytest.raises(FlowliftError, match="a test's refusal"):
        refiner.hires(
            upscaler,
            # 4x6 latents; a fraction needs a source that names SesquiLSR (never loaded here)
            HiresSettings(base_size=(48, 32), scale=scale, upscaler=FlowUpscalerSource(latent_upscaler="sesqui:x")),
            sampling=SamplingSettings(steps=2, seed=0),
            prompt_embeds=prompt_embeds(),
        )
    assert upscaler.asked == [((4, 6), passes, target, 1)]
    assert spy.seen == []  # the txt2img base never ran


def _source(unet, vae, budget, spec=None):
    return FlowUpscalerSource(unet, latent_upscaler=spec).load(
        vae, device="cpu", dtype=torch.float32, budget_bytes=budget
    )


def test_the_flow_upscalers_check_is_its_passes_plan(unet, vae):
    roomy = _source(unet, vae, 10**10)
    assert isinstance(roomy, FractionalUpscaler) and roomy.sesqui is None
    roomy.check_memory((16, 16), 2, None)  # holds
    latents = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    plain = _source(unet, vae, None)
    plain.check_memory((512, 512), 3, None)  # no budget: nothing to refuse
    expected = plain.pipeline.upscale_latents(latents, 1, seed=0)
    assert torch.equal(roomy.upscale_latents(latents, 1, seed=0), expected)  # the wrapper is the pipeline's passes
    # a latent upscale plans no decode: 64 MB holds these passes, where the FLUX.2 VAE's tiled decode alone is
    # estimated at 2 GiB (the plan once counted it and refused a hires fix's upscale for a decode it never runs)
    small = _source(unet, vae, 64 * 10**6)
    small.check_memory((8, 8), 2, None)
    assert torch.equal(small.upscale_latents(latents, 2, seed=0), plain.pipeline.upscale_latents(latents, 2, seed=0))
    assert "decode" not in small.pipeline.plan_memory(64, 64, 2, latents_only=True).describe()
    tight = _source(unet, vae, 2 * 10**6)
    with pytest.raises(FlowliftError) as refused:
        tight.check_memory((256, 256), 2, None)
    assert "\n" not in str(refused.value) and "max_memory" in str(refused.value)
    with pytest.raises(FlowliftError, match="needs a latent upscaler"):
        roomy.to_size(latents, (12, 12))


def test_sesquilsrs_part_of_the_check(unet, vae, sesqui):
    # passes that fit, SesquiLSR from their output that does not: the refusal names SesquiLSR
    probe = _source(unet, vae, 10**10, sesqui)
    weights = sum(p.numel() * 4 for m in (probe.pipeline.upscaler, probe.sesqui) for p in m.parameters())
    weights += sum(p.numel() * 4 for p in vae.model.parameters())
    frames = plan_latent_upscaler((64, 64), (96, 96), 10**12, 1, weights)[1]
    tight = _source(unet, vae, weights + (frames - weights) // 8, sesqui)
    tight.check_memory((32, 32), 1, None)  # the pass alone holds
    with pytest.raises(FlowliftError, match=r"SesquiLSR from 64x64 to 96x96 latents"):
        tight.check_memory((32, 32), 1, (96, 96))


def test_a_doors_cancel_reaches_sesquilsrs_layers(unet, vae, sesqui):
    # ComfyUI's interrupt (the pipeline's check_interrupt) before every SesquiLSR layer, whole frame or banded
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    checks = []

    def check():
        checks.append(1)
        if len(checks) == 5:
            raise KeyboardInterrupt("cancelled")

    pipeline = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, check_interrupt=check)
    upscaler = FractionalUpscaler.loading(pipeline, vae, sesqui)
    with pytest.raises(KeyboardInterrupt, match="cancelled"):
        upscaler.to_size(torch.randn(1, 32, 8, 8), (12, 12))
    assert len(checks) == 5
    hooked = [m for m in upscaler.sesqui.modules() if m._forward_pre_hooks]
    assert hooked == []  # the hooks are gone once it stopped

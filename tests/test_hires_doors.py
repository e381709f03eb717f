"""One hires fix behind every door (issue 38): the web app, ``flowlift hires`` and the InvokeAI node chain give the
same output for the same inputs and defaults, and the app and the command line name a capped 8x the same.

The app and the command line both run :meth:`~flowlift.refine.refiner.Flux2Refiner.hires` through the job; the InvokeAI
graph runs its two nodes' work (*Flow Upscale Latents*: ``raw_to_normalized`` -> ``upscale_latents`` ->
``normalized_to_raw``; *Tiled FLUX.2 Denoise*: :func:`flowlift.refine.loop.tiled_refine_raw_latents`), the
plain functions the nodes' ``invoke`` calls, here in the main environment on a tiny FLUX.2 folder.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from builders import refine_inputs, save_tiny_unet
from flowlift.app.refine_tab import refine
from flowlift.app.service import AppConfig, AppService
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from tiny_flux2 import prompt_embeds, write_model_dir

STEPS = "4"  # every other knob at its default


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("flux2-tiny"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = refine_inputs(tmp_path_factory.mktemp("hires-in"), "square.png", (64, 64), seed=4)
    save_tiny_unet(folder / "flow_upscaler.safetensors")
    return folder


def _flowlift_text(path):
    with Image.open(path) as image:
        return image.tobytes(), json.loads(image.text["flowlift"])


def test_the_apps_hires_fix_equals_the_command_lines(model_dir, inputs, tmp_path, monkeypatch, single_thread_torch):
    config = AppConfig(
        upscaler="flow_upscaler.safetensors",
        vaes=["taef2"],
        device="cpu",
        model=str(model_dir),
        work_dir=tmp_path / "app",
    )
    monkeypatch.chdir(inputs)  # both record the upscaler and the inputs by the names given: give the same
    service = AppService(config)
    try:
        app = refine(
            service, inputs / "square.png", None, inputs / "prompt.safetensors", "hires fix 2x", steps=int(STEPS)
        )
    finally:
        service.close()
    out = tmp_path / "cli.png"
    argv = [
        "hires",
        "--image",
        "square.png",
        "--model",
        str(model_dir),
        "--prompt-embeds",
        "prompt.safetensors",
        "--upscaler",
        "flow_upscaler.safetensors",
        "--steps",
        STEPS,
        "--no-progress",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    app_pixels, app_meta = _flowlift_text(app.output)
    cli_pixels, cli_meta = _flowlift_text(out)
    assert app.output.name == "square_hires2x.png" and app.output_size == (128, 128)
    assert app_meta["refine_strength"] == cli_meta["refine_strength"] == 0.3  # the table's, not img2img's 0.5
    assert app_meta == cli_meta and app_pixels == cli_pixels


def test_the_invokeai_node_chain_equals_the_hires_fix(model_dir, inputs, single_thread_torch):
    """Flow Upscale Latents then Tiled FLUX.2 Denoise, at the nodes' defaults, on the image's raw latents, equal
    the hires fix's refined latents (float32 on the CPU; the chain's raw/normalized round trips cost ~1e-6)."""
    from flowlift.files.images import load_image, to_tensor
    from flowlift.invokeai.latents import normalized_to_raw, raw_to_normalized
    from flowlift.refine.loading import load_refiner
    from flowlift.refine.loop import tiled_refine_raw_latents
    from flowlift.refine.request import HiresSettings
    from flowlift.refine.settings import REFINE_STRENGTH, SamplingSettings
    from flowlift.refine.tiling import TileRequest
    from flowlift.upscale.latent_source import FlowUpscalerSource
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    refiner = load_refiner(str(model_dir), device="cpu", dtype=torch.float32)
    images = to_tensor(load_image(inputs / "square.png")[0])
    embeds = prompt_embeds()
    sampling = SamplingSettings(steps=int(STEPS))
    weights = str(inputs / "flow_upscaler.safetensors")
    upscaler = FlowUpscalerSource(weights).load(refiner.vae, device="cpu", dtype=torch.float32)
    cli = refiner.hires(upscaler, HiresSettings(), images=images, sampling=sampling, prompt_embeds=embeds).latents

    vae = refiner.vae  # the nodes get InvokeAI's FLUX.2 VAE: its raw latents and BatchNorm statistics
    raw = vae.encode_raw(images)
    node_upscaler = FlowUpscalerPipeline(weights, vae=None, device="cpu", dtype=torch.float32)
    settings = HiresSettings()  # the Flow Upscale Latents node's defaults are the same knobs'
    upscaled = normalized_to_raw(
        node_upscaler.upscale_latents(
            raw_to_normalized(raw, vae.bn_mean, vae.bn_std),
            settings.passes,
            seed=sampling.seed,
            transplant_strength=settings.transplant_strength,
        ),
        vae.bn_mean,
        vae.bn_std,
    )
    refined_raw, _ = tiled_refine_raw_latents(
        refiner.transformer,
        upscaled,
        vae.bn_mean,
        vae.bn_std,
        embeds,
        strength=REFINE_STRENGTH.default,
        sampling=sampling,
        tiles=TileRequest(),
        device="cpu",
    )
    node = raw_to_normalized(refined_raw, vae.bn_mean, vae.bn_std)
    assert node.shape == cli.shape == (1, 32, 16, 16)
    torch.testing.assert_close(node, cli, atol=1e-4, rtol=0)
    # two prompts for one image: its tiles, stacked on the batch axis, would each take one (the refiner's rule)
    with pytest.raises(FlowliftError, match="prompt embeddings have a batch of 2 for 1 image"):
        tiled_refine_raw_latents(
            refiner.transformer,
            upscaled,
            vae.bn_mean,
            vae.bn_std,
            torch.cat([embeds, embeds]),
            strength=REFINE_STRENGTH.default,
            sampling=sampling,
            tiles=TileRequest(size=64, overlap=16, batch=2),
            device="cpu",
        )


def test_the_app_and_the_command_line_name_a_capped_8x_the_same(tmp_path):
    """An 8x of a 4096 px image stops at two passes under the 16K cap: ``_x4`` in both (it was ``_x8`` in the app)."""
    from flowlift.upscale.plan import UpscaleRequest, plan_upscale

    wide = tmp_path / "in" / "wide.png"
    wide.parent.mkdir()
    Image.new("RGB", (4096, 16)).save(wide)
    app_plan = AppService.plan([wide], tmp_path / "app", 8)
    cli_plan = plan_upscale(UpscaleRequest(inputs=[str(wide)], output=str(tmp_path / "cli"), passes=3))
    (app_job,), (cli_job,) = app_plan.jobs, cli_plan.jobs
    assert app_job.output.name == cli_job.output.name == "wide_x4.png"
    assert app_plan.sizes.passes_for(wide) == cli_plan.sizes.passes_for(wide) == 2
    assert app_job.expected_size == cli_job.expected_size == (16384, 64)


@pytest.fixture(scope="module")
def distilled_dir(tmp_path_factory):
    """The tiny folder marked as a step-distilled Klein (model_index.json ``is_distilled``): 4 steps by default."""
    root = write_model_dir(tmp_path_factory.mktemp("flux2-tiny-distilled"))
    (root / "model_index.json").write_text(json.dumps({"_class_name": "Flux2KleinPipeline", "is_distilled": True}))
    return root


@pytest.mark.parametrize("mode", ["img2img", "hires fix 2x"])
@pytest.mark.parametrize("distilled", [True, False], ids=["distilled", "base"])
def test_the_app_and_the_command_line_take_the_models_default_steps(
    mode, distilled, model_dir, distilled_dir, inputs, tmp_path, monkeypatch, single_thread_torch
):
    """Issue 48: the Refine tab ran 28 steps for every model while the commands ran the model's own (4 for a
    step-distilled Klein). With no steps given, the app and the command line run the same steps and write the same
    pixels and metadata, for a distilled and a non-distilled model, in img2img and the hires fix."""
    from flowlift.app.refine_tab import model_default_steps

    model = distilled_dir if distilled else model_dir
    config = AppConfig(
        upscaler="flow_upscaler.safetensors", vaes=["taef2"], device="cpu", model=str(model), work_dir=tmp_path / "app"
    )
    monkeypatch.chdir(inputs)
    service = AppService(config)
    try:
        app = refine(service, inputs / "square.png", None, inputs / "prompt.safetensors", mode)  # steps: the model's
    finally:
        service.close()
    out = tmp_path / "cli.png"
    command = (
        ["img2img", "square.png"]
        if mode == "img2img"
        else ["hires", "--image", "square.png", "--upscaler", "flow_upscaler.safetensors"]
    )
    argv = [*command, "--model", str(model), "--prompt-embeds", "prompt.safetensors", "--no-progress", "-o", str(out)]
    assert main(argv) == 0
    app_pixels, app_meta = _flowlift_text(app.output)
    cli_pixels, cli_meta = _flowlift_text(out)
    expected = 4 if distilled else 28
    assert model_default_steps(str(model))[0] == expected  # what the tab's steps control starts at
    assert app_meta["steps"] == cli_meta["steps"] == expected
    assert app_meta == cli_meta and app_pixels == cli_pixels

"""The three image/latent nodes: FlowliftUpscaleLatent, FlowliftUpscaleImage, FlowliftColorFix.

ComfyUI's part (memory management, progress bar, cancel, output device) is done here; the work is
flowlift's :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline` and
:func:`~flowlift.upscale.colorfix.lab_lowband_transplant`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
import torch

from flowlift.comfyui import layouts
from flowlift.comfyui.loaders import CATEGORY, UPSCALER_TYPE
from flowlift.comfyui.vae_adapters import ComfyFlux2VAE, TAEF2ComfyVAE
from flowlift.errors import FlowliftError
from flowlift.upscale.chunked.budget import CUDA_BUDGET_FRACTION
from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.node_choices import CHUNKING, SCALES, chunked_flag, passes_for
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.sizes import MAX_OUTPUT_SIDE

log = logging.getLogger("flowlift")


class Progress:
    """ComfyUI's progress bar over a run's stages (encode, each pass, decode, colour fix) and the strips
    of chunked passes. Every report is also a cancel point (ComfyUI's interrupt raises from here)."""

    UNITS = 100  # bar units per stage: strips move it by whole percents (at most 100 UI messages a stage)

    def __init__(self, stages: int) -> None:
        self.bar = comfy.utils.ProgressBar(max(1, stages) * self.UNITS)
        self.stages_done = 0
        self.shown = -1

    def _show(self, value: int) -> None:
        if value != self.shown:
            self.shown = value
            self.bar.update_absolute(value)

    def strip(self, done: int, total: int) -> None:
        mm.throw_exception_if_processing_interrupted()
        self._show(self.stages_done * self.UNITS + (self.UNITS * done) // max(1, total))

    def stage(self, _what: str = "") -> None:
        mm.throw_exception_if_processing_interrupted()
        self.stages_done += 1
        self._show(self.stages_done * self.UNITS)


def loaded_upscaler(
    model: comfy.model_patcher.ModelPatcher, also: Sequence[comfy.model_patcher.ModelPatcher] = ()
) -> torch.nn.Module:
    """Let ComfyUI's memory manager put the upscaler (and ``also``, in the same call, so that loading
    one cannot evict the other) on its device, unloading other models as needed."""
    if not isinstance(model, comfy.model_patcher.ModelPatcher):
        raise FlowliftError(f"expected a Flow Upscaler from FlowliftUpscalerLoader, got {type(model).__name__}")
    mm.load_models_gpu([model, *also], force_full_load=True)
    return model.model


def make_pipeline(
    model: comfy.model_patcher.ModelPatcher,
    vae: Any,
    chunked: str,
    progress: Progress,
    also: Sequence[comfy.model_patcher.ModelPatcher] = (),
) -> FlowUpscalerPipeline:
    """The flowlift pipeline over the loaded upscaler; chunking decided by ComfyUI's free memory."""
    unet = loaded_upscaler(model, also)
    param = next(unet.parameters())
    device = param.device
    budget = int(mm.get_free_memory(device) * CUDA_BUDGET_FRACTION)
    return FlowUpscalerPipeline(
        unet,
        vae,
        device=device,
        dtype=param.dtype,
        chunked=chunked_flag(chunked),
        chunk_budget_bytes=budget,
        on_strip=progress.strip,
        check_interrupt=mm.throw_exception_if_processing_interrupted,  # before every layer, strip and tile
    )


def run_logging_warnings(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; flowlift's warnings (e.g. passes dropped at the output cap) go to ComfyUI's log too."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    for item in caught:
        log.warning("flowlift: %s", item.message)
    return result


def upscaler_inputs() -> dict[str, tuple]:
    """Widgets shared by both upscale nodes, in their saved order."""
    return {
        "scale": (list(SCALES), {"default": "2x", "tooltip": "2x per pass: 2x = 1 pass, 4x = 2, 8x = 3"}),
        "seed": (
            "INT",
            {
                "default": 0,
                "min": 0,
                "max": layouts.SEED_MAX,
                "control_after_generate": True,  # the pack's frontend extension (web/) starts it at "fixed"
                "tooltip": "noise seed; the same seed gives the same image",
            },
        ),
        "transplant_strength": (
            "FLOAT",
            {
                "default": 1.0,
                "min": 0.0,
                "max": 1.0,
                "step": 0.05,
                "tooltip": "stage 1: how much of the latent low band comes from the input (1 = exactly)",
            },
        ),
    }


CHUNKED_INPUT = (
    list(CHUNKING),
    {
        "default": "auto",
        "tooltip": "exact bounded-memory UNet execution in row strips: auto = when the plain pass would not fit "
        "in half of the free memory",
    },
)


class FlowliftUpscaleLatent:
    """FLUX.2 LATENT -> 2x/4x/8x LATENT with the Flow Upscaler (stage 1 colour fix in latent space)."""

    DESCRIPTION = (
        "Upscales a FLUX.2 LATENT 2x per pass with the Flow Upscaler; equals flowlift's "
        "FlowUpscalerPipeline.upscale_latents for the same seed."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "upscale"

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802
        return {
            "required": {
                "upscaler": (UPSCALER_TYPE,),
                "samples": ("LATENT",),
                **upscaler_inputs(),
                "chunked": CHUNKED_INPUT,
            }
        }

    def upscale(
        self, upscaler: Any, samples: dict, scale: str, seed: int, transplant_strength: float, chunked: str
    ) -> tuple:
        checked = layouts.check_numbers("FlowliftUpscaleLatent", seed=seed, transplant_strength=transplant_strength)
        latents = layouts.flux2_latents(samples, "FlowliftUpscaleLatent")
        passes = passes_for(scale)
        progress = Progress(passes)
        pipeline = make_pipeline(upscaler, None, chunked, progress)
        result = run_logging_warnings(
            lambda: pipeline.upscale_latents(latents, passes, **checked, callback=progress.stage)
        )
        return (layouts.upscaled_latent_dict(samples, result, mm.intermediate_device()),)


class FlowliftUpscaleImage:
    """IMAGE -> 2x/4x/8x IMAGE: encode, Flow Upscaler passes, decode, both colour stages."""

    DESCRIPTION = (
        "Upscales an image with the Flow Upscaler through a FLUX.2 VAE or TAEF2, with both colour-drift "
        f"corrections; outputs are capped at {MAX_OUTPUT_SIDE} px a side (passes beyond are dropped with a warning)."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "upscale"

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802
        return {
            "required": {
                "image": ("IMAGE",),
                "upscaler": (UPSCALER_TYPE,),
                "vae": ("VAE", {"tooltip": "the FLUX.2 VAE (VAELoader) or TAEF2 (FlowliftTAEF2Loader)"}),
                **upscaler_inputs(),
                "color_fix_strength": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.0,
                        "max": 1.0,
                        "step": 0.05,
                        "tooltip": "stage 2: how much of the input's colour and tone (L*a*b* low band) to restore",
                    },
                ),
                "chunked": CHUNKED_INPUT,
            }
        }

    def upscale(
        self,
        image: torch.Tensor,
        upscaler: Any,
        vae: Any,
        scale: str,
        seed: int,
        transplant_strength: float,
        color_fix_strength: float,
        chunked: str,
    ) -> tuple:
        checked = layouts.check_numbers(
            "FlowliftUpscaleImage",
            seed=seed,
            transplant_strength=transplant_strength,
            color_fix_strength=color_fix_strength,
        )
        images = layouts.image_to_nchw(image, "FlowliftUpscaleImage")
        passes = passes_for(scale)
        progress = Progress(passes + 3)  # encode, passes, decode, colour fix
        if isinstance(vae, TAEF2ComfyVAE):
            flowlift_vae, also = vae.taef2, [vae.patcher]  # flowlift's own TAEF2 adapter: exact tiling by size
        else:  # ComfyUI's VAE loads itself when it encodes and decodes
            flowlift_vae, also = ComfyFlux2VAE(vae, mm.get_torch_device()), []
        pipeline = make_pipeline(upscaler, flowlift_vae, chunked, progress, also)
        if isinstance(flowlift_vae, ComfyFlux2VAE):
            flowlift_vae.device = pipeline.device  # decoded images meet the reference on the upscaler's device
        result = run_logging_warnings(
            lambda: pipeline.upscale_image(images, passes, **checked, output_type="pt", callback=progress.stage)
        )
        return (layouts.nchw_to_image(result, mm.intermediate_device()),)


class FlowliftColorFix:
    """Stage 2 alone: pin an upscaled image's colour and tone to its source (any upscaler's output)."""

    DESCRIPTION = (
        "Restores the source's colour and tone below its Nyquist (exact L*a*b* low-band transplant) in an image "
        "upscaled by any method; the image must be an integer multiple of the reference's size."
    )
    CATEGORY = CATEGORY
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "fix"

    @classmethod
    def INPUT_TYPES(cls) -> dict:  # noqa: N802
        return {
            "required": {
                "image": ("IMAGE", {"tooltip": "the upscaled image"}),
                "reference": ("IMAGE", {"tooltip": "the image it was upscaled from"}),
                "strength": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.05}),
            }
        }

    def fix(self, image: torch.Tensor, reference: torch.Tensor, strength: float) -> tuple:
        strength = layouts.check_numbers("FlowliftColorFix", strength=strength)["strength"]
        device = mm.get_torch_device()
        images = layouts.image_to_nchw(image, "FlowliftColorFix image").to(device)
        ref = layouts.matched_reference(images, layouts.image_to_nchw(reference, "FlowliftColorFix reference"))
        mm.throw_exception_if_processing_interrupted()
        result = lab_lowband_transplant(
            images, ref.to(device), strength, on_strip=mm.throw_exception_if_processing_interrupted
        )
        return (layouts.nchw_to_image(result, mm.intermediate_device()),)

"""The three image/latent nodes (ComfyUI's V3 schema): FlowliftUpscaleLatent, FlowliftUpscaleImage,
FlowliftColorFix. Their widgets' limits and defaults come from the knob tables
(:data:`flowlift.upscale.settings.UPSCALE_KNOBS`) through :func:`knob_input`.

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
import folder_paths
import torch
from comfy_api.latest import io

from flowlift.comfyui import layouts
from flowlift.comfyui.loaders import CATEGORY, NATIVE_TITLES, UPSCALER, UPSCALER_FOLDER, VAE_TOOLTIP
from flowlift.comfyui.vae_adapters import ComfyFlux2VAE, FlowliftComfyVAE
from flowlift.errors import FlowliftError
from flowlift.knobs import LATENT_UPSCALER, SEED, Knob
from flowlift.models.sesqui_lsr import require_bn_statistics
from flowlift.progress import StageParts
from flowlift.upscale.chunked.budget import CUDA_BUDGET_FRACTION
from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.latent_source import FractionalUpscaler
from flowlift.upscale.node_choices import (
    chunked_flag,
    image_latent_upscaler,
    image_plan,
    image_stage_work,
    latent_plan,
    latent_stage_work,
)
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import (
    CHUNKED,
    COLOR_FIX_KNOBS,
    COLOR_FIX_STRENGTH,
    SCALE,
    TRANSPLANT_STRENGTH,
    MemoryPolicy,
)
from flowlift.upscale.sizes import MAX_OUTPUT_SIDE, PassesDropped

log = logging.getLogger("flowlift")


class Progress:
    """ComfyUI's progress bar over a run's stages (encode, each pass, decode, colour fix) and the strips of chunked
    passes, as the share of the run's planned work (:class:`flowlift.progress.StageParts`, ``work``: the stages'
    relative weights, default equal). Every report is also a cancel point (ComfyUI's interrupt raises from here)."""

    UNITS = 100  # bar units per stage: at most 100 UI messages a stage

    def __init__(self, stages: int, work: Sequence[float] | None = None) -> None:
        self.parts = StageParts(stages, work)
        self.bar = comfy.utils.ProgressBar(self.parts.count * self.UNITS)
        self.shown = -1

    def _show(self) -> None:
        value = round(self.parts.fraction * self.parts.count * self.UNITS)
        if value != self.shown:
            self.shown = value
            self.bar.update_absolute(value)

    def strip(self, done: int, total: int) -> None:
        mm.throw_exception_if_processing_interrupted()
        self.parts.strip(done, total)
        self._show()

    def stage(self, _what: str = "") -> None:
        mm.throw_exception_if_processing_interrupted()
        self.parts.finished()
        self._show()


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
    latent_upscaler: str | None = None,
) -> FlowUpscalerPipeline:
    """The flowlift pipeline over the loaded upscaler; chunking decided by ComfyUI's free memory; SesquiLSR for the
    fraction of a size where ``latent_upscaler`` names it (``sesqui:PATH``)."""
    unet = loaded_upscaler(model, also)
    param = next(unet.parameters())
    device = param.device
    budget = int(mm.get_free_memory(device) * CUDA_BUDGET_FRACTION)
    with layouts.comfy_words():  # a latent upscaler with TAEF2 or Mage-VAE: one line in the pack's words
        return FlowUpscalerPipeline(
            unet,
            vae,
            device=device,
            dtype=param.dtype,
            memory=MemoryPolicy(chunked=chunked_flag(chunked), chunk_budget_bytes=budget),
            on_strip=progress.strip,
            check_interrupt=mm.throw_exception_if_processing_interrupted,  # before every layer, strip and tile
            latent_upscaler=latent_upscaler,
        )


def run_logging_warnings(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; flowlift's warnings go to ComfyUI's log too. Passes the output cap would drop fail the node in
    one line before any work (:class:`~flowlift.upscale.sizes.PassesDropped`): a ComfyUI user never sees the log,
    and an 8x asked came out 4x with status success."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", PassesDropped)
        try:
            with layouts.comfy_words():
                result = fn()
        except PassesDropped as dropped:
            raise FlowliftError(dropped.refusal) from None
    for item in caught:
        log.warning("flowlift: %s", item.message)
    return result


def knob_input(name: str, knob: Knob, tooltip: str | None = None, **extra: Any) -> io.Input:
    """A ComfyUI V3 widget from a knob of the tables: INT/FLOAT with its default, min, max and step, or a combo
    of its choices (labelled as the node packs show them), with the knob's help as tooltip (``tooltip``: a node's
    own words where its rule is narrower than the knob's)."""
    tooltip = knob.help if tooltip is None else tooltip
    if knob.choices:
        options = [knob.label(choice) for choice in knob.choices]
        return io.Combo.Input(name, options=options, default=knob.label(knob.default), tooltip=tooltip, **extra)
    widget = io.Int if knob.kind is int else io.Float
    return widget.Input(
        name, default=knob.default, step=knob.step, tooltip=tooltip, **layouts.widget_range(knob), **extra
    )


#: The latent node's scale: the knob's help says what the image doors do with any factor, which latents cannot.
LATENT_SCALE_HELP = (
    "output size / input size: 2, 4 or 8 run whole 2x passes; any other factor in [1, 8] needs a latent upscaler "
    "(SesquiLSR): the passes below it, then SesquiLSR to the size flowlift's hires fix refines at"
)


def upscaler_inputs(scale_help: str | None = None) -> list[io.Input]:
    """Widgets shared by both upscale nodes, in their saved order (``scale_help``: the scale's own tooltip)."""
    return [
        knob_input("scale", SCALE, scale_help),
        # the pack's frontend extension (web/) starts "control after generate" at "fixed"
        knob_input("seed", SEED, control_after_generate=True),
        knob_input("transplant_strength", TRANSPLANT_STRENGTH),
    ]


#: The latent upscaler widget's "no latent upscaler" choice: the fraction of a size is resampled in pixels.
NO_LATENT_UPSCALER = "none"


def latent_upscaler_input(without: str) -> io.Input:
    """An upscale node's optional latent upscaler: ``none`` (``without`` says what the node does then) or a SesquiLSR
    file of models/latent_upscale_models (the folder the Flow Upscaler's files share), the help from
    :data:`flowlift.knobs.LATENT_UPSCALER`."""
    return io.Combo.Input(
        "latent_upscaler",
        options=[NO_LATENT_UPSCALER, *folder_paths.get_filename_list(UPSCALER_FOLDER)],
        default=NO_LATENT_UPSCALER,
        tooltip=f"{LATENT_UPSCALER.help}, in models/{UPSCALER_FOLDER}; none: {without}. 2, 4 and 8 do not run it",
        optional=True,
    )


def latent_upscaler_spec(name: str) -> str | None:
    """The pipeline's ``latent_upscaler`` for the widget's choice: None for ``none``, else ``sesqui:PATH``."""
    if name == NO_LATENT_UPSCALER:
        return None
    return f"sesqui:{folder_paths.get_full_path_or_raise(UPSCALER_FOLDER, name)}"


class FlowliftUpscaleLatent(io.ComfyNode):
    """FLUX.2 LATENT -> 2x/4x/8x LATENT with the Flow Upscaler (stage 1 colour fix in latent space); any factor in
    [1, 8] with a latent upscaler and the FLUX.2 VAE's statistics (SesquiLSR for the fraction)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FlowliftUpscaleLatent",
            display_name="Flow Upscale Latent (flowlift)",
            category=CATEGORY,
            description="Upscales a FLUX.2 LATENT 2x per pass with the Flow Upscaler; equals flowlift's "
            "FlowUpscalerPipeline.upscale_latents for the same seed. With a latent upscaler (SesquiLSR) and the "
            "FLUX.2 VAE connected any scale in [1, 8]: the passes below it, then SesquiLSR to the size flowlift's "
            "hires fix refines at.",
            inputs=[
                UPSCALER.Input("upscaler"),
                io.Latent.Input("samples"),
                *upscaler_inputs(LATENT_SCALE_HELP),
                knob_input("chunked", CHUNKED),
                latent_upscaler_input("only 2, 4 and 8"),
                io.Vae.Input(
                    "vae", optional=True, tooltip="the FLUX.2 VAE (VAELoader): its BatchNorm statistics, for SesquiLSR"
                ),
            ],
            outputs=[io.Latent.Output()],
        )

    @classmethod
    def execute(
        cls,
        upscaler: Any,
        samples: dict,
        scale: float,
        seed: int,
        transplant_strength: float,
        chunked: str,
        latent_upscaler: str = NO_LATENT_UPSCALER,
        vae: Any = None,
    ) -> io.NodeOutput:
        checked = layouts.check_numbers(
            "FlowliftUpscaleLatent", scale=scale, seed=seed, transplant_strength=transplant_strength
        )
        latents = layouts.flux2_latents(samples, "FlowliftUpscaleLatent")
        spec = latent_upscaler_spec(latent_upscaler)
        passes, size = latent_plan(checked.pop("scale"), *latents.shape[-2:], fraction_last=spec is not None)
        statistics = latent_statistics(vae) if size is not None else None  # before any work: one line without
        progress = Progress(passes + (size is not None), latent_stage_work(passes, size, *latents.shape[-2:]))
        pipeline = make_pipeline(upscaler, None, chunked, progress)
        result = latents
        if passes:
            result = run_logging_warnings(
                lambda: pipeline.upscale_latents(latents, passes, **checked, callback=progress.stage)
            )
        if size is not None:  # the fraction: SesquiLSR, as flowlift's hires fix runs it
            result = FractionalUpscaler.loading(pipeline, statistics, spec).to_size(result, size)
            progress.stage()
        return io.NodeOutput(layouts.upscaled_latent_dict(samples, result, mm.intermediate_device()))


def latent_statistics(vae: Any) -> ComfyFlux2VAE:
    """The FLUX.2 VAE's BatchNorm statistics a latent upscaler needs, from the ``vae`` input (ComfyUI's FLUX.2 VAE);
    one line when it is not connected or has none (TAEF2, Mage-VAE)."""
    if vae is None:
        raise FlowliftError(
            "latent_upscaler: SesquiLSR on a LATENT needs the FLUX.2 VAE's BatchNorm statistics: connect the FLUX.2 "
            "VAE (VAELoader) to the node's vae input",
            field="latent_upscaler",
        )
    statistics = ComfyFlux2VAE(vae, mm.get_torch_device())
    with layouts.comfy_words():
        require_bn_statistics(statistics)
    return statistics


class FlowliftUpscaleImage(io.ComfyNode):
    """IMAGE -> IMAGE at any scale in [1, 8]: encode, Flow Upscaler passes, decode (then the resample to the size,
    or SesquiLSR before the decode with a latent upscaler), both colour stages."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FlowliftUpscaleImage",
            display_name="Flow Upscale Image (flowlift)",
            category=CATEGORY,
            description=f"Upscales an image with the Flow Upscaler through a FLUX.2 VAE, {NATIVE_TITLES}, with both "
            f"colour-drift corrections; outputs are capped at {MAX_OUTPUT_SIDE} px a side (a scale whose passes "
            "would pass the cap fails the node before any work, naming the largest scale that fits). A scale off "
            "2, 4, 8 is resampled in pixels, or with a latent upscaler (SesquiLSR, the FLUX.2 VAE only) resized in "
            "latent space before the decode. An alpha channel (RGBA IMAGE) is Lanczos-resized beside the colour.",
            inputs=[
                io.Image.Input("image"),
                UPSCALER.Input("upscaler"),
                io.Vae.Input("vae", tooltip=VAE_TOOLTIP),
                *upscaler_inputs(),
                knob_input("color_fix_strength", COLOR_FIX_STRENGTH),
                knob_input("chunked", CHUNKED),
                latent_upscaler_input("the fraction is resampled in pixels"),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def execute(
        cls,
        image: torch.Tensor,
        upscaler: Any,
        vae: Any,
        scale: float,
        seed: int,
        transplant_strength: float,
        color_fix_strength: float,
        chunked: str,
        latent_upscaler: str = NO_LATENT_UPSCALER,
    ) -> io.NodeOutput:
        checked = layouts.check_numbers(
            "FlowliftUpscaleImage",
            scale=scale,
            seed=seed,
            transplant_strength=transplant_strength,
            color_fix_strength=color_fix_strength,
        )
        what = "FlowliftUpscaleImage: the image input"
        images, alpha = layouts.image_to_nchw(image, what), layouts.image_alpha(image, what)
        spec = latent_upscaler_spec(latent_upscaler)
        passes, size = image_plan(
            checked.pop("scale"), images.shape[-1], images.shape[-2], fraction_last=spec is not None
        )
        batch, height, width = images.shape[0], *images.shape[-2:]
        # encode, passes, decode, colour fix, weighed as every door weighs them
        progress = Progress(passes + 3, image_stage_work(passes, size, width, height, batch, fraction_last=bool(spec)))
        if isinstance(vae, FlowliftComfyVAE):
            flowlift_vae, also = vae.adapter, [vae.patcher]  # flowlift's own adapter (TAEF2: exact tiling by size)
        else:  # ComfyUI's VAE loads itself when it encodes and decodes
            flowlift_vae, also = ComfyFlux2VAE(vae, mm.get_torch_device()), []
        latent = image_latent_upscaler(spec, size)  # 2, 4, 8: no SesquiLSR, whatever is selected
        pipeline = make_pipeline(upscaler, flowlift_vae, chunked, progress, also, latent_upscaler=latent)
        if isinstance(flowlift_vae, ComfyFlux2VAE):
            flowlift_vae.device = pipeline.device  # decoded images meet the reference on the upscaler's device
        result = run_logging_warnings(
            lambda: pipeline.upscale_image(
                images, passes, **checked, output_type="pt", callback=progress.stage, output_size=size
            )
        )
        return io.NodeOutput(layouts.nchw_to_image(result, mm.intermediate_device(), alpha))


class FlowliftColorFix(io.ComfyNode):
    """Stage 2 alone: pin an upscaled image's colour and tone to its source (any upscaler's output)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FlowliftColorFix",
            display_name="Colour Fix, stage 2 (flowlift)",
            category=CATEGORY,
            description="Restores the source's colour and tone below its Nyquist (exact L*a*b* low-band "
            "transplant) in an image upscaled by any method; the image must be an integer multiple of the "
            "reference's size. The image's alpha channel (RGBA IMAGE) is kept as it is.",
            inputs=[
                io.Image.Input("image", tooltip="the upscaled image"),
                io.Image.Input("reference", tooltip="the image it was upscaled from"),
                knob_input("strength", COLOR_FIX_KNOBS["strength"]),
            ],
            outputs=[io.Image.Output()],
        )

    @classmethod
    def execute(cls, image: torch.Tensor, reference: torch.Tensor, strength: float) -> io.NodeOutput:
        strength = layouts.check_numbers("FlowliftColorFix", strength=strength)["strength"]
        device = mm.get_torch_device()
        what = "FlowliftColorFix: the image input"
        images, alpha = layouts.image_to_nchw(image, what).to(device), layouts.image_alpha(image, what)
        ref = layouts.matched_reference(
            images, layouts.image_to_nchw(reference, "FlowliftColorFix: the reference input")
        )
        mm.throw_exception_if_processing_interrupted()
        result = lab_lowband_transplant(
            images, ref.to(device), strength, on_strip=mm.throw_exception_if_processing_interrupted
        )
        return io.NodeOutput(layouts.nchw_to_image(result, mm.intermediate_device(), alpha))  # the image's alpha

"""The InvokeAI invocations (ids ``flowlift_*``, category ``flowlift``), thin over flowlift's pipeline.

Invocation ids, field names and their meaning are part of every saved workflow: never rename them;
a change of behaviour bumps the invocation's version. Each node does InvokeAI's part (images,
tensors, the model cache, progress, cancel) and calls flowlift for the work:
:class:`flowlift.upscale.pipeline.FlowUpscalerPipeline` (noise, Euler step, stage 1, exact chunked
execution, encode/decode, stage 2) and :func:`flowlift.upscale.colorfix_image.color_fix_image` (stage 2
alone, what ``flowlift colorfix`` runs).

No ``from __future__ import annotations`` here: InvokeAI reads each ``invoke``'s return annotation
and each field's type at class creation.
"""

from contextlib import nullcontext
from typing import Literal

import torch
from invokeai.invocation_api import (
    BaseInvocation,
    ImageField,
    ImageOutput,
    Input,
    InputField,
    InvocationContext,
    LatentsField,
    LatentsOutput,
    ModelIdentifierField,
    ModelType,
    VAEField,
    WithBoard,
    WithMetadata,
    invocation,
)

from flowlift.devices import resolve_device
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.invokeai.denoise_node import TiledFlux2DenoiseInvocation  # noqa: F401  (registers it with the others)
from flowlift.invokeai.fields import CATEGORY, SEED_DESCRIPTION, knob_field
from flowlift.invokeai.files import checked_sesqui_spec
from flowlift.invokeai.latents import (
    Number,
    Seed,
    check_output_cap,
    check_raw_latents,
    normalized_to_raw,
    raw_to_normalized,
)
from flowlift.invokeai.models import (
    check_flux2_vae_field,
    flux2_vae_adapter,
    installed_model_path,
    load_native_vae_cached,
    load_upscaler_cached,
    native_vae_adapter,
    native_vae_words,
    on_device,
)
from flowlift.invokeai.progress import NodeProgress
from flowlift.knobs import LATENT_UPSCALER, SEED
from flowlift.limits import MAX_OUTPUT_SIDE
from flowlift.models.vae_loading import TAEF2_REPO
from flowlift.models.vae_names import NATIVE_VAES
from flowlift.models.weights import check_finite_result
from flowlift.upscale.colorfix_image import color_fix_image
from flowlift.upscale.latent_fraction import find_sesqui
from flowlift.upscale.latent_source import FractionalUpscaler
from flowlift.upscale.loading import DEFAULT_UPSCALER
from flowlift.upscale.node_choices import (
    CHUNKING,
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

#: The flowlift-run VAEs' names, for the image node's field (from the one declaration, flowlift.models.vae_names).
NATIVE_NAMES = ", ".join(f"{vae.name} ({vae.title}: {vae.summary})" for vae in NATIVE_VAES)
# InvokeAI reads each field's type at class creation: the choices become Literal types, from the knob table
Chunking = Literal[CHUNKING]  # type: ignore[valid-type]


UPSCALER_DESCRIPTION = (
    "Flow Upscaler weights when no installed model is chosen: a .safetensors file or folder on the InvokeAI "
    "server, or a Hugging Face repo id (downloaded once into the Hugging Face cache; HF_HUB_OFFLINE=1 is "
    "honoured). Loaded once per file content and kept in InvokeAI's model cache."
)
INSTALLED_DESCRIPTION = (
    "The {what} installed in InvokeAI's model manager (Model Manager: add the file or folder; it is listed as "
    "an unknown model). Used instead of the {field} field when chosen."
)


def installed_model_field(what: str, field: str) -> ModelIdentifierField | None:
    """An optional model-manager pick (InvokeAI lists flowlift's files as 'unknown' models)."""
    return InputField(
        default=None,
        title=f"{what} (installed)",
        description=INSTALLED_DESCRIPTION.format(what=what, field=field),
        ui_model_type=ModelType.Unknown,
    )


SCALE_DESCRIPTION = (
    f"Any factor in [{SCALE.low:g}, {SCALE.high:g}]: 2 = 1 pass, 4 = 2, 8 = 3; the image node resamples any other "
    f"factor from the fewest passes that reach it (outputs are capped at {MAX_OUTPUT_SIDE} px a side)"
)
TRANSPLANT_DESCRIPTION = (
    "Stage 1 colour fix: how much of each pass's latent low band comes from its input (1 = exactly, 0 = off)"
)
CHUNKED_DESCRIPTION = (
    "Exact bounded-memory UNet execution in row strips: auto = when the plain pass would not fit in half of "
    "the free memory; the result is the same either way"
)


LATENT_UPSCALER_DESCRIPTION = (
    f"Used instead of the installed SesquiLSR field when none is chosen: {LATENT_UPSCALER.help}; spelled sesqui:PATH "
    "(a file on the InvokeAI server). Empty: none (the image node resamples a fraction in pixels, the latents node "
    "takes 2, 4 and 8 only)"
)


def latent_upscaler_spec(context: InvocationContext, field: ModelIdentifierField | None, text: str) -> str | None:
    """The pipeline's ``latent_upscaler``: the installed SesquiLSR (``sesqui:`` its file) when ``field`` names one,
    else the text field's ``sesqui:PATH``, None when empty. Whatever the scale (2x does not run it), the file is
    checked at once as the other weight fields are (:func:`~flowlift.invokeai.files.check_weight_file`, then its
    tensors): every failure is the same line, which says nothing of a server file it is not (its size, its
    tensors' names, that it exists)."""
    spec = f"sesqui:{installed_model_path(context, field, '')}" if field is not None else text.strip() or None
    if spec is None:
        return None
    return checked_sesqui_spec(spec, shown=field.name if field is not None else text.strip())


@invocation(
    "flowlift_upscale_latents",
    title="Flow Upscale Latents (FLUX.2)",
    tags=["flowlift", "upscale", "latents", "flux2", "klein", "hires"],
    category=CATEGORY,
    version="1.2.0",  # 1.1.0: the installed-model fields (issue 32.G); 1.2.0: the latent upscaler (issue 46.3)
    use_cache=False,  # the result depends on the weight file's content, which the node cache cannot see
)
class FlowUpscaleLatentsInvocation(BaseInvocation):
    """Upscales FLUX.2 latents 2x/4x/8x with the Flow Upscaler (one Euler step per 2x pass, stage 1 colour
    fix), and with a latent upscaler (SesquiLSR) any factor in [1, 8]: the passes below it, then SesquiLSR to the
    size ``flowlift hires --latent-upscaler`` refines at. In and out: InvokeAI's raw FLUX.2 latents, so FLUX2
    Denoise (img2img, the hires fix) and Latents to Image - FLUX2 take the result directly."""

    latents: LatentsField = InputField(
        description="FLUX.2 latents (Image to Latents - FLUX2, FLUX2 Denoise)", input=Input.Connection
    )
    vae: VAEField = InputField(
        title="FLUX.2 VAE",
        description="The FLUX.2 VAE the latents belong to (for its BatchNorm statistics)",
        input=Input.Connection,
    )
    upscaler_model: ModelIdentifierField | None = installed_model_field("Flow Upscaler", "Flow Upscaler")
    upscaler: str = InputField(default=DEFAULT_UPSCALER, title="Flow Upscaler", description=UPSCALER_DESCRIPTION)
    scale: Number = knob_field(SCALE, SCALE_DESCRIPTION)
    seed: Seed = knob_field(SEED, SEED_DESCRIPTION)
    transplant_strength: Number = knob_field(TRANSPLANT_STRENGTH, TRANSPLANT_DESCRIPTION)
    chunked: Chunking = knob_field(CHUNKED, CHUNKED_DESCRIPTION)
    latent_upscaler_model: ModelIdentifierField | None = installed_model_field("SesquiLSR", "Latent upscaler")
    latent_upscaler: str = InputField(default="", title="Latent upscaler", description=LATENT_UPSCALER_DESCRIPTION)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        what = "Flow Upscale Latents (FLUX.2)"
        raw = check_raw_latents(context.tensors.load(self.latents.latents_name), what)
        spec = latent_upscaler_spec(context, self.latent_upscaler_model, self.latent_upscaler)
        passes, size = latent_plan(self.scale, raw.shape[-2], raw.shape[-1], fraction_last=spec is not None)
        pixels = (raw.shape[-2] * VAE_SCALE_FACTOR, raw.shape[-1] * VAE_SCALE_FACTOR)
        check_output_cap(*pixels, passes, what, self.scale, size)
        if size is not None:
            find_sesqui(spec)  # a wrong spec or a missing file: one line before anything loads
        check_flux2_vae_field(context, self.vae, what)
        with context.models.load(self.vae.vae).model_in_ram() as vae_module:
            vae = flux2_vae_adapter(vae_module, what)
        work = latent_stage_work(passes, size, raw.shape[-2], raw.shape[-1])
        progress = NodeProgress(context, what, passes + (size is not None), work)
        source = installed_model_path(context, self.upscaler_model, self.upscaler)
        upscaler = load_upscaler_cached(context, source, progress.check_cancel)
        with on_device(upscaler, "the Flow Upscaler") as (unet, device, dtype):
            pipeline = FlowUpscalerPipeline(
                unet,
                vae=None,
                device=device,
                dtype=dtype,
                memory=MemoryPolicy(chunked=chunked_flag(self.chunked)),
                channels_last=False,
                on_strip=progress.strip,
                check_interrupt=progress.check_cancel,  # before every layer: a cancel mid-pass stops within seconds
            )
            latents = raw_to_normalized(raw, vae.bn_mean, vae.bn_std)
            if passes:
                latents = pipeline.upscale_latents(
                    latents,
                    passes,
                    seed=self.seed,
                    transplant_strength=self.transplant_strength,
                    callback=progress.stage,
                )
            if size is not None:  # the fraction: SesquiLSR, as the hires fix runs it
                latents = FractionalUpscaler.loading(pipeline, vae, spec).to_size(latents, size)
                progress.stage("SesquiLSR")
        upscaled = check_finite_result(normalized_to_raw(latents.to("cpu"), vae.bn_mean, vae.bn_std), what)
        name = context.tensors.save(tensor=upscaled)
        return LatentsOutput.build(latents_name=name, latents=upscaled, seed=self.seed)


@invocation(
    "flowlift_upscale_image",
    title="Flow Upscale Image (FLUX.2)",
    tags=["flowlift", "upscale", "image", "flux2", *(vae.name for vae in NATIVE_VAES)],
    category=CATEGORY,
    version="1.2.0",  # 1.1.0: the installed-model fields (issue 32.G); 1.2.0: the latent upscaler (issue 46.3)
    use_cache=False,  # the result depends on the weight files' content, which the node cache cannot see
)
class FlowUpscaleImageInvocation(BaseInvocation, WithMetadata, WithBoard):
    """Upscales an image by any factor in [1, 8] through the whole Flow Upscaler pipeline: encode, passes, decode,
    both colour-drift corrections; off 2, 4, 8 the fewest passes that reach the size, then the pixel resample, or
    SesquiLSR in latent space before the decode (the latent upscaler, with the FLUX.2 VAE). An alpha channel is
    resized beside it."""

    image: ImageField = InputField(description="The image to upscale")
    vae: VAEField | None = InputField(
        default=None,
        title="FLUX.2 VAE",
        description="The FLUX.2 VAE (the upscaler's own latent space, slower); leave unconnected to use the "
        "flowlift VAE below (TAEF2 or Mage-VAE)",
        input=Input.Connection,
    )
    taef2_model: ModelIdentifierField | None = installed_model_field("TAEF2", "TAEF2")
    taef2: str = InputField(
        default=TAEF2_REPO,
        title="TAEF2",
        description=f"The VAE flowlift runs when no VAE is connected and no installed TAEF2 is chosen: "
        f"{NATIVE_NAMES}; or a folder on the InvokeAI server with taef2_encoder.pth and taef2_decoder.pth, one "
        ".safetensors file (TAEF2, or Mage-VAE as released), or a Hugging Face repo id",
    )
    upscaler_model: ModelIdentifierField | None = installed_model_field("Flow Upscaler", "Flow Upscaler")
    upscaler: str = InputField(default=DEFAULT_UPSCALER, title="Flow Upscaler", description=UPSCALER_DESCRIPTION)
    scale: Number = knob_field(SCALE, SCALE_DESCRIPTION)
    seed: Seed = knob_field(SEED, SEED_DESCRIPTION)
    transplant_strength: Number = knob_field(TRANSPLANT_STRENGTH, TRANSPLANT_DESCRIPTION)
    color_fix_strength: Number = knob_field(
        COLOR_FIX_STRENGTH,
        "Stage 2 colour fix: how much of the input's colour and tone (L*a*b* low band) to restore",
    )
    chunked: Chunking = knob_field(CHUNKED, CHUNKED_DESCRIPTION)
    latent_upscaler_model: ModelIdentifierField | None = installed_model_field("SesquiLSR", "Latent upscaler")
    latent_upscaler: str = InputField(default="", title="Latent upscaler", description=LATENT_UPSCALER_DESCRIPTION)

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> ImageOutput:
        what = "Flow Upscale Image (FLUX.2)"
        image = context.images.get_pil(self.image.image_name)
        spec = latent_upscaler_spec(context, self.latent_upscaler_model, self.latent_upscaler)
        # passes over the 16K cap: one line naming the scale and their canvas, before any work
        passes, size = image_plan(self.scale, image.width, image.height, fraction_last=spec is not None)
        if self.vae is not None:
            check_flux2_vae_field(context, self.vae, what)
        # encode, passes, decode, colour fix, weighed as every door weighs them
        work = image_stage_work(passes, size, image.width, image.height, fraction_last=spec is not None)
        progress = NodeProgress(context, what, passes + 3, work)
        source = installed_model_path(context, self.upscaler_model, self.upscaler)
        upscaler = load_upscaler_cached(context, source, progress.check_cancel)
        if self.vae is not None:
            vae_model = context.models.load(self.vae.vae)
        else:
            taef2 = installed_model_path(context, self.taef2_model, self.taef2)
            vae_model = load_native_vae_cached(context, taef2, progress.check_cancel)
        with (
            on_device(upscaler, "the Flow Upscaler") as (unet, device, dtype),
            vae_model.model_on_device() as (_, module),
        ):
            vae = flux2_vae_adapter(module, what) if self.vae is not None else native_vae_adapter(module)
            pipeline = FlowUpscalerPipeline(
                unet,
                vae,
                device=device,
                dtype=dtype,
                memory=MemoryPolicy(chunked=chunked_flag(self.chunked)),
                channels_last=False,
                on_strip=progress.strip,
                check_interrupt=progress.check_cancel,  # before every layer, strip and tile: encode and decode too
                latent_upscaler=image_latent_upscaler(spec, size),  # 2, 4, 8: checked above, never loaded
            )
            progress.begin("encode")
            # a decode-only Mage-VAE file asked to encode: one line naming the TAEF2 field that gave it
            with native_vae_words() if self.vae is None else nullcontext():
                result = pipeline.upscale_image(
                    image,
                    passes,
                    seed=self.seed,
                    transplant_strength=self.transplant_strength,
                    color_fix_strength=self.color_fix_strength,
                    output_type="pil",
                    callback=progress.stage,
                    on_decode_tile=progress.tile,
                    output_size=size,
                )
        return ImageOutput.build(context.images.save(image=result))


@invocation(
    "flowlift_color_fix",
    title="Colour Fix",
    tags=["flowlift", "color", "colour", "fix", "upscale", "drift"],
    category=CATEGORY,
    version="1.0.0",
)
class ColourFixInvocation(BaseInvocation, WithMetadata, WithBoard):
    """Restores the original's colour and tone in an upscaled image (flowlift's stage 2, an exact L*a*b*
    low-band transplant), whatever made it: the Upscale tab's models, a spandrel upscaler, an editor.
    The image must be an integer multiple >= 2 of the original's size on both axes."""

    image: ImageField = InputField(description="The upscaled image")
    reference: ImageField = InputField(description="The original it was upscaled from")
    strength: Number = knob_field(
        COLOR_FIX_KNOBS["strength"], "Share of the colour/tone difference removed (1 = all of it)"
    )

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> ImageOutput:
        progress = NodeProgress(context, "Colour Fix", 1)
        upscaled = context.images.get_pil(self.image.image_name)
        reference = context.images.get_pil(self.reference.image_name)
        progress.begin("colour fix")
        device = resolve_device(context.config.get().device)
        # a cancel stops the fix between row strips, as it stops the upscale nodes' stages
        fixed = color_fix_image(upscaled, reference, self.strength, device=device, on_strip=progress.check_cancel)
        progress.stage("colour fix")
        return ImageOutput.build(context.images.save(image=fixed))

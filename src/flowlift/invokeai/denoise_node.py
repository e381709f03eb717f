"""The Tiled FLUX.2 Denoise invocation (id ``flowlift_tiled_flux2_denoise``): flowlift's tiled refine loop on
InvokeAI's FLUX.2 transformer, with the transformer's LoRAs applied as InvokeAI's own FLUX.2 Denoise applies them.

InvokeAI does its part (the model cache, LoRA patching with its ``LayerPatcher``, conditioning, tensors, progress
and cancel); the work is :func:`flowlift.refine.loop.tiled_refine_raw_latents`, the loop ``flowlift hires`` runs.
What the tiled loop cannot honour is one error line, never a result made without it: a regional mask on the
prompt, a transformer that is no FLUX.2 one.

No ``from __future__ import annotations`` here: InvokeAI reads ``invoke``'s return annotation and each field's type
at class creation.
"""

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from invokeai.invocation_api import (
    BaseInvocation,
    BaseModelType,
    FluxConditioningField,
    Input,
    InputField,
    InvocationContext,
    LatentsField,
    LatentsOutput,
    ModelFormat,
    ModelType,
    TransformerField,
    VAEField,
    invocation,
)

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.invokeai.fields import CATEGORY, SEED_DESCRIPTION, knob_field, text_knob_field
from flowlift.invokeai.latents import Count, Number, Seed, check_raw_latents, knob_text
from flowlift.invokeai.models import check_flux2_vae_field, flux2_vae_adapter
from flowlift.invokeai.progress import NodeProgress
from flowlift.knobs import SEED
from flowlift.models.weights import check_finite_result
from flowlift.refine.loop import tiled_refine_raw_latents, tiling_line
from flowlift.refine.settings import (
    DISTILLED_STEPS,
    REFINE_STRENGTH,
    STEPS,
    TILE_BATCH,
    TILE_OVERLAP,
    TILE_SIZE,
    SamplingSettings,
)
from flowlift.refine.tiling import TileRequest

TITLE = "Tiled FLUX.2 Denoise (flowlift)"
#: The tiled denoise's text fields' types: checked by their knobs as the graph arrives.
TileSizeText = knob_text(TILE_SIZE)
TileBatchText = knob_text(TILE_BATCH)
#: Weight formats InvokeAI patches through sidecar layers (their weights cannot take a LoRA in place), as its own
#: FLUX.2 Denoise decides.
QUANTIZED_FORMATS = frozenset(
    {
        ModelFormat.BnbQuantizedLlmInt8b,
        ModelFormat.BnbQuantizednf4b,
        ModelFormat.GGUFQuantized,
        ModelFormat.SDNQQuantized,
    }
)


def check_flux2_transformer_field(context: InvocationContext, field: TransformerField, what: str) -> Any:
    """The stored model config of ``field``'s transformer, or one error line unless it is a FLUX.2 main model
    (the field's type is shared by every transformer family, so the graph lets any be connected)."""
    config = context.models.get_config(field.transformer)
    if config.base != BaseModelType.Flux2 or config.type != ModelType.Main:
        raise FlowliftError(
            f"{what} needs a FLUX.2 (Klein) transformer, got {config.name!r}, a {config.base.value} "
            f"{config.type.value}: connect the transformer of a FLUX.2 model loader"
        )
    return config


def check_no_regional_mask(field: FluxConditioningField, what: str) -> None:
    """One error line when the prompt carries a regional mask: the tiled loop conditions every tile on the whole
    prompt, so the mask would be dropped without a word."""
    if getattr(field, "mask", None) is not None:
        raise FlowliftError(
            f"{what}: Positive Text Conditioning carries a regional mask, which the tiled denoise does not apply: "
            "disconnect the mask from the text encoder node (or use FLUX2 Denoise for regional prompts)"
        )


def transformer_loras(
    context: InvocationContext, field: TransformerField, transformer: torch.nn.Module, cached_weights: Any, config: Any
) -> AbstractContextManager:
    """The LoRAs on ``field`` patched into ``transformer`` for the block, with InvokeAI's own ``LayerPatcher`` as
    its FLUX.2 Denoise does (BFL-named LoRAs converted to the diffusers names, the FLUX LoRA prefix, sidecar layers
    for quantized weights); the weights are restored when the block ends, also on an error or a cancel."""
    from invokeai.backend.patches.layer_patcher import LayerPatcher
    from invokeai.backend.patches.lora_conversions.flux_bfl_peft_lora_conversion_utils import (
        convert_bfl_lora_patch_to_diffusers,
    )
    from invokeai.backend.patches.lora_conversions.flux_lora_constants import FLUX_LORA_TRANSFORMER_PREFIX

    def patches() -> Iterator[Any]:
        for lora in field.loras:
            loaded = context.models.load(lora.lora)
            yield (convert_bfl_lora_patch_to_diffusers(loaded.model), lora.weight, loaded.model_in_ram())

    return LayerPatcher.apply_smart_model_patches(
        model=transformer,
        patches=patches(),
        prefix=FLUX_LORA_TRANSFORMER_PREFIX,
        dtype=transformer.dtype,
        cached_weights=cached_weights,
        force_sidecar_patching=config.format in QUANTIZED_FORMATS,
    )


@invocation(
    "flowlift_tiled_flux2_denoise",
    title=TITLE,
    tags=["flowlift", "flux2", "klein", "denoise", "tiled", "hires", "refine"],
    category=CATEGORY,
    version="1.1.0",  # 1.1.0: the transformer's LoRAs applied; steps default 4 (InvokeAI's FLUX2 Denoise's)
)
class TiledFlux2DenoiseInvocation(BaseInvocation):
    """FLUX.2 img2img refine of latents in overlapping tiles (flowlift's refine loop, the one ``flowlift hires``
    runs), so a Klein hires fix reaches 4x: every tile sees the transformer at a size it was trained on, and the
    tiles' velocities are blended at every step (no seams to fix). Connect the latents of Flow Upscale Latents."""

    latents: LatentsField = InputField(description="Raw FLUX.2 latents to refine (e.g. Flow Upscale Latents)")
    transformer: TransformerField = InputField(
        title="Transformer",
        description="The FLUX.2 (Klein) transformer, with its LoRAs (a FLUX.2 LoRA loader before it)",
        input=Input.Connection,
    )
    positive_text_conditioning: FluxConditioningField = InputField(
        title="Positive Text Conditioning",
        description="The prompt, from a FLUX.2 text encoder node (without a regional mask)",
        input=Input.Connection,
    )
    vae: VAEField = InputField(
        title="FLUX.2 VAE",
        description="The FLUX.2 VAE the latents belong to (for its BatchNorm statistics)",
        input=Input.Connection,
    )
    strength: Number = knob_field(REFINE_STRENGTH, "How much the refine changes the latents (img2img strength)")
    num_steps: Count = knob_field(
        STEPS,
        f"Steps of the full schedule: {DISTILLED_STEPS} for a step-distilled Klein, 28 for Klein base",
        default=DISTILLED_STEPS,
    )
    seed: Seed = knob_field(SEED, SEED_DESCRIPTION)
    tile_size: TileSizeText = text_knob_field(TILE_SIZE, TILE_SIZE.help[:1].upper() + TILE_SIZE.help[1:])
    tile_overlap: Count = knob_field(TILE_OVERLAP)
    tile_batch: TileBatchText = text_knob_field(TILE_BATCH, TILE_BATCH.help[:1].upper() + TILE_BATCH.help[1:])

    @torch.no_grad()
    def invoke(self, context: InvocationContext) -> LatentsOutput:
        raw = check_raw_latents(context.tensors.load(self.latents.latents_name), TITLE)
        tiles = TileRequest.parse(self.tile_size, self.tile_overlap, self.tile_batch)
        sampling = SamplingSettings(steps=self.num_steps, seed=self.seed)
        check_flux2_vae_field(context, self.vae, TITLE)
        config = check_flux2_transformer_field(context, self.transformer, TITLE)
        check_no_regional_mask(self.positive_text_conditioning, TITLE)
        with context.models.load(self.vae.vae).model_in_ram() as vae_module:
            vae = flux2_vae_adapter(vae_module, TITLE)
        conditioning = context.conditioning.load(self.positive_text_conditioning.conditioning_name).conditionings[0]
        progress = NodeProgress(context, TITLE, self.num_steps)
        progress.begin("refine")
        with ExitStack() as stack:
            loaded = context.models.load(self.transformer.transformer)
            cached_weights, transformer = stack.enter_context(loaded.model_on_device())
            stack.enter_context(transformer_loras(context, self.transformer, transformer, cached_weights, config))
            # a cancel takes effect before the transformer's next call, so within one tile (a step is many)
            stack.callback(transformer.register_forward_pre_hook(lambda *_: progress.check_cancel()).remove)
            device = next(transformer.parameters()).device
            refined, record = tiled_refine_raw_latents(
                transformer,
                raw,
                vae.bn_mean,
                vae.bn_std,
                conditioning.t5_embeds.to(device=device, dtype=transformer.dtype),
                strength=self.strength,
                sampling=sampling,
                tiles=tiles,
                device=device,
                on_step=lambda *_: progress.stage("refine step"),
            )
        frame = (raw.shape[2] * VAE_SCALE_FACTOR, raw.shape[3] * VAE_SCALE_FACTOR)
        context.logger.info(f"flowlift: {TITLE}: {tiling_line(frame, record)}")
        refined = check_finite_result(refined.to("cpu"), f"{TITLE}: the transformer")
        name = context.tensors.save(tensor=refined)
        return LatentsOutput.build(latents_name=name, latents=refined, seed=self.seed)

"""What a :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`'s memory settings plan: its models, dtypes and
``max_memory`` handed to :func:`flowlift.upscale.memory_plan.plan_upscale_memory` (the whole upscale) or
:func:`~flowlift.upscale.memory_plan.plan_encode` (an encode on its own), its memory policy's explicit modes held
and checked there.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flowlift.limits import model_bytes, vae_kind
from flowlift.upscale.image_steps import vae_dtype
from flowlift.upscale.memory_plan import StageChoices, UpscaleMemoryPlan, plan_encode, plan_upscale_memory
from flowlift.upscale.pass_plan import StoreSite, stores_can_leave

__all__ = ["encode_tiling", "pipeline_plan", "pipeline_weight_bytes", "store_site"]


def pipeline_weight_bytes(pipeline: Any) -> int:
    """Bytes of a :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`'s models (UNet, VAE, SesquiLSR)."""
    return sum(model_bytes(m) for m in (pipeline.upscaler, pipeline.vae, pipeline.sesqui))


def pipeline_plan(
    pipeline: Any, sizes: tuple[int, int, int, int], choices: StageChoices, latents_only: bool
) -> UpscaleMemoryPlan:
    """:func:`~flowlift.upscale.memory_plan.plan_upscale_memory` for a pipeline's models, dtypes and
    ``max_memory``: ``sizes`` (height, width, passes, batch) of its model input; its memory policy's explicit
    ``chunked``/``vae_tiled``/``chunk_rows`` go into ``choices`` (held and checked), and where its passes' stores may
    go (off its device unless that is the CPU or its ``offload_device``); ``latents_only``: no encode, decode or
    stage 2."""
    height, width, num_passes, batch = sizes
    return plan_upscale_memory(
        height,
        width,
        num_passes,
        pipeline.max_memory,
        batch=batch,
        base_channels=int(getattr(pipeline.upscaler, "config", {}).get("base_channels", 384)),
        unet_dtype=pipeline.dtype,
        vae_kind=None if latents_only else vae_kind(pipeline.vae),
        vae_dtype=vae_dtype(pipeline.vae, pipeline.dtype),
        weight_bytes=pipeline_weight_bytes(pipeline),
        spatial_factor=pipeline.spatial_factor,
        choices=replace(
            choices,
            chunked=pipeline.chunked,
            vae_tiled=pipeline.vae_tiled,
            chunk_rows=pipeline.chunk_rows,
            stores=store_site(pipeline),
        ),
    )


def store_site(pipeline: Any) -> StoreSite:
    """Where a pipeline's passes in strips may keep their stores: off its device (on its ``offload_device``, else the
    host) unless that is the device itself, the explicit ``offload_device`` named for a refusal."""
    offload = pipeline.offload_device
    return StoreSite(stores_can_leave(pipeline.device, offload), None if offload is None else str(offload))


def encode_tiling(pipeline: Any, shape: tuple[int, ...]) -> bool | None:
    """A pipeline's VAE encode tiling for a (batch, 3, height, width) model input on its own (``encode_image``):
    within ``max_memory`` as :func:`~flowlift.upscale.memory_plan.plan_encode` plans it (the memory policy's
    ``vae_tiled`` held and checked); without a budget the policy's, None where it leaves it (the VAE's own rule)."""
    if pipeline.max_memory is None or pipeline.vae is None:
        return pipeline.vae_tiled
    sizes = {"batch": shape[0], "dtype": vae_dtype(pipeline.vae, pipeline.dtype), "tiled": pipeline.vae_tiled}
    kind, weights = vae_kind(pipeline.vae), pipeline_weight_bytes(pipeline)
    return plan_encode(kind, shape[-2], shape[-1], pipeline.max_memory, weight_bytes=weights, **sizes)[0]

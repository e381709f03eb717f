"""The five ComfyUI nodes (classic ``NODE_CLASS_MAPPINGS`` API), thin over flowlift's pipeline.

Node ids and the order of their widgets are part of every saved workflow: never rename or reorder
them; add new inputs at the end (as optional inputs where possible).

Each node does ComfyUI's part (folders, memory management, progress bar, cancel, output device) and
calls flowlift for the work: :class:`flowlift.upscale.pipeline.FlowUpscalerPipeline` (noise, Euler step,
stage 1, exact chunked execution, encode/decode, stage 2), :func:`flowlift.upscale.colorfix.lab_lowband_transplant`
(stage 2 alone) and :func:`flowlift.models.vae_loading.load_vae` (TAEF2). Loaders: :mod:`flowlift.comfyui.loaders`;
the others: :mod:`flowlift.comfyui.upscale_nodes`.
"""

from __future__ import annotations

from flowlift.comfyui.loaders import FlowliftTAEF2Loader, FlowliftUpscalerLoader, ensure_model_folders
from flowlift.comfyui.upscale_nodes import FlowliftColorFix, FlowliftUpscaleImage, FlowliftUpscaleLatent

ensure_model_folders()

NODE_CLASS_MAPPINGS = {
    "FlowliftUpscalerLoader": FlowliftUpscalerLoader,
    "FlowliftUpscaleLatent": FlowliftUpscaleLatent,
    "FlowliftUpscaleImage": FlowliftUpscaleImage,
    "FlowliftColorFix": FlowliftColorFix,
    "FlowliftTAEF2Loader": FlowliftTAEF2Loader,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "FlowliftUpscalerLoader": "Load Flow Upscaler (flowlift)",
    "FlowliftUpscaleLatent": "Flow Upscale Latent (flowlift)",
    "FlowliftUpscaleImage": "Flow Upscale Image (flowlift)",
    "FlowliftColorFix": "Colour Fix, stage 2 (flowlift)",
    "FlowliftTAEF2Loader": "Load TAEF2 VAE (flowlift)",
}

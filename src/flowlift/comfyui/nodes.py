"""The ComfyUI nodes on ComfyUI's V3 schema (``comfy_api.latest.io.ComfyNode``), thin over flowlift.

Node ids and the order of their widgets are part of every saved workflow: never rename or reorder
them; add new inputs at the end (as optional inputs where possible).

ComfyUI loads the pack through :func:`comfy_entrypoint` (the repository's top-level ``__init__.py``
exports it). Each node does ComfyUI's part (folders, memory management, progress bar, cancel, output
device) and calls flowlift for the work: :class:`flowlift.upscale.pipeline.FlowUpscalerPipeline` (noise,
Euler step, stage 1, exact chunked execution, encode/decode, stage 2),
:func:`flowlift.upscale.colorfix.lab_lowband_transplant` (stage 2 alone) and
:func:`flowlift.models.vae_loading.load_vae` (TAEF2, Mage-VAE). Loaders: :mod:`flowlift.comfyui.loaders`; the others:
:mod:`flowlift.comfyui.upscale_nodes`; the tiled refine's model patch: :mod:`flowlift.comfyui.refine_nodes`.
"""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from flowlift.comfyui.loaders import VAE_LOADERS, FlowliftUpscalerLoader, ensure_model_folders
from flowlift.comfyui.refine_nodes import FlowliftTiledFlux2Refine
from flowlift.comfyui.upscale_nodes import FlowliftColorFix, FlowliftUpscaleImage, FlowliftUpscaleLatent

ensure_model_folders()


def register_prompt_check() -> None:
    """Hold the INT inputs of flowlift's nodes to their knobs' rule where a prompt arrives
    (:func:`flowlift.comfyui.layouts.check_prompt_numbers`), once per server."""
    from server import PromptServer

    from flowlift.comfyui.layouts import check_prompt_numbers

    server = getattr(PromptServer, "instance", None)
    if server is not None and check_prompt_numbers not in server.on_prompt_handlers:
        server.add_on_prompt_handler(check_prompt_numbers)


register_prompt_check()

#: The pack's nodes, in the order ComfyUI lists them.
NODES: list[type[io.ComfyNode]] = [
    FlowliftUpscalerLoader,
    FlowliftUpscaleLatent,
    FlowliftUpscaleImage,
    FlowliftColorFix,
    *VAE_LOADERS.values(),  # FlowliftTAEF2Loader, FlowliftMageVAELoader: one per native VAE (vae_names)
    FlowliftTiledFlux2Refine,
]


class FlowliftExtension(ComfyExtension):
    """flowlift's node pack as a ComfyUI V3 extension."""

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> FlowliftExtension:
    """What ComfyUI calls to load the pack (V3 extensions)."""
    return FlowliftExtension()

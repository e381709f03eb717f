"""ComfyUI node pack: the Flow Upscaler, both colour-fix stages, TAEF2 and the tiled FLUX.2 refine as ComfyUI nodes.

Only ComfyUI imports this package (through the repository's top-level ``__init__.py`` when the
repository sits in ``ComfyUI/custom_nodes/``): :mod:`flowlift.comfyui.nodes` and
:mod:`flowlift.comfyui.vae_adapters` need ComfyUI's ``comfy`` and ``folder_paths`` modules.
:mod:`flowlift.comfyui.layouts` holds the pure tensor conversions and checks and imports no ComfyUI.
"""

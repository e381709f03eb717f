"""The loader nodes (ComfyUI's V3 schema): the Flow Upscaler from models/latent_upscale_models (ComfyUI's own
folder since it has latent upscalers; registered here only where a ComfyUI lacks it), and one node per VAE flowlift
runs itself (the ``native`` entries of :data:`flowlift.models.vae_names.NAMED_VAES`): TAEF2 from models/vae_approx,
Mage-VAE from models/vae. The FLUX.2 VAE is ComfyUI's own (VAELoader); ComfyUI 0.33's VAELoader also loads TAEF2
and Mage-VAE, and FlowliftUpscaleImage takes those objects too: flowlift's loaders remain for what ComfyUI's do not
do, flowlift's exact tiled encode/decode in bounded memory (Mage-VAE at 8K-16K; TAEF2 above 1 Mpx).

All read through ComfyUI's folder helpers (so ``extra_model_paths.yaml`` folders count) and load with
flowlift's strict loaders (one-line errors). A VAE added to the declaration gets its loader node here.
"""

from __future__ import annotations

import os

import comfy.model_management as mm
import comfy.model_patcher
import folder_paths
import torch
from comfy_api.latest import io

from flowlift.comfyui.vae_adapters import FlowliftComfyVAE
from flowlift.devices import auto_dtype
from flowlift.errors import FlowliftError
from flowlift.limits import vae_kind
from flowlift.models.upscaler_weights import load_upscaler
from flowlift.models.vae_loading import load_vae
from flowlift.models.vae_names import NAMED_TAEF2, NATIVE_VAES, NamedVAE

UPSCALER_FOLDER = "latent_upscale_models"
TAEF2_FOLDER = NAMED_TAEF2.comfy_folder
#: The native VAEs, in words, and the upscale node's VAE tooltip, both from the declaration.
NATIVE_TITLES = " or ".join(f"{vae.title} ({vae.comfy_node})" for vae in NATIVE_VAES)
VAE_TOOLTIP = f"the FLUX.2 VAE (VAELoader), {NATIVE_TITLES}"
UPSCALER_TYPE = "FLOWLIFT_UPSCALER"
#: The Flow Upscaler as a ComfyUI type: the loader's output, the upscale nodes' input.
UPSCALER = io.Custom(UPSCALER_TYPE)
CATEGORY = "flowlift"


def ensure_model_folders() -> None:
    """Register our model folders only where this ComfyUI lacks them; core entries are never replaced
    (replacing them would drop the folders users add in extra_model_paths.yaml)."""
    for name in (UPSCALER_FOLDER, *dict.fromkeys(vae.comfy_folder for vae in NATIVE_VAES)):
        if name not in folder_paths.folder_names_and_paths:
            folder_paths.add_model_folder_path(name, os.path.join(folder_paths.models_dir, name))


class FlowliftUpscalerLoader(io.ComfyNode):
    """A Flow Upscaler checkpoint from models/latent_upscale_models (released file or `flowlift train` output)."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="FlowliftUpscalerLoader",
            display_name="Load Flow Upscaler (flowlift)",
            category=CATEGORY,
            description="Loads a Flow Upscaler checkpoint (strictly) from models/latent_upscale_models.",
            inputs=[io.Combo.Input("upscaler_name", options=folder_paths.get_filename_list(UPSCALER_FOLDER))],
            outputs=[UPSCALER.Output(display_name="upscaler")],
        )

    @classmethod
    def execute(cls, upscaler_name: str) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise(UPSCALER_FOLDER, upscaler_name)
        load_device = mm.get_torch_device()
        # flowlift's one --dtype auto rule, where ComfyUI says this device runs bfloat16 well
        dtype = auto_dtype(load_device) if mm.should_use_bf16(load_device) else torch.float32
        unet = load_upscaler(path, device="cpu", dtype=dtype)
        offload_device = mm.unet_offload_device()
        patcher = comfy.model_patcher.ModelPatcher(unet, load_device=load_device, offload_device=offload_device)
        return io.NodeOutput(patcher)


#: What each loader node says about its VAE; the ids and widget names are in saved workflows (never change them).
_LOADER_TEXT = {
    "taef2": (
        "Load TAEF2 VAE (flowlift)",
        "Loads TAEF2 from models/vae_approx (taef2_encoder + taef2_decoder, either released key layout): a fast, "
        "approximate FLUX.2 VAE for VAEEncode/VAEDecode/VAEDecodeTiled and FlowliftUpscaleImage.",
        "a TAEF2 file; its encoder/decoder partner next to it is loaded with it",
    ),
    "mage": (
        "Load Mage-VAE for 8K-16K (flowlift)",
        "For 8K-16K images: loads Mage-VAE (Mage-Flow's VAE, the released .safetensors with "
        "student.dconv_encoder.* and pipeline.* tensors) from models/vae with flowlift's exact tiled encode and "
        "decode, which keep memory bounded by a tile and equal the whole frame (ComfyUI's own tiled decode "
        "blends overlaps instead). At smaller sizes ComfyUI's own VAELoader loads the same file with the same "
        "results; use that. A decode-only file decodes only.",
        "a Mage-VAE .safetensors file in models/vae (the same file ComfyUI's VAELoader loads)",
    ),
}


def _file_names(named: NamedVAE) -> list[str]:
    """The files a loader offers: TAEF2's by name (its folder holds other approximate VAEs); Mage-VAE's
    .safetensors files (the released file has no fixed name; anything else is refused in one line on load)."""
    names = folder_paths.get_filename_list(named.comfy_folder)
    if named.name == "taef2":
        return [n for n in names if "taef2" in os.path.basename(n).lower()]
    return [n for n in names if n.lower().endswith(".safetensors")]


def vae_loader_node(named: NamedVAE) -> type[io.ComfyNode]:
    """The loader node of one native VAE: a file of ``named.comfy_folder`` as a ComfyUI VAE (FLUX.2 LATENT)."""
    display, description, tooltip = _LOADER_TEXT[named.name]
    widget = f"{named.name}_name"

    class Loader(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            return io.Schema(
                node_id=named.comfy_node,
                display_name=display,
                category=CATEGORY,
                description=description,
                inputs=[io.Combo.Input(widget, options=_file_names(named), tooltip=tooltip)],
                outputs=[io.Vae.Output()],
            )

        @classmethod
        def execute(cls, **inputs: str) -> io.NodeOutput:
            name = inputs[widget]
            path = folder_paths.get_full_path_or_raise(named.comfy_folder, name)
            vae = load_vae(path, device="cpu", dtype=torch.float32)
            if vae_kind(vae) != named.name:
                raise FlowliftError(f"{named.comfy_node}: {name} is not a {named.title} checkpoint")
            return io.NodeOutput(FlowliftComfyVAE(vae))

    Loader.__name__ = Loader.__qualname__ = named.comfy_node
    Loader.__doc__ = f"{named.title} from models/{named.comfy_folder} as a ComfyUI VAE in the FLUX.2 LATENT layout."
    return Loader


#: One loader node per native VAE, in the declaration's order.
VAE_LOADERS: dict[str, type[io.ComfyNode]] = {vae.name: vae_loader_node(vae) for vae in NATIVE_VAES}
FlowliftTAEF2Loader = VAE_LOADERS["taef2"]

"""The two loader nodes (ComfyUI's V3 schema): the Flow Upscaler from models/latent_upscale_models, TAEF2 from
models/vae_approx.

Both read through ComfyUI's folder helpers (so ``extra_model_paths.yaml`` folders count) and load with
flowlift's strict loaders (one-line errors).
"""

from __future__ import annotations

import os

import comfy.model_management as mm
import comfy.model_patcher
import folder_paths
import torch
from comfy_api.latest import io

from flowlift.comfyui.vae_adapters import TAEF2ComfyVAE
from flowlift.devices import auto_dtype
from flowlift.errors import FlowliftError
from flowlift.models.upscaler_weights import load_upscaler
from flowlift.models.vae import TAEF2VAE
from flowlift.models.vae_loading import load_vae

UPSCALER_FOLDER = "latent_upscale_models"
TAEF2_FOLDER = "vae_approx"
UPSCALER_TYPE = "FLOWLIFT_UPSCALER"
#: The Flow Upscaler as a ComfyUI type: the loader's output, the upscale nodes' input.
UPSCALER = io.Custom(UPSCALER_TYPE)
CATEGORY = "flowlift"


def ensure_model_folders() -> None:
    """Register our model folders only where this ComfyUI lacks them; core entries are never replaced
    (replacing them would drop the folders users add in extra_model_paths.yaml)."""
    for name in (UPSCALER_FOLDER, TAEF2_FOLDER):
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


class FlowliftTAEF2Loader(io.ComfyNode):
    """TAEF2 (tiny FLUX.2 autoencoder) from models/vae_approx as a ComfyUI VAE in the FLUX.2 LATENT layout."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        names = [n for n in folder_paths.get_filename_list(TAEF2_FOLDER) if "taef2" in os.path.basename(n).lower()]
        return io.Schema(
            node_id="FlowliftTAEF2Loader",
            display_name="Load TAEF2 VAE (flowlift)",
            category=CATEGORY,
            description="Loads TAEF2 from models/vae_approx (taef2_encoder + taef2_decoder, either released key "
            "layout): a fast, approximate FLUX.2 VAE for VAEEncode/VAEDecode/VAEDecodeTiled and FlowliftUpscaleImage.",
            inputs=[
                io.Combo.Input(
                    "taef2_name",
                    options=names,
                    tooltip="a TAEF2 file; its encoder/decoder partner next to it is loaded with it",
                )
            ],
            outputs=[io.Vae.Output()],
        )

    @classmethod
    def execute(cls, taef2_name: str) -> io.NodeOutput:
        path = folder_paths.get_full_path_or_raise(TAEF2_FOLDER, taef2_name)
        vae = load_vae(path, device="cpu", dtype=torch.float32)
        if not isinstance(vae, TAEF2VAE):
            raise FlowliftError(f"FlowliftTAEF2Loader: {taef2_name} is not a TAEF2 checkpoint")
        return io.NodeOutput(TAEF2ComfyVAE(vae))

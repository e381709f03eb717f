"""Test-only ComfyUI nodes (linked into the test server's custom_nodes/ next to the pack, tests/comfy_server.py).

The FLUX.2 model of the tests is a tiny Klein single file loaded by ComfyUI's own ``UNETLoader`` (ComfyUI 0.33
takes the heads as hidden // 128 and the blocks and context width from the weights). Its text conditioning cannot
come from ``CLIPLoader``: ComfyUI's Klein text encoder is a Qwen3-4B of fixed size (36 layers of 2560, prompts
padded to 512 tokens), so no tiny one loads. These nodes stand in for what cannot be made small:

* ``FlowliftTestConditioning``: seed -> CONDITIONING, a random text context as wide as the tiny Klein's (32), in
  the layout ``CLIPTextEncode`` gives a FLUX.2 model (no pooled output).
* ``FlowliftTestTiledReference``: a model patched by Tiled FLUX.2 Refine + a LATENT + sigma -> LATENT holding, on
  the batch axis, the patched model's prediction, flowlift's refine core (``TiledVelocity`` over the same model
  function, one tile per call) on the same inputs, and the unpatched prediction.
* ``FlowliftTestTinyFlux2``: seed -> (MODEL, CONDITIONING), ComfyUI's FLUX.2 classes built in-process at width 64
  (benchmarks/bench_comfyui_tiled_refine.py imports :func:`tiny_flux2` without a server).
"""

from __future__ import annotations

import comfy.model_detection
import comfy.model_management as mm
import comfy.model_patcher
import torch

from flowlift.flux2.latents import patchify, unpatchify
from flowlift.refine.tiled_velocity import TiledVelocity
from flowlift.refine.tiling import tile_layout

#: A FLUX.2 of ComfyUI's FLUX.2 family (the detected config's fixed entries) at width 64: 2 heads of 32.
TINY_UNET_CONFIG = {
    "image_model": "flux2",
    "in_channels": 128,
    "out_channels": 128,
    "vec_in_dim": None,
    "context_in_dim": 32,
    "hidden_size": 64,
    "mlp_ratio": 3.0,
    "num_heads": 2,
    "depth": 1,
    "depth_single_blocks": 1,
    "axes_dim": [8, 8, 8, 8],
    "theta": 2000,
    "patch_size": 1,
    "qkv_bias": False,
    "guidance_embed": False,
    "txt_ids_dims": [3],
    "global_modulation": True,
    "mlp_silu_act": True,
    "ops_bias": False,
    "default_ref_method": "index",
    "ref_index_scale": 10.0,
}
TEXT_TOKENS = 8


def tiny_flux2(seed: int) -> comfy.model_patcher.ModelPatcher:
    """ComfyUI's FLUX.2 classes at :data:`TINY_UNET_CONFIG`, float32, weights ~ N(0, 1/fan_in) (norms ~1)."""
    config = comfy.model_detection.model_config_from_unet_config(dict(TINY_UNET_CONFIG))
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model({})
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.diffusion_model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=generator)
        fan_in = tensor.shape[-1] if tensor.ndim > 1 else 1
        state[name] = 1 + 0.1 * noise if tensor.ndim == 1 else noise / fan_in**0.5
    model.diffusion_model.load_state_dict(state)
    return comfy.model_patcher.ModelPatcher(
        model, load_device=mm.get_torch_device(), offload_device=mm.unet_offload_device()
    )


def text_conditioning(seed: int) -> list:
    """A random text conditioning (from ``seed + 1``) for the tiny FLUX.2: no pooled output (FLUX.2 has none)."""
    generator = torch.Generator().manual_seed(seed + 1)
    context = torch.randn(1, TEXT_TOKENS, TINY_UNET_CONFIG["context_in_dim"], generator=generator)
    return [[context, {"pooled_output": None}]]


class _BuiltFromASeed:
    """A test node whose one input is a seed: ``build(seed)`` makes its outputs."""

    FUNCTION = "build"
    CATEGORY = "flowlift_test"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2**31})}}


class FlowliftTestTinyFlux2(_BuiltFromASeed):
    RETURN_TYPES = ("MODEL", "CONDITIONING")

    def build(self, seed: int):
        return (tiny_flux2(seed), text_conditioning(seed))


class FlowliftTestConditioning(_BuiltFromASeed):
    RETURN_TYPES = ("CONDITIONING",)

    def build(self, seed: int):
        return (text_conditioning(seed),)


class FlowliftTestTiledReference:
    RETURN_TYPES = ("LATENT",)
    FUNCTION = "compare"
    CATEGORY = "flowlift_test"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "samples": ("LATENT",),
                "conditioning": ("CONDITIONING",),
                "sigma": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.01}),
                "tile_size": ("INT", {"default": 64, "min": 32, "max": 4096}),
                "tile_overlap": ("INT", {"default": 32}),
                "batch": ("INT", {"default": 1, "min": 1, "max": 4}),
                "reference_latent": ("BOOLEAN", {"default": False}),
            }
        }

    def compare(self, model, samples, conditioning, sigma, tile_size, tile_overlap, batch, reference_latent):
        mm.load_models_gpu([model])
        base, wrapper = model.model, model.model_options["model_function_wrapper"]
        x = samples["samples"].to(torch.float32).repeat(batch, 1, 1, 1)
        x = x + 0.1 * torch.arange(batch, dtype=x.dtype).view(-1, 1, 1, 1)  # batch items that differ
        t = torch.full((batch,), sigma)
        c = {"c_crossattn": conditioning[0][0].repeat(batch, 1, 1), "transformer_options": {}}
        if reference_latent:  # a FLUX.2 reference latent, (B, 128, h, w) as ComfyUI's CONDList hands it over
            ref = torch.randn((1, 128, 3, 5), generator=torch.Generator().manual_seed(9))
            c["ref_latents"] = [ref.repeat(batch, 1, 1, 1)]
        patched = wrapper(base.apply_model, {"input": x, "timestep": t, "c": c, "cond_or_uncond": [0] * batch})

        def velocity(crops, _sigma):  # the unpatched model's velocity on a tile: v = (x - x0) / sigma
            tokens = patchify(crops)
            return unpatchify((tokens - base.apply_model(tokens, t, **c)) / sigma)

        height, width = 16 * x.shape[2], 16 * x.shape[3]
        reference = TiledVelocity(velocity, tile_layout(height, width, tile_size, tile_overlap))
        expected = x - sigma * patchify(reference(unpatchify(x), sigma))
        whole = base.apply_model(x, t, **c)
        return ({"samples": torch.cat([patched, expected, whole]).contiguous()},)


NODE_CLASS_MAPPINGS = {
    "FlowliftTestConditioning": FlowliftTestConditioning,
    "FlowliftTestTinyFlux2": FlowliftTestTinyFlux2,
    "FlowliftTestTiledReference": FlowliftTestTiledReference,
}

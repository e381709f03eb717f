"""FLUX.2 transformer and LoRA files as users have them, written from tiny random diffusers models.

* :func:`bfl_state_dict`: a diffusers ``Flux2Transformer2DModel`` state dict under Black Forest Labs' names (the
  inverse of diffusers' ``convert_flux2_transformer_checkpoint_to_diffusers``: fused qkv, BFL adaLN order);
* :func:`write_fp8` (plain or scaled, ComfyUI's and diffusers' scale spellings) and :func:`write_gguf` (Q8_0 through
  ``gguf``'s own quantizer, Q4_K through :func:`quantize_q4_k`: gguf-py only dequantizes K-quants);
* LoRA writers in diffusers (peft), kohya and ComfyUI formats.
"""

from __future__ import annotations

import numpy as np
import torch

_RENAMES = {
    "x_embedder.": "img_in.",
    "context_embedder.": "txt_in.",
    "time_guidance_embed.timestep_embedder.linear_1.": "time_in.in_layer.",
    "time_guidance_embed.timestep_embedder.linear_2.": "time_in.out_layer.",
    "time_guidance_embed.guidance_embedder.linear_1.": "guidance_in.in_layer.",
    "time_guidance_embed.guidance_embedder.linear_2.": "guidance_in.out_layer.",
    "double_stream_modulation_img.linear.": "double_stream_modulation_img.lin.",
    "double_stream_modulation_txt.linear.": "double_stream_modulation_txt.lin.",
    "single_stream_modulation.linear.": "single_stream_modulation.lin.",
    "proj_out.": "final_layer.linear.",
}
_DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
_SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}


def bfl_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers FLUX.2 transformer tensors under BFL's names."""
    out = {}
    for key, value in state.items():
        if key.startswith("transformer_blocks."):
            _, i, rest = key.split(".", 2)
            if rest in _DOUBLE:
                out[f"double_blocks.{i}.{_DOUBLE[rest]}"] = value
            elif rest == "attn.to_q.weight":
                parts = [state[f"transformer_blocks.{i}.attn.to_{c}.weight"] for c in "qkv"]
                out[f"double_blocks.{i}.img_attn.qkv.weight"] = torch.cat(parts)
            elif rest == "attn.add_q_proj.weight":
                parts = [state[f"transformer_blocks.{i}.attn.add_{c}_proj.weight"] for c in "qkv"]
                out[f"double_blocks.{i}.txt_attn.qkv.weight"] = torch.cat(parts)
        elif key.startswith("single_transformer_blocks."):
            _, i, rest = key.split(".", 2)
            out[f"single_blocks.{i}.{_SINGLE[rest]}"] = value
        elif key == "norm_out.linear.weight":
            scale, shift = value.chunk(2)
            out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
        else:
            prefix = next(p for p in _RENAMES if key.startswith(p))
            out[_RENAMES[prefix] + key[len(prefix) :]] = value
    return out


def is_matrix(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and name.endswith(".weight")


def write_single_file(model, path, *, prefix: str = "", dtype: torch.dtype | None = None, layout: str = "bfl"):
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    state = bfl_state_dict(state) if layout == "bfl" else state
    save_file({prefix + k: (v.to(dtype) if dtype else v).contiguous() for k, v in state.items()}, str(path))


def write_fp8(model, path, *, scale: str | None = None, prefix: str = ""):
    """Matrices as float8_e4m3fn, vectors float32. ``scale``: None (plain), ``"comfyui"`` (a per-tensor
    ``scale_weight`` of absmax/448, ``scale_input`` and the ``scaled_fp8`` marker) or ``"rows"`` (a per-row
    ``weight_scale``). Returns the BFL-named float32 weights the file stands for (fp8 values times their scale)."""
    from safetensors.torch import save_file

    state = bfl_state_dict(model.state_dict())
    out, meant = {}, {}
    for name, value in state.items():
        if not is_matrix(name, value):
            out[prefix + name], meant[name] = value, value
            continue
        layer = name.removesuffix(".weight")
        if scale is None:
            q = value.to(torch.float8_e4m3fn)
            out[prefix + name], meant[name] = q, q.float()
        elif scale == "comfyui":
            s = value.abs().max() / 448.0
            q = (value / s).to(torch.float8_e4m3fn)
            out[prefix + name], out[prefix + layer + ".scale_weight"] = q, s.reshape(())
            out[prefix + layer + ".scale_input"] = torch.ones(())
            meant[name] = q.float() * s
        else:
            s = value.abs().amax(dim=1).clamp_min(1e-12) / 448.0
            q = (value / s[:, None]).to(torch.float8_e4m3fn)
            out[prefix + name], out[prefix + layer + ".weight_scale"] = q, s
            meant[name] = q.float() * s[:, None]
    if scale == "comfyui":
        out[prefix + "scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    save_file(out, str(path))
    return meant


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float32 -> Q4_K blocks (rows, cols // 256 * 144) uint8: a plain min/max quantizer.

    Each 256-value super-block: fp16 ``d``, ``dmin``, 8 six-bit scales and mins (12 packed bytes) and 256 four-bit
    values, ``x = d * sc[j] * q - dmin * m[j]`` for sub-block ``j`` of 32 (ggml's ``block_q4_K``).
    """
    rows = x.shape[0]
    blocks = x.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(blocks.min(-1), 0.0), np.maximum(blocks.max(-1), 0.0)
    scale, mins = (hi - lo) / 15.0, -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)

    def ratio(num, den):
        return np.where(den > 0, num / np.where(den > 0, den, 1), 0)

    sc = np.rint(ratio(scale, d.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
    mn = np.rint(ratio(mins, dmin.astype(np.float32)[:, None])).clip(0, 63).astype(np.uint8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.rint(ratio(blocks + offset, step)).clip(0, 15).astype(np.uint8)
    packed = np.zeros((blocks.shape[0], 12), np.uint8)
    for j in range(4):
        packed[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        packed[:, j + 4] = mn[:, j] | ((mn[:, j + 4] >> 4) << 6)
        packed[:, j + 8] = (sc[:, j + 4] & 0xF) | ((mn[:, j + 4] & 0xF) << 4)
    qs = np.stack([q[:, 2 * i] | (q[:, 2 * i + 1] << 4) for i in range(4)], axis=1).reshape(-1, 128)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs]
    return np.concatenate(head, axis=1).reshape(rows, -1)


def write_gguf(model, path, kind: str):
    """The model's matrices quantized to ``kind`` ("Q8_0" or "Q4_K"; rows that do not fit Q4_K's 256-value blocks
    fall back to Q8_0, as llama.cpp's quantizers do), vectors F32. Returns the BFL-named float32 weights gguf-py's
    own dequantizer reads back."""
    import gguf
    from gguf.quants import dequantize, quantize

    state = bfl_state_dict(model.state_dict())
    writer = gguf.GGUFWriter(str(path), "flux")
    meant = {}
    for name, value in state.items():
        array = value.float().numpy()
        qtype = gguf.GGMLQuantizationType.F32
        if is_matrix(name, value):
            qtype = gguf.GGMLQuantizationType.Q8_0
            if kind == "Q4_K" and array.shape[1] % 256 == 0:
                qtype = gguf.GGMLQuantizationType.Q4_K
        data = array
        if qtype == gguf.GGMLQuantizationType.Q4_K:
            data = quantize_q4_k(array)
        elif qtype == gguf.GGMLQuantizationType.Q8_0:
            data = quantize(array, qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
        meant[name] = value if qtype == gguf.GGMLQuantizationType.F32 else torch.from_numpy(dequantize(data, qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return meant


def diffusers_state_from_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    return convert_flux2_transformer_checkpoint_to_diffusers({k: v.float() for k, v in state.items()})


def same_model_with(model, state: dict[str, torch.Tensor]):
    """A float32 copy of ``model``'s architecture holding ``state`` (diffusers names), strictly loaded."""
    from diffusers import Flux2Transformer2DModel

    twin = Flux2Transformer2DModel.from_config(model.config)
    twin.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return twin.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- LoRAs

#: Target modules of the peft LoRA: both attention stacks, the fused single-block projection, an MLP, the output.
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_qkv_mlp_proj", "linear_in", "proj_out"]


def write_peft_lora(transformer, path, *, rank: int = 4, alpha: int = 8, seed: int = 3) -> None:
    """A random LoRA made by peft on ``transformer``'s architecture, saved as diffusers saves LoRAs (keys under
    ``transformer.``, the adapter config in the ``lora_adapter_metadata`` header: here ``alpha / rank = 2``)."""
    import copy

    from diffusers import Flux2KleinPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = copy.deepcopy(transformer)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    model.add_adapter(config, adapter_name="random")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero (a no-op LoRA)
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    Flux2KleinPipeline.save_lora_weights(
        str(path.parent),
        transformer_lora_layers=get_peft_model_state_dict(model, adapter_name="random"),
        weight_name=path.name,
        transformer_lora_adapter_metadata=model.peft_config["random"].to_dict(),
    )


def bfl_lora_layers(transformer, *, rank: int = 4, seed: int = 5) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random (down, up) pairs on BFL module names: the fused qkv of both streams, a single block's linear1 and
    linear2, an MLP and the output projection."""
    shapes = {name.removesuffix(".weight"): v.shape for name, v in bfl_state_dict(transformer.state_dict()).items()}
    generator = torch.Generator().manual_seed(seed)
    layers = {}
    for name in (
        "double_blocks.0.img_attn.qkv",
        "double_blocks.0.txt_attn.qkv",
        "double_blocks.0.img_mlp.0",
        "single_blocks.0.linear1",
        "single_blocks.0.linear2",
        "final_layer.linear",
    ):
        out_features, in_features = shapes[name]
        down = torch.randn(rank, in_features, generator=generator) / in_features**0.5
        up = torch.randn(out_features, rank, generator=generator) * 0.3
        layers[name] = (down, up)
    return layers


def write_kohya_lora(layers, path, *, alpha: float = 2.0) -> None:
    from safetensors.torch import save_file

    out = {}
    for name, (down, up) in layers.items():
        key = "lora_unet_" + name.replace(".", "_")
        out[f"{key}.lora_down.weight"], out[f"{key}.lora_up.weight"] = down, up
        out[f"{key}.alpha"] = torch.tensor(alpha)
    save_file(out, str(path))


def write_comfyui_lora(layers, path, *, alpha: float | None = 2.0, names: tuple[str, str] = ("lora_A", "lora_B")):
    """ComfyUI's (ai-toolkit's) names: ``diffusion_model.<BFL name>.lora_A/B.weight`` (or ``names``, e.g.
    ``("lora_down", "lora_up")``) and, unless None, ``alpha``."""
    from safetensors.torch import save_file

    out = {}
    for name, (down, up) in layers.items():
        out[f"diffusion_model.{name}.{names[0]}.weight"], out[f"diffusion_model.{name}.{names[1]}.weight"] = down, up
        if alpha is not None:
            out[f"diffusion_model.{name}.alpha"] = torch.tensor(alpha)
    save_file(out, str(path))

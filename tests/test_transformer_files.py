"""Transformer files as users have them (issue 23, part 2): BFL/ComfyUI single files, fp8, GGUF.

Each file is written from a tiny random diffusers transformer and must load to the outputs of the same weights
loaded as a folder. "The same weights" is what the file stands for:

* bf16/fp32 single files (BFL names, ComfyUI's prefix, diffusers' names): the stored values: equal bit for bit;
* fp8 (``float8_e4m3fn``): stored fp8, computed in float32 through diffusers' layerwise casting; the weights it
  stands for are the fp8 values (times their scale, for scaled files): equal bit for bit. Against the float32
  weights the file was made from, fp8's own rounding: at most 2**-4 relative (3 mantissa bits), 2**-10 absolute
  below the normal range;
* GGUF: blocks stay quantized (``GGUFLinear``, uint8) and diffusers dequantizes them per call in float16
  arithmetic. Outputs equal the folder of those dequantized weights bit for bit; those weights equal gguf-py's
  float32 dequantization within float16 rounding of the block terms (measured <= 1.3e-4 absolute on weights of
  magnitude <= 0.064, i.e. 2**-9 of max|w|; Q8_0 exactly); the outputs of both folders then agree within 2e-3 of
  max|output| here (6e-4 measured).
"""

from __future__ import annotations

import pytest
import torch

from builders import transformer_forward
from flowlift.errors import FlowliftError
from flowlift.models.flux2_transformer_files import inspect_transformer_file
from flowlift.refine.loading import load_transformer
from flowlift.refine.settings import SamplingSettings
from flux2_files import (
    bfl_state_dict,
    diffusers_state_from_bfl,
    same_model_with,
    write_fp8,
    write_gguf,
    write_single_file,
)
from tiny_flux2 import TEXT_DIM, tiny_transformer


def wide_transformer(seed: int = 0):
    """Width 256 (2 heads of 128, FLUX.2's head size and rotary axes): rows long enough for Q4_K's 256 blocks."""
    return tiny_transformer(
        seed=seed,
        guidance_embeds=True,
        text_dim=256,
        attention_head_dim=128,
        timestep_guidance_channels=256,
        axes_dims_rope=(32, 32, 32, 32),
    )


def fresh(model):
    """Each weight copied into a fresh allocation: CPU BLAS kernels take other paths for weights that sit unaligned
    in a memory-mapped file (2.4e-7 apart here), which is not what these tests compare."""
    for param in model.parameters():
        param.data = param.data.clone()
    return model


CONFIG_KEYS = (
    "in_channels",
    "num_layers",
    "num_single_layers",
    "attention_head_dim",
    "num_attention_heads",
    "joint_attention_dim",
    "timestep_guidance_channels",
    "mlp_ratio",
    "guidance_embeds",
)


@pytest.mark.parametrize("guidance", [False, True])
@pytest.mark.parametrize("layout", ["bfl", "comfyui", "diffusers"])
def test_single_file_config_from_shapes_and_outputs_equal_the_folder(tmp_path, guidance, layout):
    model = tiny_transformer(guidance_embeds=guidance)
    model.to(torch.bfloat16).to(torch.float32)  # the file holds bf16: the folder holds the same values
    path = tmp_path / "flux-2-tiny.safetensors"
    prefix = "model.diffusion_model." if layout == "comfyui" else ""
    names = "diffusers" if layout == "diffusers" else "bfl"
    write_single_file(model, path, prefix=prefix, dtype=torch.bfloat16, layout=names)

    info = inspect_transformer_file(path)
    assert {k: info.config[k] for k in CONFIG_KEYS} == {k: model.config[k] for k in CONFIG_KEYS}
    tensors = len(model.state_dict()) if names == "diffusers" else len(bfl_state_dict(model.state_dict()))
    assert info.prefix == prefix and info.layout == names and info.storage == {"bfloat16": tensors}
    loaded = fresh(load_transformer(str(path), dtype=torch.float32))
    model.save_pretrained(tmp_path / "folder")
    from_folder = fresh(load_transformer(str(tmp_path / "folder"), dtype=torch.float32))
    expected = transformer_forward(from_folder, text_dim=TEXT_DIM, guidance=guidance)
    assert torch.equal(transformer_forward(loaded, text_dim=TEXT_DIM, guidance=guidance), expected)


def fp8_matrices(model) -> dict[str, torch.dtype]:
    return {n: p.dtype for n, p in model.named_parameters() if p.ndim == 2}


def test_plain_fp8_is_stored_fp8_and_equals_its_dequantized_folder(tmp_path):
    from flowlift.refine.loading import store_fp8_layers

    model = tiny_transformer()
    path = tmp_path / "flux-2-tiny-fp8.safetensors"
    meant = write_fp8(model, path)
    loaded = load_transformer(str(path), dtype=torch.float32)
    assert store_fp8_layers(loaded, dtype=torch.float32) == len(fp8_matrices(model))
    assert set(fp8_matrices(loaded).values()) == {torch.float8_e4m3fn}  # at rest: fp8
    assert all(p.dtype == torch.float32 for n, p in loaded.named_parameters() if p.ndim == 1)
    folder = same_model_with(model, diffusers_state_from_bfl(meant))
    out = transformer_forward(loaded, text_dim=TEXT_DIM)
    assert torch.equal(out, transformer_forward(folder, text_dim=TEXT_DIM))
    assert set(fp8_matrices(loaded).values()) == {torch.float8_e4m3fn}  # and again after the forward
    # the file's own rounding against the float32 weights it was made from
    original = model.state_dict()
    for name, value in diffusers_state_from_bfl(meant).items():
        w = original[name]
        assert ((value - w).abs() <= 2**-4 * w.abs() + 2**-10).all(), name


@pytest.mark.parametrize("scale", ["comfyui", "rows"])
def test_scaled_fp8_is_dequantized_exactly(tmp_path, scale):
    model = tiny_transformer(seed=1)
    path = tmp_path / "flux-2-tiny-fp8-scaled.safetensors"
    meant = write_fp8(model, path, scale=scale, prefix="model.diffusion_model.")
    info = inspect_transformer_file(path)
    assert info.storage["float8_e4m3fn"] == sum(v.ndim == 2 for v in bfl_state_dict(model.state_dict()).values())
    with pytest.warns(UserWarning, match="scaled fp8 layers dequantized to float32"):
        loaded = load_transformer(str(path), dtype=torch.float32)
    folder = same_model_with(model, diffusers_state_from_bfl(meant))
    assert torch.equal(transformer_forward(loaded, text_dim=TEXT_DIM), transformer_forward(folder, text_dim=TEXT_DIM))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_gguf_stays_quantized_and_equals_its_dequantized_folder(tmp_path, kind):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from diffusers.quantizers.gguf.utils import GGUFLinear, dequantize_gguf_tensor

    model = wide_transformer()
    path = tmp_path / f"flux-2-tiny-{kind}.gguf"
    meant = write_gguf(model, path, kind)
    info = inspect_transformer_file(path)
    assert kind in info.storage and info.container == "gguf" and info.config["num_attention_heads"] == 2
    loaded = load_transformer(str(path), dtype=torch.float32)
    linears = [m for m in loaded.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears)
    quant_types = {m.weight.quant_type.name for m in linears}
    assert kind in quant_types

    # 1. the folder of the weights as diffusers dequantizes them: bit for bit
    dequantized = {n: dequantize_gguf_tensor(p).float() for n, p in loaded.state_dict().items()}
    out = transformer_forward(loaded, text_dim=256)
    assert torch.equal(out, transformer_forward(same_model_with(model, dequantized), text_dim=256))
    # 2. those weights against gguf-py's float32 dequantization: float16 rounding of the block terms
    reference = diffusers_state_from_bfl(meant)
    for name, value in dequantized.items():
        assert (value - reference[name]).abs().max() <= 2**-8 * reference[name].abs().max(), name
    # 3. so the outputs agree within a small fraction of their scale
    expected = transformer_forward(same_model_with(model, reference), text_dim=256)
    assert (out - expected).abs().max() <= 2e-3 * expected.abs().max()


def test_refiner_runs_a_gguf_transformer_from_the_api(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from flowlift.refine.loading import load_refiner
    from tiny_flux2 import prompt_embeds, tiny_vae

    path = tmp_path / "flux-2-tiny-Q8_0.gguf"
    write_gguf(tiny_transformer(), path, "Q8_0")
    vae_dir = tmp_path / "vae"
    tiny_vae().save_pretrained(vae_dir)
    refiner = load_refiner(str(vae_dir), vae=str(vae_dir), transformer=str(path), device="cpu")
    out = refiner.txt2img(height=32, width=32, sampling=SamplingSettings(steps=2), prompt_embeds=prompt_embeds())
    assert torch.isfinite(out.images).all()
    assert out.parameters["transformer"] == str(path)
    assert "gguf (Q8_0" in out.parameters["transformer_file"] and out.parameters["offload"] == "none"


# ------------------------------------------------------------------------------------------- wrong files


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_wrong_files_are_one_line_naming_what_they_are(tmp_path):
    z = torch.zeros(2, 2)
    z2 = torch.zeros(2, 2)
    model = tiny_transformer()
    full = bfl_state_dict(model.state_dict())
    cases = [
        (_save(tmp_path / "lora.safetensors", {"diffusion_model.single_blocks.0.linear1.lora_A.weight": z}), "a LoRA"),
        (_save(tmp_path / "vae.safetensors", {"decoder.conv_in.weight": z, "encoder.conv_in.weight": z2}), "a VAE"),
        (_save(tmp_path / "flux1.safetensors", {"double_blocks.0.img_mod.lin.weight": z}), "a FLUX.1 transformer"),
        (_save(tmp_path / "qwen.safetensors", {"model.layers.0.self_attn.q_proj.weight": z}), "a text encoder"),
        (_save(tmp_path / "part.safetensors", {k: v for k, v in full.items() if "linear2" not in k}), "does not fill"),
        (_save(tmp_path / "i8.safetensors", {**full, "img_in.weight": torch.zeros(32, 128).char()}), "is int8"),
    ]
    pickle = tmp_path / "flux2.ckpt"
    pickle.write_bytes(b"\x80\x04")
    cases.append((pickle, "never pickles"))
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    cases.append((broken, "not a readable safetensors file"))
    for path, message in cases:
        with pytest.raises(FlowliftError) as caught:
            load_transformer(str(path), dtype=torch.float32, option="--transformer")
        text = str(caught.value)
        assert message in text and text.startswith(f"--transformer {path}") and "\n" not in text, text
        if message not in ("does not fill", "is int8", "not a readable safetensors file"):
            assert "expected a FLUX.2 transformer" in text


def test_unsupported_comfyui_quantization_is_refused(tmp_path):
    import json

    from safetensors.torch import save_file

    state = bfl_state_dict(tiny_transformer().state_dict())
    path = tmp_path / "nvfp4.safetensors"
    layers = {"single_blocks.0.linear1": {"format": "nvfp4"}}
    save_file(state, str(path), metadata={"_quantization_metadata": json.dumps({"layers": layers})})
    with pytest.raises(FlowliftError, match="stored as nvfp4"):
        inspect_transformer_file(path)

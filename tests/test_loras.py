"""LoRAs (issue 23, part 4): diffusers' own FLUX.2 LoRA path is the reference.

A random LoRA made by peft on the tiny transformer, loaded by flowlift, gives diffusers' ``Flux2KleinPipeline``
output after ``load_lora_weights`` + ``set_adapters(scale)`` (within 1e-4); kohya's and ComfyUI's key formats
give what diffusers' converters (ComfyUI: with each alpha folded in) give; scale 0 is no LoRA bit for bit;
``hires`` runs the LoRA in its base and its refine pass; refused files are one line.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from builders import command_line, prompt_embeds_file, save_tiny_unet, transformer_forward
from flowlift.commands.cli import main  # noqa: E402
from flowlift.errors import FlowliftError  # noqa: E402
from flowlift.flux2.latents import denormalize  # noqa: E402
from flowlift.refine.loading import load_refiner  # noqa: E402
from flowlift.refine.loras import apply_loras, parse_lora_spec  # noqa: E402
from flowlift.refine.request import HiresSettings  # noqa: E402
from flowlift.refine.settings import SamplingSettings  # noqa: E402
from flux2_files import bfl_lora_layers, write_comfyui_lora, write_kohya_lora, write_peft_lora  # noqa: E402
from tiny_flux2 import TEXT_DIM, AsUpscaler, prompt_embeds, tiny_transformer, tiny_vae  # noqa: E402

H, W, STEPS, SEED = 64, 96, 3, 5
EMB = prompt_embeds()


@pytest.fixture(scope="module")
def peft_lora(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "style.safetensors"
    write_peft_lora(tiny_transformer(), path)
    return path


def diffusers_pipeline():
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    return Flux2KleinPipeline(
        scheduler=scheduler, vae=tiny_vae(), text_encoder=None, tokenizer=None, transformer=tiny_transformer()
    )


def raw_latents(refiner, normalized):
    return denormalize(normalized, refiner.vae.bn_mean, refiner.vae.bn_std)


@pytest.mark.parametrize("scale", [1.0, 0.6])
def test_peft_lora_equals_the_diffusers_klein_pipeline(model_dir, peft_lora, scale):
    refiner = load_refiner(str(model_dir), loras=[(peft_lora, scale)], device="cpu", mu="empirical")  # diffusers mu
    ours = refiner.txt2img(height=H, width=W, sampling=SamplingSettings(steps=STEPS, seed=SEED), prompt_embeds=EMB)

    pipe = diffusers_pipeline()
    pipe.load_lora_weights(str(peft_lora), adapter_name="style")
    pipe.set_adapters(["style"], [scale])
    reference = pipe(
        prompt_embeds=EMB,
        height=H,
        width=W,
        num_inference_steps=STEPS,
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(SEED),
        output_type="latent",
    ).images
    torch.testing.assert_close(raw_latents(refiner, ours.latents), reference, rtol=0, atol=1e-4)
    plain = load_refiner(str(model_dir), device="cpu", mu="empirical")
    without = plain.txt2img(height=H, width=W, sampling=SamplingSettings(steps=STEPS, seed=SEED), prompt_embeds=EMB)
    assert (ours.latents - without.latents).abs().max() > 1e-2  # the LoRA changes the result
    record = ours.parameters["loras"]
    assert record == [{"path": str(peft_lora), "sha256": record[0]["sha256"], "scale": scale}]
    assert len(record[0]["sha256"]) == 64


def test_scale_zero_is_no_lora_bit_for_bit(model_dir, peft_lora):
    with_zero = load_refiner(str(model_dir), loras=[(peft_lora, 0.0)], device="cpu")
    plain = load_refiner(str(model_dir), device="cpu")
    a = with_zero.txt2img(height=H, width=W, sampling=SamplingSettings(steps=STEPS, seed=SEED), prompt_embeds=EMB)
    b = plain.txt2img(height=H, width=W, sampling=SamplingSettings(steps=STEPS, seed=SEED), prompt_embeds=EMB)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images)


@pytest.mark.parametrize("layout", ["kohya", "comfyui", "comfyui-down-up"])
def test_kohya_and_comfyui_formats_equal_diffusers_conversion(tmp_path, layout):
    layers = bfl_lora_layers(tiny_transformer())
    path = tmp_path / f"{layout}.safetensors"
    reference_file = path
    if layout == "kohya":
        write_kohya_lora(layers, path, alpha=2.0)
    else:
        names = ("lora_down", "lora_up") if layout.endswith("down-up") else ("lora_A", "lora_B")
        write_comfyui_lora(layers, path, alpha=2.0, names=names)
        # diffusers' own converter takes ai-toolkit files without alpha: the same LoRA with alpha / rank folded in
        reference_file = tmp_path / "folded.safetensors"
        folded = {k: (down * 2.0 / down.shape[0], up) for k, (down, up) in layers.items()}
        write_comfyui_lora(folded, reference_file, alpha=None)
    ours = tiny_transformer()
    apply_loras(ours, [(path, 0.8)])
    pipe = diffusers_pipeline()
    pipe.load_lora_weights(str(reference_file), adapter_name="x")
    pipe.set_adapters(["x"], [0.8])
    expected = transformer_forward(pipe.transformer, text_dim=TEXT_DIM)
    torch.testing.assert_close(transformer_forward(ours, text_dim=TEXT_DIM), expected, rtol=0, atol=1e-5)
    assert (expected - transformer_forward(tiny_transformer(), text_dim=TEXT_DIM)).abs().max() > 1e-2


def test_hires_runs_the_lora_in_the_base_and_the_refine_pass(model_dir, peft_lora):
    refiner = load_refiner(str(model_dir), loras=[(peft_lora, 1.0)], device="cpu")
    lora_calls, model_calls = [], []
    lora_layer = refiner.transformer.proj_out.lora_A["lora0"]
    lora_layer.register_forward_hook(lambda *_: lora_calls.append(1))
    refiner.transformer.register_forward_hook(lambda *_: model_calls.append(1))

    def upscale(latents):  # a stand-in for the Flow Upscaler: nearest 2x in latent space
        return torch.nn.functional.interpolate(latents, scale_factor=2, mode="nearest")

    out = refiner.hires(
        AsUpscaler(upscale),
        HiresSettings(base_size=(32, 32), base_steps=3, refine_strength=0.5),
        sampling=SamplingSettings(steps=4),
        prompt_embeds=EMB,
    )
    base_calls, refine_calls = 3, out.parameters["model_calls"]
    assert refine_calls >= 1 and len(model_calls) == base_calls + refine_calls
    assert len(lora_calls) == len(model_calls)  # every call of both passes went through the LoRA
    assert out.parameters["loras"][0]["scale"] == 1.0


def test_cli_lora_option_and_metadata(capsys, tmp_path, model_dir, peft_lora):
    from PIL import Image
    from safetensors.torch import save_file

    embeds = tmp_path / "emb.safetensors"
    save_file({"prompt_embeds": EMB}, str(embeds))
    photo = tmp_path / "photo.png"
    Image.new("RGB", (48, 32), (120, 80, 40)).save(photo)
    out = tmp_path / "out.png"
    lora = {"lora": f"{peft_lora}:0.7", "strength": "0.6", "steps": "4"}
    argv = command_line("img2img", photo, model=model_dir, prompt_embeds=embeds, **lora, o=out)
    assert main(argv) == 0, capsys.readouterr().err
    with Image.open(out) as img:
        meta = json.loads(img.text["flowlift"])
    assert meta["loras"][0]["path"] == str(peft_lora) and meta["loras"][0]["scale"] == 0.7
    assert len(meta["loras"][0]["sha256"]) == 64


# ---------------------------------------------------------------------------------------- refused LoRAs


def test_lora_spec_parsing():
    assert parse_lora_spec("style.safetensors") == ("style.safetensors", 1.0)
    assert parse_lora_spec("style.safetensors:0.5") == ("style.safetensors", 0.5)
    assert parse_lora_spec("C:\\loras\\style.safetensors") == ("C:\\loras\\style.safetensors", 1.0)
    assert parse_lora_spec("C:\\loras\\style.safetensors:-1") == ("C:\\loras\\style.safetensors", -1.0)
    with pytest.raises(FlowliftError, match="finite"):
        parse_lora_spec("style.safetensors:nan")


def test_bad_loras_are_one_line_and_leave_the_model_untouched(tmp_path, peft_lora):
    from safetensors.torch import load_file, save_file

    good = load_file(str(peft_lora))
    first = next(k for k in good if "lora_A" in k)
    r = torch.randn(4, 32)
    cases = {
        "nan.safetensors": ({**good, first: torch.full_like(good[first], float("nan"))}, "NaN"),
        "int.safetensors": ({**good, first: good[first].to(torch.int16)}, "expected floating point"),
        "flux1.safetensors": (  # a FLUX.1 LoRA in kohya's names: per-block modulation FLUX.2 has not
            {
                "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight": r,
                "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight": torch.randn(192, 4),
            },
            "match no layer",
        ),
        "elsewhere.safetensors": (
            {"transformer.nowhere.lora_A.weight": r, "transformer.nowhere.lora_B.weight": r.T.contiguous()},
            "match no layer of this FLUX.2 transformer: transformer.nowhere.lora_A.weight",
        ),
        "text.safetensors": (
            {"lora_te1_layer.lora_down.weight": r, "lora_te1_layer.lora_up.weight": r.T.contiguous()},
            "match no layer",
        ),
        "dora.safetensors": ({**good, first.replace("lora_A.weight", "dora_scale"): torch.ones(1, 32)}, "DoRA"),
    }
    for name, (tensors, message) in cases.items():
        path = tmp_path / name
        save_file(tensors, str(path))
        model = tiny_transformer()
        with pytest.raises(FlowliftError) as caught:
            apply_loras(model, [(str(peft_lora), 1.0), (str(path), 1.0)])
        text = str(caught.value)
        assert message in text and str(path) in text and "\n" not in text, text
        assert not getattr(model, "peft_config", None)  # nothing loaded, not even the good LoRA
    pickle = tmp_path / "style.pt"
    pickle.write_bytes(b"\x80\x04")
    with pytest.raises(FlowliftError, match="read from .safetensors only"):
        apply_loras(tiny_transformer(), [(str(pickle), 1.0)])


def test_cli_refuses_a_missing_or_pickled_lora_before_loading(capsys, tmp_path, model_dir):
    embeds = prompt_embeds_file(tmp_path, "emb.safetensors")
    photo = tmp_path / "p.png"
    photo.write_bytes(b"x")
    for lora, message in ((tmp_path / "nope.safetensors", "no such file"), (embeds.with_suffix(".ckpt"), "")):
        if lora.suffix == ".ckpt":
            lora.write_bytes(b"x")
            message = "safetensors only"
        argv = ["hires", "--model", str(model_dir), "--prompt-embeds", str(embeds), "--lora", str(lora)]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------------ LoRAs on fp8 and GGUF transformers


def test_lora_on_fp8_and_gguf_files_equals_the_lora_on_their_dequantized_folders(tmp_path, peft_lora):
    """The LoRA's own matrices stay float32 beside fp8-stored layers (diffusers keeps peft layers out of the
    layerwise casting) and beside GGUF blocks; the result is the LoRA on the weights the file stands for."""
    from flowlift.refine.loading import load_transformer, store_fp8_layers
    from flux2_files import diffusers_state_from_bfl, same_model_with, write_fp8, write_gguf

    model = tiny_transformer()
    files = {"fp8": write_fp8(model, tmp_path / "t-fp8.safetensors")}
    if importlib.util.find_spec("gguf") is not None:
        files["gguf"] = write_gguf(model, tmp_path / "t-Q8_0.gguf", "Q8_0")
    for kind, meant in files.items():
        path = tmp_path / ("t-fp8.safetensors" if kind == "fp8" else "t-Q8_0.gguf")
        loaded = load_transformer(str(path), dtype=torch.float32)
        apply_loras(loaded, [(peft_lora, 0.8)])
        store_fp8_layers(loaded, dtype=torch.float32)
        if kind == "fp8":
            base = loaded.transformer_blocks[0].attn.to_q
            assert base.base_layer.weight.dtype == torch.float8_e4m3fn
            assert base.lora_A["lora0"].weight.dtype == torch.float32
            folder = same_model_with(model, diffusers_state_from_bfl(meant))
        else:
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            state = {n: dequantize_gguf_tensor(p).float() for n, p in loaded.state_dict().items() if "lora_" not in n}
            folder = same_model_with(model, {n.replace(".base_layer", ""): v for n, v in state.items()})
        apply_loras(folder, [(peft_lora, 0.8)])
        torch.testing.assert_close(
            transformer_forward(loaded, text_dim=TEXT_DIM),
            transformer_forward(folder, text_dim=TEXT_DIM),
            rtol=0,
            atol=1e-6,
            msg=kind,
        )


def test_cli_hires_with_a_file_transformer_a_lora_and_a_budget(capsys, tmp_path, model_dir, peft_lora):
    """The 12 GB recipe of docs/refine.md in miniature: a single-file transformer, one LoRA, 2x hires, a budget."""
    from PIL import Image
    from safetensors.torch import save_file

    from flux2_files import write_fp8

    upscaler = save_tiny_unet(tmp_path / "flow_upscaler.safetensors", seed=0, cond_dim=32)
    embeds = tmp_path / "emb.safetensors"
    save_file({"prompt_embeds": EMB}, str(embeds))
    fp8 = tmp_path / "flux-2-tiny-fp8.safetensors"
    write_fp8(tiny_transformer(), fp8, scale="comfyui", prefix="model.diffusion_model.")
    out = tmp_path / "hires.png"
    base = {"width": "64", "height": "64", "base_steps": "2", "scale": "2", "upscaler": upscaler}
    transformer = {"model": model_dir, "transformer": fp8, "lora": f"{peft_lora}:0.5", "max_memory": "256MB"}
    argv = command_line("hires", **base, **transformer, prompt_embeds=embeds, steps="4", no_progress=True, o=out)
    assert main(argv) == 0, capsys.readouterr().err
    with Image.open(out) as img:
        assert img.size == (128, 128)
        meta = json.loads(img.text["flowlift"])
    assert meta["transformer"] == str(fp8) and "FLUX.2 (width 32)" in meta["transformer_file"]
    assert meta["loras"][0]["scale"] == 0.5 and meta["offload"] == "none" and "max_memory" in meta["memory_plan"]

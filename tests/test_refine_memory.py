"""Fitting the refine pass in device memory (issue 23, part 3): offload modes, the plan, the text encoder first.

On the CPU the offload modes move nothing, so what is checked here is what must hold on any device: the same
outputs bit for bit in every mode (the same kernels on the same values), the moves and hooks each mode sets up,
the plan's choices from sizes, and that the text encoder is gone before the transformer loads. GPU figures come
from ``benchmarks/bench_gpu.py`` (its refine rows).
"""

from __future__ import annotations

import gc
import importlib.util
import json
import shutil
import sys
import types
import weakref

import pytest
import torch

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.refine.loading import load_refiner
from flowlift.refine.memory_plan import (
    RefineMemory,
    TransformerSizes,
    VAESizes,
    plan_refine,
    transformer_activation_bytes,
)
from flowlift.refine.offload import Placement
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest
from tiny_flux2 import prompt_embeds, tiny_transformer, tiny_vae, write_model_dir

H, W = 48, 64
EMB = prompt_embeds()
GB = 10**9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("flux2-tiny"))


@pytest.fixture(scope="module")
def image():
    return torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(4))


def _img2img(refiner, image):
    return refiner.img2img(
        image, strength=0.6, sampling=SamplingSettings(steps=6, seed=3, sampler="heun"), prompt_embeds=EMB
    )


def test_offloaded_equals_not_offloaded_bit_for_bit(model_dir, image, monkeypatch):
    reference = _img2img(load_refiner(str(model_dir), memory=RefineMemory(offload="none")), image)

    model = load_refiner(str(model_dir), memory=RefineMemory(offload="model"))
    moves = []
    real_to = torch.nn.Module.to

    def spy_to(module, *args, **kwargs):
        if module is model.transformer:
            moves.append(str(args[0]) if args else str(kwargs.get("device")))
        return real_to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    out = _img2img(model, image)
    monkeypatch.undo()
    assert moves == ["cpu", "cpu"]  # onto the device (the CPU here) for the sampling loop, back to the host after
    assert torch.equal(out.latents, reference.latents) and torch.equal(out.images, reference.images)


def test_group_offloaded_equals_not_offloaded_bit_for_bit(model_dir, image):
    pytest.importorskip("accelerate")  # diffusers' group offloading moves tensors with accelerate's helpers
    reference = _img2img(load_refiner(str(model_dir), memory=RefineMemory(offload="none")), image)
    group = load_refiner(str(model_dir), memory=RefineMemory(offload="group"))
    hooked = [m for m in group.transformer.modules() if getattr(m, "_diffusers_hook", None) is not None]
    assert any(h._diffusers_hook.get_hook("group_offloading") is not None for h in hooked)
    out = _img2img(group, image)
    assert torch.equal(out.latents, reference.latents) and torch.equal(out.images, reference.images)
    assert out.parameters["offload"] == "group" and reference.parameters["offload"] == "none"
    with pytest.raises(FlowliftError, match="group-offloaded"):
        from flowlift.refine.refiner import Flux2Refiner

        Flux2Refiner(group.transformer, group.vae, placement=Placement(offload="none"))


def test_the_planned_vae_tiling_reaches_the_vae(model_dir, image):
    refiner = load_refiner(str(model_dir))
    seen = []

    class Recording:
        def __init__(self, inner):
            self.inner, self.bn_mean, self.bn_std = inner, inner.bn_mean, inner.bn_std

        def encode_raw(self, images, **kwargs):
            seen.append(("encode_raw", kwargs))
            return self.inner.encode_raw(images, **kwargs)

        def encode(self, images, **kwargs):
            seen.append(("encode", kwargs))
            return self.inner.encode(images, **kwargs)

        def decode(self, latents, **kwargs):
            seen.append(("decode", kwargs))
            return self.inner.decode(latents, **kwargs)

    refiner.vae = Recording(refiner.vae)
    whole = _img2img(refiner, image)
    assert seen == [("encode_raw", {}), ("decode", {})]  # no plan: the VAE decides by size
    seen.clear()
    refiner.vae_tiled = True
    tiled = _img2img(refiner, image)
    assert seen == [("encode_raw", {"tiled": True}), ("decode", {"tiled": True})]
    assert tiled.images.shape == whole.images.shape and torch.isfinite(tiled.images).all()


# ------------------------------------------------------------------------------------------------- the plan

KLEIN_4B = TransformerSizes(
    total_bytes=int(7.75 * GB), largest_block_bytes=int(0.226 * GB), outside_blocks_bytes=int(0.5 * GB), width=3072
)
VAE_BYTES = int(0.17 * GB)


def _plan(side, budget_gb, **kwargs):
    return plan_refine(side, side, int(budget_gb * GB), KLEIN_4B, vae=VAESizes(bytes=VAE_BYTES), **kwargs)


def test_plan_picks_the_fastest_fit_as_the_budget_shrinks():
    assert (_plan(1024, 24).offload, _plan(1024, 24).vae_tiled) == ("none", False)
    # 2048 px: the whole-frame decode (~4.3 GB in bf16) no longer fits beside the weights: tile, keep the weights
    assert (_plan(2048, 16).offload, _plan(2048, 16).vae_tiled) == ("none", False)
    assert (_plan(2048, 12).offload, _plan(2048, 12).vae_tiled) == ("none", True)
    # weights + activations (3.3 GB at 16896 tokens) exceed 10 GB: stream the blocks
    plan = _plan(2048, 10)
    assert (plan.offload, plan.vae_tiled, plan.upscaler_budget_bytes) == ("group", False, 10 * GB)
    assert plan.peak_bytes <= 10 * GB and "transformer offload group" in plan.describe()
    # 1024 px, 8.9 GB: weights + activations (8.83 GB) fit, weights + the decode (9.0 GB) do not: model offload
    assert (_plan(1024, 8.9).offload, _plan(1024, 8.9).vae_tiled) == ("model", False)
    # offload given: only the VAE's tiling is planned
    assert _plan(2048, 12, offload="group").offload == "group"
    assert _plan(2048, 40).upscaler_budget_bytes == 40 * GB - KLEIN_4B.total_bytes


def test_plan_counts_the_encode_of_an_image_the_size_it_decodes():
    """An img2img encodes its image at the size it decodes, and the FLUX.2 VAE's whole-frame encode (5.5 GB at 2048²
    in bf16, beside the image) is larger than its decode (4.3 GB): 13 GB took the whole-frame VAE by the decode alone,
    and the encode ran 0.4 GB past the budget."""
    plan = _plan(2048, 13)
    assert (plan.offload, plan.vae_tiled) == ("none", True) and plan.peak_bytes <= 13 * GB
    from flowlift.limits import encode_peak_bytes
    from flowlift.refine.memory_plan import vae_peak_bytes

    whole = vae_peak_bytes(VAESizes(bytes=VAE_BYTES), 2048, 2048, 1, False)
    assert whole == 3 * 2048 * 2048 * 4 + encode_peak_bytes("flux2", 2048, 2048, dtype=torch.bfloat16, tiled=False)
    assert KLEIN_4B.total_bytes + VAE_BYTES + whole > 13 * GB


def test_plan_too_small_is_one_line():
    with pytest.raises(FlowliftError) as caught:
        _plan(2048, 1.5)
    text = str(caught.value)
    assert "too small to refine a 2048x2048 image" in text and "group offload, a tiled VAE and 1024 px tiles" in text
    assert "\n" not in text
    with pytest.raises(FlowliftError, match="even group offload and a tiled VAE needs"):
        _plan(2048, 3, tiles=TileRequest.parse("off"))  # 3 GB plans 1024 px tiles (next test); untiled it is too small


# Klein 9B as a Q4_K_M GGUF: 8 + 24 blocks of width 4096; the largest (a double block) ~0.25 GB at ~4.5 bits
KLEIN_9B_Q4 = TransformerSizes(
    total_bytes=int(5.5 * GB), largest_block_bytes=int(0.25 * GB), outside_blocks_bytes=int(0.3 * GB), width=4096
)
# the same in bf16: a double block is ~436M parameters
KLEIN_9B_BF16 = TransformerSizes(
    total_bytes=int(18.1 * GB), largest_block_bytes=int(0.87 * GB), outside_blocks_bytes=int(0.6 * GB), width=4096
)


def test_plan_counts_a_tiles_tokens_so_12_gb_plans_a_4096_hires_fix():
    from flowlift.limits import decode_peak_bytes, encode_peak_bytes
    from flowlift.refine.memory_plan import LATENT_FRAME_BUFFERS

    def plan(budget_gb, **kwargs):
        return plan_refine(4096, 4096, int(budget_gb * GB), KLEIN_9B_Q4, vae=VAESizes(bytes=VAE_BYTES), **kwargs)

    # untiled, one forward on 65536 + 512 tokens is 17.3 GB of activations: refused even with group offload
    with pytest.raises(FlowliftError, match="too small to refine a 4096x4096 image: even group offload and a tiled"):
        plan(12, tiles=TileRequest.parse("off"))
    tiled = plan(12)
    assert (tiled.offload, tiled.tile_size) == ("none", 1024)
    # the sampling stage, term by term: weights + VAE + k tiles' activations (4096 + 512 tokens each) + latents
    tile_activations = int(32 * (64 * 64 + 512) * 4096 * 2)
    latents = LATENT_FRAME_BUFFERS * 32 * 512 * 512 * 4
    sampling = KLEIN_9B_Q4.total_bytes + VAE_BYTES + tiled.tile_batch * tile_activations + latents
    assert tiled.stage_peaks["sampling"] == sampling
    vae_sizes = {"dtype": torch.bfloat16, "tiled": tiled.vae_tiled}
    decode = decode_peak_bytes("flux2", 4096, 4096, **vae_sizes)
    encode = 3 * 4096 * 4096 * 4 + encode_peak_bytes("flux2", 4096, 4096, **vae_sizes)  # beside the float32 image
    coding = KLEIN_9B_Q4.total_bytes + VAE_BYTES + max(decode, encode)
    assert tiled.stage_peaks["vae"] == coding and tiled.peak_bytes == max(sampling, coding) <= 12 * GB
    # tile_batch auto: as many tiles per call as fit, at most 4; one more would not fit (or the cap is reached)
    assert tiled.tile_batch == min(4, (12 * GB - (sampling - tiled.tile_batch * tile_activations)) // tile_activations)
    assert f"1024 px tiles, {tiled.tile_batch} per call" in tiled.describe()
    # sampling fits 8 GB beside the weights (5.5 + 0.17 + 1.2 + 0.27 GB), the tiled decode (its float32 image, 0.2 GB,
    # and one tile's 2 GiB) does not: the weights leave the device for the VAE
    assert plan(8).tile_batch == 1 and plan(8).offload == "model"
    assert plan(12, tiles=TileRequest.parse(batch=2)).tile_batch == 2
    assert plan(12, tiles=TileRequest.parse(512)).tile_size == 512
    # a frame within 4 MP stays whole while it fits, and tiles only when nothing untiled does
    whole = plan_refine(2048, 2048, 12 * GB, KLEIN_9B_Q4, vae=VAESizes(bytes=VAE_BYTES))
    assert whole.tile_size is None and whole.tile_batch == 1
    small = plan_refine(2048, 2048, int(3 * GB), KLEIN_4B, vae=VAESizes(bytes=VAE_BYTES))
    assert (small.offload, small.tile_size) == ("group", 1024)
    # docs/refine.md's 24 GB and 12 GB rows for Klein 9B in bf16
    card24 = plan_refine(4096, 4096, 23 * GB, KLEIN_9B_BF16, vae=VAESizes(bytes=VAE_BYTES))
    card12 = plan_refine(4096, 4096, 11 * GB, KLEIN_9B_BF16, vae=VAESizes(bytes=VAE_BYTES))
    assert (card24.offload, card24.tile_size, card12.offload, card12.tile_size) == ("none", 1024, "group", 1024)


def test_activation_estimate_scales_with_tokens_width_and_dtype():
    base = transformer_activation_bytes(4608, 3072, dtype=torch.bfloat16)
    assert transformer_activation_bytes(9216, 3072, dtype=torch.bfloat16) == 2 * base
    assert transformer_activation_bytes(4608, 3072, dtype=torch.float32) == 2 * base
    assert 0.5 * GB < base < 1.5 * GB  # 32 frames of 4608 x 3072 bf16


def test_load_refiner_plans_from_max_memory(model_dir, image):
    refiner = load_refiner(str(model_dir), memory=RefineMemory(max_memory="64MB", image_size=(H, W)))
    assert refiner.memory_plan is not None and refiner.offload == "none" and refiner.vae_tiled is False
    out = _img2img(refiner, image)
    assert "max_memory 64 MB (61.0 MiB)" in out.parameters["memory_plan"]
    with pytest.raises(FlowliftError, match="too small to refine"):
        load_refiner(str(model_dir), memory=RefineMemory(max_memory="5MB", image_size=(H, W)))


def test_load_refiner_plans_the_tiles_and_their_batch(model_dir, image):
    refiner = load_refiner(
        str(model_dir),
        memory=RefineMemory(max_memory="64MB", image_size=(H, W)),
        tiles=TileRequest.parse(size=32, overlap=16),
    )
    plan = refiner.memory_plan
    assert plan.tile_size == 32 and plan.tile_batch == 4  # 6 tiles of a 64x48 frame; auto stops at 4
    out = _img2img(refiner, image)
    assert out.parameters["tiles"] == {"size": [32, 32], "overlap": 16, "grid": [2, 3], "batch": 4}
    assert "32 px tiles, 4 per call" in out.parameters["memory_plan"]
    one = _img2img(load_refiner(str(model_dir), tiles=TileRequest.parse(size=32, overlap=16, batch=1)), image)
    assert torch.allclose(out.latents, one.latents, rtol=0, atol=1e-5)  # batched tiles: the same blend
    with pytest.raises(FlowliftError, match="tile_size must be"):
        load_refiner(str(model_dir), tiles=TileRequest.parse(size=33))  # checked before any weights load


# --------------------------------------------------------------------------------------------- command line


@pytest.fixture
def photo(tmp_path):
    from PIL import Image

    path = tmp_path / "photo.png"
    array = (torch.rand(H, W, 3, generator=torch.Generator().manual_seed(0)) * 255).to(torch.uint8).numpy()
    Image.fromarray(array, "RGB").save(path)
    return path


@pytest.fixture
def embeds_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "prompt.safetensors"
    save_file({"prompt_embeds": EMB}, str(path))
    return path


def _pixels_and_metadata(path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB")).copy(), json.loads(img.text["flowlift"])


def test_cli_offload_and_max_memory(capsys, tmp_path, model_dir, photo, embeds_file):
    base = ["img2img", photo, "--model", model_dir, "--prompt-embeds", embeds_file, "--steps", "4", "--seed", "2"]
    outputs = {}
    runs = {"none": [], "model": ["--offload", "model"], "plan": ["--max-memory", "64MB"]}
    if importlib.util.find_spec("accelerate") is not None:
        runs["group"] = ["--offload", "group"]
    for name, extra in runs.items():
        out = tmp_path / f"{name}.png"
        assert main([str(a) for a in [*base, *extra, "-o", out]]) == 0, capsys.readouterr().err
        outputs[name] = _pixels_and_metadata(out)
    for name, (pixels, meta) in outputs.items():
        assert (pixels == outputs["none"][0]).all(), name
        assert meta["offload"] == ("none" if name == "plan" else name)
    assert "VAE whole frame" in outputs["plan"][1]["memory_plan"]
    assert main([str(a) for a in [*base, "--max-memory", "5MB", "-o", tmp_path / "x.png"]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if ": error: " in line]  # the others are progress lines ("loading ...")
    assert len(errors) == 1 and "too small to refine a 64x48 image" in errors[0] and errors[0] == lines[-1]
    assert not (tmp_path / "x.png").exists()
    assert main([str(a) for a in [*base, "--max-memory", "lots", "-o", tmp_path / "y.png"]]) == 2
    assert "--max-memory" in capsys.readouterr().err


def test_cli_frees_the_text_encoder_before_the_transformer_loads(capsys, tmp_path, model_dir, photo, monkeypatch):
    """--prompt text: the text encoder is loaded, run and released before the transformer is read."""
    import diffusers

    import flowlift.refine.loading as loading

    class FakePipe:  # what DiffusionPipeline.from_pretrained(model, transformer=None, vae=None) gives
        def __init__(self):
            self.text_encoder = torch.nn.Linear(4, 4)

        def encode_prompt(self, prompt, device):
            return prompt_embeds(7, seed=len(prompt)).to(device), None

    encoders = []

    def fake_from_pretrained(model, **kwargs):
        assert kwargs.get("transformer", 0) is None and kwargs.get("vae", 0) is None
        pipe = FakePipe()
        encoders.append(weakref.ref(pipe.text_encoder))
        return pipe

    real_load = loading.load_transformer
    alive_at_load = []

    def checking_load(*args, **kwargs):
        gc.collect()
        alive_at_load.append([ref() is not None for ref in encoders])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", staticmethod(fake_from_pretrained))
    monkeypatch.setattr(loading, "load_transformer", checking_load)
    stand_in = sys.modules.get("transformers") or types.ModuleType("transformers")  # the real one where installed
    monkeypatch.setitem(sys.modules, "transformers", stand_in)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "transformers" else real_find_spec(name, *a)
    )
    out = tmp_path / "o.png"
    model = tmp_path / "model"  # the tiny model with a text_encoder/ folder: the up-front check looks for it
    shutil.copytree(model_dir, model)
    (model / "text_encoder").mkdir()
    (model / "text_encoder" / "config.json").write_text("{}")
    argv = [
        "img2img",
        photo,
        "--model",
        model,
        "--prompt",
        "a red door",
        "--cfg-scale",
        "2",
        "--steps",
        "3",
        "-o",
        out,
    ]
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    assert len(encoders) == 1 and alive_at_load == [[False]]  # one encoder for prompt and negative, freed first
    _, meta = _pixels_and_metadata(out)
    assert meta["prompt"] == "a red door" and meta["negative_prompt"] == "" and meta["cfg_scale"] == 2.0


def test_offload_choices_mirror_the_api():
    from flowlift.refine.offload import OFFLOAD_MODES
    from flowlift.refine.settings import OFFLOADS

    assert OFFLOADS == ("auto", *OFFLOAD_MODES)


def test_offload_modes_compose_with_fp8_gguf_and_a_lora(tmp_path, image):
    """fp8 layerwise casting, GGUF blocks and a peft LoRA under each offload mode: the same latents bit for bit."""
    pytest.importorskip("accelerate")
    pytest.importorskip("peft")
    from flux2_files import write_fp8, write_gguf, write_peft_lora

    tiny_vae().save_pretrained(tmp_path / "vae")
    write_peft_lora(tiny_transformer(), tmp_path / "lora.safetensors")
    files = [tmp_path / "t-fp8.safetensors"]
    write_fp8(tiny_transformer(), files[0])
    if importlib.util.find_spec("gguf") is not None:
        files.append(tmp_path / "t-Q8_0.gguf")
        write_gguf(tiny_transformer(), files[1], "Q8_0")
    for path in files:
        latents = {}
        for mode in ("none", "model", "group"):
            refiner = load_refiner(
                str(tmp_path / "vae"),
                vae=str(tmp_path / "vae"),
                transformer=str(path),
                loras=[(tmp_path / "lora.safetensors", 0.7)],
                memory=RefineMemory(offload=mode),
            )
            latents[mode] = refiner.img2img(
                image, strength=0.6, sampling=SamplingSettings(steps=2, seed=3), prompt_embeds=EMB
            ).latents
        assert torch.equal(latents["model"], latents["none"]) and torch.equal(latents["group"], latents["none"]), path

"""What a refine's inputs already tell is refused at every strength, at every door, before any model loads.

Each case here was taken before this change: a tiled img2img conditioned one image's tiles on different prompts
(embeddings of batch 2), an outpaint at a strength that runs no step wrote its smeared-edge border, an inpaint with an
all-black mask ran every step for a round trip, strength 0 dropped guidance on Klein and took garbage conditioning,
img2img wrote a 16385 px wide output past the cap, and the command line refused an outpaint of a 50x37 image, prompt
embeddings of batch 2 and ``--guidance`` on Klein only after the model had loaded. Tiny random FLUX.2 components.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from builders import command_line, forbid_call
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.refine.refiner import Flux2Refiner
from flowlift.refine.request import PromptRequest, RefineRequest, RefinerSource
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest
from tiny_flux2 import AsUpscaler, Spy, prompt_embeds, tiny_transformer, tiny_vae

H, W = 32, 64  # two 32 px tiles side by side
ONE = SamplingSettings(steps=1)
EMB = prompt_embeds()
TWO = prompt_embeds(batch=2, seed=3)


@pytest.fixture(scope="module")
def vae():
    from flowlift.models.vae_loading import load_vae

    return load_vae(tiny_vae(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def transformer():
    return tiny_transformer()


@pytest.fixture
def spy(transformer):
    return Spy(transformer)


@pytest.fixture
def refiner(spy, vae):
    return Flux2Refiner(spy, vae, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def image():
    return torch.rand(1, 3, H, W, generator=torch.Generator().manual_seed(0))


def _refused(call, *words):
    """``call()`` is one FlowliftError line holding every one of ``words``."""
    with pytest.raises(FlowliftError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message
    return caught.value


# ----------------------------------------------------------------- 1. prompt embeddings: one, or one per image


def test_one_image_takes_one_prompt_tiled_or_not(refiner, spy, image):
    """The tiled velocity stacks one image's tiles on the batch axis, where embeddings of batch 2 once matched:
    the left tile ran on prompt 0, the right on prompt 1. Refused as untiled, before any step."""
    for tiles in (TileRequest(32, 0, 2), TileRequest(32, 0, 1), TileRequest("off")):
        error = _refused(
            lambda tiles=tiles: refiner.img2img(image, strength=0.5, sampling=ONE, prompt_embeds=TWO, tiles=tiles),
            "prompt embeddings have a batch of 2 for 1 image",
        )
        assert error.field == "prompt_embeds"
    negative = {"prompt_embeds": EMB, "negative_prompt_embeds": TWO, "cfg_scale": 2.0}
    error = _refused(lambda: refiner.img2img(image, strength=0.5, sampling=ONE, **negative), "negative prompt")
    assert error.field == "negative_prompt_embeds"
    mask = torch.ones(1, 1, H, W)
    three = prompt_embeds(batch=3)
    _refused(lambda: refiner.inpaint(image, mask, sampling=ONE, prompt_embeds=TWO), "batch of 2 for 1 image")
    _refused(lambda: refiner.outpaint(image, right=16, sampling=ONE, prompt_embeds=TWO), "batch of 2 for 1 image")
    _refused(lambda: refiner.txt2img(height=32, width=32, prompt_embeds=three, sampling=ONE), "batch of 3 for 1")
    _refused(lambda: refiner.txt2img(height=32, width=32, batch=2, prompt_embeds=three), "batch of 3 for 2 images")
    upscaler = AsUpscaler(lambda z: torch.nn.functional.interpolate(z, scale_factor=2.0))
    _refused(lambda: refiner.hires(upscaler, images=image, sampling=ONE, prompt_embeds=TWO), "batch of 2 for 1")
    assert spy.seen == [] and upscaler.seen == []


def test_one_prompt_per_image_still_runs_each_image_on_its_own(refiner, spy):
    images = torch.rand(2, 3, H, W, generator=torch.Generator().manual_seed(1))
    refiner.img2img(images, strength=0.5, sampling=ONE, prompt_embeds=TWO, tiles=TileRequest(32, 0, 1))
    assert len(spy.seen) == 2  # one tile of both images per call
    for call in spy.seen:
        conditioning = call["encoder_hidden_states"]
        assert torch.equal(conditioning[0], TWO[0]) and torch.equal(conditioning[1], TWO[1])


# ----------------------------------------------------------------- 2. an outpaint that runs no step


@pytest.mark.parametrize(
    ("strength", "strength_map"), [(0.0, "linear"), (1e-17, "linear"), (5e-324, "linear"), (1e-300, "canvas")]
)
def test_outpaint_refuses_every_strength_that_runs_no_step(refiner, spy, image, strength, strength_map, monkeypatch):
    """1 - 1e-17 is 1.0 in float (and 1 - (1e-300)**0.2 too): ``denoising_start`` 1, no model call, the smeared edge
    written, where strength 0 was refused."""
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    words = ("paints nothing into the new border", "no denoising step")
    outpaint = {"right": 16, "strength": strength, "strength_map": strength_map, "prompt_embeds": EMB}
    assert _refused(lambda: refiner.outpaint(image, **outpaint), *words).field == "strength"
    request = {"prompt": PromptRequest(text="x"), "source": RefinerSource(model="m"), "image": "in.png"}
    fields = {"mode": "outpaint", "outpaint": (0, 0, 16, 0), "strength": strength, "strength_map": strength_map}
    assert _refused(lambda: RefineRequest(**request, **fields), *words).field == "strength"
    assert spy.seen == []


def test_the_least_strength_that_runs_a_step_outpaints(refiner, image):
    out = refiner.outpaint(image, right=16, strength=1e-6, sampling=ONE, prompt_embeds=EMB)
    assert out.parameters["model_calls"] == 1 and out.images.shape[-1] == W + 16


# ----------------------------------------------------------------- 3. a mask that paints nothing


def test_an_all_black_mask_is_refused_as_outpaints_zero_borders_are(refiner, image, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    for mask in (torch.zeros(1, 1, H, W), torch.zeros(1, 1, H, W, dtype=torch.uint8)):
        error = _refused(lambda mask=mask: refiner.inpaint(image, mask, prompt_embeds=EMB), "mask is all 0", "img2img")
        assert error.field == "mask"
    images, masks = image.expand(2, -1, -1, -1), torch.ones(2, 1, H, W)
    masks[1] = 0.0  # that image alone would be a round trip
    _refused(lambda: refiner.inpaint(images, masks, prompt_embeds=EMB), "the mask of image 1 (of 2) is all 0")


# ----------------------------------------------------------------- 4. strength 0 checks the conditioning too


@pytest.mark.parametrize(
    ("conditioning", "words"),
    [
        ({"prompt_embeds": "garbage"}, ("prompt_embeds must be a tensor",)),
        ({"prompt_embeds": EMB, "cfg_scale": -5}, ("cfg_scale",)),
        ({"prompt_embeds": EMB, "guidance": 4.0}, ("guidance 4", "no guidance embedding", "cfg_scale")),
        ({"prompt_embeds": EMB, "reference_images": [torch.full((1, 3, 32, 32), float("nan"))]}, ("non-finite",)),
        ({"prompt_embeds": torch.zeros(1, 4, 8)}, ("have dim 8",)),
        ({"prompt_embeds": TWO}, ("batch of 2 for 1 image",)),
        ({}, ("give a prompt",)),
    ],
)
@pytest.mark.parametrize("mode", ["img2img", "inpaint"])
def test_strength_zero_checks_the_conditioning_as_any_strength(refiner, spy, image, mode, conditioning, words):
    mask = {"mask": torch.ones(1, 1, H, W)} if mode == "inpaint" else {}
    for strength in (0.0, 0.5):
        _refused(lambda s=strength: refiner.img2img(image, strength=s, sampling=ONE, **mask, **conditioning), *words)
    assert spy.seen == []


def test_strength_zero_still_runs_no_step(refiner, spy, image):
    tiles = TileRequest(32, 0, 2)
    cfg = {"prompt_embeds": EMB, "negative_prompt_embeds": EMB, "cfg_scale": 2.0}
    out = refiner.img2img(image, strength=0.0, sampling=ONE, tiles=tiles, **cfg)
    assert spy.seen == [] and out.parameters["model_calls"] == 0 and "tiles" not in out.parameters
    assert torch.equal(out.latents, refiner.encode(image))  # the round trip
    assert "cfg_scale" not in out.parameters  # no step used it


# ----------------------------------------------------------------- 5. the 16384 px cap on img2img's output


def test_img2img_and_inpaint_refuse_an_input_over_the_cap(refiner, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    wide = torch.zeros(1, 3, 16, 16385)
    error = _refused(lambda: refiner.img2img(wide, strength=0.5, prompt_embeds=EMB), "16385x16", "16384 px cap")
    assert error.field == "images"
    _refused(lambda: refiner.inpaint(wide, torch.ones(1, 1, 16, 16385), prompt_embeds=EMB), "16384 px cap")


def test_the_plan_takes_an_input_at_the_cap(tmp_path, embeds_file):
    from flowlift.refine.jobs import plan_refine_job

    Image.new("RGB", (16384, 16)).save(tmp_path / "wide.png")
    prompt, source = PromptRequest(embeds=embeds_file), RefinerSource(model=str(tmp_path))
    request = RefineRequest(mode="img2img", prompt=prompt, source=source, image=tmp_path / "wide.png")
    assert plan_refine_job(request).frame == (16, 16384)


# ----------------------------------------------------------------- 6. the command line, before any model loads


@pytest.fixture
def no_model_loads(monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.loading.load_refiner", "a model loaded before the inputs were checked")
    forbid_call(monkeypatch, "flowlift.refine.loading.load_transformer", "a transformer loaded first")
    forbid_call(monkeypatch, "flowlift.refine.prompts.embed_prompts", "a text encoder loaded first")


@pytest.fixture(scope="module")
def embeds_file(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("emb") / "prompt.safetensors"
    save_file({"prompt_embeds": EMB}, str(path))
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The files the cases name: a square photo, a 50x37 one, a 16385x16 one, a black mask, embeddings of batch 2
    for one image (prompt and negative)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("inputs")
    g = torch.Generator().manual_seed(0)
    for name, (width, height) in {"sq": (64, 64), "odd": (50, 37), "wide": (16385, 16)}.items():
        pixels = (torch.rand(height, width, 3, generator=g) * 255).to(torch.uint8).numpy()
        Image.fromarray(pixels, "RGB").save(folder / f"{name}.png")
    Image.new("L", (64, 64), 0).save(folder / "black.png")
    save_file({"prompt_embeds": TWO}, str(folder / "emb_b2.safetensors"))
    save_file({"prompt_embeds": EMB, "negative_prompt_embeds": TWO}, str(folder / "neg_b2.safetensors"))
    return folder


TILED = ["--tile-size", "32", "--tile-overlap", "0", "--tile-batch", "2"]


@pytest.mark.parametrize(
    ("image", "argv", "words"),
    [
        ("sq", ["--prompt-embeds", "{emb_b2}", *TILED], ("--prompt-embeds: prompt embeddings have a batch of 2",)),
        ("sq", ["--prompt-embeds", "{neg_b2}", "--cfg-scale", "2"], ("negative prompt embeddings have a batch of 2",)),
        ("odd", ["--outpaint", "0,0,16,0"], ("multiples of 16 px, got 50x37",)),
        ("sq", ["--guidance", "4"], ("--guidance 4: this transformer has no guidance embedding", "--cfg-scale")),
        ("sq", ["--guidance", "4", "--strength", "0"], ("no guidance embedding",)),
        ("sq", ["--outpaint", "0,0,16,0", "--strength", "1e-17"], ("strength 1e-17 paints nothing",)),
        ("sq", ["--outpaint", "0,0,16,0", "--strength", "1e-300", "--strength-map", "canvas"], ("paints nothing",)),
        ("sq", ["--mask", "{black}"], ("mask is all 0", "nothing to paint")),
        ("wide", [], ("image 16385x16 is over the 16384 px cap a side",)),
    ],
)
def test_the_inputs_refusals_come_before_any_model_loads(
    capsys, tmp_path, model_dir, embeds_file, inputs, no_model_loads, image, argv, words
):
    names = {"emb_b2": inputs / "emb_b2.safetensors", "neg_b2": inputs / "neg_b2.safetensors"}
    argv = [word.format(**names, black=inputs / "black.png") for word in argv]
    if "--prompt-embeds" not in argv:
        argv += ["--prompt-embeds", str(embeds_file)]
    out = tmp_path / "out.png"
    code = main(command_line("img2img", inputs / f"{image}.png", *argv, model=model_dir, steps="1", o=out))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and all(word in err for word in words), err
    assert not out.exists()

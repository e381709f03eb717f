"""The Python API's functions check their own arguments as the request objects do (a hostile sweep's findings):
a flag is a bool (``color_fix="no"`` was read as True: the output equal to ``color_fix=True``), ``output_size`` is
two integers within the 16384 px cap (a 16385-wide image came back), and ``load_refiner``'s arguments are refused
before any weights load (a missing LoRA, ``dtype="bf16"``, ``device="meta"`` and ``vae=""`` only failed, or were
used, after the transformer loaded). Each refusal is one FlowliftError line naming the keyword.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from builders import forbid_call
from flowlift import FlowliftError, FlowUpscalerPipeline, load_refiner


@pytest.fixture(scope="module")
def pipe(unet, vae):
    return FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)


@pytest.fixture
def image():
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _refused(call, *words):
    with pytest.raises(FlowliftError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and all(word in message for word in words), message
    return message


@pytest.mark.parametrize("flag", ["no", "false", 1, 0.0, None])
def test_color_fix_is_a_bool(pipe, image, flag, monkeypatch):
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    _refused(lambda: pipe.upscale_image(image, color_fix=flag, output_type="pt"), "color_fix")
    latents = torch.zeros(1, 32, 4, 4)
    _refused(lambda: pipe.upscale_latents(latents, color_fix=flag), "color_fix")
    _refused(lambda: pipe.encode_image(image, return_size=flag), "return_size")


@pytest.mark.parametrize(
    "size",
    [(16385, 128), (128, 16385), (0, 64), (64.5, 64), ("64", 64), (True, 64), (200,), (200, 200, 3), "200x200", 200],
)
def test_output_size_is_two_integers_within_the_cap_before_the_encoder_runs(pipe, image, size, monkeypatch):
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    _refused(lambda: pipe.upscale_image(image, output_size=size, output_type="pt"), "output_size", "16384")


def test_a_checked_output_size_still_runs(pipe):
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out = pipe.upscale_image(image, output_size=[96, 80], output_type="pt")
    assert tuple(out.shape) == (1, 3, 80, 96)


@pytest.mark.parametrize(
    ("passes", "size", "words"),
    [
        (1, (1000, 1000), ("over the 8x",)),  # was a 31x bicubic enlargement of the 2x frame, without a word
        (0, (256, 256), ("past the 1x num_passes=0 make", "give num_passes=3")),  # an "8x upscale" with no pass
        (1, (96, 96), ("past the 2x num_passes=1 make", "give num_passes=2")),
        (None, (24, 32), ("below the 32x32 input",)),
        (True, (128, 128), ("num_passes must be a non-negative integer, got True",)),  # a bool is no count
        ("2", (128, 128), ("num_passes must be a non-negative integer, got '2'",)),
    ],
)
def test_output_size_within_what_the_passes_make(pipe, image, passes, size, words, monkeypatch):
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    _refused(lambda: pipe.upscale_image(image, num_passes=passes, output_size=size, output_type="pt"), *words)


def test_passes_that_make_the_size_are_taken():
    """``output_size`` of the input's own size with ``num_passes=0`` (a VAE round trip) was refused as "1x the input,
    past the 1x num_passes=0 make": the passes make that size."""
    from flowlift.upscale.sizes import passes_for_output_size

    assert passes_for_output_size((48, 32), (48, 32), 0) == 0
    assert passes_for_output_size((48, 32), (96, 64), 1) == 1 and passes_for_output_size((48, 32), (90, 60), 1) == 1
    with pytest.raises(FlowliftError, match="49x32 is 1.021x the 48x32 input, past the 1x num_passes=0 make"):
        passes_for_output_size((48, 32), (49, 32), 0)


def test_fewer_passes_than_a_size_takes_are_taken_where_the_cap_drops_them():
    from flowlift.upscale.sizes import passes_for_output_size

    # 5x of 2100x16: three passes would pass 16384 px, so two run and the rest is resampled (the doors warn)
    assert passes_for_output_size((2100, 16), (10500, 80), 2) == 2
    assert passes_for_output_size((2100, 16), (10500, 80), None) == 3  # planned; the cap is the pipeline's
    _refused(lambda: passes_for_output_size((2100, 16), (10500, 80), 1), "give num_passes=3")


def test_output_size_alone_plans_the_passes_as_the_command_does(pipe, monkeypatch):
    ran = []
    original = FlowUpscalerPipeline.upscale_latents
    monkeypatch.setattr(
        FlowUpscalerPipeline,
        "upscale_latents",
        lambda self, latents, n, *a: ran.append(n) or original(self, latents, n, *a),
    )
    image = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out = pipe.upscale_image(image, output_size=(192, 176), output_type="pt")  # 3x: two passes, then down
    assert tuple(out.shape) == (1, 3, 176, 192) and ran == [2]


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"vae": ""}, ("vae",)),
        ({"vae": "  "}, ("vae",)),
        ({"loras": "style.safetensors"}, ("loras", "pairs")),
        ({"loras": [("missing.safetensors", 1.0)]}, ("LoRA missing.safetensors: no such file",)),
        ({"loras": [("style.safetensors", float("nan"))]}, ("loras",)),
        ({"dtype": "bf16"}, ("dtype",)),
        ({"dtype": torch.int8}, ("dtype",)),
        ({"device": "bogus"}, ("bogus",)),
        ({"device": "meta"}, ("meta",)),
        ({"memory": "auto"}, ("memory", "RefineMemory")),
        ({"tiles": "auto"}, ("tiles", "TileRequest")),
        ({"text_encoder": "no"}, ("text_encoder",)),
        ({"progress": "no"}, ("progress",)),
    ],
)
def test_load_refiner_refuses_its_arguments_before_any_weights_load(tmp_path, keywords, words, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "style.safetensors").write_bytes(b"")  # exists: only the pair's scale is wrong there
    forbid_call(monkeypatch, "flowlift.refine.loading.load_transformer", "the transformer loaded first")
    _refused(lambda: load_refiner("no/such-model", **keywords), *words)


# ------------------------------------------------------------------------------- never a NaN result


def test_refine_latents_refuses_a_non_finite_result():
    from flowlift import refine_latents
    from flowlift.refine.settings import SamplingSettings

    init = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(0))
    sampling = SamplingSettings(steps=2)

    def nan_velocity(z, sigma):
        return torch.full_like(z, float("nan"))

    _refused(lambda: refine_latents(nan_velocity, init_latents=init, denoising_start=0.5, sampling=sampling), "NaN")
    raw = torch.randn(1, 32, 8, 8)
    zero_std = {"bn_mean": torch.zeros(128), "bn_std": torch.zeros(128)}
    _refused(lambda: refine_latents(torch.zeros_like, init_latents=raw, denoising_start=1.0, **zero_std), "bn_std")
    # refused before the sampler runs (it ran, then its result was NaN)
    message = _refused(lambda: refine_latents(lambda z, s: z * 0, init_latents=raw, denoising_start=0.5, **zero_std))
    assert message.startswith("bn_std must be finite and above 0"), message


def test_the_refiners_vae_results_are_finite():
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.refiner import Flux2Refiner
    from tiny_flux2 import tiny_transformer, tiny_vae

    class Overflowing:  # a caller's VAE whose finite weights overflow: finite latents in, NaN pixels out
        def __init__(self, vae):
            self.vae = vae

        def decode(self, latents, **_):
            return self.vae.decode(latents) * float("nan")

    vae = load_vae(tiny_vae(), device="cpu", dtype=torch.float32)
    refiner = Flux2Refiner(tiny_transformer(), Overflowing(vae))
    _refused(lambda: refiner.decode(torch.zeros(1, 32, 2, 2)), "the VAE's decode gave NaN")
    assert Flux2Refiner(tiny_transformer(), vae).decode(torch.zeros(1, 32, 2, 2)).isfinite().all()


# ------------------------------------------------------------------------------- images of every mode


@pytest.mark.parametrize(
    ("make", "level"),
    [
        (lambda size: Image.fromarray(np.full(size, 30000, np.uint16)), round(30000 / 65535 * 255)),
        (lambda size: Image.fromarray(np.full(size, 0.5, np.float32), "F"), 128),
    ],
)
def test_color_fix_image_scales_16_bit_and_float_grey_as_load_image_does(make, level):
    from flowlift import color_fix_image

    fixed = np.asarray(color_fix_image(make((32, 32)), make((16, 16))))
    assert abs(int(fixed.mean()) - level) <= 1, fixed.mean()  # was 255 (16-bit clipped) and 0 ("F" truncated)


def test_the_metrics_refuse_a_float_image_outside_the_unit_range():
    from flowlift.measure import metrics

    picture = np.random.default_rng(0).integers(0, 256, (16, 16, 3)).astype(np.float32)
    with pytest.raises(FlowliftError, match=r"must lie in \[0, 1\]"):
        metrics.psnr(picture, picture * 0.5)
    assert metrics.psnr(picture / 255, picture / 255 * 0.5) > 0
    sixteen = Image.fromarray(np.full((8, 8), 65535, np.uint16))
    assert metrics.as_float_rgb(sixteen).min() == 1.0


# ------------------------------------------------------------------------------- the refiner's geometry and schedule


@pytest.fixture(scope="module")
def refiner():
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.refiner import Flux2Refiner
    from tiny_flux2 import tiny_transformer, tiny_vae

    return Flux2Refiner(tiny_transformer(), load_vae(tiny_vae(), device="cpu", dtype=torch.float32))


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda r, e: r.txt2img(height=32, width=32, batch=True, prompt_embeds=e), "batch must be an integer >= 1"),
        (lambda r, e: r.txt2img(height=32, width=32, batch=0, prompt_embeds=e), "batch must be an integer >= 1"),
        (lambda r, e: r.txt2img(height="32", width=32, prompt_embeds=e), "height must be an integer (px), got '32'"),
        (lambda r, e: r.txt2img(height=32, width=True, prompt_embeds=e), "width must be an integer (px), got True"),
        (lambda r, e: r.txt2img(height=32, width=40, prompt_embeds=e), "width must be a multiple of 16 px"),
        (lambda r, e: r.txt2img(height=20000, width=32, prompt_embeds=e), "height must be a multiple of 16 px in"),
        (lambda r, e: r.img2img(torch.rand(1, 3, 32, 32), strength=0.5, prompt_embeds="x"), "prompt_embeds must be a"),
        (lambda r, e: r.img2img(torch.rand(1, 3, 32, 32), strength=0.5, prompt=5), "prompt must be a string"),
        (
            lambda r, e: r.txt2img(height=32, width=32, prompt_embeds=e, negative_prompt_embeds="x", cfg_scale=2.0),
            "negative_prompt_embeds must be a tensor",
        ),
        (lambda r, e: r.hires("flow", images=torch.rand(1, 3, 32, 32), prompt_embeds=e), "upscaler must have"),
        (lambda r, e: r.encode("x"), "images must be an RGB tensor"),
        (lambda r, e: r.inpaint(torch.rand(1, 3, 32, 32), None, prompt_embeds=e), "mask must be"),  # was img2img
        (
            lambda r, e: r.txt2img(height=32, width=32, prompt_embeds=e, reference_images=5),
            "reference_images must be a list",  # was a TypeError: 'int' object is not iterable
        ),
    ],
)
def test_the_refiners_modes_name_a_wrong_argument_before_any_work(refiner, call, words, monkeypatch):
    """Each was an AttributeError from inside (``'str' object has no attribute 'to'``), or named the wrong thing
    (``batch=0``: "refine_latents: shape must be four positive integers")."""
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._run", "the sampler ran first")
    _refused(lambda: call(refiner, torch.zeros(1, 4, 32)), words)


@pytest.mark.parametrize(
    ("mask", "words"),
    [
        (torch.full((1, 1, 32, 32), 255.0), ("[0, 1]",)),
        (torch.full((1, 1, 32, 32), -1.0), ("[0, 1]",)),
        (torch.ones(3, 1, 32, 32), ("batch of 3 for 1",)),
        (torch.ones(1, 3, 32, 32), ("1-channel",)),
        (torch.ones(1, 1, 16, 32), ("differs from the image",)),
        (torch.ones(0, 1, 32, 32), ("none of them 0",)),
    ],
)
def test_an_inpaint_mask_is_one_per_image_or_one_in_the_unit_range(refiner, mask, words, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    image = torch.rand(1, 3, 32, 32)
    _refused(lambda: refiner.img2img(image, strength=0.5, mask=mask, prompt_embeds=torch.zeros(1, 4, 8)), *words)


@pytest.mark.parametrize("negative", [{"negative_prompt": "blur"}, {"negative_prompt_embeds": torch.zeros(1, 4, 8)}])
def test_a_negative_prompt_at_cfg_one_is_refused_not_ignored(refiner, negative, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    image = torch.rand(1, 3, 32, 32)
    _refused(lambda: refiner.img2img(image, strength=0.5, prompt_embeds=torch.zeros(1, 4, 8), **negative), "true CFG")
    _refused(lambda: refiner.denoiser(prompt_embeds=torch.zeros(1, 4, 8), cfg_scale=1e30), "at most 100")


def test_an_unknown_conditioning_keyword_is_one_line_naming_it(refiner, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner.encode", "the VAE ran first")
    image, emb = torch.rand(1, 3, 32, 32), torch.zeros(1, 4, 8)
    for strength in (0.5, 1.0):  # 1.0 builds no denoiser: the keyword is still refused
        _refused(lambda s=strength: refiner.img2img(image, strength=s, strenght=0.6, prompt_embeds=emb), "'strenght'")
    _refused(lambda: refiner.outpaint(image, left=16, strenght=0.6, prompt_embeds=emb), "outpaint", "'strenght'")
    _refused(lambda: refiner.txt2img(height=32, width=32, seed=1, prompt_embeds=emb), "txt2img", "'seed'")
    _refused(lambda: refiner.denoiser(prompt_embeds=emb, promt="x"), "'promt'", "reference_images")
    message = _refused(lambda: refiner.hires(object(), images=image, scale=2, prompt_embeds=emb), "'scale'")
    assert "HiresSettings" in message, message


def test_a_uint8_mask_is_scaled_by_its_range():
    from flowlift.refine.canvas import checked_mask

    images = torch.rand(2, 3, 8, 8)
    assert checked_mask(torch.full((1, 1, 8, 8), 255, dtype=torch.uint8), images).eq(1.0).all()
    keep_most = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    keep_most[..., 2:4, 2:4] = True  # a mask of 0 everywhere paints nothing: refused (tests/test_refine_refusals.py)
    assert checked_mask(keep_most, images).eq(keep_most.float()).all()


@pytest.mark.parametrize("border", [-16, True, 1.5, "16", None])
def test_outpaint_borders_are_whole_non_negative_numbers(refiner, border, monkeypatch):
    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    image = torch.rand(1, 3, 32, 32)
    _refused(lambda: refiner.outpaint(image, left=border, right=16, prompt_embeds=torch.zeros(1, 4, 8)), "left")


def test_an_empty_image_batch_is_one_line(refiner):
    _refused(lambda: refiner.img2img(torch.rand(0, 3, 32, 32), strength=0.5), "images", "none of them 0")


@pytest.mark.parametrize(
    ("args", "keywords", "word"),
    [
        ((4, -5), {"mu": "empirical"}, "image_seq_len"),
        ((4, 0), {}, "image_seq_len"),
        ((4, 1.5), {}, "image_seq_len"),
        ((True, 256), {}, "num_steps"),
        ((2.5, 256), {}, "num_steps"),
        ((4, 256), {"mu": True}, "mu"),
        ((4, 256), {"denoising_end": True}, "denoising_end"),
        ((4, 256), {"denoising_start": "0.5"}, "denoising_start"),
    ],
)
def test_flux2_sigmas_refuses_what_is_not_a_schedule(args, keywords, word):
    from flowlift import flux2_sigmas

    with pytest.raises(FlowliftError, match=word) as caught:  # a ValueError before: the API's errors are one kind
        flux2_sigmas(*args, **keywords)
    assert caught.value.fields == (word,)


def test_flux2_sigmas_takes_numpy_numbers():
    from flowlift import flux2_sigmas

    assert torch.equal(flux2_sigmas(4, np.int64(256), np.float32(0.5)), flux2_sigmas(4, 256, 0.5))


def test_txt2img_takes_numpy_sides_as_it_takes_a_numpy_batch(refiner):
    """``txt2img(height=np.int64(32))`` was refused while ``batch=np.int64(2)`` was taken; the sides come back as
    ints (no numpy number reaches a request's JSON), and the requests hold ints too."""
    from flowlift.refine.request import HiresSettings, PromptRequest, RefineRequest, RefinerSource
    from flowlift.refine.settings import SamplingSettings, check_txt2img_size
    from flowlift.upscale.latent_source import FlowUpscalerSource
    from tiny_flux2 import prompt_embeds

    sides = check_txt2img_size(np.int64(32), np.int32(48), ("width", "height"))
    assert sides == (32, 48) and all(type(side) is int for side in sides)
    assert all(type(side) is int for side in check_txt2img_size(np.uint16(32), 48))
    sampling = SamplingSettings(steps=1, seed=0)
    out = refiner.txt2img(
        height=np.int64(32), width=np.int64(48), batch=np.int64(2), sampling=sampling, prompt_embeds=prompt_embeds()
    )
    assert out.images.shape == (2, 3, 32, 48)
    prompt, source = PromptRequest(text="a cat"), RefinerSource(model="no/such-model")
    request = RefineRequest(mode="txt2img", prompt=prompt, source=source, size=(np.int64(64), np.int64(32)))
    hires = HiresSettings(upscaler=FlowUpscalerSource(), base_size=(np.int64(512), 256))
    request_hires = RefineRequest(mode="hires", prompt=prompt, source=source, hires=hires)
    for size in (request.size, request_hires.hires.base_size):
        assert size in ((64, 32), (512, 256)) and all(type(side) is int for side in size)
    for bad in (32.0, True, "32"):
        with pytest.raises(FlowliftError, match="^width must be an integer") as caught:
            check_txt2img_size(bad, 48, ("width", "height"))
        assert caught.value.field == "width"


def test_refine_latents_never_ignores_a_shape():
    from flowlift import refine_latents

    init = torch.zeros(1, 32, 8, 8)
    _refused(lambda: refine_latents(lambda z, s: z * 0, init_latents=init, shape=(2, 32, 16, 16)), "shape")


@pytest.mark.parametrize("device", ["bogus", "meta", "cpu:3"])
def test_a_device_that_is_not_here_is_one_line_at_every_entry(unet, vae, device):
    from flowlift import Flux2Refiner, load_upscaler, load_vae, refine_latents
    from tiny_flux2 import tiny_transformer

    for call in (
        lambda: FlowUpscalerPipeline(unet, vae, device=device),
        lambda: Flux2Refiner(tiny_transformer(), vae, device=device),
        lambda: load_upscaler("no/such-upscaler", device=device),
        lambda: load_vae("taef2", device=device),
        lambda: refine_latents(lambda z, s: z, shape=(1, 32, 4, 4), device=device),
    ):
        with pytest.raises(FlowliftError) as caught:
            call()
        assert caught.value.fields == ("device",), caught.value  # each door names it its way (--device)
        assert "\n" not in str(caught.value) and str(caught.value).startswith(f"device {device}: "), caught.value


def test_a_vae_refuses_images_and_latents_that_are_not_its_own(vae):
    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    _refused(lambda: vae.encode(images * 255), "[0, 1]")
    _refused(lambda: vae.encode(images * 2 - 1), "[0, 1]")
    _refused(lambda: vae.encode(images.clone().fill_(float("nan"))), "NaN")
    latents = vae.encode(images)
    latents[0, 0, 0, 0] = float("inf")
    _refused(lambda: vae.decode(latents), "NaN or Inf")


# ------------------------------------------------------------------------------- settings objects in their places


@pytest.mark.parametrize(("keyword", "value"), [("sampling", {"steps": 2}), ("tiles", "auto")])
def test_the_refiners_settings_are_their_objects(refiner, keyword, value, monkeypatch):
    from flowlift import refine_latents

    forbid_call(monkeypatch, "flowlift.refine.refiner.Flux2Refiner._encode_init", "the VAE ran first")
    word = "SamplingSettings" if keyword == "sampling" else "TileRequest"
    image = torch.rand(1, 3, 32, 32)
    _refused(lambda: refiner.img2img(image, strength=0.5, **{keyword: value}), keyword, word)
    _refused(lambda: refine_latents(lambda z, s: z, shape=(1, 32, 4, 4), **{keyword: value}), keyword, word)
    _refused(lambda: refiner.txt2img(height=32, width=32, **{keyword: value}), keyword, word)


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"memory": "auto"}, ("memory", "MemoryPolicy")),
        ({"compile": "no"}, ("compile must be True, False or a torch.compile mode",)),
        ({"compile": ""}, ("compile",)),  # was no compile, quietly
        ({"compile": 1}, ("compile",)),
        ({"dtype": "bf16"}, ("dtype",)),
        ({"dtype": torch.int8}, ("dtype",)),
        ({"channels_last": "no"}, ("channels_last", "True, False or None", "'no'")),  # was read as True
        ({"on_strip": "x"}, ("on_strip", "a function")),  # was a TypeError at the first strip of a pass
        ({"check_interrupt": 5}, ("check_interrupt", "a function")),
    ],
)
def test_the_pipelines_settings_are_checked_when_it_is_made(unet, vae, keywords, words):
    _refused(lambda: FlowUpscalerPipeline(unet, vae, device="cpu", **keywords), *words)


def test_callbacks_and_flags_are_refused_by_name_before_any_work(pipe, image, monkeypatch):
    """A callback that is not a function failed as a TypeError where it was first called (``on_decode_tile`` after
    the passes, minutes into a real run); ``latents_only="no"`` planned as True."""
    from flowlift import color_fix_image, refine_latents

    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._passes", "the passes ran first")
    _refused(lambda: pipe.upscale_image(image, num_passes=1, callback="x"), "callback must be a function", "'x'")
    _refused(lambda: pipe.upscale_image(image, num_passes=1, on_decode_tile=3), "on_decode_tile must be a function")
    _refused(lambda: pipe.upscale_latents(torch.zeros(1, 32, 4, 4), callback="x"), "callback must be a function")
    _refused(lambda: pipe.plan_memory(32, 32, 1, latents_only="no"), "latents_only must be True or False")
    picture = Image.new("RGB", (32, 32))
    _refused(lambda: color_fix_image(picture.resize((64, 64)), picture, on_strip="x"), "on_strip must be a function")
    _refused(lambda: refine_latents("x", shape=(1, 32, 4, 4)), "velocity_fn must be a function", "'x'")
    _refused(lambda: refine_latents(None, shape=(1, 32, 4, 4)), "velocity_fn must be a function", "denoising_start 1")
    _refused(lambda: refine_latents(lambda z, s: z, shape=(1, 32, 4, 4), on_step="x"), "on_step must be a function")


@pytest.mark.parametrize("dtype", ["bf16", torch.int8, None])
def test_a_dtype_that_is_not_a_floating_torch_dtype_is_one_line_at_every_loader(shared, tmp_path, vae, dtype):
    """``dtype="bf16"`` was a TypeError from torch's ``.to()``; ``torch.int8`` to ``load_upscaler`` blamed the file
    ("`...bias` has dtype int8")."""
    from builders import save_tiny_unet
    from flowlift import Flux2Refiner, load_upscaler, load_vae
    from tiny_flux2 import tiny_transformer

    weights = save_tiny_unet(tmp_path / "unet.safetensors")
    words = ("dtype must be a floating torch.dtype", repr(dtype))
    _refused(lambda: load_upscaler(weights, dtype=dtype), *words)
    _refused(lambda: load_vae(shared / "models" / "taef2", dtype=dtype), *words)
    _refused(lambda: Flux2Refiner(tiny_transformer(), vae, dtype=dtype), *words)


@pytest.mark.parametrize(
    ("keywords", "words"),
    [
        ({"transformer": "x"}, ("transformer must be a torch module",)),
        ({"vae": "taef2"}, ("vae must have decode() (and encode() for images), got str",)),
        ({"prompt_encoder": "x"}, ("prompt_encoder must be a function",)),
        ({"model_name": 5}, ("model_name must be a string",)),
        ({"placement": "gpu"}, ("placement must be a Placement",)),
        ({"provenance": "x"}, ("provenance must be a dict",)),
    ],
)
def test_the_refiners_own_arguments_are_checked_when_it_is_made(vae, keywords, words):
    from flowlift import Flux2Refiner
    from tiny_flux2 import tiny_transformer

    arguments = {"transformer": tiny_transformer(), "vae": vae, **keywords}
    _refused(lambda: Flux2Refiner(**arguments), *words)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("offload", "yes", ("offload must be one of none, model, group",)),
        ("vae_tiled", "no", ("vae_tiled must be True, False or None", "'no'")),  # was read as True: a tiled decode
        ("plan", 5, ("plan must be a RefinePlan",)),  # was an AttributeError where the tiles are sized
    ],
)
def test_a_placement_checks_its_fields_when_it_is_made(field, value, words):
    from flowlift.refine.offload import Placement

    _refused(lambda: Placement(**{field: value}), *words)


@pytest.mark.parametrize("device", ["bogus", "cpu:3", 5])
def test_a_memory_policys_offload_device_is_a_device_that_is_here(device):
    """It was used only at a chunked pass's first strip: a RuntimeError after the encode and any plain passes."""
    from flowlift.upscale.settings import MemoryPolicy

    message = _refused(lambda: MemoryPolicy(offload_device=device), f"{device}'", "device")
    assert message.startswith(f"offload_device {device}: "), message
    assert MemoryPolicy(offload_device="cpu").offload_device == "cpu"


@pytest.mark.parametrize("image", [torch.rand(0, 3, 32, 32), torch.zeros(0, 3, 32, 32, dtype=torch.uint8)])
def test_an_empty_image_is_refused_before_the_encoder(pipe, image, monkeypatch):
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    _refused(lambda: pipe.upscale_image(image, output_type="pt"), "empty")


@pytest.mark.parametrize(
    ("keywords", "word"),
    [
        ({"base_channels": 0}, "base_channels"),
        ({"base_channels": -32}, "base_channels"),
        ({"sample_channels": 0}, "sample_channels"),
        ({"time_dim": 0}, "time_dim"),
        ({"time_dim": 33}, "even"),
        ({"dropout": float("nan")}, "dropout"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_the_unets_constructor_refuses_what_is_no_network(keywords, word):
    from flowlift import FlowUpscalerUNet

    _refused(lambda: FlowUpscalerUNet(**{"base_channels": 16, "time_dim": 32, "cond_dim": 32, **keywords}), word)


@pytest.mark.parametrize(
    ("image", "metadata", "word"),
    [
        (Image.new("RGB", (0, 0)), None, "1x1"),
        (torch.zeros(3, 8, 8), None, "Pillow image"),
        (Image.new("RGB", (8, 8)), torch.zeros(2), "metadata"),
        (Image.new("RGB", (8, 8)), ["a", "b"], "metadata"),
    ],
)
def test_save_image_atomic_takes_an_image_and_a_mapping(tmp_path, image, metadata, word):
    from flowlift import save_image_atomic

    _refused(lambda: save_image_atomic(image, tmp_path / "out.png", metadata), word)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_an_rgba_array_keeps_its_alpha(pipe, dtype, monkeypatch):
    rng = np.random.default_rng(0)
    full = {"uint8": 255, "uint16": 65535, "float32": 1.0}[dtype]
    rgba = (rng.random((64, 64, 4)) * full).astype(dtype)
    rgba[..., 3] = 0
    rgba[:32, :, 3] = full
    out = pipe.upscale_image(rgba, num_passes=1, color_fix=False)
    assert out.mode == "RGBA" and out.size == (128, 128)
    alpha = np.asarray(out.getchannel("A"))
    assert alpha[:56].min() == 255 and alpha[72:].max() == 0  # Lanczos-resized, rows of the edge left out


def test_rgba_arrays_refused_before_any_work_when_their_alpha_cannot_be_kept(pipe, monkeypatch):
    forbid_call(monkeypatch, "flowlift.upscale.pipeline.FlowUpscalerPipeline._vae_call", "the VAE ran first")
    _refused(lambda: pipe.upscale_image(np.zeros((2, 32, 32, 4), np.uint8)), "batch of 2 RGBA arrays")
    bad_alpha = np.zeros((32, 32, 4), np.float32)
    bad_alpha[..., 3] = np.nan
    _refused(lambda: pipe.upscale_image(bad_alpha), "alpha", "NaN")


def test_inpaint_runs_at_one_default_strength_at_every_door():
    """The API's ``Flux2Refiner.inpaint`` defaulted to outpaint's 1.0 while the command's (and the app's) inpaint ran
    at ``--strength``'s 0.5: the same operation, another result by door."""
    import inspect
    from types import SimpleNamespace

    from flowlift.refine.refiner import Flux2Refiner
    from flowlift.refine.request import RefineRequest
    from flowlift.refine.settings import STRENGTH

    default = inspect.signature(Flux2Refiner.inpaint).parameters["strength"].default
    commands = RefineRequest.mode_strength.fget(SimpleNamespace(mode="inpaint", strength=None))  # no --strength
    assert default == commands == STRENGTH.default


def test_words_name_what_was_given(tmp_path):
    """passes=4 was refused as "scale must be in [1, 8], got 16.0"; a SesquiLSR folder as "no such file"."""
    from flowlift.models.sesqui_lsr import check_sesqui_file
    from flowlift.upscale.plan import UpscaleRequest

    _refused(lambda: UpscaleRequest(inputs=["a.png"], passes=4), "passes must be 1, 2 or 3", "got 4")
    _refused(lambda: check_sesqui_file(tmp_path), "is a folder; give the weights file itself")


def test_the_conditioning_keywords_are_the_denoisers_own():
    """The list a mode checks its keywords against is the denoiser's keyword-only parameters, no more, no less: a
    keyword added to one and not the other would be refused though valid, or pass unchecked."""
    import inspect

    from flowlift.refine.parameters import CONDITIONING_KEYWORDS
    from flowlift.refine.refiner import Flux2Refiner

    parameters = inspect.signature(Flux2Refiner.denoiser).parameters.values()
    named = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert named == list(CONDITIONING_KEYWORDS)

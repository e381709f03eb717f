"""Issue 43 items 4 and 5: one validation for every door, at construction.

The request and settings objects of the Python API (``RefineRequest``, ``PromptRequest``, ``RefinerSource``,
``SamplingSettings``, ``HiresSettings``, ``TileRequest``, ``UpscaleRequest``, ``UpscaleSettings``) check every field
when they are made, through the knob tables: a hostile value is one FlowliftError line naming the field as the
Python API spells it (never a command-line option, never an AttributeError from deep inside, never after a model
loaded), and the refiner's image doors refuse a float image outside [0, 1] and scale uint8 by its range. Each case
here was accepted (or failed late, or with the wrong words) before this change.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.refine.request import HiresSettings, PromptRequest, RefineRequest, RefinerSource
from flowlift.refine.settings import SamplingSettings
from flowlift.refine.tiling import TileRequest
from flowlift.upscale.outputs import UpscaleSettings
from flowlift.upscale.plan import UpscaleRequest

PROMPT = PromptRequest(text="a cat")
SOURCE = RefinerSource(model="no/such-model")


def _refine(**fields):
    return RefineRequest(**{"mode": "img2img", "prompt": PROMPT, "source": SOURCE, "image": "in.png", **fields})


def _refused(make, field, *words):
    """``make()`` is one FlowliftError line about ``field``, in the Python API's words (no ``--option``)."""
    with pytest.raises(FlowliftError) as caught:
        make()
    message = str(caught.value)
    assert caught.value.field == field, (caught.value.field, message)
    assert message.startswith(field) or field in message, message
    assert "--" not in message and "\n" not in message, message
    for word in words:
        assert word in message, message
    return message


# ------------------------------------------------------------------------------- what a mode needs (43.4)


def test_txt2img_over_the_16k_cap_is_refused_when_the_request_is_made():
    _refused(lambda: RefineRequest(mode="txt2img", prompt=PROMPT, source=SOURCE, size=(16400, 16)), "size", "16384")
    _refused(lambda: RefineRequest(mode="txt2img", prompt=PROMPT, source=SOURCE, size=(1000, 1024)), "size", "16")
    _refused(lambda: RefineRequest(mode="txt2img", prompt=PROMPT, source=SOURCE, size=(1024.0, 1024)), "size")
    assert RefineRequest(mode="txt2img", prompt=PROMPT, source=SOURCE, size=(16384, 16)).size == (16384, 16)


def test_outpaint_needs_its_borders_and_borders_need_outpaint():
    _refused(lambda: _refine(mode="outpaint"), "outpaint", "borders")
    _refused(lambda: _refine(outpaint=(0, 0, 64, 0)), "outpaint")  # img2img with borders: not a silent img2img
    _refused(lambda: _refine(mode="outpaint", outpaint=(0, 0, 0, 0)), "outpaint", "all 0")
    _refused(lambda: _refine(mode="outpaint", outpaint=(0, -16, 0, 0)), "outpaint")
    _refused(lambda: _refine(mode="outpaint", outpaint="0,0,64,0"), "outpaint")
    assert _refine(mode="outpaint", outpaint=[0, 0, 64, 0]).outpaint == (0, 0, 64, 0)


def test_a_mask_with_outpaint_names_both_fields_and_the_fix():
    """It said ``--mask: outpaint takes no mask (mask and outpaint are exclusive)``: one field for two, no fix."""
    message = _refused(lambda: _refine(mode="outpaint", outpaint=(0, 0, 64, 0), mask="m.png"), "mask")
    assert message == "mask and outpaint are exclusive (inpaint or outpaint); drop one"
    with pytest.raises(FlowliftError) as caught:
        _refine(mode="outpaint", outpaint=(0, 0, 64, 0), mask="m.png")
    assert caught.value.fields == ("mask", "outpaint")
    said = caught.value.worded({"mask": "--mask", "outpaint": "--outpaint"})
    assert said == "--mask and --outpaint are exclusive (inpaint or outpaint); drop one"


def test_a_field_the_mode_does_not_use_is_refused_not_dropped():
    """hires ran at its refine_strength 0.3 whatever ``strength`` said, dropped ``references`` and a base size
    beside an image; txt2img dropped an image, img2img a size: each is one line naming the field now."""
    from flowlift.upscale.latent_source import FlowUpscalerSource

    hires = HiresSettings(upscaler=FlowUpscalerSource())
    base = HiresSettings(upscaler=FlowUpscalerSource(), base_size=(512, 512))

    def hires_request(**fields):
        return RefineRequest(**{"mode": "hires", "prompt": PROMPT, "source": SOURCE, "hires": hires, **fields})

    def txt2img(**fields):
        return RefineRequest(mode="txt2img", prompt=PROMPT, source=SOURCE, **fields)

    _refused(lambda: hires_request(image="in.png", strength=0.9), "strength", "hires.refine_strength")
    _refused(lambda: hires_request(image="in.png", references=("ref.png",)), "references", "hires takes no reference")
    _refused(lambda: hires_request(image="in.png", hires=base), "hires.base_size", "which image replaces")
    _refused(lambda: txt2img(image="in.png"), "image", "use img2img")
    _refused(lambda: txt2img(strength=0.5), "strength", "starts from noise")
    _refused(lambda: txt2img(references=("ref.png",)), "references")
    _refused(lambda: _refine(size=(512, 512)), "size", "only txt2img draws at a size")
    _refused(lambda: _refine(size=True), "size", "only txt2img draws at a size")  # a number was a TypeError
    _refused(lambda: _refine(hires=hires), "hires", "only the hires mode uses it")
    assert hires_request(hires=base).hires.base_size == (512, 512)  # a txt2img base: its size is used
    assert hires_request(image="in.png").mode == "hires" and _refine(strength=0.4).strength == 0.4


def test_the_default_hires_request_names_its_missing_upscaler_before_anything_loads():
    """``RefineRequest(mode='hires')`` used to load the transformer, then fail with ``'NoneType' object has no
    attribute 'load'``; the request itself now says what is missing."""
    _refused(lambda: RefineRequest(mode="hires", prompt=PROMPT, source=SOURCE), "hires.upscaler", "FlowUpscalerSource")
    from flowlift.upscale.latent_source import FlowUpscalerSource

    hires = HiresSettings(upscaler=FlowUpscalerSource())
    assert RefineRequest(mode="hires", prompt=PROMPT, source=SOURCE, hires=hires).hires.passes == 1
    _refused(lambda: HiresSettings(upscaler="flow_upscaler.safetensors"), "upscaler")
    big = HiresSettings(upscaler=FlowUpscalerSource(), scale=8, base_size=(4096, 4096))
    too_big = lambda: RefineRequest(mode="hires", prompt=PROMPT, source=SOURCE, hires=big)  # noqa: E731
    _refused(too_big, "hires.scale", "16384", "use hires.scale 4")  # the scale is blamed: a smaller one fits


# ------------------------------------------------------------------------- wrong types deep inside (43.5)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt", None),
        ("prompt", "a cat"),
        ("source", "model"),
        ("sampling", None),
        ("sampling", {"steps": 4}),
        ("tiles", None),
        ("tiles", "auto"),
        ("hires", "2x"),
    ],
)
def test_a_settings_object_place_takes_only_that_object(field, value):
    _refused(lambda: _refine(**{field: value}), field, "must be a")


def test_one_lora_string_is_one_path_and_paths_are_never_empty():
    assert RefinerSource(model="m", loras="x.safetensors:0.5").loras == ("x.safetensors:0.5",)
    assert _refine(references="ref.png").references == ("ref.png",)
    _refused(lambda: RefinerSource(model="m", loras=[""]), "source.loras")
    _refused(lambda: RefinerSource(model=""), "source.model")
    _refused(lambda: RefinerSource(model="m", vae=""), "source.vae")
    _refused(lambda: RefinerSource(model="m", max_memory="lots"), "source.max_memory")
    _refused(lambda: RefinerSource(model="m", offload="gpu"), "source.offload")
    _refused(lambda: RefinerSource(model="m", device="bogus"), "source.device", "not a torch device")  # was at the job
    _refused(lambda: RefinerSource(model="m", dtype="bf16"), "source.dtype", "choose one of")
    _refused(lambda: _refine(output=""), "output")
    _refused(lambda: _refine(image=3), "image")


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: PromptRequest(text="a", cfg_scale=math.nan), "prompt.cfg_scale"),
        (lambda: PromptRequest(text="a", cfg_scale=0), "prompt.cfg_scale"),
        (lambda: PromptRequest(text="a", cfg_scale=101), "prompt.cfg_scale"),
        (lambda: PromptRequest(text="a", negative="blur"), "prompt.negative"),
        (lambda: PromptRequest(text="a", guidance=math.inf), "prompt.guidance"),
        (lambda: PromptRequest(text=5), "prompt.text"),
        (lambda: PromptRequest(), "prompt.text"),
        (lambda: SamplingSettings(mu="auto"), "mu"),
        (lambda: SamplingSettings(mu=math.nan), "mu"),
        (lambda: SamplingSettings(schedule="linear"), "schedule"),
        (lambda: SamplingSettings(steps=True), "steps"),
        (lambda: TileRequest(size=40), "tile_size"),
        (lambda: TileRequest(size="512"), "tile_size"),
        (lambda: TileRequest(size=64, overlap=64), "tile_overlap"),
        (lambda: TileRequest(batch=0), "tile_batch"),
        (lambda: HiresSettings(base_size=(1000, 1000)), "base_size"),
        (lambda: HiresSettings(base_size=None), "base_size"),
        (lambda: HiresSettings(color_fix="no"), "color_fix"),
        (lambda: _refine(strength=math.nan), "strength"),
        (lambda: _refine(progress="yes"), "progress"),
    ],
)
def test_every_refine_field_is_checked_at_construction(make, field):
    _refused(make, field)


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"batch_size": 0}, "batch_size", ">= 1"),
        ({"batch_size": 1.5}, "batch_size", ">= 1"),
        ({"barrier_timeout": math.nan}, "barrier_timeout", "finite"),
        ({"barrier_timeout": 0}, "barrier_timeout", ""),
        ({"passes": 0}, "passes", ">= 1"),
        ({"passes": "2"}, "passes", ""),
        ({"settings": None}, "settings", "must be"),
        ({"settings": "fast"}, "settings", "must be"),
        ({"inputs": []}, "inputs", ""),
        ({"output": ""}, "output", ""),
        ({"chunked": "no"}, "chunked", ""),
        ({"output_format": "bmp2"}, "output_format", ""),
        ({"long_side": 20000}, "long_side", "16384"),
        ({"long_side": 1.5}, "long_side", "integer"),
        ({"size": "3840 by 2160"}, "size", "WIDTHxHEIGHT"),
        ({"size": (3840, 0)}, "size", "(width, height)"),
        ({"size": True}, "size", "(width, height)"),  # a number was a TypeError ("not iterable")
        ({"size": 2.5}, "size", "(width, height)"),
        ({"device": "bogus"}, "device", "not a torch device"),  # was a line only after the inputs were listed
        ({"device": 5}, "device", "not a torch device"),
        ({"dtype": "bf16"}, "dtype", "floating torch.dtype"),
        ({"dtype": torch.int8}, "dtype", "floating torch.dtype"),
    ],
)
def test_every_upscale_request_field_is_checked_at_construction(fields, field, words):
    message = _refused(lambda: UpscaleRequest(**{"inputs": ["a.png"], **fields}), field, words)
    assert "MAX_OUTPUT_SIDE" not in message  # passes=0 used to be answered with the output cap: a false reason


def test_one_input_string_is_one_input_and_upscale_settings_check_their_knobs():
    assert UpscaleRequest(inputs="photos/*.png").inputs == ("photos/*.png",)
    for fields, field in [
        ({"seed": -1}, "seed"),
        ({"color_fix": "no"}, "color_fix"),
        ({"vae": ""}, "vae"),
        ({"transplant_strength": 2.0}, "transplant_strength"),
        ({"quality": 0}, "quality"),
        ({"resize_mode": "crop"}, "resize_mode"),
    ]:
        _refused(lambda fields=fields: UpscaleSettings(**fields), field)


# ----------------------------------------------------------------------------- images at the refiner's doors


@pytest.fixture(scope="module")
def refiner():
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.refiner import Flux2Refiner
    from tiny_flux2 import tiny_transformer, tiny_vae

    return Flux2Refiner(tiny_transformer(), load_vae(tiny_vae(), device="cpu", dtype=torch.float32))


def test_float_images_outside_0_1_are_refused_and_uint8_is_scaled_by_its_range(refiner):
    from tiny_flux2 import prompt_embeds

    class Doubling:
        def upscale_latents(self, latents, passes, **_):
            return torch.nn.functional.interpolate(latents, scale_factor=2**passes)

    sampling = SamplingSettings(steps=2, seed=3)
    pixels = torch.randint(0, 256, (1, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    embeds = prompt_embeds()
    common = dict(strength=0.5, sampling=sampling, prompt_embeds=embeds)
    _refused(lambda: refiner.img2img(pixels.float(), **common), "images", "[0, 1]")  # a [0, 255] float image
    _refused(lambda: refiner.img2img(pixels.float() / 255 * math.nan, **common), "images", "non-finite")
    _refused(
        lambda: refiner.hires(
            Doubling(), HiresSettings(), images=pixels.float(), sampling=sampling, prompt_embeds=embeds
        ),
        "images",
        "[0, 1]",
    )
    _refused(lambda: refiner.outpaint(pixels.float(), right=16, sampling=sampling, prompt_embeds=embeds), "images")
    as_uint8 = refiner.img2img(pixels, **common)
    as_float = refiner.img2img(pixels.float() / 255, **common)
    assert torch.equal(as_uint8.latents, as_float.latents)  # uint8 is scaled by its range, as documented


# ------------------------------------------------------------------------------------------ words at the doors


def test_the_python_api_says_keywords_and_the_command_line_says_its_options(tmp_path, capsys):
    """The capabilities name the knob or field; the command line translates it to its option (``--tile-size``),
    from its parser, so refine/ and upscale/ never spell an option."""
    from flowlift.commands.cli import main

    message = _refused(lambda: TileRequest(size=40), "tile_size")
    assert message.startswith("tile_size must be")
    missing = tmp_path / "missing.safetensors"
    from flowlift.refine.jobs import plan_refine_job

    request = _refine(image=None, mode="txt2img", prompt=PromptRequest(embeds=missing), output=tmp_path / "o.png")
    _refused(lambda: plan_refine_job(request), "prompt.embeds", "file not found")
    image = tmp_path / "in.png"
    from PIL import Image

    Image.new("RGB", (32, 32)).save(image)
    code = main(
        [
            "img2img",
            str(image),
            "--model",
            "no/such-model",
            "--prompt-embeds",
            str(missing),
            "-o",
            str(tmp_path / "out.png"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"flowlift img2img: error: --prompt-embeds: file not found: {missing}", err
    code = main(["img2img", str(image), "--model", "m", "--prompt", "x", "--max-memory", "lots"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("flowlift img2img: error: --max-memory must be a size like 6GB"), err
    code = main(["upscale", str(image), "--long-side", "20000", "-o", str(tmp_path / "big.png")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("flowlift upscale: error: --long-side must be an integer in [1, 16384]"), err
    assert not (tmp_path / "big.png").exists()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("no_cache", "no", ("True or False",)),  # was read as True: the cache dropped
        ("save_outputs", "no", ("True or False",)),
        ("progress", "no", ("True, False or None",)),
        ("overwrite", "no", ("true or false",)),
        ("limit", "5", ("an integer >= 1",)),
        ("box", "x", ("x,y,w,h",)),  # was a ValueError from int()
        ("box", (0, 0, 0, 8), ("w,h > 0",)),
        ("figure_images", -1, ("an integer >= 1",)),  # was accepted
        ("barrier_timeout", "x", ("a finite number above 0",)),  # was accepted
        ("device", 5, ("a string",)),
        ("device", "bogus", ("not a torch device",)),  # was refused only when the run began
        ("dtype", "fp8", ("choose one of auto, float32, bfloat16, float16",)),
        ("scale", 0.5, ("above 1",)),
    ],
)
def test_every_eval_request_field_is_checked_at_construction(tmp_path, field, value, words):
    from flowlift.measure.eval_job import EvalRequest

    _refused(lambda: EvalRequest(output=tmp_path / "report", **{field: value}), field, *words)


def test_an_eval_request_takes_one_string_as_one_path_and_speaks_keywords(tmp_path):
    """``outputs="a.png"`` was measured as the images ``a``, ``.``, ``p``...; a field only ``run`` uses, given with
    ``outputs``, was named by its command-line option (``--limit goes with --run METHODS --dataset``)."""
    from PIL import Image

    from flowlift.measure.eval_job import EvalRequest, run_eval

    request = EvalRequest(output=tmp_path / "report", outputs="a.png", dataset="photos", run="lanczos,bicubic")
    assert (request.outputs, request.dataset, request.run) == (("a.png",), ("photos",), ("lanczos,bicubic",))
    image = tmp_path / "in.png"
    Image.new("RGB", (32, 32)).save(image)
    pairs = {"output": tmp_path / "report", "outputs": [str(image)], "reference": str(image)}
    message = _refused(lambda: run_eval(EvalRequest(**pairs, limit=1)), "limit")
    assert message.startswith("limit goes with run; outputs with reference"), message
    message = _refused(lambda: run_eval(EvalRequest(output=tmp_path / "report", run="lanczos")), "run")
    assert message == "run needs dataset (a folder of photos)", message
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("overwrite", "no", ("true or false",)),
        ("progress", "no", ("True, False or None",)),
        ("seed", "1", ("non-negative integer",)),
        ("shard_size", 0, ("an integer >= 1",)),
        ("batch_size", "4", ("an integer >= 1",)),
        ("storage_dtype", "fp16", ("float16, bfloat16, float32",)),
        ("storage_dtype", ["float16"], ("float16, bfloat16, float32",)),  # was a TypeError: unhashable type
        ("storage_dtype", {}, ("float16, bfloat16, float32",)),
        ("filter", "nearest", ("area, bicubic",)),
        ("jpeg_quality", 101, ("1..100",)),
        ("noise_std", "x", ("[0, 1]",)),  # was a TypeError from a comparison
        ("part", "0/4", ("(index, count)",)),
        ("part", (4, 4), ("0 <= I < N",)),
    ],
)
def test_every_dataset_request_field_is_checked_at_construction(tmp_path, field, value, words):
    """A ``DatasetRequest`` checked only that it had one source: ``overwrite="no"``, ``progress="no"`` and the
    numbers were taken as given (some failed at the first shard, some never)."""
    from flowlift.training.dataset_jobs import DatasetRequest, PhotoCrops

    crops = PhotoCrops(["photos"])
    _refused(lambda: DatasetRequest(tmp_path / "data", "taef2", crops=crops, **{field: value}), field, *words)


@pytest.mark.parametrize(
    ("make", "field", "words"),
    [
        (lambda: _crops(flip="no"), "flip", ("True or False",)),  # was read as True
        (lambda: _crops(crops_per_image=0), "crops_per_image", ("an integer >= 1",)),
        (lambda: _teacher(num=0), "num", ("an integer >= 1",)),
        (lambda: _teacher(width=1000), "width", ("multiples of 32", "1000x1024")),  # was checked by run_dataset
        (lambda: _teacher(steps="4"), "steps", ("an integer >= 1",)),
        (lambda: _teacher(guidance=float("nan")), "guidance", ("finite",)),
        (lambda: _teacher(teacher_dtype="fp8"), "teacher_dtype", ("float16, bfloat16, float32",)),
        (lambda: _teacher(teacher_dtype=["float16"]), "teacher_dtype", ("float16",)),  # was a TypeError: unhashable
        (lambda: _teacher(teacher_dtype={}), "teacher_dtype", ("float16",)),
        (lambda: _teacher(guidance=-1.0), "guidance", ("above 0",)),  # was taken: PromptRequest.guidance's rule
        (lambda: _teacher(guidance=0), "guidance", ("above 0",)),
        (lambda: _teacher(guidance="4"), "guidance", ("above 0",)),
        (lambda: _crops(crop_px=math.nan), "crop_px", ("multiple of 32", "e.g. 512")),  # was a ValueError
        (lambda: _crops(crop_px=math.inf), "crop_px", ("multiple of 32", "e.g. 512")),  # was an OverflowError
        (lambda: _crops(crop_px=-math.inf), "crop_px", ("multiple of 32",)),
        (lambda: _crops(crop_px=64.0), "crop_px", ("multiple of 32", "e.g. 64")),
    ],
)
def test_a_datasets_sources_check_their_fields_at_construction(make, field, words):
    message = _refused(make, field, *words)
    assert "--" not in message


def test_a_teachers_guidance_is_a_positive_number_as_a_refines_is():
    """``guidance=-1`` and ``0`` were taken for the teacher; ``PromptRequest.guidance``, the same scale, refused."""
    from flowlift.refine.request import PromptRequest

    assert _teacher(guidance=4).guidance == PromptRequest(text="x", guidance=4).guidance == 4.0
    assert _teacher().guidance is None and _teacher(teacher_dtype="bfloat16").teacher_dtype == "bfloat16"
    for value in (-1.0, 0):
        _refused(lambda value=value: PromptRequest(text="x", guidance=value), "prompt.guidance", "above 0")


def test_a_dataset_sources_one_string_is_one_input_and_its_device_is_here(tmp_path):
    from flowlift.training.dataset_jobs import DatasetRequest

    assert _crops(inputs="photos").inputs == ("photos",)
    with pytest.raises(FlowliftError, match="^device bogus: 'bogus' is not a torch device"):  # was a RuntimeError
        DatasetRequest(tmp_path / "data", "taef2", crops=_crops(), device="bogus")


def _crops(**fields):
    from flowlift.training.dataset_jobs import PhotoCrops

    return PhotoCrops(**{"inputs": ["photos"], **fields})


def _teacher(**fields):
    from flowlift.training.dataset_jobs import TeacherSource

    return TeacherSource(**{"teacher": "some/teacher", "num": 4, **fields})


def test_a_stopped_refine_closes_its_step_bar(refiner, monkeypatch):
    """img2img/hires stopped mid-steps printed a progress line after "interrupted": the steps' bar was closed at the
    last step only, and its ticker thread went on writing. It is closed however the sampling ends."""
    from flowlift import console
    from flowlift.refine import refiner as refiner_module
    from tiny_flux2 import prompt_embeds

    def stopped_after_one_step(*_args, on_step, **_kwargs):
        on_step(0, 4, 0.9)
        raise KeyboardInterrupt

    monkeypatch.setattr(refiner_module, "refine_latents", stopped_after_one_step)
    monkeypatch.setattr(refiner, "progress", None)  # a bar of lines, as the command line draws one off a terminal
    before = list(console._open_lines)
    with pytest.raises(KeyboardInterrupt):
        refiner.img2img(
            torch.rand(1, 3, 32, 32), strength=0.5, sampling=SamplingSettings(steps=4), prompt_embeds=prompt_embeds()
        )
    assert console._open_lines == before  # the bar is closed, its ticker gone


@pytest.mark.parametrize("size", [math.inf, -math.inf, math.nan])
def test_a_non_finite_max_memory_is_one_line_at_construction(size):
    from flowlift.limits import parse_memory
    from flowlift.upscale.settings import MemoryPolicy

    for make, field in (
        (lambda: parse_memory(size), "max_memory"),
        (lambda: MemoryPolicy(max_memory=size), "max_memory"),  # was OverflowError / ValueError at the pipeline
        (lambda: RefinerSource(model="m", max_memory=size), "source.max_memory"),
        (lambda: UpscaleRequest(inputs=["a.png"], max_memory=size), "max_memory"),
    ):
        _refused(make, field, "finite")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("strength", 1.5),
        ("strength", "0.5"),
        ("quality", 0),
        ("quality", True),
        ("device", "bogus"),
        ("inputs", []),
        ("references", [""]),
        ("output_format", 5),  # any value was taken: a failed save per image
        ("output_format", "bmp2"),
    ],
)
def test_a_colour_fix_request_checks_its_fields_up_front(field, value):
    """Each was accepted and failed every image in turn (or listed the letters of a path) before."""
    from flowlift.upscale.colorfix_job import ColorFixRequest

    message = _refused(lambda: ColorFixRequest(**{"inputs": ["a.png"], "references": ["b.png"], field: value}), field)
    assert f"{field}: {field}" not in message, message  # the field once ("device: device bogus: ..." said it twice)


def test_a_colour_fix_request_takes_one_path_string_as_one_path():
    from flowlift.upscale.colorfix_job import ColorFixRequest

    request = ColorFixRequest(inputs="a.png", references="photos", quality=90, device="cpu")
    assert request.inputs == ("a.png",) and request.references == ("photos",)
    assert request.quality == 90 and request.device == torch.device("cpu")

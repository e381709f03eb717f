"""The Python API's request objects check every field when they are made (a fourth hostile sweep's findings): a
wrong type or value is one FlowliftError line naming the field, never a TypeError or AttributeError later, and
never a value quietly read as another (``scale="3"`` held as 3, ``compile="no"`` as a compile mode, ``""`` as the
default weights).
"""

from __future__ import annotations

import pytest
import torch

from flowlift import FlowliftError


def _refused(call, field, *words):
    with pytest.raises(FlowliftError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(field) and caught.value.field == field, message
    assert all(word in message for word in words), message
    return message


@pytest.mark.parametrize(
    ("keywords", "field"),
    [
        ({"offload": "foo"}, "memory.offload"),
        ({"offload": ["auto"]}, "memory.offload"),
        ({"max_memory": "bogus"}, "memory.max_memory"),
        ({"max_memory": True}, "memory.max_memory"),
        ({"image_size": "1024"}, "memory.image_size"),
        ({"image_size": (0, -5)}, "memory.image_size"),
        ({"image_size": (1024.5, 1024)}, "memory.image_size"),
        ({"text_tokens": 0}, "memory.text_tokens"),  # was read as the default 512
        ({"text_tokens": -1}, "memory.text_tokens"),
        ({"text_tokens": "512"}, "memory.text_tokens"),
    ],
)
def test_a_refine_memory_checks_its_fields_when_it_is_made(keywords, field):
    """They were read only when ``load_refiner`` made its plan, after the transformer and the VAE had loaded."""
    from flowlift.refine.memory_plan import RefineMemory

    _refused(lambda: RefineMemory(**keywords), field)
    assert RefineMemory(image_size=[512, 768], text_tokens=77).image_size == (512, 768)


@pytest.mark.parametrize(
    ("keywords", "field"),
    [
        ({"scale": "3"}, "scale"),  # was held as 3
        ({"scale": True}, "scale"),
        ({"tile": "512"}, "tile"),  # held as given, then read as 512 by the run
        ({"tile": 512.0}, "tile"),
        ({"tile": 2.5}, "tile"),
        ({"tile": True}, "tile"),
        ({"tile": -5}, "tile"),
        ({"tile": None}, "tile"),
        ({"tile_overlap": "32"}, "tile_overlap"),
        ({"tile_overlap": -1}, "tile_overlap"),
        ({"tile": 64, "tile_overlap": 32}, "tile"),  # a tile no larger than twice its overlap
    ],
)
def test_an_eval_request_checks_its_numbers_when_it_is_made(tmp_path, keywords, field):
    from flowlift.measure.eval_job import EvalRequest

    _refused(lambda: EvalRequest(output=tmp_path / "report", outputs=["a.png"], reference="b", **keywords), field)
    made = EvalRequest(output=tmp_path / "report", outputs=["a.png"], reference="b", scale=3, tile="none")
    assert made.scale == 3 and made.tile == "none"


def test_the_eval_command_still_reads_its_numbers_from_text():
    from flowlift.measure.inputs import scale_argument

    assert scale_argument("1.5") == 1.5 and scale_argument("3") == 3


@pytest.mark.parametrize("value", ["no", "false", "", "bogus-mode", 1, None])
def test_an_upscale_request_takes_a_compile_mode_it_knows(value):
    """``"no"`` was held, then refused by the pipeline after both models loaded; ``""`` meant no compile."""
    from flowlift.upscale.plan import UpscaleRequest

    _refused(lambda: UpscaleRequest(inputs=["a.png"], compile=value), "compile", "max-autotune")
    assert UpscaleRequest(inputs=["a.png"], compile="max-autotune").compile == "max-autotune"


@pytest.mark.parametrize(
    ("keywords", "field"),
    [({"weights": ""}, "weights"), ({"weights": 5}, "weights"), ({"unet": "x"}, "unet"), ({"unet": 5}, "unet")],
)
def test_a_flow_upscaler_source_names_its_weights(keywords, field):
    """``weights=""`` was the released weights, ``5`` a TypeError when the hires fix looked its file up."""
    from flowlift.upscale.latent_source import FlowUpscalerSource

    _refused(lambda: FlowUpscalerSource(**keywords), field)


@pytest.mark.parametrize("source", ["", "  ", 5, None])
def test_load_upscaler_names_its_source(source):
    import flowlift

    _refused(lambda: flowlift.load_upscaler(source), "source")


@pytest.mark.parametrize(
    ("keywords", "field"),
    [
        ({"bn_mean": "x", "bn_std": "y"}, "bn_mean"),  # was an AttributeError
        ({"bn_mean": torch.zeros(5), "bn_std": torch.ones(5)}, "bn_mean"),  # was a RuntimeError mid-normalization
        ({"bn_mean": torch.zeros(128), "bn_std": torch.ones(5)}, "bn_std"),
        ({"bn_mean": torch.zeros(2, 64), "bn_std": torch.ones(128)}, "bn_mean"),  # 128 values, not the 128 channels
        ({"bn_mean": torch.zeros(128, dtype=torch.int64), "bn_std": torch.ones(128)}, "bn_mean"),
        ({"memory_plan": "x"}, "memory_plan"),  # was an AttributeError where the tiles are sized
    ],
)
def test_refine_latents_names_its_statistics_and_plan(keywords, field):
    from flowlift.refine.loop import refine_latents
    from flowlift.refine.tiling import TileRequest

    init = torch.zeros(1, 32, 4, 4)
    _refused(lambda: refine_latents(torch.zeros_like, init_latents=init, tiles=TileRequest(), **keywords), field)


@pytest.mark.parametrize(
    ("arguments", "field"),
    [((5, "image"), "upscaled"), (("image", "x"), "reference"), (("image", "image", 1.5), "strength")],
)
def test_color_fix_image_names_its_arguments(arguments, field):
    """It said ``expected a Pillow image ...`` for either image and ``colour fix strength`` for the strength."""
    import numpy as np
    from PIL import Image

    import flowlift

    image = Image.fromarray(np.zeros((32, 32, 3), np.uint8))
    made = [image if value == "image" else value for value in arguments]
    _refused(lambda: flowlift.color_fix_image(*made), field)


@pytest.mark.parametrize("value", [-1, 2.5, True, "3"])
def test_a_count_names_its_field_for_every_door(value):
    """``check_count`` named the field in its text only: a door could not say it in its own words."""
    from flowlift.knobs import check_count

    _refused(lambda: check_count("num_passes", value), "num_passes")


@pytest.mark.parametrize("tiled", ["no", "false", 1, [], "auto"])
def test_a_vaes_tiled_is_true_false_or_none(vae, tiled):
    """``tiled="no"`` ran the tiled path (read as truthy) at every adapter."""
    from flowlift.models.vae_loading import load_vae
    from tiny_flux2 import tiny_vae

    images, latents = torch.rand(1, 3, 32, 32), torch.zeros(1, 32, 4, 4)
    flux2 = load_vae(tiny_vae(), device="cpu", dtype=torch.float32)
    for adapter in (vae, flux2):
        _refused(lambda adapter=adapter: adapter.encode(images, tiled=tiled), "tiled")
        _refused(lambda adapter=adapter: adapter.decode(latents, tiled=tiled), "tiled")


@pytest.mark.parametrize(
    ("bn_std", "field"),
    [(-torch.ones(128), "bn_std"), (torch.full((128,), float("nan")), "bn_std"), (torch.zeros(128), "bn_std")],
)
def test_refine_latents_takes_a_vaes_statistics_only(bn_std, field):
    """A negative std was taken (latents mirrored), a NaN one ran the whole sampler first."""
    from flowlift.refine.loop import refine_latents

    init, bn_mean = torch.zeros(1, 32, 4, 4), torch.zeros(128)
    _refused(lambda: refine_latents(torch.zeros_like, init_latents=init, bn_mean=bn_mean, bn_std=bn_std), field)


def test_a_plan_of_passes_names_its_sides_and_says_any_count(unet, vae):
    """``plan_passes("32", ...)`` was a TypeError and 32.5 was taken; 20,000 passes were a ValueError (2**20000 has
    too many digits to print)."""
    import warnings

    from flowlift import FlowUpscalerPipeline
    from flowlift.upscale.sizes import PassesDropped

    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)
    for sides, field in ((("32", 32), "image_height"), ((32, 32.5), "image_width"), ((32, -32), "image_width")):
        _refused(lambda sides=sides: pipe.plan_passes(*sides, 1), field)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pipe.plan_passes(32, 32, 20000) == 9
    dropped = [w.message for w in caught if isinstance(w.message, PassesDropped)]
    assert dropped and "scale 2^20000" in dropped[0].refusal and "2^20000 x 32x32 px" in dropped[0].refusal


@pytest.mark.parametrize(
    ("keywords", "field"),
    [
        ({"target_size": (12.9, 12)}, "target_size"),  # was cut to 12
        ({"target_size": ("12", 12)}, "target_size"),
        ({"target_size": 12}, "target_size"),
        ({"latents": torch.zeros(1, 32, 8, 8, dtype=torch.int64)}, "latents"),  # came back as int64
        ({"rows": 0}, "rows"),
        ({"rows": 2.7}, "rows"),
        ({"rows": "3"}, "rows"),
        ({"rows": float("nan")}, "rows"),  # was a ValueError
    ],
)
def test_sesqui_names_its_size_latents_and_bands(tmp_path, keywords, field):
    from flowlift.models.sesqui_bands import sesqui_to_size
    from flowlift.models.sesqui_lsr import load_sesqui_lsr
    from sesqui_reference import save_random_sesqui

    model = load_sesqui_lsr(save_random_sesqui(tmp_path), device="cpu", dtype=torch.float32)
    arguments = {"latents": torch.zeros(1, 32, 8, 8), "target_size": (12, 12), "rows": None, **keywords}
    stats = {"bn_mean": torch.zeros(128), "bn_std": torch.ones(128)}
    _refused(lambda: sesqui_to_size(model, **arguments, **stats), field)


@pytest.mark.parametrize(
    ("arguments", "keywords", "field"),
    [
        ((5,), {}, "path"),  # a TypeError
        ((None,), {}, "path"),
        (("FILE",), {"dtype": torch.int32}, "dtype"),  # a TypeError from torch
        (("FILE",), {"dtype": "bf16"}, "dtype"),
        (("FILE",), {"device": "bogus"}, "device"),  # a RuntimeError
    ],
)
def test_load_sesqui_lsr_names_its_arguments(tmp_path, arguments, keywords, field):
    from flowlift.models.sesqui_lsr import load_sesqui_lsr
    from sesqui_reference import save_random_sesqui

    path = save_random_sesqui(tmp_path)
    _refused(lambda: load_sesqui_lsr(*(path if a == "FILE" else a for a in arguments), **keywords), field)


def test_sesqui_refuses_its_inputs_before_the_network_runs(tmp_path):
    """Odd latents were a ValueError from patchify, 64 BN statistics a RuntimeError, and NaN latents were said as
    "SesquiLSR produced non-finite latents" (the network's fault)."""
    from flowlift.models.sesqui_bands import sesqui_to_size
    from flowlift.models.sesqui_lsr import load_sesqui_lsr
    from sesqui_reference import save_random_sesqui

    model = load_sesqui_lsr(save_random_sesqui(tmp_path), device="cpu", dtype=torch.float32)
    stats = {"bn_mean": torch.zeros(128), "bn_std": torch.ones(128)}
    odd = torch.zeros(1, 32, 7, 7)
    with pytest.raises(FlowliftError, match=r"^SesquiLSR: latents need an even height and width"):
        sesqui_to_size(model, odd, (12, 12), rows=None, **stats)
    bad_stats = {"bn_mean": torch.zeros(64), "bn_std": torch.ones(64)}
    _refused(lambda: sesqui_to_size(model, torch.zeros(1, 32, 8, 8), (12, 12), **bad_stats), "bn_mean")
    nan = torch.zeros(1, 32, 8, 8)
    nan[0, 3, 2, 2] = float("nan")
    with pytest.raises(FlowliftError, match=r"^SesquiLSR: the input latents contain non-finite values"):
        sesqui_to_size(model, nan, (12, 12), rows=None, **stats)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_the_finiteness_check_makes_no_copy_of_what_it_checks(bad):
    """``isfinite(t).all()`` made a bool tensor of t's size: 0.8 GB beside a 16K image, outside any memory plan."""
    from builders import Allocations
    from flowlift.models.weights import check_finite_result

    image = torch.rand(1, 3, 64, 64)
    if bad is not None:
        image[0, 1, 5, 7] = bad
    with Allocations() as made:
        if bad is None:
            assert check_finite_result(image, "the decode") is image
        else:
            with pytest.raises(FlowliftError, match="the decode gave " + ("NaN" if bad != bad else "Inf")):
                check_finite_result(image, "the decode")
    assert made.sizes and max(made.sizes) <= 8, made.sizes  # two scalars, never a tensor of the image's size


@pytest.mark.parametrize(
    "answer",
    [
        lambda z: z[..., :-2],  # a RuntimeError in the sampler's arithmetic
        lambda z: z.mean(dim=1, keepdim=True),  # broadcast: a silently wrong result
        lambda z: z[0],  # broadcast too
        lambda z: z.tolist(),  # a TypeError
        lambda z: None,
        lambda z: z.long(),  # an integer velocity was taken
    ],
)
@pytest.mark.parametrize("tiled", [False, True])
def test_refine_latents_names_a_velocity_of_another_shape(answer, tiled):
    from flowlift.refine.loop import refine_latents
    from flowlift.refine.tiling import TileRequest

    init = torch.zeros(1, 32, 12, 12)
    tiles = TileRequest(size=64, overlap=16) if tiled else None
    _refused(lambda: refine_latents(lambda z, sigma: answer(z), init_latents=init, tiles=tiles), "velocity_fn")
    out = refine_latents(lambda z, sigma: torch.zeros_like(z), init_latents=init, tiles=tiles).latents
    assert out.shape == init.shape  # the right shape runs, tiled or not


def test_the_metadata_holds_the_sigmas_that_ran():
    """Rounded to 6 decimals, the sigmas of a strength of 1e-9 were recorded as [0.0, 0.0] and t0 as 0.0."""
    from flowlift.refine.loop import refine_latents
    from flowlift.refine.parameters import output_parameters

    result = refine_latents(
        lambda z, sigma: torch.zeros_like(z), init_latents=torch.zeros(1, 32, 4, 4), denoising_start=1 - 1e-9
    )
    params = output_parameters(
        "img2img", result, model="m", dtype=torch.float32, device=torch.device("cpu"), provenance={}
    )
    assert params["sigmas"] == [float(s) for s in result.sigmas] and params["sigmas"][0] > 0
    assert params["t0"] == result.t0 > 0 and params["mu"] == result.mu

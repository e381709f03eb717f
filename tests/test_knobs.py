"""One definition of every knob (issue 29): every front-end's control has the knob table's domain and default.

The tables are :data:`flowlift.upscale.settings.UPSCALE_KNOBS`, :data:`~flowlift.upscale.settings.COLOR_FIX_KNOBS`
and :data:`flowlift.refine.settings.REFINE_KNOBS`. Here: the command line's options, the web app's components
and request checks, the ComfyUI nodes' numeric checks and the Python API's checks. The ComfyUI inputs as a
real server lists them and the InvokeAI fields as a real server's schema has them are held to the same tables
in tests/test_comfyui.py and tests/test_invokeai.py (they need those hosts' environments). A knob added to a
table but not to a front-end below fails ``test_every_knob_is_mapped``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from builders import resized_photo
from flowlift.errors import FlowliftError
from flowlift.knobs import SEED, SEED_MAX, Knob, exact_int
from flowlift.refine.settings import REFINE_KNOBS, TILE_KNOBS, SamplingSettings
from flowlift.upscale.settings import COLOR_FIX_KNOBS, UPSCALE_KNOBS

#: (command, option) -> (table, knob name, the argparse default where the command resolves the knob's own
#: default itself, or ``...`` for the knob's default).
CLI_OPTIONS: dict[tuple[str, str], tuple[dict[str, Knob], str, object]] = {
    ("upscale", "--scale"): (UPSCALE_KNOBS, "scale", None),  # None: run() applies DEFAULT_SCALE (checked below)
    ("upscale", "--seed"): (UPSCALE_KNOBS, "seed", ...),
    ("upscale", "--transplant-strength"): (UPSCALE_KNOBS, "transplant_strength", ...),
    ("upscale", "--color-fix-strength"): (UPSCALE_KNOBS, "color_fix_strength", ...),
    ("upscale", "--resize-mode"): (UPSCALE_KNOBS, "resize_mode", ...),
    ("colorfix", "--color-fix-strength"): (COLOR_FIX_KNOBS, "strength", ...),  # the same knob as upscale's
    ("img2img", "--strength"): (REFINE_KNOBS, "strength", None),  # None: 0.5, outpaint 1 (run() decides)
    ("img2img", "--strength-map"): (REFINE_KNOBS, "strength_map", ...),
    ("img2img", "--steps"): (REFINE_KNOBS, "steps", None),  # None: the model's (4 for a distilled Klein, else 28)
    ("img2img", "--seed"): (REFINE_KNOBS, "seed", ...),
    ("img2img", "--sampler"): (REFINE_KNOBS, "sampler", ...),
    ("img2img", "--mu"): (REFINE_KNOBS, "mu", ...),
    ("img2img", "--schedule"): (REFINE_KNOBS, "schedule", ...),
    ("hires", "--scale"): (REFINE_KNOBS, "hires_scale", ...),
    ("hires", "--base-steps"): (REFINE_KNOBS, "steps", None),  # None: the model's, as --steps
    ("hires", "--transplant-strength"): (UPSCALE_KNOBS, "transplant_strength", ...),
    ("hires", "--refine-strength"): (REFINE_KNOBS, "refine_strength", ...),
    ("hires", "--steps"): (REFINE_KNOBS, "steps", None),
    ("hires", "--seed"): (REFINE_KNOBS, "seed", ...),
    ("hires", "--sampler"): (REFINE_KNOBS, "sampler", ...),
    ("hires", "--mu"): (REFINE_KNOBS, "mu", ...),
    ("hires", "--schedule"): (REFINE_KNOBS, "schedule", ...),
    **{
        (command, "--" + knob.name.replace("_", "-")): (REFINE_KNOBS, knob.name, ...)
        for command in ("img2img", "hires")
        for knob in TILE_KNOBS
    },
}
#: Knobs the node packs show but the command line spells otherwise (``--chunked/--no-chunked`` is a flag pair).
NOT_ON_THE_COMMAND_LINE = {"chunked"}


def parser_of(command: str) -> argparse.ArgumentParser:
    import importlib

    module = importlib.import_module(f"flowlift.commands.{command}")
    parser = argparse.ArgumentParser(prog=f"flowlift {command}")
    module.add_arguments(parser)
    return parser


def action_of(parser: argparse.ArgumentParser, option: str) -> argparse.Action:
    return next(action for action in parser._actions if option in action.option_strings)


def edge_values(knob: Knob) -> tuple[list[object], list[object]]:
    """(values inside the domain, values just outside it) for a knob: the ends of a range and one step past."""
    if knob.choices:
        return list(knob.choices), ["not-a-choice"] if knob.kind is str else [max(knob.choices) + 1, -1]
    if knob.kind is int:
        inside = [knob.low, *knob.words] if knob.high is None else [knob.low, knob.high, *knob.words]
        return inside, [knob.low - 1] if knob.high is None else [knob.low - 1, knob.high + 1]
    return [knob.low, knob.high, *knob.words], [knob.low - 0.001, knob.high + 0.001, float("nan")]


def test_every_knob_is_mapped():
    on_cli = {(id(table), name) for table, name, _ in CLI_OPTIONS.values()}
    for table in (UPSCALE_KNOBS, COLOR_FIX_KNOBS, REFINE_KNOBS):
        for name in table:
            assert (id(table), name) in on_cli or name in NOT_ON_THE_COMMAND_LINE, f"knob {name} has no CLI option"


@pytest.mark.parametrize(("command", "option"), list(CLI_OPTIONS))
def test_cli_options_have_the_knobs_domain_and_default(command, option):
    table, name, cli_default = CLI_OPTIONS[(command, option)]
    knob = table[name]
    action = action_of(parser_of(command), option)
    assert action.default == (knob.default if cli_default is ... else cli_default)
    if knob.choices:  # argparse checks the choices; the type (if any) parses exactly
        assert tuple(action.choices) == knob.choices
        assert all(action.type is None or action.type(str(choice)) == choice for choice in knob.choices)
        return
    inside, outside = edge_values(knob)
    for value in inside:
        assert action.type(str(value)) == value
    for value in outside:
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(str(value))


def test_the_command_lines_default_scale_is_the_knobs():
    from flowlift.commands._options import DEFAULT_SCALE

    assert DEFAULT_SCALE == UPSCALE_KNOBS["scale"].default


def test_app_components_have_the_knobs_domain_and_default(tmp_path):
    pytest.importorskip("gradio")
    from flowlift.app.page import build_app
    from flowlift.app.service import AppConfig, AppService

    service = AppService(AppConfig(upscaler="unused", vaes=["taef2"], model="unused", work_dir=tmp_path))
    fns = {fn.api_name: fn for fn in build_app(service).fns.values()}
    upscale = dict(
        zip(
            ["image", "scale", "seed", "transplant_strength", "color_fix_strength", "vae", "latent_upscaler"],
            fns["upscale"].inputs,
            strict=True,
        )
    )
    batch = dict(
        zip(
            ["files", "scale", "seed", "transplant_strength", "color_fix_strength", "vae", "latent_upscaler"],
            fns["batch"].inputs,
            strict=True,
        )
    )
    refine = dict(
        zip(
            [
                "image",
                "prompt",
                "embeds",
                "mode",
                "strength",
                "refine_strength",
                "strength_map",
                "steps",
                "seed",
                "sampler",
                "tile_size",
                "tile_overlap",
            ],
            fns["refine"].inputs,
            strict=True,
        )
    )
    tile_size = refine.pop("tile_size")  # a menu of the knob's words and sides, any multiple of 16 typed in
    assert tile_size.value == REFINE_KNOBS["tile_size"].default and tile_size.allow_custom_value
    words = REFINE_KNOBS["tile_size"].words
    assert [choice[1] for choice in tile_size.choices][: len(words)] == list(words)
    assert refine["tile_overlap"].step == REFINE_KNOBS["tile_overlap"].step
    mapped = [(UPSCALE_KNOBS, controls) for controls in (upscale, batch)] + [(REFINE_KNOBS, refine)]
    for table, controls in mapped:
        for name, component in controls.items():
            if name not in table:
                continue
            knob = table[name]
            assert component.value == knob.default, name
            if knob.choices:
                assert [choice[1] for choice in component.choices] == list(knob.choices), name
            else:
                assert (component.minimum, component.maximum) == (knob.low, knob.high), name
    # the latent upscaler's box: off, and shown only where the app was started with --latent-upscaler
    assert [(c["latent_upscaler"].value, c["latent_upscaler"].visible) for c in (upscale, batch)] == [
        (False, False)
    ] * 2
    offered = AppService(AppConfig(upscaler="unused", vaes=["flux2"], latent_upscaler="sesqui:x", work_dir=tmp_path))
    boxes = [fn.inputs[-1] for fn in build_app(offered).fns.values() if fn.api_name in ("upscale", "batch")]
    assert [(box.value, box.visible) for box in boxes] == [(False, True)] * 2
    presets = list(REFINE_KNOBS["hires_scale"].extra["presets"])
    assert presets == [2, 4, 8]  # the Refine tab's "hires fix 2x/4x/8x" modes
    from flowlift.app.refine_tab import MODES

    assert sorted(factor for factor in MODES.values() if factor) == presets


def test_app_request_checks_have_the_knobs_domain(tmp_path):
    from flowlift.app.service import AppConfig, AppService

    service = AppService(AppConfig(upscaler="unused", vaes=["taef2"], work_dir=tmp_path))
    order = ["scale", "seed", "transplant_strength", "color_fix_strength"]
    good = [2, 0, 1.0, 1.0]
    for index, name in enumerate(order):
        inside, outside = edge_values(UPSCALE_KNOBS[name])
        for value in inside:
            values = [*good[:index], value, *good[index + 1 :]]
            assert service.validate(*values, None)[index] == value
        for value in outside:
            with pytest.raises(FlowliftError):
                service.validate(*[*good[:index], value, *good[index + 1 :]], None)


def test_comfyui_numeric_checks_are_the_knobs():
    from flowlift.comfyui import layouts

    for node, inputs in layouts.NODE_KNOBS.items():
        for name, knob in inputs.items():
            table = COLOR_FIX_KNOBS if node == "FlowliftColorFix" else UPSCALE_KNOBS
            assert knob == table[name]
            assert layouts.NUMERIC_INPUTS[node][name] == (knob.low, knob.high, knob.kind is int)
            inside, outside = edge_values(knob)
            for value in inside:
                assert layouts.check_numbers(node, **{name: value})[name] == value
            for value in outside:
                with pytest.raises(FlowliftError):
                    layouts.check_numbers(node, **{name: value})


def test_the_tile_overlap_knob_is_bounded_by_the_largest_tile_and_every_comfyui_widget_has_a_max():
    """``tile_overlap`` had no ``high``: ComfyUI's widget then had no ``max`` and its frontend capped it at 2048.
    Its high is the widest overlap any tile allows (the 16K cap's tile less one 16-px step), and a ComfyUI number
    widget is never built without both ends (:func:`flowlift.comfyui.layouts.widget_range`)."""
    from flowlift.comfyui.layouts import PROMPT_KNOBS, widget_range
    from flowlift.limits import MAX_OUTPUT_SIDE, PIXEL_MULTIPLE
    from flowlift.refine.settings import TILE_OVERLAP, TILE_SIZE
    from flowlift.refine.tiling import TileRequest

    assert TILE_OVERLAP.high == TILE_SIZE.high - PIXEL_MULTIPLE == MAX_OUTPUT_SIDE - PIXEL_MULTIPLE
    assert TileRequest(size=TILE_SIZE.high, overlap=TILE_OVERLAP.high).overlap == TILE_OVERLAP.high
    with pytest.raises(FlowliftError, match="tile_overlap"):
        TILE_OVERLAP.check(TILE_OVERLAP.high + PIXEL_MULTIPLE)
    for node, knobs in PROMPT_KNOBS.items():
        for name, knob in knobs.items():
            assert widget_range(knob) == {"min": knob.low, "max": knob.high}, (node, name)
    with pytest.raises(ValueError, match="closed range"):
        widget_range(Knob("unbounded", int, 0, "a count", low=0))


def test_node_pack_choices_are_the_knobs():
    from flowlift.upscale import node_choices

    scale = UPSCALE_KNOBS["scale"]  # a number in [1, 8] on both packs: the image node resamples, latents whole passes
    assert (scale.low, scale.high, scale.kind) == (1.0, 8.0, float)
    assert [node_choices.latent_plan(factor, 4, 6)[0] for factor in scale.extra["presets"]] == [1, 2, 3]
    assert node_choices.image_plan(scale.low, 48, 32) == (1, (48, 32))
    for outside in (scale.low - 0.001, scale.high + 0.001, float("nan")):
        with pytest.raises(FlowliftError):
            node_choices.image_plan(outside, 48, 32)
    assert node_choices.CHUNKING == UPSCALE_KNOBS["chunked"].choices


def test_python_api_checks_have_the_knobs_domain():
    import torch

    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    class Velocity(torch.nn.Module):  # v = noise - 2x(cond): the pass returns the nearest-upsampled input
        def forward(self, sample, timestep, small):
            return sample - torch.nn.functional.interpolate(small, scale_factor=2.0)

    pipe = FlowUpscalerPipeline(Velocity(), None, device="cpu", dtype=torch.float32)
    latents = torch.zeros(1, 32, 2, 2)
    for name in ("seed", "transplant_strength"):
        inside, outside = edge_values(UPSCALE_KNOBS[name])
        for value in inside:
            assert pipe.upscale_latents(latents, 1, **{name: value}).shape == (1, 32, 4, 4)
        for value in outside:
            with pytest.raises(FlowliftError):
                pipe.upscale_latents(latents, 1, **{name: value})
    for name in ("steps", "seed"):
        inside, outside = edge_values(REFINE_KNOBS[name])
        for value in inside:
            assert getattr(SamplingSettings(**{name: value}), name) == value
        for value in outside:
            with pytest.raises(FlowliftError):
                SamplingSettings(**{name: value})
    with pytest.raises(FlowliftError, match="sampler must be one of euler, heun"):
        SamplingSettings(sampler="dpm++")


# ------------------------------------------------------------------------------------------ the seed


def test_seeds_are_exact_integers_on_every_door():
    assert SEED.domain == ("range", 0, 2**64 - 1) and SEED_MAX == 18446744073709551615
    assert exact_int(2**53 + 1) == 2**53 + 1
    assert exact_int(str(2**53 + 1), loose=True) == 2**53 + 1  # text: exact, never through float
    assert exact_int(float(2**53), loose=True) == 2**53
    assert exact_int(float(2**53) * 2, loose=True) is None  # a float this large is no longer one integer
    assert exact_int(2.0) is None and exact_int(True) is None and exact_int("7") is None  # strict doors
    for bad in (-1, 2**64, 1.5, "12", None):
        with pytest.raises(FlowliftError, match="seed must be a non-negative integer"):
            SEED.check(bad)


@pytest.mark.parametrize("command", ["upscale", "img2img", "hires"])
def test_seed_2_64_is_one_error_line_exit_2_on_the_command_line(command, tmp_path):
    needs = {"upscale": ["x.png"], "img2img": ["x.png", "--model", "m", "--prompt", "p"], "hires": ["--model", "m"]}
    from app_helpers import subprocess_env

    result = subprocess.run(
        [sys.executable, "-m", "flowlift", command, *needs[command], "--seed", str(2**64)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [  # the one line: no usage block above it
        f"flowlift {command}: error: argument --seed: must be a non-negative integer at most "
        f"18446744073709551615 (2^64 - 1), got '18446744073709551616' (flowlift {command} -h lists the options)"
    ], result.stderr
    assert "Traceback" not in result.stderr


def test_seed_2_64_is_one_error_line_on_the_app_the_nodes_and_the_api(tmp_path):
    import torch

    from flowlift.app.service import AppConfig, AppService
    from flowlift.comfyui.layouts import check_numbers
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    service = AppService(AppConfig(upscaler="unused", vaes=["taef2"], work_dir=tmp_path))
    pipe = FlowUpscalerPipeline(lambda sample, t, small: sample, None, device="cpu", dtype=torch.float32)
    doors = [
        lambda: service.validate(2, 2**64, 1.0, 1.0, None),
        lambda: service.validate(2, str(2**64), 1.0, 1.0, None),
        lambda: check_numbers("FlowliftUpscaleLatent", seed=2**64),
        lambda: pipe.upscale_latents(torch.zeros(1, 32, 2, 2), 1, seed=2**64),
        lambda: SamplingSettings(seed=2**64),
    ]
    for door in doors:
        with pytest.raises(FlowliftError) as info:
            door()
        assert "\n" not in str(info.value) and "18446744073709551616" in str(info.value)


#: Seeds as a hostile client sends them (issue 36 class 10: ComfyUI took 5.5 as 5 and ``true`` as 1, InvokeAI
#: ``true``), with what the JSON and text doors make of them (None: refused).
SEED_VARIANTS = [
    (5, 5),
    (0, 0),
    (2**64 - 1, 2**64 - 1),
    (2**53 + 1, 2**53 + 1),
    ("5", 5),
    (" 7 ", 7),
    (5.0, 5),
    (5.5, None),
    (0.5, None),
    (True, None),
    (False, None),
    (-1, None),
    ("-1", None),
    (2**64, None),
    (str(2**64), None),
    (2.0**64, None),
    (float("nan"), None),
    (float("inf"), None),
    ("5.5", None),
    ("x", None),
    ("", None),
    (None, None),
    ([5], None),
    ({"seed": 5}, None),
]


def _comfyui_door(value):
    """ComfyUI's POST /prompt handler on one FlowliftUpscaleLatent node, then ComfyUI's own ``int()``."""
    from flowlift.comfyui.layouts import check_prompt_numbers

    request = {"prompt": {"5": {"class_type": "FlowliftUpscaleLatent", "inputs": {"seed": value, "scale": 2.0}}}}
    seen = check_prompt_numbers(request)["prompt"]["5"]["inputs"]["seed"]
    if type(seen) is not int:
        assert isinstance(seen, str) and seen.startswith("FlowliftUpscaleLatent: seed must be"), seen
        with pytest.raises(ValueError):
            int(seen)  # what ComfyUI then does with it: HTTP 400 carrying the line
        raise FlowliftError(seen)
    return seen


def check_prompt_leaves_links_alone(link) -> bool:
    from flowlift.comfyui.layouts import check_prompt_numbers

    request = {"prompt": {"5": {"class_type": "FlowliftUpscaleLatent", "inputs": {"seed": link}}}}
    return check_prompt_numbers(request)["prompt"]["5"]["inputs"]["seed"] is link


def test_the_comfyui_prompt_check_unwraps_values_and_ignores_other_nodes_and_bodies():
    from flowlift.comfyui.layouts import check_prompt_numbers

    request = {
        "prompt": {
            "1": {"class_type": "FlowliftUpscaleImage", "inputs": {"seed": {"__value__": "9"}}},
            "2": {"class_type": "FlowliftUpscaleImage", "inputs": {"seed": {"__value__": 9.5}}},
            "3": {"class_type": "KSampler", "inputs": {"seed": 5.5}},  # not flowlift's: ComfyUI's rule
            "4": {"class_type": "FlowliftColorFix", "inputs": {"strength": 0.5}},  # no INT input
            "5": "not a node",
        }
    }
    out = check_prompt_numbers(request)["prompt"]
    assert out["1"]["inputs"]["seed"] == 9 and out["2"]["inputs"]["seed"].startswith("FlowliftUpscaleImage: seed")
    assert out["3"]["inputs"]["seed"] == 5.5 and out["4"]["inputs"]["strength"] == 0.5 and out["5"] == "not a node"
    for body in ({}, {"prompt": None}, {"prompt": []}, [], None, "x"):
        assert check_prompt_numbers(body) == body


@pytest.mark.parametrize(
    ("class_type", "name", "value", "words"),
    [
        ("FlowliftColorFix", "strength", False, "FlowliftColorFix: strength must be"),  # ran as strength 0
        ("FlowliftUpscaleImage", "scale", True, "FlowliftUpscaleImage: scale must be"),  # ran at 1x
        ("FlowliftUpscaleImage", "color_fix_strength", False, "color_fix_strength must be"),
        ("FlowliftTiledFlux2Refine", "tile_overlap", False, "tile_overlap must be"),  # overlap 0: seams
        ("FlowliftTiledFlux2Refine", "tile_overlap", 5.5, "got 5.5"),  # was "got 5" (ComfyUI's int() first)
    ],
)
def test_the_comfyui_prompt_check_refuses_bools_in_number_inputs(class_type, name, value, words):
    from flowlift.comfyui.layouts import check_prompt_numbers

    request = {"prompt": {"7": {"class_type": class_type, "inputs": {name: value}}}}
    seen = check_prompt_numbers(request)["prompt"]["7"]["inputs"][name]
    assert isinstance(seen, str) and words in seen, seen
    with pytest.raises(ValueError):
        float(seen)  # what ComfyUI then does with it: HTTP 400 carrying the line
    kept = {"prompt": {"7": {"class_type": "FlowliftColorFix", "inputs": {"strength": 0.25}}}}
    assert check_prompt_numbers(kept)["prompt"]["7"]["inputs"]["strength"] == 0.25  # the node checks the rest
    overlap = {"prompt": {"7": {"class_type": "FlowliftTiledFlux2Refine", "inputs": {"tile_overlap": "32"}}}}
    assert check_prompt_numbers(overlap)["prompt"]["7"]["inputs"]["tile_overlap"] == 32


@pytest.mark.parametrize(("value", "expected"), SEED_VARIANTS)
def test_one_seed_rule_at_every_json_and_text_door(tmp_path, value, expected):
    from flowlift.app.service import AppConfig, AppService
    from flowlift.invokeai.latents import seed_field_value

    service = AppService(AppConfig(upscaler="unused", vaes=["taef2"], work_dir=tmp_path))

    def invokeai(value):
        try:
            return seed_field_value(value)
        except ValueError as error:  # pydantic turns it into HTTP 422
            raise FlowliftError(str(error)) from None

    doors = {
        "web API": lambda v: service.validate(2, v, 1.0, 1.0, None, False)[1],
        "ComfyUI /prompt": _comfyui_door,
        "InvokeAI graph": invokeai,
        "knob (loose)": lambda v: SEED.check(v, loose=True),
    }
    if isinstance(value, str):
        doors["CLI --seed"] = SEED.parse_text
    if isinstance(value, list):  # a link ([node, output]) to ComfyUI: its graph check, not a widget value
        assert check_prompt_leaves_links_alone(value)
        del doors["ComfyUI /prompt"]
    for door, check in doors.items():
        if expected is None:
            with pytest.raises(FlowliftError) as caught:
                check(value)
            assert "must be a non-negative integer at most 18446744073709551615" in str(caught.value), door
            assert "\n" not in str(caught.value)
        else:
            got = check(value)
            assert got == expected and type(got) is int, (door, got)


@pytest.mark.parametrize(("value", "expected"), SEED_VARIANTS)
def test_the_python_doors_take_only_integers(value, expected):
    """The Python API and the node functions (what ComfyUI's nodes and a script call): an int, never text or
    floats (``5.0`` too: a float seed is a computed value, not a seed)."""
    import numpy as np

    from flowlift.comfyui.layouts import check_numbers

    doors = {
        "ComfyUI node": lambda v: check_numbers("FlowliftUpscaleImage", seed=v)["seed"],
        "SamplingSettings": lambda v: SamplingSettings(seed=v).seed,
        "knob": SEED.check,
    }
    integer = type(value) is int
    for door, check in doors.items():
        if integer and expected is not None:
            assert check(value) == expected and check(np.uint64(value)) == expected, door
        else:
            with pytest.raises(FlowliftError, match="seed must be a non-negative integer"):
                check(value)


# ---------------------------------------------------------------------------------- settings objects


def test_memory_policy_refuses_a_chunk_rows_that_is_not_a_positive_integer():
    from flowlift.upscale.settings import MemoryPolicy

    with pytest.raises(FlowliftError, match="chunk_rows must be a positive integer"):
        MemoryPolicy(chunk_rows=0)


# ------------------------------------------------------------------- the seed bugs of issue 29, end to end


@pytest.fixture(scope="module")
def small_photo(shared, tmp_path_factory):
    return resized_photo(
        shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png", tmp_path_factory.mktemp("photo") / "wine.png"
    )


def test_cli_seed_2_64_minus_1_runs_and_equals_the_python_api(tmp_path, shared, tiny_upscaler_weights, small_photo):
    # a ComfyUI workflow's seed >= 2^63 was refused by `flowlift upscale --seed` ("seed must be in [0, 2^63)")
    import json

    import numpy as np
    import torch
    from PIL import Image

    from flowlift.commands.cli import main
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    taef2 = str(shared / "models" / "taef2")
    out = tmp_path / "out.png"
    argv = [
        "upscale",
        str(small_photo),
        "-o",
        str(out),
        "--seed",
        str(SEED_MAX),
        "--upscaler",
        str(tiny_upscaler_weights),
    ]
    assert main([*argv, "--vae", taef2, "--device", "cpu", "--no-progress"]) == 0
    pipeline = FlowUpscalerPipeline(str(tiny_upscaler_weights), taef2, device="cpu", dtype=torch.float32)
    with Image.open(small_photo) as image:
        expected = pipeline.upscale_image(image.convert("RGB"), 1, seed=SEED_MAX)
        other = pipeline.upscale_image(image.convert("RGB"), 1, seed=SEED_MAX - 1)
    with Image.open(out) as written:
        assert json.loads(written.text["flowlift"])["seed"] == SEED_MAX
        got = np.asarray(written.convert("RGB"))
    assert np.array_equal(got, np.asarray(expected))
    assert not np.array_equal(got, np.asarray(other))  # the seed reached the noise


def test_app_keeps_seeds_exact(tmp_path, shared, tiny_upscaler_weights, small_photo):
    # through float(), seeds 2^53 and 2^53 + 1 were the same seed and gave the same image
    import json

    import numpy as np
    from PIL import Image

    from flowlift.app.service import AppConfig, AppService

    config = AppConfig(
        upscaler=str(tiny_upscaler_weights),
        vaes=[str(shared / "models" / "taef2")],
        device="cpu",
        work_dir=tmp_path / "work",
    )
    service = AppService(config)
    try:
        pictures, seeds = [], []
        for seed in (2**53, 2**53 + 1, str(2**53 + 1), SEED_MAX):
            result = service.upscale(small_photo, 2, seed)
            with Image.open(result.output) as png:
                seeds.append(json.loads(png.text["flowlift"])["seed"])
                pictures.append(np.asarray(png.convert("RGB")))
    finally:
        service.close()
    assert seeds == [2**53, 2**53 + 1, 2**53 + 1, SEED_MAX]
    assert not np.array_equal(pictures[0], pictures[1])
    assert np.array_equal(pictures[1], pictures[2])  # a seed sent as text is the same seed


def test_seeded_noise_takes_every_seed_up_to_2_64_minus_1():
    import torch

    from flowlift.flux2.latents import seeded_noise
    from flowlift.refine.loop import latent_noise
    from flowlift.upscale.sizes import pass_noise

    top = seeded_noise((2, 4, 4), SEED_MAX)
    assert torch.equal(top, torch.randn((2, 4, 4), generator=torch.Generator().manual_seed(SEED_MAX)))
    assert not torch.equal(top, seeded_noise((2, 4, 4), SEED_MAX - 1))
    assert not torch.equal(latent_noise((1, 32, 4, 4), SEED_MAX), latent_noise((1, 32, 4, 4), 0))
    assert not torch.equal(pass_noise([SEED_MAX], 0, (32, 4, 4)), pass_noise([SEED_MAX - 1], 0, (32, 4, 4)))


#: Front-end parameter names that mean a knob under another name (the InvokeAI nodes' ``num_steps``).
KNOB_ALIASES = {"num_steps": "steps", "transplant": "transplant_strength", "color_fix": "color_fix_strength"}
FRONT_END_PACKAGES = ("app", "commands", "comfyui", "invokeai")


def _front_end_knob_defaults():
    """``(where, parameter, default node)`` for every parameter of a front-end function that names a knob."""
    import ast
    from pathlib import Path

    import flowlift

    names = {*UPSCALE_KNOBS, *REFINE_KNOBS, *KNOB_ALIASES}
    root = Path(flowlift.__file__).parent
    for package in FRONT_END_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                arguments = node.args
                positional = [*arguments.posonlyargs, *arguments.args]
                with_defaults = positional[len(positional) - len(arguments.defaults) :]
                pairs = list(zip(with_defaults, arguments.defaults, strict=True))
                pairs += [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True) if d]
                for argument, default in pairs:
                    if argument.arg in names:
                        yield f"{path.relative_to(root)}:{node.name}", argument.arg, default


def test_no_front_end_writes_a_knobs_default_as_a_literal():
    """A front-end parameter named after a knob takes its default from the table (``STEPS.default``) or None (the
    callee decides), never a number or word typed again: the app's hires fix once started at 0.5 this way."""
    import ast

    literals = [
        f"{where}({name}={ast.unparse(default)})"
        for where, name, default in _front_end_knob_defaults()
        if isinstance(default, ast.Constant) and default.value is not None
    ]
    assert not literals, "front-end defaults retyped as literals: " + ", ".join(literals)


def test_no_front_end_writes_the_output_cap_as_a_literal():
    """The 16K cap is ``flowlift.limits.MAX_OUTPUT_SIDE``: a front-end's text or number names it from there (the
    InvokeAI scale field's description once said "16384" itself). Docstrings may speak of it."""
    import ast
    from pathlib import Path

    import flowlift
    from flowlift.limits import MAX_OUTPUT_SIDE

    root = Path(flowlift.__file__).parent
    found = []
    for package in FRONT_END_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            docstrings = {
                id(node.body[0].value)
                for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body
                and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and id(node) not in docstrings:
                    if node.value == MAX_OUTPUT_SIDE or str(MAX_OUTPUT_SIDE) in str(node.value):
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, "the output cap typed again: " + ", ".join(found)


def test_the_apps_handlers_and_forms_default_to_the_knobs():
    import dataclasses
    import inspect

    from flowlift.app.refine import RefineForm
    from flowlift.app.service import AppService

    tables = {**UPSCALE_KNOBS, **REFINE_KNOBS}
    checked = 0
    for handler in (AppService.upscale, AppService.batch, AppService.refine):
        for name, parameter in inspect.signature(handler).parameters.items():
            if name in tables and parameter.default is not None:
                assert parameter.default == tables[name].default, (handler.__name__, name)
                checked += 1
    for spec in dataclasses.fields(RefineForm):
        if spec.name in tables and spec.default is not None:
            assert spec.default == tables[spec.name].default, spec.name
            checked += 1
    assert checked >= 13  # the Refine tab's form is RefineForm's fields (AppService.refine takes one)


@pytest.mark.parametrize(
    "argv, prefix",
    [
        (["upscale", "x.png", "--color-fix", "0.5"], "--color-fix"),
        (["img2img", "x.png", "--model", "m", "--stre", "1"], "--stre"),
        (["dataset", "images", "x.png", "-o", "o", "--vae", "taef2", "--cro", "64"], "--cro"),
    ],
)
def test_a_prefix_of_an_option_is_refused_on_every_command(argv, prefix, capsys):
    """Issue 39: ``--color-fix 0.5`` once ran as ``--color-fix-strength 0.5``; every parser, the subcommands' and
    their subcommands' too, refuses a prefix in one line (exit 2)."""
    from flowlift.commands.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"unrecognized arguments: {prefix}" in err and len(err.splitlines()) == 1


def _command_parsers():
    """``{"flowlift CMD": parser}`` for every subcommand the command line has (``dataset images`` and
    ``dataset distill`` too), as ``flowlift --help`` builds them."""
    from flowlift.commands.cli import build_parser

    found = {}

    def visit(parser):
        found[parser.prog] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    visit(sub)

    visit(build_parser())
    return found


#: One name (and with it one unit) per knob: the concepts every command spells the same.
VOCABULARY = {
    "output": ["-o", "--output"],
    "vae": ["--vae"],
    "color_fix_strength": ["--color-fix-strength"],
    "seed": ["--seed"],
    "device": ["--device"],
    "dtype": ["--dtype"],
    "overwrite": ["--overwrite"],
}


def test_every_knob_has_one_name_on_every_command():
    """Issue 39: a test walks every parser and the knob tables and fails on a knob spelled two ways: one option
    per ``dest`` across all commands, the shared concepts spelled as :data:`VOCABULARY` says, every knob of the
    tables under its own ``--name`` wherever it keeps its name, one ``--vae`` help text, no old spelling."""
    from flowlift.commands._options import VAE_HELP

    spellings: dict[str, dict[tuple[str, ...], list[str]]] = {}
    knobs = {**UPSCALE_KNOBS, **REFINE_KNOBS, "color_fix_strength": UPSCALE_KNOBS["color_fix_strength"]}
    for prog, parser in _command_parsers().items():
        for action in parser._actions:
            if not action.option_strings:
                continue  # positionals
            flags = tuple(action.option_strings)
            spellings.setdefault(action.dest, {}).setdefault(flags, []).append(prog)
            if action.dest in VOCABULARY:
                assert list(flags) == VOCABULARY[action.dest], (prog, action.dest, flags)
            if action.dest in knobs:
                assert "--" + action.dest.replace("_", "-") in flags, (prog, action.dest, flags)
            if action.dest == "vae":
                assert action.help.startswith(VAE_HELP), (prog, action.help)
            assert not any(flag in ("--out", "--crop") for flag in flags), (prog, flags)  # units or -o in the name
    twice = {dest: {flags: progs for flags, progs in seen.items()} for dest, seen in spellings.items() if len(seen) > 1}
    twice.pop("help", None)
    assert not twice, f"one setting spelled two ways: {twice}"


def test_non_finite_and_unbounded_numbers_read_as_words():
    """ "t_std must be a finite number a number > 0" and "t_mean must be a finite number in [-inf, inf]"."""
    from flowlift.errors import FlowliftError
    from flowlift.knobs import Knob

    positive = Knob("t_std", float, 1.0, "spread", low=0.0, low_open=True)
    anything = Knob("t_mean", float, 0.0, "centre")
    assert anything.describe() == "a number"
    for knob, value, line in (
        (positive, float("nan"), "t_std must be a finite number > 0, got nan"),
        (anything, float("inf"), "t_mean must be a finite number, got inf"),
        (positive, -1.0, "t_std must be a number > 0, got -1.0"),
    ):
        try:
            knob.check(value)
        except FlowliftError as error:
            assert str(error) == line
        else:
            raise AssertionError(f"{knob.name}={value} passed")


def test_the_knob_tables_of_docs_architecture_say_each_knobs_type_and_range():
    """docs/architecture.md's rows for the upscale and refine knobs name each knob's type and, for a number, open with
    its range: ``scale`` and ``hires_scale`` were listed as "int | 2 / 4 / 8" long after they took any factor."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    knobs = {**UPSCALE_KNOBS, **REFINE_KNOBS}
    seen = set()
    for line in doc.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`") or cells[0].strip("`") not in knobs:
            continue
        knob = knobs[cells[0].strip("`")]
        seen.add(knob.name)
        assert cells[1] == knob.kind.__name__, (knob.name, cells[1], knob.kind)
        if knob.kind in (int, float) and knob.low is not None and knob.high is not None and knob.high < 1e6:
            assert cells[2].startswith(f"[{knob.low:g}, {knob.high:g}]"), (knob.name, cells[2])
    assert {"scale", "hires_scale", "strength", "tile_size"} <= seen, seen

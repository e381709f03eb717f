"""Tiled FLUX.2 Refine (flowlift) on a real ComfyUI 0.33 server: the model patch under ComfyUI's own KSampler.

The session's server (tests/comfy_server.py) with the test-only nodes of tests/comfy_test_nodes. The model is a tiny
FLUX.2 Klein single file (hidden 256: 2 heads of 128, one double and one single block) loaded by ComfyUI's own
``UNETLoader``; its text conditioning comes from a test-only node (no tiny Qwen3 text encoder loads in ComfyUI).
The latent is 128x192 px (8x12 in ComfyUI's layout); small tiles of 64 px with a 32 px overlap make a 3x5 grid.
The whole hires graph (txt2img, Flow Upscale Latent, the patched KSampler, decode, save) is
``test_the_klein_hires_template_runs_end_to_end_through_comfyuis_own_loaders``.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from comfy_server import KLEIN_UNET, REFINE_LATENT, load_api_workflow, message, png_tensor, session_server
from flowlift.flux2.latents import from_comfyui_latent, patchify
from flowlift.models.upscaler_weights import load_upscaler
from flowlift.refine.settings import TILE_BATCH, TILE_OVERLAP, TILE_SIZE
from flowlift.upscale.pipeline import FlowUpscalerPipeline

NODE = "FlowliftTiledFlux2Refine"
TITLE = "Tiled FLUX.2 Refine (flowlift)"
FRAME_PX = (16 * REFINE_LATENT[2], 16 * REFINE_LATENT[3])  # (h, w)


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, shared):
    """The session's ComfyUI 0.33 server with this pack (tests/comfy_server.py), shared by the pack's test modules."""
    return session_server(request.config, tmp_path_factory, shared)


def tiled(model: list, tile_size: str, tile_overlap: int = 32, tile_batch: str = "auto") -> dict:
    return {
        "class_type": NODE,
        "inputs": {"model": model, "tile_size": tile_size, "tile_overlap": tile_overlap, "tile_batch": tile_batch},
    }


def ksampler(model: list, latent: list, cfg: float = 1.0) -> dict:
    return {
        "class_type": "KSampler",
        "inputs": {
            "model": model,
            "positive": ["c", 0],
            "negative": ["c", 0],
            "latent_image": latent,
            "seed": 5,
            "steps": 2,
            "cfg": cfg,
            "sampler_name": "euler",
            "scheduler": "simple",
            "denoise": 0.5,
        },
    }


def save(samples: list, name: str) -> dict:
    return {"class_type": "SaveLatent", "inputs": {"samples": samples, "filename_prefix": f"tiled/{name}"}}


def base_graph() -> dict:
    """The tiny Klein through ComfyUI's UNETLoader ("1"), the refine latent ("2") and a text conditioning ("c")."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": KLEIN_UNET, "weight_dtype": "default"}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "refine.latent"}},
        "c": {"class_type": "FlowliftTestConditioning", "inputs": {"seed": 3}},
    }


def saved(server, entry: dict, node: str) -> torch.Tensor:
    return load_file(str(server.output_file(entry, node, "latents")))["latent_tensor"]


def test_the_server_lists_the_node_with_model_in_and_out_and_the_knob_tables_tile_inputs(server):
    info = server.object_info[NODE]
    assert info["display_name"] == TITLE and info["output"] == ["MODEL"]
    assert info["input_order"]["required"] == ["model", "tile_size", "tile_overlap", "tile_batch"]
    required = info["input"]["required"]
    assert required["model"][0] == "MODEL"
    for name, knob in (("tile_size", TILE_SIZE), ("tile_batch", TILE_BATCH)):  # px or words: text, parsed on run
        kind, options = required[name]
        assert (kind, options["default"]) == ("STRING", str(knob.default)), name
        assert options["tooltip"] == f"{knob.help} ({knob.describe()})", name
    kind, options = required["tile_overlap"]
    assert kind == "INT" and options["tooltip"] == TILE_OVERLAP.help
    assert (options["default"], options["min"], options["step"]) == (
        TILE_OVERLAP.default,
        TILE_OVERLAP.low,
        TILE_OVERLAP.step,
    )
    assert options["max"] == TILE_OVERLAP.high > 2048  # the frontend's cap for a widget without a max


def test_ksampler_through_the_patch_one_tile_is_bit_exact_small_tiles_run_and_differ(server):
    graph = base_graph() | {
        "10": ksampler(["1", 0], ["2", 0]),
        "11": save(["10", 0], "plain"),
        "20": tiled(["1", 0], "256"),
        "21": ksampler(["20", 0], ["2", 0]),
        "22": save(["21", 0], "one_tile"),
        "30": tiled(["1", 0], "auto"),
        "31": ksampler(["30", 0], ["2", 0]),
        "32": save(["31", 0], "auto"),
        "40": tiled(["1", 0], "64"),
        "41": ksampler(["40", 0], ["2", 0]),
        "42": save(["41", 0], "small"),
        # cond and uncond in one batch of 2 (cfg != 1), two tiles asked per call
        "50": tiled(["1", 0], "64", tile_batch="2"),
        "51": ksampler(["50", 0], ["2", 0], cfg=2.0),
        "52": save(["51", 0], "small_cfg"),
        "53": ksampler(["1", 0], ["2", 0], cfg=2.0),
        "54": save(["53", 0], "cfg"),
        # a second patch replaces the first: 64 px tiles then "off" is the plain model, then one tile the same
        "60": tiled(["40", 0], "off"),
        "61": ksampler(["60", 0], ["2", 0]),
        "62": save(["61", 0], "small_then_off"),
        "70": tiled(["40", 0], "256"),
        "71": ksampler(["70", 0], ["2", 0]),
        "72": save(["71", 0], "small_then_one_tile"),
    }
    entry = server.run(graph)
    plain = saved(server, entry, "11")
    assert plain.shape == REFINE_LATENT
    # a tile at least as large as the latent, and auto below 4 MP: the unpatched run, bit for bit
    assert torch.equal(saved(server, entry, "22"), plain)
    assert torch.equal(saved(server, entry, "32"), plain)
    small = saved(server, entry, "42")
    assert torch.isfinite(small).all() and (small - plain).abs().max() > 1e-2  # the tiles really ran
    for node in ("62", "72"):  # the earlier patch's tiles no longer run (they ran inside the new one's)
        assert torch.equal(saved(server, entry, node), plain), node
    cfg, small_cfg = saved(server, entry, "54"), saved(server, entry, "52")
    assert (small_cfg - cfg).abs().max() > 1e-2 and not torch.equal(small_cfg, small)
    height, width = FRAME_PX
    grid = f"Tiled FLUX.2 Refine: {width}x{height} px in 3x5 tiles of 64x64 px, overlap 32 px, 1 per call"
    assert grid in server.log.read_text(errors="replace"), server.log_tail()


def test_the_patched_model_equals_refine_cores_tiled_velocity_on_the_same_inputs(server):
    # flowlift's TiledVelocity over the unpatched model's velocity (one tile per call), inside the server process;
    # the patch runs two tiles per call: text conditioning, a FLUX.2 reference latent and batches of 2 per tile
    graph = base_graph() | {"3": tiled(["1", 0], "64", tile_batch="2")}
    cases = {"60": (1, False), "61": (1, True), "62": (2, True)}
    for node, (batch, reference) in cases.items():
        graph[node] = {
            "class_type": "FlowliftTestTiledReference",
            "inputs": {
                "model": ["3", 0],
                "samples": ["2", 0],
                "conditioning": ["c", 0],
                "sigma": 0.6,
                "tile_size": 64,
                "tile_overlap": 32,
                "batch": batch,
                "reference_latent": reference,
            },
        }
        graph[f"{node}s"] = save([node, 0], f"reference_{node}")
    entry = server.run(graph)
    for node, (batch, _reference) in cases.items():
        patched, expected, whole = saved(server, entry, f"{node}s").split(batch)
        torch.testing.assert_close(patched, expected, rtol=0, atol=1e-5)  # float rounding of the two blends
        assert (patched - whole).abs().max() > 1e-2, node  # and tiles are not the whole frame


@pytest.mark.parametrize(
    ("tile_size", "tile_overlap", "tile_batch", "expected"),
    [
        ("1000", 32, "auto", "tile size must be a multiple of 16 px, got '1000'"),
        (
            "big",
            32,
            "auto",
            "tile size must be an integer in [32, 16384] and a multiple of 16 or auto or off, got 'big'",
        ),
        ("64", 64, "auto", "tile overlap 64 px must be smaller than the tile (64 px); give a smaller tile overlap"),
        ("64", 32, "0", "tile batch must be an integer >= 1 or auto, got '0'"),
    ],
)
def test_a_bad_tile_knob_fails_that_prompt_with_one_line_and_the_next_prompt_runs(
    server, tile_size, tile_overlap, tile_batch, expected
):
    bad = base_graph() | {
        "3": tiled(["1", 0], tile_size, tile_overlap, tile_batch),
        "4": ksampler(["3", 0], ["2", 0]),
        "5": save(["4", 0], "never"),
    }
    entry = server.wait(server.queue(bad))
    error = message(entry, "execution_error")
    assert entry["status"]["status_str"] == "error" and error["node_type"] == NODE
    assert error["exception_message"].strip() == f"{TITLE}: {expected}"
    assert "5" not in entry["outputs"]
    good = json.loads(json.dumps(bad))
    good["3"]["inputs"].update(tile_size="64", tile_overlap=32, tile_batch="auto")
    assert saved(server, server.run(good), "5").shape == REFINE_LATENT


def test_an_inpaint_mask_is_kept_per_tile(server):
    # ComfyUI applies the noise mask to the (blended) prediction: the kept half stays the input latent
    height, width = FRAME_PX
    graph = base_graph() | {
        "3": {"class_type": "SolidMask", "inputs": {"value": 0.0, "width": width, "height": height}},
        "4": {"class_type": "SolidMask", "inputs": {"value": 1.0, "width": width // 2, "height": height}},
        "5": {
            "class_type": "MaskComposite",
            "inputs": {"destination": ["3", 0], "source": ["4", 0], "x": 0, "y": 0, "operation": "add"},
        },
        "6": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["2", 0], "mask": ["5", 0]}},
        "7": tiled(["1", 0], "64"),
        "8": ksampler(["7", 0], ["6", 0]),
        "9": save(["8", 0], "inpaint"),
    }
    entry = server.run(graph)
    got = saved(server, entry, "9")
    source = load_file(str(server.root / "input" / "refine.latent"))["latent_tensor"]
    half = REFINE_LATENT[3] // 2
    torch.testing.assert_close(got[..., half + 1 :], source[..., half + 1 :], rtol=0, atol=1e-5)
    assert (got[..., : half - 1] - source[..., : half - 1]).abs().max() > 1e-2
    assert re.search(r"Tiled FLUX.2 Refine: \d+x\d+ px in 3x5 tiles", server.log.read_text(errors="replace"))


def test_cancel_stops_a_step_between_tiles(server):
    # one sampler step over 47x47 = 2209 tiles of 64 px (1536 px frame) takes far longer than ComfyUI's own check
    # between steps would allow; the patch checks before every tile
    graph = base_graph() | {
        "3": {"class_type": "EmptyFlux2LatentImage", "inputs": {"width": 1536, "height": 1536, "batch_size": 1}},
        "4": tiled(["1", 0], "64"),
        "5": ksampler(["4", 0], ["3", 0]),
        "6": save(["5", 0], "cancelled"),
    }
    graph["5"]["inputs"] |= {"steps": 1, "denoise": 1.0}
    prompt_id = server.queue(graph)
    deadline = time.monotonic() + 60
    while not any(item[1] == prompt_id for item in server.request("/queue")["queue_running"]):
        assert time.monotonic() < deadline, "the prompt never started"
        time.sleep(0.1)
    time.sleep(3.0)
    assert not server.request(f"/history/{prompt_id}"), "the step finished before the interrupt: make it longer"
    started = time.monotonic()
    server.request("/interrupt", {})
    entry = server.wait(prompt_id, timeout=120)
    took = time.monotonic() - started
    print(f"cancel honoured after {took:.2f} s")
    assert message(entry, "execution_interrupted")["node_type"] == "KSampler"
    assert "6" not in entry["outputs"] and took <= 5.0, took


def test_the_klein_hires_template_runs_end_to_end_through_comfyuis_own_loaders(server):
    """The shipped hires template's graph on a real FLUX.2 Klein file: UNETLoader -> EmptyFlux2LatentImage ->
    KSampler (txt2img) -> Flow Upscale Latent 4x -> KSampler through Tiled FLUX.2 Refine (3x3 tiles) at low denoise
    -> decode -> SaveImage. Only the text encoder is swapped for the test conditioning (no tiny Qwen3 loads)."""
    workflow = load_api_workflow("flux2_klein_tiled_refine_4x.json")
    assert [workflow[k]["class_type"] for k in ("1", "2", "3")] == ["UNETLoader", "CLIPLoader", "CLIPTextEncode"]
    del workflow["2"]
    workflow["3"] = {"class_type": "FlowliftTestConditioning", "inputs": {"seed": 1}}
    workflow["4"]["inputs"] |= {"width": 64, "height": 64}
    workflow["5"]["inputs"]["steps"] = workflow["9"]["inputs"]["steps"] = 2
    workflow["8"]["inputs"] |= {"tile_size": "128", "tile_overlap": 64}
    workflow |= {"90": save(["5", 0], "txt2img"), "91": save(["7", 0], "upscaled"), "92": save(["9", 0], "refined")}
    entry = server.run(workflow)

    generated, upscaled, refined = (saved(server, entry, node) for node in ("90", "91", "92"))
    assert generated.shape == (1, 128, 4, 4) and upscaled.shape == refined.shape == (1, 128, 16, 16)
    upscaler = load_upscaler(server.root / "models" / "latent_upscale_models" / "flow_upscaler.safetensors")
    pipeline = FlowUpscalerPipeline(upscaler, vae=None)
    expected = patchify(pipeline.upscale_latents(from_comfyui_latent({"samples": generated}), 2, seed=0))
    torch.testing.assert_close(upscaled, expected, rtol=0, atol=1e-5)  # flowlift's upscale of the Klein latent
    assert torch.isfinite(refined).all() and (refined - upscaled).abs().max() > 1e-2  # the refine changed it
    assert "Tiled FLUX.2 Refine: 256x256 px in 3x3 tiles of 128x128 px, overlap 64 px" in server.log.read_text(
        errors="replace"
    )
    image = png_tensor(server.output_file(entry, "12"))
    assert image.shape == (1, 3, 256, 256) and image.std() > 0.01


def test_the_side_by_side_template_runs_its_flow_upscaler_and_bicubic_paths_without_pids_weights(server):
    """The comparison template as queued: ComfyUI 0.33 validates every output; only PiD's (its transformer and text
    encoder are not here) is refused, naming those two files, and the Flow Upscaler and latent bicubic paths, each
    refined by the tiled Klein, run to images of the same 4x size. Only the Klein text encoder is swapped for the
    test conditioning (no tiny Qwen3 loads)."""
    workflow = load_api_workflow("flux2_hires_side_by_side.json")
    assert workflow["7"]["class_type"] == "CLIPLoader" and workflow["8"]["class_type"] == "CLIPTextEncode"
    del workflow["7"]
    workflow["8"] = {"class_type": "FlowliftTestConditioning", "inputs": {"seed": 2}}
    for sampler in ("10", "14"):
        workflow[sampler]["inputs"]["steps"] = 2
    answer = server.request("/prompt", {"prompt": workflow, "client_id": "side-by-side"})
    errors = answer["node_errors"]
    missing = {(node, e["extra_info"]["input_name"]) for node, entry in errors.items() for e in entry["errors"]}
    assert missing == {("17", "unet_name"), ("18", "clip_name")}, errors
    assert {e["type"] for entry in errors.values() for e in entry["errors"]} == {"value_not_in_list"}, errors
    entry = server.wait(answer["prompt_id"])
    assert entry["status"]["status_str"] == "success", entry["status"]
    assert set(entry["outputs"]) == {"12", "16"}  # PiD's SaveImage (29) was not run
    flow, bicubic = (png_tensor(server.output_file(entry, node)) for node in ("12", "16"))
    source = png_tensor(server.root / "input" / "example.png")
    assert flow.shape == bicubic.shape == (1, 3, 4 * source.shape[2], 4 * source.shape[3])
    assert (flow - bicubic).abs().max() > 0.05  # two different upscalers

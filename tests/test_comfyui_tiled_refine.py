"""Tiled FLUX.2 Refine (flowlift) on a real ComfyUI v0.8.0 server: the model patch under ComfyUI's own KSampler.

One server for the module (tests/comfy_server.py) with the test-only nodes of tests/comfy_test_nodes: ComfyUI's
own FLUX.2 model classes at a tiny width (its model detection accepts no FLUX.2 file narrower than the released
hidden size 6144, see that module) and a random text conditioning. The latent is 128x192 px (8x12 in ComfyUI's
layout); small tiles of 64 px with a 32 px overlap make a 3x5 grid.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file

from comfy_server import REFINE_LATENT, comfy_server, message
from flowlift.refine.settings import TILE_BATCH, TILE_OVERLAP, TILE_SIZE

NODE = "FlowliftTiledFlux2Refine"
TITLE = "Tiled FLUX.2 Refine (flowlift)"
FRAME_PX = (16 * REFINE_LATENT[2], 16 * REFINE_LATENT[3])  # (h, w)


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared):
    with comfy_server(tmp_path_factory.mktemp("comfy-tiled"), shared, test_nodes=True) as comfy:
        yield comfy


def tiled(model: list, tile_size: str, tile_overlap: int = 32, tile_batch: str = "auto") -> dict:
    return {"class_type": NODE, "inputs": {"model": model, "tile_size": tile_size, "tile_overlap": tile_overlap,
                                           "tile_batch": tile_batch}}  # fmt: skip


def ksampler(model: list, latent: list, cfg: float = 1.0) -> dict:
    return {"class_type": "KSampler", "inputs": {
        "model": model, "positive": ["1", 1], "negative": ["1", 1], "latent_image": latent, "seed": 5, "steps": 2,
        "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 0.5}}  # fmt: skip


def save(samples: list, name: str) -> dict:
    return {"class_type": "SaveLatent", "inputs": {"samples": samples, "filename_prefix": f"tiled/{name}"}}


def base_graph() -> dict:
    return {
        "1": {"class_type": "FlowliftTestTinyFlux2", "inputs": {"seed": 3}},
        "2": {"class_type": "LoadLatent", "inputs": {"latent": "refine.latent"}},
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
        TILE_OVERLAP.default, TILE_OVERLAP.low, TILE_OVERLAP.step)  # fmt: skip
    assert options.get("max") == TILE_OVERLAP.high or TILE_OVERLAP.high is None


def test_ksampler_through_the_patch_one_tile_is_bit_exact_small_tiles_run_and_differ(server):
    graph = base_graph() | {
        "10": ksampler(["1", 0], ["2", 0]), "11": save(["10", 0], "plain"),
        "20": tiled(["1", 0], "256"), "21": ksampler(["20", 0], ["2", 0]), "22": save(["21", 0], "one_tile"),
        "30": tiled(["1", 0], "auto"), "31": ksampler(["30", 0], ["2", 0]), "32": save(["31", 0], "auto"),
        "40": tiled(["1", 0], "64"), "41": ksampler(["40", 0], ["2", 0]), "42": save(["41", 0], "small"),
        # cond and uncond in one batch of 2 (cfg != 1), two tiles asked per call
        "50": tiled(["1", 0], "64", tile_batch="2"), "51": ksampler(["50", 0], ["2", 0], cfg=2.0),
        "52": save(["51", 0], "small_cfg"), "53": ksampler(["1", 0], ["2", 0], cfg=2.0), "54": save(["53", 0], "cfg"),
    }  # fmt: skip
    entry = server.run(graph)
    plain = saved(server, entry, "11")
    assert plain.shape == REFINE_LATENT
    # a tile at least as large as the latent, and auto below 4 MP: the unpatched run, bit for bit
    assert torch.equal(saved(server, entry, "22"), plain)
    assert torch.equal(saved(server, entry, "32"), plain)
    small = saved(server, entry, "42")
    assert torch.isfinite(small).all() and (small - plain).abs().max() > 1e-2  # the tiles really ran
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
        graph[node] = {"class_type": "FlowliftTestTiledReference", "inputs": {
            "model": ["3", 0], "samples": ["2", 0], "conditioning": ["1", 1], "sigma": 0.6, "tile_size": 64,
            "tile_overlap": 32, "batch": batch, "reference_latent": reference}}  # fmt: skip
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
        ("big", 32, "auto", "tile size must be an integer in [32, inf] and a multiple of 16 or auto or off, got 'big'"),
        ("64", 64, "auto", "tile overlap 64 px must be smaller than the tile (64 px); give a smaller tile overlap"),
        ("64", 32, "0", "tile batch must be an integer in [1, inf] or auto, got '0'"),
    ],
)
def test_a_bad_tile_knob_fails_that_prompt_with_one_line_and_the_next_prompt_runs(
    server, tile_size, tile_overlap, tile_batch, expected
):
    bad = base_graph() | {
        "3": tiled(["1", 0], tile_size, tile_overlap, tile_batch), "4": ksampler(["3", 0], ["2", 0]),
        "5": save(["4", 0], "never"),
    }  # fmt: skip
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
        "5": {"class_type": "MaskComposite", "inputs": {
            "destination": ["3", 0], "source": ["4", 0], "x": 0, "y": 0, "operation": "add"}},
        "6": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["2", 0], "mask": ["5", 0]}},
        "7": tiled(["1", 0], "64"), "8": ksampler(["7", 0], ["6", 0]), "9": save(["8", 0], "inpaint"),
    }  # fmt: skip
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
        "4": tiled(["1", 0], "64"), "5": ksampler(["4", 0], ["3", 0]), "6": save(["5", 0], "cancelled"),
    }  # fmt: skip
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

"""The InvokeAI node pack inside a real InvokeAI 6.14.2 server, driven over its REST API.

One server per module (tests/invokeai_client.py): a fresh INVOKEAI_ROOT with this repository linked
as ``nodes/flowlift``, bound to 127.0.0.1 on a free port, stopped at the end (its exit is checked).
Models are local files: small random Flow Upscalers, the real TAEF2, a random full-size FLUX.2 VAE and a
tiny random FLUX.2 Klein diffusers pipeline (tests/tiny_flux2.py) installed through InvokeAI's model install
API. Results are read back (images over HTTP, latents from the server's tensor folder) and compared with
flowlift's own pipeline on the same inputs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from comfy_server import random_upscaler, write_random_flux2_vae, write_random_mage_vae
from flowlift.flux2.latents import bn_std as bn_std_of
from flowlift.flux2.latents import denormalize, normalize
from flowlift.models.upscaler_weights import load_upscaler, save_upscaler
from flowlift.models.vae import Flux2VAE
from flowlift.models.vae_loading import load_vae
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy
from flux2_files import write_single_file
from invokeai_client import InvokeAIServer, graph, start_server, stop_server, wait_until_serving
from invokeai_venv import invokeai_env, invokeai_python
from sesqui_reference import save_random_sesqui
from tiny_flux2 import QWEN3_WIDTH, tiny_transformer, write_invokeai_klein_pipeline

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = REPO_ROOT / "example_workflows" / "invokeai"
NODE_TYPES = {
    "flowlift_upscale_latents": ("FlowUpscaleLatentsInvocation", "Flow Upscale Latents (FLUX.2)"),
    "flowlift_upscale_image": ("FlowUpscaleImageInvocation", "Flow Upscale Image (FLUX.2)"),
    "flowlift_color_fix": ("ColourFixInvocation", "Colour Fix"),
    "flowlift_tiled_flux2_denoise": ("TiledFlux2DenoiseInvocation", "Tiled FLUX.2 Denoise (flowlift)"),
}
#: Saved workflows refer to these field names: a change here is a breaking change for users.
FIELDS = {
    "flowlift_upscale_latents": [
        "latents",
        "vae",
        "upscaler_model",
        "upscaler",
        "scale",
        "seed",
        "transplant_strength",
        "chunked",
        "latent_upscaler_model",
        "latent_upscaler",
    ],
    "flowlift_upscale_image": [
        "image",
        "vae",
        "taef2_model",
        "taef2",
        "upscaler_model",
        "upscaler",
        "scale",
        "seed",
        "transplant_strength",
        "color_fix_strength",
        "chunked",
        "latent_upscaler_model",
        "latent_upscaler",
    ],
    "flowlift_color_fix": ["image", "reference", "strength"],
    "flowlift_tiled_flux2_denoise": [
        "latents",
        "transformer",
        "positive_text_conditioning",
        "vae",
        "strength",
        "num_steps",
        "seed",
        "tile_size",
        "tile_overlap",
        "tile_batch",
    ],
}
#: The Tiled FLUX.2 Denoise node's fields -> their refine knobs (flowlift.refine.settings.REFINE_KNOBS).
TILED_DENOISE_KNOBS = {
    "strength": "refine_strength",
    "num_steps": "steps",
    "seed": "seed",
    "tile_size": "tile_size",
    "tile_overlap": "tile_overlap",
    "tile_batch": "tile_batch",
}
IMAGE_W, IMAGE_H = 48, 32
KLEIN_W, KLEIN_H = 256, 128  # the tiled refine's frame: 64 px tiles really tile it
ONE_LEVEL = 1 / 255 + 1e-6  # an 8-bit PNG's rounding


# --------------------------------------------------------------------------------------------------
# models, inputs and the server


def write_models(folder: Path) -> None:
    """Local model files the graphs name by path (and the files InvokeAI installs)."""
    folder.mkdir(parents=True)
    save_upscaler(random_upscaler(16, seed=1), folder / "flow_upscaler.safetensors")
    save_upscaler(random_upscaler(16, seed=3), folder / "replaced_upscaler.safetensors")
    save_upscaler(random_upscaler(64, seed=2), folder / "flow_upscaler_b64.safetensors")
    (folder / "corrupt.safetensors").write_bytes(b"\x17not a safetensors file" * 8)
    save_random_sesqui(folder)  # upscaler_Flux2.safetensors, SesquiLSR's released name
    with open(folder / "big.safetensors", "wb") as handle:  # issue 32.G: 300 GB, sparse (no disk used)
        handle.truncate(300 << 30)
    (folder / ".profile").write_text("# a dotfile of the server user's\nexport TOKEN=secret\n")
    write_random_flux2_vae(folder / "flux2-vae.safetensors")
    write_random_mage_vae(folder / "mage_vae.safetensors")  # issue 37: a narrow Mage-VAE, released layout
    write_random_mage_vae(folder / "mage_decoder.safetensors", decode_only=True)  # decodes, cannot encode
    write_invokeai_klein_pipeline(folder / "klein-tiny", qwen3_tokenizer_files())
    # A Klein transformer as one BFL-named file (how Klein 4B/9B ship): InvokeAI's checkpoint loader rebuilds it
    # with 128-wide heads and diffusers' other defaults (rope axes 32x4, 256 timestep channels), so it has those.
    single = tiny_transformer(
        seed=12,
        text_dim=3 * QWEN3_WIDTH,
        attention_head_dim=128,
        num_attention_heads=1,
        timestep_guidance_channels=256,
        axes_dims_rope=(32, 32, 32, 32),
    )
    write_single_file(single, folder / "klein-tiny-transformer.safetensors")
    # What InvokeAI's model probe identifies as an SD-1 VAE (4 latent channels); the nodes must refuse it
    # from its model config, before anything loads, so its other weights are left out.
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            "encoder.conv_in.weight": torch.randn(8, 3, 3, 3, generator=gen),
            "decoder.conv_in.weight": torch.randn(8, 4, 3, 3, generator=gen),
        },
        str(folder / "sd15-vae.safetensors"),
    )


def qwen3_tokenizer_files() -> Path:
    """InvokeAI's vendored Qwen3 tokenizer (the real one; its single-file Qwen3 loader uses it offline)."""
    find = "import importlib.util as u; print(u.find_spec('invokeai').submodule_search_locations[0])"
    result = subprocess.run([str(invokeai_python()), "-c", find], env=invokeai_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip()) / "backend" / "qwen3" / "tokenizer"
    assert (folder / "tokenizer.json.gz").is_file(), folder
    return folder


def example_images(shared: Path) -> dict[str, Image.Image]:
    source = Image.open(shared / "images" / "kodak" / "kodim23.png").convert("RGB")
    example = source.crop((300, 150, 300 + 4 * IMAGE_W, 150 + 4 * IMAGE_H)).resize((IMAGE_W, IMAGE_H), Image.LANCZOS)
    rgba = example.copy()
    ramp = np.linspace(40, 255, IMAGE_W, dtype=np.float32)[None, :].repeat(IMAGE_H, 0)
    rgba.putalpha(Image.fromarray(ramp.round().astype(np.uint8), "L"))
    # "another upscaler's" output with a colour drift, for the colour fix
    drifted = np.asarray(example.resize((2 * IMAGE_W, 2 * IMAGE_H), Image.LANCZOS), dtype=np.float32)
    drifted = np.clip(drifted * [1.08, 1.0, 0.9] + [6, 0, -4], 0, 255).round().astype(np.uint8)
    return {
        "example.png": example,
        "example_rgba.png": rgba,
        "upscaled.png": Image.fromarray(drifted),
        "wide.png": Image.new("RGB", (2049, 16), (90, 120, 150)),  # 8x of its canvas passes 16384 px
        "klein.png": source.crop((200, 100, 200 + KLEIN_W, 100 + KLEIN_H)),
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, shared):
    """InvokeAI 6.14.2 with the pack, models installed and images uploaded; stopped (and checked) after."""
    base = tmp_path_factory.mktemp("invokeai")
    invoke = start_server(base / "root")
    try:
        write_models(base / "models")  # while the server starts
        wait_until_serving(invoke)
        invoke.models = base / "models"
        invoke.shared_taef2 = shared / "models" / "taef2"
        invoke.flux2_vae = invoke.install_model(base / "models" / "flux2-vae.safetensors")
        invoke.sd15_vae = invoke.install_model(base / "models" / "sd15-vae.safetensors")
        invoke.klein = invoke.install_model(base / "models" / "klein-tiny")
        invoke.klein_file = invoke.install_model(base / "models" / "klein-tiny-transformer.safetensors")
        invoke.images = {}
        for name, picture in example_images(shared).items():
            picture.save(base / name)
            invoke.images[name] = invoke.upload_png(picture, name)
        invoke.inputs = base
        invoke.events = base / "events.jsonl"
        listener = subprocess.Popen(
            [str(invokeai_python()), str(REPO_ROOT / "tests" / "invokeai_events.py"), invoke.url, str(invoke.events)],
            env=invokeai_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            assert listener.stdout.readline().strip() == "subscribed", listener.stdout.read()
            yield invoke
        finally:
            stop_server(listener)
    finally:
        status = stop_server(invoke.process)
        print(f"InvokeAI stopped with exit status {status}")


def vae_loader(config: dict) -> dict:
    keys = ("key", "hash", "name", "base", "type")
    return {"type": "vae_loader", "vae_model": {k: config[k] for k in keys}}


def upscale_image_node(server: InvokeAIServer, image: str, **fields) -> dict:
    return {
        "type": "flowlift_upscale_image",
        "image": {"image_name": server.images[image]},
        "upscaler": str(server.models / "flow_upscaler.safetensors"),
        "taef2": str(server.shared_taef2),
        "scale": 4.0,
        "seed": 3,
        **fields,
    }


def error_line(item: dict) -> str:
    assert item["status"] == "failed", (item["status"], item.get("error_message"))
    assert item["error_type"] == "FlowliftError", (item["error_type"], item["error_message"])
    text = item["error_message"].strip()
    assert "\n" not in text, text
    return text


def count_loads(server: InvokeAIServer, file: str) -> int:
    return len([line for line in server.log_lines("flowlift: loading Flow Upscaler") if file in line])


# --------------------------------------------------------------------------------------------------
# tests


def test_the_pack_loads_and_its_invocations_are_in_the_openapi_schema(server):
    schemas = server.request("GET", "/openapi.json")["components"]["schemas"]
    for node_type, (schema_name, title) in NODE_TYPES.items():
        schema = schemas[schema_name]
        assert schema["properties"]["type"]["default"] == node_type
        assert (schema["title"], schema["category"], schema["node_pack"]) == (title, "flowlift", "flowlift")
        inputs = [name for name, field in schema["properties"].items() if field.get("field_kind") == "input"]
        assert inputs == FIELDS[node_type], node_type
        assert all(schema["properties"][name].get("description") for name in inputs), node_type
    packs = server.request("GET", "/api/v2/custom_nodes/")["node_packs"]
    (pack,) = [p for p in packs if p["name"] == "flowlift"]
    assert sorted(pack["node_types"]) == sorted(NODE_TYPES)
    assert not server.log_lines("Failed to load node pack")


def test_the_fields_have_the_knob_tables_domain_and_default(server):
    # issue 29: every field's limits and default come from flowlift's knob tables (the seed: [0, 2^64 - 1])
    from flowlift.upscale.settings import COLOR_FIX_KNOBS, UPSCALE_KNOBS

    schemas = server.request("GET", "/openapi.json")["components"]["schemas"]
    checked = 0
    from flowlift.refine.settings import DISTILLED_STEPS, REFINE_KNOBS

    tiled = schemas[NODE_TYPES["flowlift_tiled_flux2_denoise"][0]]["properties"]
    for name, knob_name in TILED_DENOISE_KNOBS.items():
        knob, field = REFINE_KNOBS[knob_name], tiled[name]
        if knob.words:  # a number that also takes words: a text field with the knob's default
            assert (field["type"], field["default"]) == ("string", str(knob.default)), name
            assert knob.describe() in field["description"], name
        else:  # the steps' default is InvokeAI's FLUX2 Denoise's, a step-distilled Klein's (the CLI asks the model)
            default = DISTILLED_STEPS if name == "num_steps" else knob.default
            assert (field.get("minimum"), field.get("maximum"), field["default"]) == (knob.low, knob.high, default)
    for node_type, (schema_name, _title) in NODE_TYPES.items():
        if node_type == "flowlift_tiled_flux2_denoise":
            continue
        table = COLOR_FIX_KNOBS if node_type == "flowlift_color_fix" else UPSCALE_KNOBS
        for name, field in schemas[schema_name]["properties"].items():
            if name not in table or field.get("field_kind") != "input":
                continue
            knob = table[name]
            if knob.choices:
                assert field["enum"] == [knob.label(choice) for choice in knob.choices], (node_type, name)
                assert field["default"] == knob.label(knob.default), (node_type, name)
            else:
                assert (field["minimum"], field["maximum"], field["default"]) == (knob.low, knob.high, knob.default)
            checked += 1
    assert checked == 10  # scale, seed, transplant, chunked twice; color_fix_strength; the colour fix's strength
    # the widest seed runs (a ComfyUI or `flowlift upscale` seed reproduces here); one past it is refused
    item = server.run(graph({"up": upscale_image_node(server, "example.png", scale=2.0, seed=2**64 - 1)}, []))
    assert item["status"] == "completed", item.get("error_message")
    with pytest.raises(AssertionError, match=r"(?s)HTTP 422: .*18446744073709551615"):  # the field's limit, named
        server.enqueue(graph({"up": upscale_image_node(server, "example.png", scale=2.0, seed=2**64)}, []))
    # issue 36 class 10: pydantic's int took `true` as 1; every seed field has the rule of every JSON door
    rule = "seed must be a non-negative integer at most 18446744073709551615"
    for node_type in ("flowlift_upscale_image", "flowlift_upscale_latents", "flowlift_tiled_flux2_denoise"):
        for bad in (True, False, 5.5, -1, 2**64, "5.5", "x", None):
            node = upscale_image_node(server, "example.png", scale=2.0, seed=bad)
            if node_type != "flowlift_upscale_image":
                node = {"type": node_type, "seed": bad}
            with pytest.raises(AssertionError, match=rf"(?s)HTTP 422: .*{re.escape(rule)}") as caught:
                server.enqueue(graph({"up": node}, []))
            assert f"got {bad!r}" in str(caught.value), (node_type, bad, str(caught.value)[:400])
    for good in ("5", 5.0):  # digits and whole floats are the integer they spell, as at the web API
        item = server.run(graph({"up": upscale_image_node(server, "example.png", scale=2.0, seed=good)}, []))
        assert item["status"] == "completed", item.get("error_message")
        assert item["session"]["graph"]["nodes"]["up"]["seed"] == 5, item["session"]["graph"]["nodes"]["up"]


def test_image_node_equals_the_pipeline_and_keeps_alpha(server, shared):
    nodes = {
        "rgb": upscale_image_node(server, "example.png"),
        "rgba": upscale_image_node(server, "example_rgba.png", scale=2.0, seed=4),
    }
    item = server.run(graph(nodes, []))
    got = server.image(server.output(item, "rgb")["image"]["image_name"])
    got_rgba = server.image(server.output(item, "rgba")["image"]["image_name"])

    pipeline = FlowUpscalerPipeline(
        load_upscaler(server.models / "flow_upscaler.safetensors"), load_vae(shared / "models" / "taef2")
    )
    pixels = torch.from_numpy(np.asarray(Image.open(server.inputs / "example.png"), np.float32) / 255)
    expected = pipeline.upscale_image(pixels.permute(2, 0, 1)[None], 2, seed=3, output_type="pt")
    assert got.size == (4 * IMAGE_W, 4 * IMAGE_H) and got.mode == "RGB"
    got_pixels = torch.from_numpy(np.asarray(got, np.float32) / 255).permute(2, 0, 1)[None]
    print(f"image node vs upscale_image: max |diff| = {255 * (got_pixels - expected).abs().max().item():.3f}/255")
    assert (got_pixels - expected).abs().max().item() <= ONE_LEVEL

    expected_rgba = pipeline.upscale_image(Image.open(server.inputs / "example_rgba.png"), 1, seed=4)
    assert got_rgba.mode == "RGBA" and got_rgba.size == (2 * IMAGE_W, 2 * IMAGE_H)
    difference = np.abs(np.asarray(got_rgba, np.int16) - np.asarray(expected_rgba, np.int16))
    assert difference[..., 3].max() == 0 and difference.max() <= 1

    # progress went through InvokeAI's progress events: every stage of the 4x run, in order
    time.sleep(1.0)
    events = [json.loads(line) for line in server.events.read_text().splitlines()]
    ours = [e for e in events if e["item_id"] == item["item_id"] and e["node"] == "rgb"]
    percentages = [e["percentage"] for e in ours if e["percentage"] is not None]
    assert percentages and percentages == sorted(percentages) and percentages[-1] == 1.0, ours
    messages = " | ".join(e["message"] for e in ours)
    for stage in ("encode", "pass 1/2 done", "pass 2/2 done", "decode done", "color fix done"):
        assert stage in messages, messages


def test_image_node_runs_mage_vae_from_its_flowlift_vae_field(server):
    """issue 37: the field that takes TAEF2 takes Mage-VAE too (a released-layout file, found by its tensor
    names), and the node equals the pipeline on it."""
    path = server.models / "mage_vae.safetensors"
    item = server.run(graph({"up": upscale_image_node(server, "example.png", scale=2.0, taef2=str(path))}, []))
    got = server.image(server.output(item, "up")["image"]["image_name"])
    pipeline = FlowUpscalerPipeline(load_upscaler(server.models / "flow_upscaler.safetensors"), load_vae(path))
    pixels = torch.from_numpy(np.asarray(Image.open(server.inputs / "example.png"), np.float32) / 255)
    expected = pipeline.upscale_image(pixels.permute(2, 0, 1)[None], 1, seed=3, output_type="pt")
    got_pixels = torch.from_numpy(np.asarray(got, np.float32) / 255).permute(2, 0, 1)[None]
    assert got.size == (2 * IMAGE_W, 2 * IMAGE_H)
    assert (got_pixels - expected).abs().max().item() <= ONE_LEVEL
    assert server.log_lines("flowlift: loading Mage-VAE")


def test_upscaler_loads_once_per_file_content_and_is_freed_with_the_cache(server, shared):
    path = server.models / "replaced_upscaler.safetensors"
    node = {"up": upscale_image_node(server, "example.png", upscaler=str(path), scale=2.0)}
    first = server.run(graph(node, []))
    server.run(graph(node, []))
    assert count_loads(server, path.name) == 1, "the second run must reuse the cached upscaler"

    # a file replaced in place is a new model: loaded again, and its result is the new weights'
    save_upscaler(random_upscaler(16, seed=9), path, overwrite=True)
    replaced = server.run(graph(node, []))
    assert count_loads(server, path.name) == 2
    pipeline = FlowUpscalerPipeline(load_upscaler(path), load_vae(shared / "models" / "taef2"))
    expected = pipeline.upscale_image(Image.open(server.inputs / "example.png"), 1, seed=3)
    got = server.image(server.output(replaced, "up")["image"]["image_name"])
    assert np.abs(np.asarray(got, np.int16) - np.asarray(expected, np.int16)).max() <= 1
    assert server.output(first, "up")["image"]["image_name"] != server.output(replaced, "up")["image"]["image_name"]

    # InvokeAI's cache frees it when it needs the room (here: all of it), nothing else holds it
    freed_before = len(server.log_lines("flowlift: Flow Upscaler"))
    server.request("POST", "/api/v2/models/empty_model_cache")
    deadline = time.monotonic() + 30
    while not [ln for ln in server.log_lines("freed") if path.name in ln and "Flow Upscaler" in ln]:
        assert time.monotonic() < deadline, f"the upscaler was not freed:\n{server.log_tail()}"
        time.sleep(0.2)
    assert len(server.log_lines("flowlift: Flow Upscaler")) > freed_before
    server.run(graph(node, []))
    assert count_loads(server, path.name) == 3


def test_colour_fix_equals_flowlift_colorfix(server, tmp_path):
    nodes = {
        "fix": {
            "type": "flowlift_color_fix",
            "image": {"image_name": server.images["upscaled.png"]},
            "reference": {"image_name": server.images["example.png"]},
        }
    }
    item = server.run(graph(nodes, []))
    got = server.image_tensor(server.output(item, "fix")["image"]["image_name"])

    upscaled = tmp_path / "example_x2.png"  # the CLI pairs <stem>_x<N> with <stem>
    shutil.copy(server.inputs / "upscaled.png", upscaled)
    command = [
        sys.executable,
        "-m",
        "flowlift",
        "colorfix",
        str(upscaled),
        "--reference",
        str(server.inputs / "example.png"),
        "-o",
        str(tmp_path / "fixed.png"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    expected = torch.from_numpy(np.asarray(Image.open(tmp_path / "fixed.png").convert("RGB"), np.float32) / 255)
    expected = expected.permute(2, 0, 1)[None]
    print(f"colour fix node vs flowlift colorfix: max |diff| = {255 * (got - expected).abs().max().item():.3f}/255")
    assert (got - expected).abs().max().item() <= ONE_LEVEL
    drifted = torch.from_numpy(np.asarray(Image.open(server.inputs / "upscaled.png"), np.float32) / 255)
    assert (drifted.permute(2, 0, 1)[None] - expected).abs().max().item() > 4 / 255  # the fix did change it


def test_latent_and_image_nodes_on_invokeais_flux2_vae_equal_the_pipeline(server):
    upscaler = str(server.models / "flow_upscaler.safetensors")
    latent_node = {"type": "flowlift_upscale_latents", "upscaler": upscaler, "scale": 2.0, "seed": 7}
    nodes = {
        "image": {"type": "image", "image": {"image_name": server.images["example.png"]}},
        "vae": vae_loader(server.flux2_vae),
        "encode": {"type": "flux2_vae_encode"},
        "up": latent_node,
        "up_chunked": {**latent_node, "chunked": "always"},
        "decode": {"type": "flux2_vae_decode"},
        "img": upscale_image_node(server, "example.png", scale=2.0, seed=8),  # the image node on this VAE
    }
    edges = [("vae", "vae", node, "vae") for node in ("img", "encode", "up", "up_chunked", "decode")]
    edges += [
        ("image", "image", "encode", "image"),
        ("encode", "latents", "up", "latents"),
        ("encode", "latents", "up_chunked", "latents"),
        ("up", "latents", "decode", "latents"),
    ]
    item = server.run(graph(nodes, edges))

    encoded = server.tensor(server.output(item, "encode")["latents"]["latents_name"])
    assert encoded.shape == (1, 32, IMAGE_H // 8, IMAGE_W // 8)
    # The installed file as InvokeAI holds it: its FLUX.2 checkpoint loader casts every tensor to bfloat16
    # before loading (then to float32 on the CPU). The nodes use InvokeAI's VAE (its BatchNorm statistics, as
    # FLUX2 Denoise does), so the expected values come from the same rounded weights.
    file_vae = load_vae(server.models / "flux2-vae.safetensors").model
    vae_as_invokeai_holds_it = Flux2VAE(file_vae.to(torch.bfloat16).float())
    bn = vae_as_invokeai_holds_it.model.bn
    bn_mean, bn_std = bn.running_mean.float(), bn_std_of(bn.running_var.float(), bn.eps)
    pipeline = FlowUpscalerPipeline(load_upscaler(upscaler), vae=None, memory=MemoryPolicy(chunked=False))
    normalized = normalize(encoded.float(), bn_mean, bn_std)
    expected = denormalize(pipeline.upscale_latents(normalized, 1, seed=7), bn_mean, bn_std)
    for node in ("up", "up_chunked"):
        output = server.output(item, node)
        got = server.tensor(output["latents"]["latents_name"])
        assert got.shape == (1, 32, IMAGE_H // 4, IMAGE_W // 4)
        assert (output["width"], output["height"]) == (2 * IMAGE_W, 2 * IMAGE_H)
        print(f"latent node ({node}) vs upscale_latents: max |diff| = {(got - expected).abs().max().item():.2e}")
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    decoded = server.image(server.output(item, "decode")["image"]["image_name"])
    assert decoded.size == (2 * IMAGE_W, 2 * IMAGE_H)

    got = server.image_tensor(server.output(item, "img")["image"]["image_name"])
    image_pipeline = FlowUpscalerPipeline(load_upscaler(upscaler), vae_as_invokeai_holds_it)
    expected_image = image_pipeline.upscale_image(
        server.image_tensor(server.images["example.png"]), 1, seed=8, output_type="pt"
    )
    print(f"image node (FLUX.2 VAE) vs upscale_image: max |diff| = {255 * (got - expected_image).abs().max():.3f}/255")
    assert got.shape == (1, 3, 2 * IMAGE_H, 2 * IMAGE_W)
    assert (got - expected_image).abs().max().item() <= ONE_LEVEL


def test_the_image_node_runs_sesquilsr_for_the_fraction_on_the_flux2_vae(server):
    """issue 46.3: the image node's latent upscaler (``sesqui:PATH``) with InvokeAI's FLUX.2 VAE: 3x is one Flow pass
    then SesquiLSR 1.5x in latent space, equal to FlowUpscalerPipeline(latent_upscaler=...) over the VAE as InvokeAI
    holds it, and not the pixel resample's image; with the TAEF2 field instead it is one line naming the fix."""
    sesqui = f"sesqui:{server.models / 'upscaler_Flux2.safetensors'}"
    nodes = {
        "vae": vae_loader(server.flux2_vae),
        "sesqui": upscale_image_node(server, "example.png", scale=3.0, seed=9, latent_upscaler=sesqui),
        "pixels": upscale_image_node(server, "example.png", scale=3.0, seed=9),
    }
    item = server.run(graph(nodes, [("vae", "vae", "sesqui", "vae"), ("vae", "vae", "pixels", "vae")]))
    got = server.image_tensor(server.output(item, "sesqui")["image"]["image_name"])
    resampled = server.image_tensor(server.output(item, "pixels")["image"]["image_name"])

    file_vae = load_vae(server.models / "flux2-vae.safetensors").model  # bfloat16-rounded, as InvokeAI loads it
    pipeline = FlowUpscalerPipeline(
        load_upscaler(server.models / "flow_upscaler.safetensors"),
        Flux2VAE(file_vae.to(torch.bfloat16).float()),
        latent_upscaler=sesqui,
    )
    pixels = server.image_tensor(server.images["example.png"])
    expected = pipeline.upscale_image(pixels, 1, seed=9, output_type="pt", output_size=(3 * IMAGE_W, 3 * IMAGE_H))
    print(f"image node (SesquiLSR) vs upscale_image: max |diff| = {255 * (got - expected).abs().max():.3f}/255")
    assert got.shape == (1, 3, 3 * IMAGE_H, 3 * IMAGE_W) == resampled.shape
    assert (got - expected).abs().max().item() <= ONE_LEVEL
    assert (got - resampled).abs().max().item() > 4 / 255  # the fraction ran in latent space, not in pixels

    taef2 = graph({"up": upscale_image_node(server, "example.png", scale=3.0, latent_upscaler=sesqui)}, [])
    text = error_line(server.wait(server.enqueue(taef2)))
    assert "latent_upscaler" in text and "set vae to the FLUX.2 VAE" in text, text
    # 2, 4 and 8 do not run it: TAEF2 at 4x with the file chosen is the image without it (the pipeline loaded
    # SesquiLSR whatever the scale and refused TAEF2 for its statistics)
    both = {"chosen": upscale_image_node(server, "example.png", latent_upscaler=sesqui)}
    item = server.run(graph(both | {"none": upscale_image_node(server, "example.png")}, []))
    chosen, without = (server.image_tensor(server.output(item, n)["image"]["image_name"]) for n in ("chosen", "none"))
    assert chosen.shape == (1, 3, 4 * IMAGE_H, 4 * IMAGE_W) and torch.equal(chosen, without)


def test_the_latents_node_runs_sesquilsr_to_the_hires_fixs_size(server):
    """issue 46.3: Flow Upscale Latents with a latent upscaler does any factor: 3x is one Flow pass, then SesquiLSR to
    the size ``flowlift hires --scale 3 --latent-upscaler`` refines at (hires_latent_size: 4x6 -> 12x18), equal to
    the same steps in Python on the VAE as InvokeAI holds it; without one, 3x stays one line."""
    from flowlift.limits import hires_latent_size
    from flowlift.models.sesqui_lsr import load_sesqui_lsr, sesqui_upscale_latents

    sesqui_file = server.models / "upscaler_Flux2.safetensors"
    upscaler = str(server.models / "flow_upscaler.safetensors")
    latent_node = {"type": "flowlift_upscale_latents", "upscaler": upscaler, "scale": 3.0, "seed": 6}
    nodes = {
        "image": {"type": "image", "image": {"image_name": server.images["example.png"]}},
        "vae": vae_loader(server.flux2_vae),
        "encode": {"type": "flux2_vae_encode"},
        "up": {**latent_node, "latent_upscaler": f"sesqui:{sesqui_file}"},
    }
    edges = [("vae", "vae", "encode", "vae"), ("vae", "vae", "up", "vae"), ("image", "image", "encode", "image")]
    item = server.run(graph(nodes, [*edges, ("encode", "latents", "up", "latents")]))
    encoded = server.tensor(server.output(item, "encode")["latents"]["latents_name"])
    got = server.tensor(server.output(item, "up")["latents"]["latents_name"])

    bn = Flux2VAE(load_vae(server.models / "flux2-vae.safetensors").model.to(torch.bfloat16).float()).model.bn
    bn_mean, bn_std = bn.running_mean.float(), bn_std_of(bn.running_var.float(), bn.eps)
    size = hires_latent_size(IMAGE_H // 8, IMAGE_W // 8, 3.0)
    pipeline = FlowUpscalerPipeline(load_upscaler(upscaler), vae=None, memory=MemoryPolicy(chunked=False))
    passed = pipeline.upscale_latents(normalize(encoded.float(), bn_mean, bn_std), 1, seed=6)
    expected = denormalize(
        sesqui_upscale_latents(load_sesqui_lsr(sesqui_file), passed, size, bn_mean, bn_std), bn_mean, bn_std
    )
    assert got.shape == (1, 32, *size) == (1, 32, 3 * IMAGE_H // 8, 3 * IMAGE_W // 8)
    print(f"latent node (SesquiLSR) vs the steps: max |diff| = {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)

    plain = graph(
        {
            "vae": vae_loader(server.flux2_vae),
            "up": {
                **latent_node,
                "latents": {"latents_name": server.output(item, "encode")["latents"]["latents_name"]},
            },
        },
        [("vae", "vae", "up", "vae")],
    )
    assert "a latent upscale runs whole 2x passes" in error_line(server.wait(server.enqueue(plain)))


def test_tiled_denoise_runs_on_installed_klein_models(server, shared, tmp_path):
    """Issue 30: a small random FLUX.2 Klein pipeline installs through the model API (InvokeAI's probe takes it as
    a Klein 4B diffusers main model) and InvokeAI's own Klein graph feeds the Tiled FLUX.2 Denoise node: its
    model loader's transformer and VAE, its Qwen3 text encoder node's conditioning, its VAE encode and decode.
    64 px tiles really tile the 256x128 frame; a tile covering the frame is the untiled run bit for bit. A Klein
    transformer as one file (a Klein 4B checkpoint to the probe) runs too, with the pipeline as its Qwen3 source.
    The tiled result equals flowlift's own loop on the weights, conditioning and latents the server held."""
    from flowlift.refine.tiling import tile_layout

    identity = ("base", "type", "format", "variant")
    assert [server.klein[k] for k in identity] == ["flux2", "main", "diffusers", "klein_4b"]
    assert [server.klein_file[k] for k in identity] == ["flux2", "main", "checkpoint", "klein_4b"]
    model, model_file = (
        {k: config[k] for k in ("key", "hash", "name", "base", "type")} for config in (server.klein, server.klein_file)
    )
    refine = {"type": "flowlift_tiled_flux2_denoise", "strength": 0.6, "num_steps": 2, "seed": 3}
    nodes = {
        "loader": {"type": "flux2_klein_model_loader", "model": model, "max_seq_len": 256},
        "prompt": {"type": "flux2_klein_text_encoder", "prompt": "a parrot on a branch"},
        "image": {"type": "image", "image": {"image_name": server.images["klein.png"]}},
        "encode": {"type": "flux2_vae_encode"},
        "tiled": {**refine, "tile_size": "64", "tile_overlap": 16},
        "whole": {**refine, "tile_size": str(KLEIN_W)},
        "off": {**refine, "tile_size": "off"},
        "file_loader": {"type": "flux2_klein_model_loader", "model": model_file, "qwen3_source_model": model},
        "file_tiled": {**refine, "tile_size": "64", "tile_overlap": 16},
        "decode": {"type": "flux2_vae_decode"},
    }
    edges = [
        ("loader", "qwen3_encoder", "prompt", "qwen3_encoder"),
        ("loader", "max_seq_len", "prompt", "max_seq_len"),
        ("image", "image", "encode", "image"),
        ("loader", "vae", "encode", "vae"),
        ("tiled", "latents", "decode", "latents"),
        ("loader", "vae", "decode", "vae"),
    ]
    for node, loader in (("tiled", "loader"), ("whole", "loader"), ("off", "loader"), ("file_tiled", "file_loader")):
        edges += [
            ("encode", "latents", node, "latents"),
            (loader, "transformer", node, "transformer"),
            ("prompt", "conditioning", node, "positive_text_conditioning"),
            (loader, "vae", node, "vae"),
        ]
    started = time.monotonic()
    item = server.run(graph(nodes, edges))
    print(f"Klein tiled refine graph: {time.monotonic() - started:.1f} s")

    encoded = server.tensor(server.output(item, "encode")["latents"]["latents_name"])
    refined = {
        node: server.tensor(server.output(item, node)["latents"]["latents_name"])
        for node in ("tiled", "whole", "off", "file_tiled")
    }
    assert encoded.shape == (1, 32, KLEIN_H // 8, KLEIN_W // 8)
    for node, latents in refined.items():
        assert latents.shape == encoded.shape and latents.dtype == torch.float32, node
        assert torch.isfinite(latents).all(), node
    assert torch.equal(refined["whole"], refined["off"])
    tiles_change = (refined["tiled"] - refined["off"]).abs().max().item()
    print(f"tiled vs untiled: max |diff| = {tiles_change:.3e}")
    assert tiles_change > 1e-3  # the tiles ran (each tile sees only its own positions and neighbours)
    for node in ("off", "file_tiled"):
        assert (refined[node] - encoded).abs().max().item() > 1e-1, node  # the refine changed the latents

    # the node equals flowlift's own loop on what the server held: the pipeline's weights as InvokeAI loads them,
    # the Qwen3 conditioning its text encoder node stored, the latents its VAE encode made
    (conditioning,) = (server.root / "outputs" / "conditioning").glob(
        "tmp*/" + server.output(item, "prompt")["conditioning"]["conditioning_name"]
    )
    (latents_file,) = (server.root / "outputs" / "tensors").glob(
        "tmp*/" + server.output(item, "encode")["latents"]["latents_name"]
    )
    reference = tmp_path / "reference.safetensors"
    env = invokeai_env(PYTHONPATH=os.pathsep.join([str(shared / "comfyui-cpu-shim"), str(REPO_ROOT / "src")]))
    command = [
        str(invokeai_python()),
        str(REPO_ROOT / "tests" / "invokeai_klein_reference.py"),
        str(server.models / "klein-tiny"),
        str(conditioning),
        str(latents_file),
        str(reference),
        "64",
        "16",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = load_file(str(reference))["latents"]
    print(f"tiled node vs tiled_refine_raw_latents: max |diff| = {(refined['tiled'] - expected).abs().max():.2e}")
    torch.testing.assert_close(refined["tiled"], expected, rtol=0, atol=1e-4)

    picture = server.image(server.output(item, "decode")["image"]["image_name"])
    assert picture.size == (KLEIN_W, KLEIN_H) and picture.mode == "RGB"
    assert np.asarray(picture, np.float32).std() > 1.0  # not a constant image

    grid = tile_layout(KLEIN_H, KLEIN_W, 64, 16, 1).record()["grid"]
    assert grid[0] > 1 and grid[1] > 1, grid
    what = "flowlift: Tiled FLUX.2 Denoise (flowlift):"
    tiled_lines = server.log_lines(
        f"{what} {KLEIN_W}x{KLEIN_H} px refined in {grid[0]}x{grid[1]} tiles of 64x64 px, overlap 16 px, 1 per call"
    )
    assert len(tiled_lines) == 2, server.log_lines(what)  # the pipeline's transformer and the file's
    for asked in (str(KLEIN_W), "off"):
        assert server.log_lines(f"{what} {KLEIN_W}x{KLEIN_H} px refined untiled (tile size {asked})"), asked


def test_bad_inputs_fail_only_their_item_with_one_line(server):
    flux2_vae = vae_loader(server.flux2_vae)
    good = str(server.models / "flow_upscaler.safetensors")

    def latent_graph(latents_name: str, vae: dict, upscaler: str = good) -> dict:
        nodes = {
            "vae": vae,
            "up": {"type": "flowlift_upscale_latents", "latents": {"latents_name": latents_name}, "upscaler": upscaler},
        }
        return graph(nodes, [("vae", "vae", "up", "vae")])

    gen = torch.Generator().manual_seed(5)
    flux2 = server.put_tensor(torch.randn(1, 32, 8, 8, generator=gen), "Tensor_flowlift_flux2")
    sd = server.put_tensor(torch.randn(1, 4, 8, 8, generator=gen), "Tensor_flowlift_sd")
    nan = torch.randn(1, 32, 8, 8, generator=gen)
    nan[0, 3, 2, 2] = float("nan")
    nan = server.put_tensor(nan, "Tensor_flowlift_nan")
    wide = graph({"up": upscale_image_node(server, "wide.png", scale=8.0)}, [])
    dotfile = server.models / ".profile"

    # a 300 GB sparse file (issue 32.G) is refused before a byte is read (the item queued behind must not wait for
    # its hash), in the same words as a file that does not exist, telling nothing of what a file holds
    upscalers = {"corrupt": "corrupt.safetensors", "300 GB sparse": "big.safetensors", "dotfile": ".profile"}
    upscalers["missing"] = "missing.safetensors"
    cases = {
        f"{kind} upscaler": (
            latent_graph(flux2, flux2_vae, str(server.models / name)),
            ["cannot use", name, "expected the Flow Upscaler's weights"],
        )
        for kind, name in upscalers.items()
    }
    cases |= {
        "dotfile TAEF2": (
            graph({"up": upscale_image_node(server, "example.png", taef2=str(dotfile))}, []),
            ["TAEF2: cannot use", ".profile", "expected TAEF2's weights"],
        ),
        "wrong latent channels": (latent_graph(sd, flux2_vae), ["needs FLUX.2 latents", "(1, 4, 8, 8)"]),
        "NaN latents": (latent_graph(nan, flux2_vae), ["non-finite", "NaN"]),
        "SD-1 VAE": (latent_graph(flux2, vae_loader(server.sd15_vae)), ["needs a FLUX.2 VAE", "sd-1"]),
        "16K cap": (wide, ["16384 px cap", "2049x16"]),
        # the VAE's fetch hint in this door's words: its field, never the command line's --vae
        "uncached TAEF2 repo": (
            graph({"up": upscale_image_node(server, "example.png", taef2="nobody/no-taef2")}, []),
            ["cannot get nobody/no-taef2", "or set the TAEF2 field to a local path"],
        ),
        # a decode-only Mage-VAE file asked to encode: the same field named, not the command line's --vae taef2
        "decode-only Mage-VAE": (
            graph(
                {
                    "up": upscale_image_node(
                        server, "example.png", taef2=str(server.models / "mage_decoder.safetensors")
                    )
                },
                [],
            ),
            ["Mage-VAE", "is decode-only", "set the TAEF2 field to taef2"],
        ),
    }
    item_ids = {name: server.enqueue(g) for name, (g, _) in cases.items()}
    after = server.enqueue(latent_graph(flux2, flux2_vae))  # queued behind the failures: must still run
    refusals = set()
    for name, (_, expected) in cases.items():
        text = error_line(server.wait(item_ids[name]))
        assert all(part in text for part in expected), (name, text)
        assert "secret" not in text and "TOKEN" not in text and "operand" not in text, (name, text)
        assert "--vae" not in text and "CLI" not in text, (name, text)
        if name.endswith(" upscaler"):
            refusals.add(text.split(": expected ", 1)[1])
    assert len(refusals) == 1, refusals  # corrupt, huge, a dotfile or missing: one and the same line
    item = server.wait(after, timeout=60)
    assert item["status"] == "completed", item.get("error_message")
    sd_image = graph(
        {"vae": vae_loader(server.sd15_vae), "up": upscale_image_node(server, "example.png")},
        [("vae", "vae", "up", "vae")],
    )
    assert "needs a FLUX.2 VAE" in error_line(server.wait(server.enqueue(sd_image)))


def test_installed_models_are_preferred_over_server_paths(server):
    """Issue 32.G: like InvokeAI's own model fields, the nodes take the upscaler and TAEF2 from the model
    manager (installed as 'unknown' models) before the path fields, which then are not even looked at."""
    keys = ("key", "hash", "name", "base", "type")
    upscaler = server.install_model(server.models / "flow_upscaler.safetensors")
    taef2 = server.install_model(server.shared_taef2)
    print(f"installed as: upscaler {upscaler['type']}, TAEF2 {taef2['type']}")
    installed = upscale_image_node(
        server,
        "example.png",
        scale=2.0,
        seed=4,
        upscaler=str(server.models / "missing.safetensors"),
        taef2="/nonexistent/taef2",
        upscaler_model={k: upscaler[k] for k in keys},
        taef2_model={k: taef2[k] for k in keys},
    )
    by_path = upscale_image_node(server, "example.png", scale=2.0, seed=4)
    item = server.run(graph({"installed": installed, "path": by_path}, []))
    got = server.image_tensor(server.output(item, "installed")["image"]["image_name"])
    assert torch.equal(got, server.image_tensor(server.output(item, "path")["image"]["image_name"]))


def test_cancelling_a_running_item_stops_it(server):
    gen = torch.Generator().manual_seed(6)
    big = server.put_tensor(torch.randn(1, 32, 96, 96, generator=gen), "Tensor_flowlift_big")
    nodes = {
        "vae": vae_loader(server.flux2_vae),
        "up": {
            "type": "flowlift_upscale_latents",
            "latents": {"latents_name": big},
            "scale": 8.0,
            "upscaler": str(server.models / "flow_upscaler_b64.safetensors"),
            "chunked": "always",
        },
    }
    long_run = server.enqueue(graph(nodes, [("vae", "vae", "up", "vae")]))
    deadline = time.monotonic() + 120
    while server.item(long_run)["status"] != "in_progress":
        assert time.monotonic() < deadline, "the long item never started"
        time.sleep(0.1)
    time.sleep(1.0)  # inside the first pass's strips (the 8x run of a 96x96 latent takes minutes on a CPU)
    assert server.item(long_run)["status"] == "in_progress", "the run ended before the cancel: make it longer"
    started = time.monotonic()
    server.cancel(long_run)
    quick = server.enqueue(
        graph(
            {
                "fix": {
                    "type": "flowlift_color_fix",
                    "image": {"image_name": server.images["upscaled.png"]},
                    "reference": {"image_name": server.images["example.png"]},
                    "use_cache": False,
                }
            },
            [],
        )
    )
    item = server.wait(quick, timeout=60)
    took = time.monotonic() - started
    print(f"cancel: the next item completed {took:.2f} s after the cancel request")
    assert item["status"] == "completed", item.get("error_message")
    cancelled = server.item(long_run)
    assert cancelled["status"] == "canceled" and not cancelled.get("error_type")
    (prepared,) = cancelled["session"]["source_prepared_mapping"]["up"]
    assert prepared not in cancelled["session"]["results"], "the cancelled node must not produce an output"
    assert took <= 10.0, f"the cancelled node kept the queue busy for {took:.1f} s"
    assert not server.log_lines(f"Error while invoking session {cancelled['session_id']}")


def test_workflows_validate_against_this_server(server):
    schemas = server.request("GET", "/openapi.json")["components"]["schemas"]
    templates = {
        s["properties"]["type"]["default"]: s
        for s in schemas.values()
        if "properties" in s and "type" in s["properties"] and s.get("class") == "invocation"
    }
    files = sorted(WORKFLOWS.glob("*.json"))
    assert [f.name for f in files] == [
        "flux2_klein_hires_fix.json",
        "flux2_klein_tiled_hires_fix_4x.json",
        "image_upscale_4x.json",
    ]
    for file in files:
        workflow = json.loads(file.read_text())
        nodes = {node["id"]: node["data"] for node in workflow["nodes"]}
        for data in nodes.values():
            template = templates[data["type"]]
            assert data["version"] == template["version"], (file.name, data["type"])
            assert data["nodePack"] == template["node_pack"], (file.name, data["type"])
            assert set(data["inputs"]) <= set(template["properties"]), (file.name, data["type"], set(data["inputs"]))
        for edge in workflow["edges"]:
            source, target = nodes[edge["source"]], nodes[edge["target"]]
            output_type = templates[source["type"]]["output"]["$ref"].rsplit("/", 1)[-1]
            assert edge["sourceHandle"] in schemas[output_type]["properties"], (file.name, edge)
            assert edge["targetHandle"] in templates[target["type"]]["properties"], (file.name, edge)
        for field in workflow["exposedFields"]:
            assert field["fieldName"] in nodes[field["nodeId"]]["inputs"], (file.name, field)
        created = server.request("POST", "/api/v1/workflows/", {"workflow": workflow})  # the library's own check
        assert created["workflow"]["name"] == workflow["name"]


def test_workflows_load_in_the_web_page(server, headless_browser):
    from invokeai_browser import chrome, load_workflow

    driver = chrome()
    try:
        for path in sorted(WORKFLOWS.glob("*.json")):
            workflow = json.loads(path.read_text())
            said, nodes, edges = load_workflow(driver, server.url, path)
            assert "Workflow Loaded" in said and not [t for t in said if "Warning" in t or "rror" in t], said
            assert (nodes, edges) == (len(workflow["nodes"]), len(workflow["edges"])), path.name
    finally:
        driver.quit()


def test_the_tiled_denoise_node_inside_invokeais_python(shared):
    """The Tiled FLUX.2 Denoise node on InvokeAI's own classes (tests/invokeai_denoise_node_checks.py, in the
    InvokeAI venv): the transformer's LoRAs patched by InvokeAI's LayerPatcher equal them merged by hand and come
    off again, a cancel stops before the transformer's next call, a regional mask or a FLUX.1 transformer is one
    line."""
    env = invokeai_env(
        PYTHONPATH=os.pathsep.join([str(shared / "comfyui-cpu-shim"), str(REPO_ROOT / "src")]),
        FLOWLIFT_SHARED=str(shared),
    )
    checks = "tests/invokeai_denoise_node_checks.py"
    command = [str(invokeai_python()), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore", checks]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "3 passed" in result.stdout, result.stdout[-2000:]


def test_the_core_passes_under_invokeais_pins(shared):
    """flowlift's floors (diffusers>=0.40...) are what InvokeAI's pins give: the core's diffusers-facing
    tests run in the InvokeAI venv."""
    modules = ["tests/test_vae.py", "tests/test_denoiser.py", "tests/test_schedule.py"]
    env = invokeai_env(
        PYTHONPATH=os.pathsep.join([str(shared / "comfyui-cpu-shim"), str(REPO_ROOT / "src")]),
        FLOWLIFT_SHARED=str(shared),
    )
    command = [str(invokeai_python()), "-m", "pytest", "-q", "-p", "no:cacheprovider", *modules]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    versions = subprocess.run(
        [str(invokeai_python()), "-c", "import diffusers, numpy; print(diffusers.__version__, numpy.__version__)"],
        env=env,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert versions[0] == "0.40.0" and versions[1].startswith("1."), versions

"""Regenerate the ComfyUI assets: the UI-format workflows, their thumbnails and the docs screenshots.

Everything is made by a real ComfyUI 0.33 server with this pack (tests/comfy_server.py: temp copy,
random models, loopback) and its own frontend in headless Chromium (tests/comfy_frontend.py)::

    python benchmarks/train_mini.py --out /tmp/train_mini
    python docs/comfyui_screenshot.py \
        --upscaler /tmp/train_mini/run-64/checkpoints/step-00000600/flow_upscaler.safetensors

(options: ``--skip-thumbnails``, ``--skip-workflows``, ``--skip-screenshots``).

1. Thumbnails, ``example_workflows/<name>.jpg``: each API-format workflow (``example_workflows/api/``)
   run through the server on a Kodak image (a square region downsampled to the input size) with the
   real TAEF2 and the upscaler of ``--upscaler`` (without it: a randomly initialised full-size one,
   whose high band is noise). The committed thumbnails come from the command above: a small Flow
   Upscaler trained for 600 steps on the CPU by flowlift's own trainer, on images other than the
   thumbnails' kodim05 and kodim23. The released FLUX.2 VAE's weights are not here, so TAEF2 (the
   same latent space) stands in for it in the FLUX.2 latent workflow's run. That workflow has no
   stage 2 colour fix, and the small model's raw passes are soft, so its thumbnail is soft too. The
   side-by-side template's thumbnail is two panels on the same input: the Flow Upscaler stage (the Klein
   template's thumbnail: the same input and the same stage) and ComfyUI's latent bicubic 4x, both decoded by
   TAEF2 (PiD's weights are not here).
2. UI-format workflows, ``example_workflows/<name>.json``: each API copy loaded by the frontend
   (``app.loadApiJson``), every node sized so that its title and widgets are drawn whole at 100%
   (measured with the frontend's fonts), laid out left to right by :func:`layout_columns`, and written
   as the frontend serializes it (``JSON.stringify``, so absent fields stay absent instead of null).
3. Screenshots: Templates -> Extensions -> flowlift (``docs/comfyui_templates.png``) and each workflow
   opened from its card at 100% (``docs/comfyui_workflow.png`` for the FLUX.2 latent one,
   ``docs/comfyui_workflow_<name>.png`` for the others).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "tests"), str(REPO_ROOT / "src")]

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

import comfy_frontend as ui  # noqa: E402
from comfy_server import API_WORKFLOWS, PACK_NAME, WORKFLOWS, comfy_server, write_models_and_inputs  # noqa: E402
from comfy_venv import shared_dir  # noqa: E402
from flowlift.models.upscaler_unet import FlowUpscalerUNet  # noqa: E402
from flowlift.models.upscaler_weights import save_upscaler  # noqa: E402

DOCS = REPO_ROOT / "docs"
ORIGIN = (100, 130)  # clear of the frontend's floating menus at the top left
COLUMN_GAP, ROW_GAP = 60, 40
GRID = 10
#: Room for the output preview a Save Image node shows after a run.
SAVE_IMAGE_SIZE = (400, 420)
#: Per workflow: the Kodak image its thumbnail run starts from, and the square region of it.
THUMBNAIL_SOURCES = {
    "image_upscale_4x_taef2": ("kodim05.png", (128, 0, 640, 512)),
    "flux2_latent_upscale_4x": ("kodim23.png", (128, 0, 640, 512)),
    "color_fix": ("kodim15.png", (128, 0, 640, 512)),
    "flux2_klein_tiled_refine_4x": ("kodim13.png", (128, 0, 640, 512)),
    "flux2_hires_side_by_side": ("kodim13.png", (128, 0, 640, 512)),
}
#: The template whose Flow Upscaler stage the side-by-side thumbnail shows (the same input and stage).
SIDE_BY_SIDE, SAME_STAGE_AS = "flux2_hires_side_by_side", "flux2_klein_tiled_refine_4x"
#: Workflows whose FLUX.2 transformer has no weights here (Klein, its Qwen3 text encoder): the thumbnail run is
#: their flowlift stage alone on a Kodak image (TAEF2 encode -> the workflow's Flow Upscale Latent -> decode).
TRANSFORMER_LOADERS = ("UNETLoader", "CLIPLoader")
THUMBNAIL_INPUT = 128  # px a side; 4x gives a 512 px thumbnail
WINDOW = (2000, 1100)
#: Nodes a template saves muted (the API format has no such state): the side-by-side template's PiD branch, whose
#: weights few users have; muted, it opens without the frontend's missing-model errors and the rest runs. Ctrl+M on
#: the selected nodes enables it.
MUTED_NODES = {"flux2_hires_side_by_side": (17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30)}
MUTED = 2  # LiteGraph's mode "never"
#: Core nodes whose seed a template saves at "fixed" (flowlift's own nodes start there by themselves).
FIXED_SEED_NODES = ("KSampler", "SamplerCustom")
UUID_NAMESPACE = uuid.UUID("5b0e5a4e-3c1f-4f53-9a3e-0f1ee7f10f7e")


def layout_columns(
    sizes: dict[int, tuple[float, float]], links: list[tuple[int, int, int]], title_height: float
) -> dict[int, tuple[float, float]]:
    """Left-to-right positions for nodes of the given (width, height) sizes and (origin, target, target slot) links.

    Column of a node with inputs: one right of its rightmost input (longest path); a node without
    inputs (a loader, Load Image) sits one column left of its leftmost consumer, next to where it is
    used. Within a column, nodes are ordered as the inputs they feed in the nearest column (consumer's
    row, then input slot), so links do not cross; columns are as wide as their widest node, COLUMN_GAP
    apart, and nodes are stacked ROW_GAP apart below their title bars. Returns each node's ``pos`` (the body's top-left
    corner; LiteGraph draws the title bar above it).
    """
    inputs: dict[int, list[int]] = {node: [] for node in sizes}
    consumers: dict[int, list[tuple[int, int]]] = {node: [] for node in sizes}
    for origin, target, slot in links:
        inputs[target].append(origin)
        consumers[origin].append((target, slot))

    depth: dict[int, int] = {}

    def depth_of(node: int) -> int:
        if node not in depth:
            depth[node] = 1 + max((depth_of(o) for o in inputs[node]), default=-1)
        return depth[node]

    column = {node: depth_of(node) for node in sizes}
    for node in sizes:
        if not inputs[node] and consumers[node]:
            column[node] = max(0, min(column[t] for t, _ in consumers[node]) - 1)

    rank: dict[int, int] = {}
    for col in sorted(set(column.values()), reverse=True):  # consumers are ranked before their inputs
        members = [n for n in sizes if column[n] == col]
        nearest = {
            n: min(((column[t], rank[t], s) for t, s in consumers[n]), default=(math.inf, 0, 0)) for n in members
        }
        members.sort(key=lambda n: (nearest[n], n))
        rank.update({n: i for i, n in enumerate(members)})

    positions: dict[int, tuple[float, float]] = {}
    x = ORIGIN[0]
    for col in sorted(set(column.values())):
        members = sorted((n for n in sizes if column[n] == col), key=rank.__getitem__)
        y = ORIGIN[1]
        for node in members:
            positions[node] = (x, y)
            y += sizes[node][1] + title_height + ROW_GAP
        x += max(sizes[n][0] for n in members) + COLUMN_GAP
    return positions


def node_size(measured: dict) -> tuple[float, float]:
    """A size at which the frontend draws the node's title and widgets whole (whole grid steps)."""
    width = max(measured["size"][0], measured["min_size"][0], measured["title_width"], measured["widget_width"])
    height = max(measured["size"][1], measured["min_size"][1])
    if measured["type"] == "SaveImage":
        width, height = max(width, SAVE_IMAGE_SIZE[0]), max(height, SAVE_IMAGE_SIZE[1])
    return (math.ceil(width / GRID) * GRID, math.ceil(height / GRID) * GRID)


def ui_workflow(driver, api: dict, name: str) -> dict:
    """The UI-format workflow of an API-format one: the frontend's graph, sized and laid out."""
    # clean(): no state of the previous graph (image previews are kept by node id and would resize a node
    # of this graph with the same id); loading a template from the Templates browser does the same.
    driver.execute_script("window.app.clean(); return window.app.loadApiJson(arguments[0], arguments[1])", api, name)
    time.sleep(2)  # image previews load and resize their nodes
    measured = {m["id"]: m for m in ui.measure_nodes(driver)}
    graph = json.loads(driver.execute_script("return JSON.stringify(window.app.graph.serialize())"))
    sizes = {node_id: node_size(m) for node_id, m in measured.items()}
    links = [(link[1], link[3], link[4]) for link in graph["links"]]
    positions = layout_columns(sizes, links, driver.execute_script("return LiteGraph.NODE_TITLE_HEIGHT"))
    for node in graph["nodes"]:
        node["pos"] = list(positions[node["id"]])
        node["size"] = list(sizes[node["id"]])
    for node in graph["nodes"]:
        if node["type"] in FIXED_SEED_NODES:  # a template runs again as saved ("control after generate": fixed)
            values = node["widgets_values"]
            node["widgets_values"] = ["fixed" if v in ("randomize", "increment", "decrement") else v for v in values]
    for node in graph["nodes"]:
        if node["id"] in MUTED_NODES.get(name, ()):
            node["mode"] = MUTED
    graph["id"] = str(uuid.uuid5(UUID_NAMESPACE, name))  # a stable id per template (the API loader leaves zeros)
    graph["extra"] = {**graph.get("extra", {}), "ds": {"scale": 1, "offset": [0, 0]}}
    return graph


def write_thumbnail_inputs(root: Path, shared: Path, upscaler: Path | None) -> None:
    """The test models and inputs, ``upscaler`` (else a random full-size one) in place of the small one,
    and the thumbnail runs' inputs (``thumb_<name>.png``; the colour fix's drifted 2x ``thumb_color_fix_2x.png``)."""
    write_models_and_inputs(root, shared)
    target = root / "models" / "latent_upscale_models" / "flow_upscaler.safetensors"
    if upscaler is not None:
        shutil.copy(upscaler, target)
    else:
        import torch

        torch.manual_seed(0)
        save_upscaler(FlowUpscalerUNet().eval(), target)
    for name, (image, box) in THUMBNAIL_SOURCES.items():
        source = Image.open(shared / "images" / "kodak" / image).convert("RGB").crop(box)
        size = 2 * THUMBNAIL_INPUT if name == "color_fix" else THUMBNAIL_INPUT
        small = source.resize((size, size), Image.LANCZOS)
        small.save(root / "input" / f"thumb_{name}.png")
        if name == "color_fix":  # "another upscaler's" 2x with a colour cast, as the test input has
            drifted = np.asarray(small.resize((2 * size, 2 * size), Image.LANCZOS), dtype=np.float32)
            drifted = np.clip(drifted * [1.08, 1.0, 0.9] + [6, 0, -4], 0, 255).round().astype(np.uint8)
            Image.fromarray(drifted).save(root / "input" / "thumb_color_fix_2x.png")


def upscale_stage(api: dict) -> dict:
    """A workflow's Flow Upscale Latent node between TAEF2's encode (of a Load Image) and decode, saved."""
    (key,) = [key for key, node in api.items() if node["class_type"] == "FlowliftUpscaleLatent"]
    upscale = json.loads(json.dumps(api[key]))
    loader = api[upscale["inputs"]["upscaler"][0]]
    upscale["inputs"] |= {"upscaler": ["2", 0], "samples": ["4", 0]}
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "2": loader,
        "3": {"class_type": "FlowliftTAEF2Loader", "inputs": {"taef2_name": "taef2_encoder.pth"}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["3", 0]}},
        "5": upscale,
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["3", 0]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "thumbnails/stage"}},
    }


def bicubic_stage() -> dict:
    """ComfyUI's latent bicubic 4x between TAEF2's encode (of a Load Image) and decode, saved."""
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "3": {"class_type": "FlowliftTAEF2Loader", "inputs": {"taef2_name": "taef2_encoder.pth"}},
        "4": {"class_type": "VAEEncode", "inputs": {"pixels": ["1", 0], "vae": ["3", 0]}},
        "5": {"class_type": "LatentUpscaleBy", "inputs": {"samples": ["4", 0], "upscale_method": "bicubic",
                                                          "scale_by": 4.0}},
        "6": {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["3", 0]}},
        "7": {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": "thumbnails/bicubic"}},
    }  # fmt: skip


def side_by_side_thumbnail(server, flow_upscaler: Path) -> Image.Image:
    """The Flow Upscaler panel (``flow_upscaler``: the same input's Flow Upscaler stage) beside ComfyUI's latent
    bicubic 4x run now, each cut to its middle half, with a white gap."""
    workflow = bicubic_stage()
    workflow["1"]["inputs"]["image"] = f"thumb_{SIDE_BY_SIDE}.png"
    entry = server.run(workflow)
    with Image.open(server.output_file(entry, "7")) as bicubic, Image.open(flow_upscaler) as flow:
        panels = [image.convert("RGB") for image in (flow, bicubic)]
    width, height = panels[0].size
    out = Image.new("RGB", (width + 8, height), "white")
    for i, panel in enumerate(panels):
        out.paste(panel.crop((width // 4, 0, width // 4 + width // 2, height)), (i * (width // 2 + 8), 0))
    return out


def thumbnail_run(api: dict, name: str) -> tuple[dict, str]:
    """The API workflow pointed at the thumbnail inputs (TAEF2 for the FLUX.2 VAE; only the flowlift stage where
    the transformer has no weights here, :data:`TRANSFORMER_LOADERS`); returns it and its Save node."""
    if any(node["class_type"] in TRANSFORMER_LOADERS for node in api.values()):
        api = upscale_stage(api)
    workflow = json.loads(json.dumps(api))
    for node in workflow.values():
        if node["class_type"] == "LoadImage":
            node["inputs"]["image"] = f"thumb_{name}.png"
        if node["class_type"] == "VAELoader":  # no FLUX.2 VAE weights here: TAEF2 is the same latent space
            node["class_type"], node["inputs"] = "FlowliftTAEF2Loader", {"taef2_name": "taef2_encoder.pth"}
    if name == "color_fix":
        workflow["1"]["inputs"]["image"] = "thumb_color_fix_2x.png"
    (save,) = [key for key, node in workflow.items() if node["class_type"] == "SaveImage"]
    return workflow, save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upscaler", type=Path, help="Flow Upscaler checkpoint of the thumbnail runs")
    parser.add_argument("--skip-thumbnails", action="store_true")
    parser.add_argument("--skip-workflows", action="store_true")
    parser.add_argument("--skip-screenshots", action="store_true")
    parser.add_argument(
        "--side-by-side-thumbnail",
        action="store_true",
        help="with --skip-thumbnails: still make the side-by-side one (from the committed Klein one)",
    )
    args = parser.parse_args()
    apis = {path.stem: json.loads(path.read_text()) for path in sorted(API_WORKFLOWS.glob("*.json"))}

    write_files = functools.partial(write_thumbnail_inputs, upscaler=args.upscaler)
    with tempfile.TemporaryDirectory() as tmp, comfy_server(Path(tmp), shared_dir(), write_files) as server:
        if not args.skip_thumbnails:
            for name, api in apis.items():
                if name == SIDE_BY_SIDE:
                    continue  # after the template whose stage it shows
                workflow, save = thumbnail_run(api, name)
                started = time.monotonic()
                entry = server.run(workflow)
                with Image.open(server.output_file(entry, save)) as image:
                    image.convert("RGB").save(WORKFLOWS / f"{name}.jpg", quality=88, optimize=True)
                print(f"wrote {WORKFLOWS / f'{name}.jpg'} (run {time.monotonic() - started:.1f} s)")
        if not args.skip_thumbnails or args.side_by_side_thumbnail:
            image = side_by_side_thumbnail(server, WORKFLOWS / f"{SAME_STAGE_AS}.jpg")
            image.save(WORKFLOWS / f"{SIDE_BY_SIDE}.jpg", quality=88, optimize=True)
            print(f"wrote {WORKFLOWS / f'{SIDE_BY_SIDE}.jpg'}")
        server.request("/settings/Comfy.TutorialCompleted", True)  # no template browser on the first visit
        with ui.chromium(*WINDOW) as driver:
            ui.open_app(driver, server.url)
            if not args.skip_workflows:
                for name, api in apis.items():
                    graph = ui_workflow(driver, api, name)
                    (WORKFLOWS / f"{name}.json").write_text(json.dumps(graph, indent=1) + "\n")
                    print(f"wrote {WORKFLOWS / f'{name}.json'}")
            if not args.skip_screenshots:
                ui.open_app(driver, server.url)  # a fresh page, as a user opens it
                names = ui.open_templates_of(driver, PACK_NAME)
                deadline = time.monotonic() + 30
                sizes = {name: Image.open(WORKFLOWS / f"{name}.jpg").size for name in names}
                while not ui.thumbnails_loaded(driver, sizes) and time.monotonic() < deadline:
                    time.sleep(0.5)
                driver.save_screenshot(str(DOCS / "comfyui_templates.png"))
                print(f"wrote {DOCS / 'comfyui_templates.png'}")
                for name in apis:
                    ui.open_template(driver, PACK_NAME, name)
                    width, height = ui.show_at_100_percent(driver)
                    driver.set_window_size(max(WINDOW[0], width + 250), max(WINDOW[1], height + 300))  # all of it
                    time.sleep(1)
                    out = DOCS / (
                        "comfyui_workflow.png" if name == "flux2_latent_upscale_4x" else f"comfyui_workflow_{name}.png"
                    )
                    driver.save_screenshot(str(out))
                    driver.set_window_size(*WINDOW)
                    print(f"wrote {out}")


if __name__ == "__main__":
    main()

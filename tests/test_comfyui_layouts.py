"""The node pack's pure layout conversions and input checks (no ComfyUI needed), and its packaging."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
import torch.nn.functional as F
from PIL import Image

from comfy_frontend import overlaps
from door_helpers import COMFY_WIDGET_ORDER
from flowlift.comfyui import layouts as L
from flowlift.errors import FlowliftError
from flowlift.flux2.latents import patchify
from flowlift.upscale import node_choices as choices

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Which of the nodes' inputs (door_helpers.COMFY_WIDGET_ORDER) are widgets (the others are links).
WIDGET_INPUTS = {"scale", "seed", "transplant_strength", "color_fix_strength", "chunked", "strength"}


def test_scale_and_chunking_widgets():
    assert [choices.image_plan(s, 48, 32) for s in (2, 4, 8)] == [(1, None), (2, None), (3, None)]
    assert choices.image_plan(3, 48, 32) == (2, (144, 96)) and choices.image_plan(1.5, 48, 32) == (1, (72, 48))
    assert [choices.latent_plan(s, 4, 6) for s in (2.0, 4, 8)] == [(1, None), (2, None), (3, None)]
    assert [choices.chunked_flag(c) for c in choices.CHUNKING] == [None, True, False]
    with pytest.raises(FlowliftError, match=r"scale must be in \[1, 8\]"):
        choices.image_plan(9, 48, 32)
    with pytest.raises(FlowliftError, match="a latent upscale runs whole 2x passes"):
        choices.latent_plan(3, 4, 6)


def test_with_a_latent_upscaler_the_image_nodes_plan_the_passes_below_the_fraction():
    # issue 46.3: the packs' image nodes plan as `flowlift upscale --latent-upscaler` does: the passes below the
    # factor, SesquiLSR after them (1.5x: none; 3x: one then 1.5x; 6x: two), the powers of two unchanged
    plan = [choices.image_plan(s, 48, 32, fraction_last=True) for s in (1.5, 3, 6, 2, 4, 8)]
    assert plan == [(0, (72, 48)), (1, (144, 96)), (2, (288, 192)), (1, None), (2, None), (3, None)]


@pytest.mark.parametrize("channels", [4, 16, 32])
def test_non_flux2_latent_is_one_clear_error(channels):
    with pytest.raises(FlowliftError, match=r"needs a FLUX.2 LATENT \(batch, 128, h, w\)") as info:
        L.flux2_latents({"samples": torch.zeros(1, channels, 8, 8)}, "FlowliftUpscaleLatent")
    assert f"(1, {channels}, 8, 8)" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(FlowliftError, match="got samples of shape"):
        L.flux2_latents({"samples": torch.zeros(1, 128, 2, 8, 8)}, "FlowliftUpscaleLatent")


def test_latent_round_trip_keeps_batch_index_and_resizes_the_mask():
    latents = torch.randn(2, 32, 8, 12)
    samples = patchify(latents)
    mask = torch.zeros(2, 1, 64, 96)
    mask[:, :, :32] = 1.0
    latent = {"samples": samples, "batch_index": [3, 4], "noise_mask": mask}
    assert torch.equal(L.flux2_latents(latent, "x"), latents)
    upscaled = torch.randn(2, 32, 32, 48)  # two passes
    out = L.upscaled_latent_dict(latent, upscaled, "cpu")
    assert torch.equal(out["samples"], patchify(upscaled)) and out["batch_index"] == [3, 4]
    assert out["noise_mask"].shape == (2, 1, 256, 384)
    assert out["noise_mask"][:, :, :120].min() == 1 and out["noise_mask"][:, :, 136:].max() == 0
    assert latent["samples"] is samples  # the input dict is not modified
    # a latent upscaler's 1.5x (8x12 -> 12x18 latents): the mask's sides scale alike (64x96 -> 96x144)
    fraction = L.upscaled_latent_dict(latent, torch.randn(2, 32, 12, 18), "cpu")
    assert fraction["noise_mask"].shape == (2, 1, 96, 144)
    assert fraction["noise_mask"][:, :, :44].min() == 1 and fraction["noise_mask"][:, :, 52:].max() == 0


def test_image_layouts_and_reference_matching():
    image = torch.rand(2, 16, 24, 4)  # NHWC with alpha
    nchw = L.image_to_nchw(image)
    assert nchw.shape == (2, 3, 16, 24) and torch.equal(nchw[:, 1], image[..., 1])
    assert torch.equal(L.nchw_to_image(nchw, "cpu"), image[..., :3])
    one = torch.rand(1, 3, 8, 12)
    assert L.matched_reference(nchw, one).shape == (2, 3, 8, 12)
    with pytest.raises(FlowliftError, match="integer multiple of the reference"):
        L.matched_reference(nchw, torch.rand(1, 3, 7, 6))
    with pytest.raises(FlowliftError, match="same integer scale on both axes"):  # 2x by 3x
        L.matched_reference(nchw, torch.rand(1, 3, 8, 8))
    with pytest.raises(FlowliftError, match="reference's own size"):
        L.matched_reference(nchw, nchw[:1])
    with pytest.raises(FlowliftError, match="3 reference images for 2 images"):
        L.matched_reference(nchw, torch.rand(3, 3, 8, 12))


def test_requirements_txt_is_pyproject_minus_torch():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    expected = [d for d in project["project"]["dependencies"] if not re.match(r"torch\b", d)]
    lines = [ln.strip() for ln in (REPO_ROOT / "requirements.txt").read_text().splitlines()]
    assert [ln for ln in lines if ln and not ln.startswith("#")] == expected
    assert project["tool"]["comfy"]["PublisherId"] and project["tool"]["comfy"]["DisplayName"]


def test_pyproject_has_what_the_comfy_registry_reads():
    """issue 45: [project] name, version and a Repository URL, [tool.comfy] PublisherId, DisplayName and an Icon
    URL that names a square image of at most 400 px in this repository (on the Repository's main branch)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    meta, comfy = project["project"], project["tool"]["comfy"]
    assert meta["name"] == "flowlift" and re.fullmatch(r"\d+\.\d+\.\d+", meta["version"])
    repository = meta["urls"]["Repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repository), repository
    assert re.fullmatch(r"[a-z][a-z0-9-]*", comfy["PublisherId"]) and comfy["DisplayName"]
    owner_repo = repository.removeprefix("https://github.com/")
    prefix = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    assert comfy["Icon"].startswith(prefix), comfy["Icon"]
    with Image.open(REPO_ROOT / comfy["Icon"].removeprefix(prefix)) as icon:
        assert icon.width == icon.height <= 400, icon.size


# --------------------------------------------------------------------------------------------------
# numeric inputs (issue 22: a NaN strength gave an all-black image with status success)


NUMERIC_CASES = [(node, name) for node, inputs in L.NUMERIC_INPUTS.items() for name in inputs]


@pytest.mark.parametrize(("node", "name"), NUMERIC_CASES)
def test_every_numeric_input_refuses_non_finite_out_of_range_and_non_numbers(node, name):
    low, high, integer = L.NUMERIC_INPUTS[node][name]
    bad = [math.nan, math.inf, -math.inf, low - 1, high + 1, "0.5", None, True, torch.tensor(0.5)]
    bad += [0.5, 2.0] if integer else [np.float32("nan")]
    for value in bad:
        with pytest.raises(FlowliftError) as info:
            L.check_numbers(node, **{name: value})
        text = str(info.value)
        assert text.startswith(f"{node}: {name} must be") and repr(value) in text and "\n" not in text, text
    good = [low, high, np.int64(1) if integer else np.float32((low + high) / 2)]
    for value in good:
        checked = L.check_numbers(node, **{name: value})[name]
        assert checked == value and type(checked) is (int if integer else float)


def test_an_rgba_image_keeps_its_alpha_resized_as_every_door_resizes_it():
    # the nodes dropped the fourth channel of core JoinImageWithAlpha's IMAGE; the CLI and InvokeAI keep alpha
    from flowlift.files.alpha import attach_alpha
    from flowlift.files.sixteen_bit import resize_alpha16

    gen = torch.Generator().manual_seed(3)
    image = torch.rand(2, 16, 24, 4, generator=gen)
    rows, columns = torch.meshgrid(torch.arange(16.0), torch.arange(24.0), indexing="ij")
    image[1, ..., 3] = ((rows - 8) ** 2 + (columns - 12) ** 2 < 30).float()  # a hard-edged disc: Lanczos rings
    image[0, ..., 3] = columns / 23  # a smooth ramp
    alpha = L.image_alpha(image, "the image")
    assert torch.equal(alpha, image[..., 3]) and L.image_alpha(image[..., :3]) is None
    same = L.nchw_to_image(L.image_to_nchw(image), "cpu", alpha)  # the colour fix: the image's own size
    assert same.shape == (2, 16, 24, 4) and torch.equal(same, image)
    upscaled = torch.rand(2, 3, 48, 72, generator=gen)
    out = L.nchw_to_image(upscaled, "cpu", alpha)
    assert out.shape == (2, 48, 72, 4) and torch.equal(out[..., :3], upscaled.movedim(1, -1))
    for i in range(2):  # the CLI's Lanczos in float, as on a 16-bit alpha (resize_alpha16)
        sixteen = resize_alpha16(alpha[i].mul(65535).round().numpy().astype(np.uint16), (72, 48)) / 65535.0
        assert np.abs(out[i, ..., 3].numpy() - sixteen).max() <= 1 / 65535
    for i in range(2):  # and on 8 bits (attach_alpha), the hard edge too: one rounding apart
        eight_bit = Image.fromarray(alpha[i].mul(255).round().to(torch.uint8).numpy(), "L")
        expected = np.asarray(attach_alpha(Image.new("RGB", (72, 48)), eight_bit))[..., 3] / 255.0
        assert np.abs(out[i, ..., 3].numpy() - expected).max() <= 1 / 255
    assert out[1, ..., 3].min() == 0.0 and out[1, ..., 3].max() == 1.0  # the rings past the ends: clamped
    with pytest.raises(FlowliftError, match=r"^the image: expected a ComfyUI IMAGE of shape .*3 or 4\), got"):
        L.image_alpha(torch.rand(1, 8, 8, 5), "the image")


def test_comfyuis_bicubic_overshoot_is_clamped_and_a_0_255_image_is_one_line():
    # ImageScale / ImageScaleBy "bicubic" is torch's bicubic, unclamped: FlowliftUpscaleImage refused such an image
    # ("pass uint8 ... or divide by 255") while FlowliftColorFix took it as it was
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(20):  # the kernel's worst case, (1.1875^2 + 0.1875^2) - 1, on random binary patterns
        binary = (torch.rand(1, 3, 32, 32, generator=gen) > 0.5).float()
        for size in ((48, 48), (45, 45), (17, 17)):
            resized = F.interpolate(binary, size=size, mode="bicubic")
            worst = max(worst, float(resized.max()) - 1, -float(resized.min()))
    assert 0.25 < worst <= L.IMAGE_OVERSHOOT  # 0.25 would refuse ComfyUI's own resize of a [0, 1] image
    photo = torch.rand(1, 3, 16, 24, generator=gen)
    image = F.interpolate(photo, size=(40, 60), mode="bicubic").movedim(1, -1)
    image[0, 0, 0, :] = torch.tensor([1.3, -0.2, 0.5])
    kept = image.clone()
    nchw = L.image_to_nchw(image, "FlowliftColorFix: the image input")
    assert torch.equal(nchw, image.clamp(0, 1).movedim(-1, 1)) and torch.equal(image, kept)  # the input untouched
    rgba = torch.cat([image.clamp(0, 1), torch.full((1, 40, 60, 1), 1.2)], -1)
    assert torch.equal(L.image_alpha(rgba, "x"), torch.ones(1, 40, 60))
    with pytest.raises(FlowliftError) as caught:
        L.image_to_nchw(image * 255, "FlowliftUpscaleImage: the image input")
    text = str(caught.value)
    assert text.startswith("FlowliftUpscaleImage: the image input has values in [") and "\n" not in text
    assert "a ComfyUI IMAGE is 0..1" in text and "0..255 pixels" in text and "divide" not in text
    with pytest.raises(FlowliftError, match=r"^x's alpha has values in \[255, 255\]"):
        L.image_alpha(torch.cat([image.clamp(0, 1), torch.full((1, 40, 60, 1), 255.0)], -1), "x")
    with pytest.raises(FlowliftError, match="is empty"):
        L.image_to_nchw(torch.rand(1, 0, 8, 3), "x")


def test_nan_pixels_and_latents_are_one_clear_error():
    image = torch.rand(1, 8, 8, 3)
    image[0, 3, 4, 1] = math.nan
    with pytest.raises(
        FlowliftError,
        match=r"^FlowliftColorFix: the image input contains non-finite values \(NaN/Inf\); check the node that "
        r"produced it$",
    ):
        L.image_to_nchw(image, "FlowliftColorFix: the image input")
    samples = torch.zeros(1, 128, 4, 4)
    samples[0, 5, 1, 1] = math.inf
    with pytest.raises(FlowliftError, match="FlowliftUpscaleLatent: the LATENT contains non-finite values"):
        L.flux2_latents({"samples": samples}, "FlowliftUpscaleLatent")


# --------------------------------------------------------------------------------------------------
# the shipped workflows (issue 21): UI format at the top (ComfyUI's Templates), API copies in api/

WORKFLOWS = REPO_ROOT / "example_workflows"
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
#: LiteGraph.NODE_TITLE_HEIGHT: a node's title bar is drawn above its ``pos``.
TITLE_HEIGHT = 30
MIN_GAP = 20


def api_copy(path: Path) -> dict:
    return json.loads((WORKFLOWS / "api" / path.name).read_text())


def test_every_ui_workflow_has_an_api_copy_with_the_same_graph():
    assert [p.name for p in UI_FILES] == sorted(p.name for p in (WORKFLOWS / "api").glob("*.json"))
    assert len(UI_FILES) == 5
    for path in UI_FILES:
        ui, api = json.loads(path.read_text()), api_copy(path)
        assert isinstance(ui["version"], (int, float)) and ui["version"] > 0, path.name
        nodes = {str(n["id"]): n for n in ui["nodes"]}
        assert {k: n["type"] for k, n in nodes.items()} == {k: n["class_type"] for k, n in api.items()}, path.name
        assert ui["last_node_id"] >= max(n["id"] for n in ui["nodes"])
        assert ui["last_link_id"] >= max(link[0] for link in ui["links"])
        expected_links = set()
        for node_id, node in api.items():
            title = node["_meta"]["title"]  # the frontend saves a title only where it is not the node's own name
            assert nodes[node_id].get("title", title) == title, (path.name, node_id)
            literals = [v for v in node["inputs"].values() if not isinstance(v, list)]
            values = iter(nodes[node_id].get("widgets_values", []))
            assert all(any(v == w for w in values) for v in literals), (path.name, node_id)  # in order
            expected_links |= {(int(v[0]), v[1], int(node_id)) for v in node["inputs"].values() if isinstance(v, list)}
        got_links = set()
        for link_id, origin, origin_slot, target, target_slot, _type in ui["links"]:
            assert nodes[str(target)]["inputs"][target_slot]["link"] == link_id
            assert link_id in nodes[str(origin)]["outputs"][origin_slot]["links"]
            got_links.add((origin, origin_slot, target))
        assert got_links == expected_links, path.name


def nulls(value: object, where: str = "") -> list[str]:
    """Paths of every null in a JSON value."""
    if value is None:
        return [where]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{where}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{where}[{i}]")]
    return []


def test_ui_workflows_have_nulls_only_where_the_frontend_schema_allows_them():
    # The frontend's zod schema allows null only for an input's link and an output's links; a null at
    # floatingLinks, extra.reroutes, definitions or slot_index made it refuse the whole workflow.
    allowed = re.compile(r"^\.nodes\[\d+\]\.(inputs\[\d+\]\.link|outputs\[\d+\]\.links)$")
    for path in UI_FILES:
        found = [p for p in nulls(json.loads(path.read_text())) if not allowed.match(p)]
        assert not found, (path.name, found)


def test_ui_workflows_are_laid_out_left_to_right_without_overlaps():
    for path in UI_FILES:
        ui = json.loads(path.read_text())
        boxes = {
            f"{n['id']} {n['type']}": (
                n["pos"][0],
                n["pos"][1] - TITLE_HEIGHT,
                n["size"][0],
                n["size"][1] + TITLE_HEIGHT,
            )
            for n in ui["nodes"]
        }
        assert not overlaps(boxes, gap=MIN_GAP), (path.name, overlaps(boxes, gap=MIN_GAP))
        nodes = {n["id"]: n for n in ui["nodes"]}
        for _link, origin, _slot, target, _tslot, _type in ui["links"]:
            a, b = nodes[origin], nodes[target]
            assert a["pos"][0] + a["size"][0] + MIN_GAP <= b["pos"][0], (path.name, a["type"], b["type"])
        assert ui["extra"]["ds"]["scale"] == 1  # opens at 100%


def test_ui_workflows_start_with_fixed_seeds():
    found = 0
    for path in UI_FILES:
        for node in json.loads(path.read_text())["nodes"]:
            widgets = [name for name in COMFY_WIDGET_ORDER.get(node["type"], []) if name in WIDGET_INPUTS]
            if "seed" in widgets:  # the frontend stores "control after generate" right after the seed
                values = node["widgets_values"]
                assert values[widgets.index("seed") + 1] == "fixed", (path.name, node["type"], values)
                found += 1
    assert found == 4  # the side-by-side template has one Flow Upscale Latent too


def test_every_template_has_a_thumbnail_from_a_real_run():
    pixels = {}
    for path in UI_FILES:
        thumbnail = path.with_suffix(".jpg")  # the name and format ComfyUI's Templates browser asks for
        with Image.open(thumbnail) as image:
            assert image.format == "JPEG" and min(image.size) >= 256, thumbnail.name
            array = np.asarray(image.convert("RGB"))
        colours = np.unique(array.astype(np.int32) @ np.array([1 << 16, 1 << 8, 1], dtype=np.int32))
        assert array.std() > 20 and len(colours) > 5000, thumbnail.name  # a photo, not a flat placeholder
        pixels[path.stem] = array.astype(np.float32)
    first, *others = pixels.values()
    assert all(o.shape != first.shape or np.abs(o - first).mean() > 10 for o in others)


def test_the_side_by_side_template_opens_with_pids_branch_muted():
    """PiD's weights are optional: its branch (everything only PiD's Save Image needs) is saved muted, so the template
    opens without missing-model errors and the Flow Upscaler and bicubic paths run; Ctrl+M enables it."""
    ui = json.loads((WORKFLOWS / "flux2_hires_side_by_side.json").read_text())
    api = api_copy(WORKFLOWS / "flux2_hires_side_by_side.json")
    needed: set[str] = set()

    def inputs_of(key: str) -> None:
        needed.add(key)
        for value in api[key]["inputs"].values():
            if isinstance(value, list):
                inputs_of(str(value[0]))

    saves = {key: "pid" in n["inputs"]["filename_prefix"] for key, n in api.items() if n["class_type"] == "SaveImage"}
    for key in (k for k, is_pid in saves.items() if is_pid):
        inputs_of(key)
    pid, needed = needed, set()
    for key in (k for k, is_pid in saves.items() if not is_pid):
        inputs_of(key)
    muted = {str(n["id"]) for n in ui["nodes"] if n.get("mode") == 2}
    assert muted == pid - needed and "17" in muted, sorted(muted)

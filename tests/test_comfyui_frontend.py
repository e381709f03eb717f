"""The shipped workflows in ComfyUI 0.33's own frontend (1.49), in headless Chromium, as a user meets them.

The session's server (tests/comfy_server.py, loopback, stopped at the end) and one browser session for the
module. A template is opened the way a user opens it (Templates -> Extensions -> flowlift -> card);
then the frontend's state is read: toasts (the zod-schema alert, "links fixed" notices), console
warnings and errors, the graph (node boxes with their title bars, links, widget values) and every text
the canvas draws at 100%, so that an overlap, a right-to-left link or a truncated title fails here.
"""

from __future__ import annotations

import json
import time

import pytest
from PIL import Image

import comfy_frontend as ui
from comfy_server import PACK_NAME, WORKFLOWS, session_server

WINDOW = (3100, 1500)  # the widest and tallest template (the side-by-side one) is ~2900 x 1250 px at 100%
NAMES = sorted(path.stem for path in WORKFLOWS.glob("*.json"))
THUMBNAIL_SIZES = {name: Image.open(WORKFLOWS / f"{name}.jpg").size for name in NAMES}
SEEDED = ("FlowliftUpscaleLatent", "FlowliftUpscaleImage")
MIN_GAP = 10  # px between node boxes (title bars included) in the live graph
MUTED = 2  # LiteGraph's mode "never"
SIDE_BY_SIDE, PID_WEIGHTS = "flux2_hires_side_by_side", "pid_flux2_512_to_2048_4step_bf16.safetensors"


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, shared):
    """The session's ComfyUI 0.33 server with this pack (tests/comfy_server.py), shared by the pack's test modules."""
    return session_server(request.config, tmp_path_factory, shared)


@pytest.fixture(scope="module")
def page(server, headless_browser):
    """One Chromium on the server's page; the page-load console noise (404s of optional files) is drained."""
    # The shared server's history may hold other modules' prompts with NaN inputs (the NaN checks): ComfyUI's jobs
    # API writes them as bare NaN, which frontend 1.49 cannot parse ("[Jobs API] Error fetching jobs").
    server.request("/history", {"clear": True})
    with ui.chromium(*WINDOW) as driver:
        ui.open_app(driver, server.url)
        ui.console_problems(driver)
        yield driver


def problems(driver) -> list[str]:
    """Toasts, the frontend's "N errors found" notices (e.g. missing models) and console warnings and errors."""
    notices = [f"notice: {text}" for text in ui.error_notices(driver)]
    return [f"toast: {text}" for text in ui.toasts(driver)] + notices + ui.console_problems(driver)


def test_the_templates_api_serves_every_workflow_and_its_thumbnail(server):
    listed = server.request("/workflow_templates")
    assert {pack: sorted(names) for pack, names in listed.items()} == {PACK_NAME: NAMES}
    for name in NAMES:
        body, kind = server.fetch(f"/api/workflow_templates/{PACK_NAME}/{name}.jpg")
        assert kind == "image/jpeg" and body == (WORKFLOWS / f"{name}.jpg").read_bytes(), name
        body, _ = server.fetch(f"/api/workflow_templates/{PACK_NAME}/{name}.json")
        assert json.loads(body) == json.loads((WORKFLOWS / f"{name}.json").read_text())


def test_every_template_opens_from_the_templates_browser_cleanly(server, page, tmp_path):
    assert sorted(ui.open_templates_of(page, PACK_NAME)) == NAMES
    deadline = time.monotonic() + 60
    while not ui.thumbnails_loaded(page, THUMBNAIL_SIZES):
        assert time.monotonic() < deadline, "the template cards do not show their thumbnails"
        time.sleep(0.25)
    assert not problems(page)  # a missing thumbnail is a 404 and a "Failed to cache media" warning

    for name in NAMES:
        ui.open_template(page, PACK_NAME, name)
        page.save_screenshot(str(tmp_path / f"{name}.png"))  # kept by pytest for a failure's inspection
        assert not problems(page), name  # e.g. "Invalid workflow against zod schema ..." or "Workflow Links Fixed"

        saved = json.loads((WORKFLOWS / f"{name}.json").read_text())
        state = ui.graph_state(page)
        nodes = {node["id"]: node for node in state["nodes"]}
        assert {i: n["type"] for i, n in nodes.items()} == {n["id"]: n["type"] for n in saved["nodes"]}, name
        # frontend 1.49 opens a template fitted to the view (its saved view is for Workflow -> Open): all of it shown
        vx, vy, vw, vh = state["visible"]
        for node in state["nodes"]:
            x, y, w, h = node["bounding"]
            inside = vx <= x and vy <= y and x + w <= vx + vw and y + h <= vy + vh
            assert inside, (name, node["title"], state["visible"])
        muted = {n["id"] for n in state["nodes"] if n["mode"] == MUTED}
        assert muted == {n["id"] for n in saved["nodes"] if n.get("mode") == MUTED}, name
        if name == SIDE_BY_SIDE:  # PiD's branch opens muted, its weights absent here: no missing-model notice
            loaders = {n["widgets"].get("unet_name"): n["id"] for n in state["nodes"] if n["type"] == "UNETLoader"}
            assert loaders[PID_WEIGHTS] in muted
            assert not any(path.name == PID_WEIGHTS for path in (server.root / "models").rglob("*"))
        for node in state["nodes"]:
            if node["type"] in SEEDED:
                assert node["widgets"]["control_after_generate"] == "fixed", (name, node["type"])

        boxes = {f"{n['id']} {n['title']}": tuple(n["bounding"]) for n in state["nodes"]}
        assert not ui.overlaps(boxes, gap=MIN_GAP), (name, ui.overlaps(boxes, gap=MIN_GAP))
        for origin, target in state["links"]:
            a, b = nodes[origin]["bounding"], nodes[target]["bounding"]
            assert a[0] + a[2] < b[0], (name, nodes[origin]["title"], nodes[target]["title"])

        width, height = ui.show_at_100_percent(page)
        assert width + 150 < WINDOW[0] and height + 200 < WINDOW[1], (name, width, height)  # all of it drawn
        texts = ui.drawn_texts(page)
        for node in state["nodes"]:
            assert node["title"] in texts, (name, node["title"])
        truncated = [t for t in texts if any(mark in t for mark in ui.TRUNCATION_MARKS)]
        assert not truncated, (name, truncated)


def test_new_nodes_start_with_a_fixed_seed_and_a_saved_choice_is_kept(page):
    controls = page.execute_script(
        """
        return arguments[0].concat(['KSampler']).map(type => {
          const node = LiteGraph.createNode(type);
          return [type, node.widgets.find(w => w.name === 'control_after_generate').value];
        });
        """,
        list(SEEDED),
    )
    assert controls == [[t, "fixed"] for t in SEEDED] + [["KSampler", "randomize"]]  # core nodes untouched

    saved = json.loads((WORKFLOWS / "image_upscale_4x_taef2.json").read_text())
    (node,) = [n for n in saved["nodes"] if n["type"] == "FlowliftUpscaleImage"]
    node["widgets_values"][2] = "randomize"  # a user's own choice, saved in their workflow
    value = page.execute_script(
        """
        await window.app.loadGraphData(arguments[0], true, true, 'mine');
        const node = window.app.graph._nodes.find(n => n.type === 'FlowliftUpscaleImage');
        return node.widgets.find(w => w.name === 'control_after_generate').value;
        """,
        saved,
    )
    assert value == "randomize"
    assert not problems(page)


def test_run_twice_gives_the_same_seed_and_image(server, page):
    ui.open_template(page, PACK_NAME, "image_upscale_4x_taef2")
    before = set(server.request("/history"))
    for run in (1, 2):
        page.execute_script(
            "Array.from(document.querySelectorAll('button')).find(b => b.textContent.trim() === 'Run').click()"
        )
        deadline = time.monotonic() + 120
        while len(set(server.request("/history")) - before) < run:
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.25)
    entries = [server.wait(prompt_id) for prompt_id in set(server.request("/history")) - before]
    assert [e["status"]["status_str"] for e in entries] == ["success", "success"]
    seeds = {e["prompt"][2]["4"]["inputs"]["seed"] for e in entries}
    assert seeds == {0}  # the saved seed, unchanged by "control after generate"
    seed = page.execute_script(
        "return window.app.graph._nodes.find(n => n.type === 'FlowliftUpscaleImage')"
        ".widgets.find(w => w.name === 'seed').value"
    )
    assert seed == 0
    assert not problems(page)

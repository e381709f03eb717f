"""ComfyUI's own frontend (the comfyui_frontend_package of the server's venv) in headless Chromium.

Used by tests/test_comfyui_frontend.py and docs/comfyui_screenshot.py: Debian's chromium and
chromedriver through Selenium; the page is driven the way a user does (the Templates button, the
Extensions category, a template card) and read through the frontend's own objects (``window.app``,
``window.LiteGraph``). What a user would see as a problem is collected: alert/warning toasts and the
browser console's warnings and errors.
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import time
from collections.abc import Iterator

from selenium.webdriver.chrome.webdriver import WebDriver

from browser import headless_chromium

PAGE_TIMEOUT_S = 120
#: Console lines that are not about the page: the tests have no network (ComfyUI's release check).
OFFLINE_NOISE = ("https://api.comfy.org/",)
#: What the frontend's text truncation draws in place of the cut-off end (LiteGraph's ellipsis and leaders).
TRUNCATION_MARKS = ("\u2026", "\u2025", "\u2024")
#: LiteGraph's widget text layout (BaseWidget.drawTruncatingText): margins, arrows and the label/value gap
#: around a widget's label and value, plus a few pixels of slack.
WIDGET_CHROME_PX = 100
TITLE_SLACK_PX = 8

MEASURE_NODES_JS = """
const ctx = document.createElement('canvas').getContext('2d');
return window.app.graph._nodes.map(node => {
  ctx.font = node.titleFontStyle;
  const titleWidth = ctx.measureText(node.getTitle()).width + 2 * LiteGraph.NODE_TITLE_HEIGHT + arguments[1];
  ctx.font = node.innerFontStyle;
  let widgetWidth = 0;
  for (const widget of node.widgets ?? []) {
    if (!widget.name || widget.type === 'custom') continue;  // image previews draw no text
    const label = ctx.measureText(widget.label || widget.name).width;
    const value = ctx.measureText(String(widget.value ?? '')).width;
    widgetWidth = Math.max(widgetWidth, label + value + arguments[0]);
  }
  return {id: node.id, type: node.type, title: node.getTitle(), size: [...node.size],
          min_size: [...node.computeSize()], title_width: titleWidth, widget_width: widgetWidth};
});
"""

GRAPH_JS = """
const graph = window.app.graph;
return {
  nodes: graph._nodes.map(node => ({
    id: node.id, type: node.type, title: node.getTitle(), pos: [...node.pos], size: [...node.size],
    bounding: [...node.boundingRect], mode: node.mode,
    widgets: Object.fromEntries((node.widgets ?? []).filter(w => w.name).map(w => [w.name, w.value ?? null])),
  })),
  links: [...graph.links.values()].map(link => [link.origin_id, link.target_id]),
  title_height: LiteGraph.NODE_TITLE_HEIGHT,
  scale: window.app.canvas.ds.scale,
  visible: [...window.app.canvas.visible_area],
};
"""

#: Draw the whole canvas once with CanvasRenderingContext2D.fillText recorded: every text the user sees.
DRAWN_TEXTS_JS = """
const texts = [];
const original = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, ...rest) {
  texts.push(String(text));
  return original.call(this, text, ...rest);
};
try {
  window.app.canvas.setDirty(true, true);
  window.app.canvas.draw(true, true);
} finally {
  CanvasRenderingContext2D.prototype.fillText = original;
}
return texts;
"""

#: Scale 1 with the graph's top-left corner at (x, y) of the canvas: everything at 100%.
SHOW_AT_100_PERCENT_JS = """
const nodes = window.app.graph._nodes;
const left = Math.min(...nodes.map(n => n.boundingRect[0]));
const top = Math.min(...nodes.map(n => n.boundingRect[1]));
const ds = window.app.canvas.ds;
ds.scale = 1;
ds.offset[0] = arguments[0] - left;
ds.offset[1] = arguments[1] - top;
window.app.canvas.setDirty(true, true);
const right = Math.max(...nodes.map(n => n.boundingRect[0] + n.boundingRect[2]));
const bottom = Math.max(...nodes.map(n => n.boundingRect[1] + n.boundingRect[3]));
return [right - left, bottom - top];
"""


@contextlib.contextmanager
def chromium(width: int, height: int) -> Iterator[WebDriver]:
    """One headless Chromium (Debian's, through chromedriver; see tests/browser.py) with its console log kept;
    quit on exit."""
    with tempfile.TemporaryDirectory(prefix="flowlift-chromium-") as profile:
        driver = headless_chromium(
            width, height, profile_dir=profile, extra_flags=("--hide-scrollbars",), console_log=True
        )
        try:
            yield driver
        finally:
            driver.quit()


def wait_for(driver: WebDriver, script: str, what: str, timeout: float = PAGE_TIMEOUT_S, *args: object) -> object:
    """Poll ``script`` (JS returning a value) until it is truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(script, *args)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"the ComfyUI page: {what} not within {timeout:.0f} s")
        time.sleep(0.25)


def open_app(driver: WebDriver, url: str) -> None:
    """Load the page and wait until the graph, the sidebar and the fonts are ready."""
    driver.get(url)
    wait_for(driver, "return !!(window.app && window.app.graph && window.app.canvas && window.LiteGraph)", "the app")
    wait_for(driver, "return !!document.querySelector('.templates-tab-button')", "the Templates button")
    driver.execute_async_script("document.fonts.ready.then(() => arguments[arguments.length - 1](true))")


def console_problems(driver: WebDriver) -> list[str]:
    """Warnings and errors the browser console got since the last call (the log is drained)."""
    return [
        f"{entry['level']}: {entry['message']}"
        for entry in driver.get_log("browser")
        if entry["level"] in ("WARNING", "SEVERE") and not any(n in entry["message"] for n in OFFLINE_NOISE)
    ]


def toasts(driver: WebDriver) -> list[str]:
    """The texts of the toasts on screen (alerts, warnings, 'links fixed' notices...)."""
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('.p-toast-message')).map(e => e.innerText.trim())"
    )


def error_notices(driver: WebDriver) -> list[str]:
    """The frontend's error notices on screen that are not toasts: frontend 1.49 checks a loaded workflow (missing
    models, missing nodes) and shows "N errors found" in a side panel."""
    text = driver.execute_script("return document.body.innerText")
    return [line.strip() for line in text.splitlines() if re.search(r"\b\d+ errors? found\b", line)]


def close_toasts(driver: WebDriver) -> None:
    driver.execute_script("document.querySelectorAll('.p-toast-message .p-toast-close-button').forEach(b => b.click())")


def open_templates_of(driver: WebDriver, pack: str) -> list[str]:
    """Templates (sidebar) -> the pack's Extensions category; returns the names of the cards shown."""
    if not driver.execute_script("return !!document.querySelector('[data-testid=template-workflows-content]')"):
        driver.execute_script("document.querySelector('.templates-tab-button').click()")
    category = wait_for(
        driver,
        "return Array.from(document.querySelectorAll('[role=dialog] [role=button]'))"
        ".find(e => e.textContent.trim() === arguments[0])",
        f"the {pack!r} category in the Templates browser",
        PAGE_TIMEOUT_S,
        pack,
    )
    driver.execute_script("arguments[0].click()", category)  # a click event: the dialog's overlay may cover it
    return wait_for(
        driver,
        "const cards = Array.from(document.querySelectorAll('[data-testid^=template-workflow-]'))"
        ".map(e => e.dataset.testid.slice('template-workflow-'.length));"
        "return cards.length ? cards : null",
        f"the cards of {pack!r}",
    )


def thumbnails_loaded(driver: WebDriver, sizes: dict[str, tuple[int, int]]) -> bool:
    """Every card of ``sizes`` (name -> its thumbnail's pixel size) shows that image, not the frontend's
    default picture (the frontend shows a fetched thumbnail through a blob: URL of its media cache)."""
    return bool(
        driver.execute_script(
            """
        return Object.entries(arguments[0]).every(([name, [width, height]]) => {
          const img = document.querySelector(`[data-testid="template-workflow-${name}"] img`);
          return img && img.complete && !img.src.includes('default-template')
            && img.naturalWidth === width && img.naturalHeight === height;
        });
        """,
            sizes,
        )
    )


def open_template(driver: WebDriver, pack: str, name: str) -> None:
    """Click ``name``'s card in the pack's category and wait until its graph is the one on the canvas
    (the dialog closes before the frontend loads the graph: the nodes on screen before are marked)."""
    open_templates_of(driver, pack)
    driver.execute_script("window.app.graph._nodes.forEach(node => { node.flowliftShownBefore = true; })")
    driver.execute_script(f"document.querySelector('[data-testid=\"template-workflow-{name}\"]').click()")
    wait_for(
        driver,
        "const nodes = window.app.graph._nodes;"
        "return !document.querySelector('[data-testid=template-workflows-content]')"
        " && nodes.length > 0 && !nodes.some(node => node.flowliftShownBefore)",
        f"template {name!r} to open",
    )
    time.sleep(0.5)  # the load's own follow-ups (size fixes, image previews) run in the next frames


def node_id(value: object) -> object:
    """A node id as the saved workflow writes it: frontend 1.49 holds some ids as strings of digits."""
    return int(value) if isinstance(value, str) and value.isdigit() else value


def measure_nodes(driver: WebDriver) -> list[dict]:
    """Per node of the loaded graph: its size, the frontend's minimum size, and the widths its title and
    widget texts need to be drawn whole (LiteGraph's fonts and margins)."""
    return [
        {**m, "id": node_id(m["id"])} for m in driver.execute_script(MEASURE_NODES_JS, WIDGET_CHROME_PX, TITLE_SLACK_PX)
    ]


def graph_state(driver: WebDriver) -> dict:
    """The loaded graph as the frontend holds it: nodes (pos, size, bounding box with title, widget
    values) and links (origin id, target id)."""
    state = driver.execute_script(GRAPH_JS)
    for node in state["nodes"]:
        node["id"] = node_id(node["id"])
    state["links"] = [[node_id(origin), node_id(target)] for origin, target in state["links"]]
    return state


def show_at_100_percent(driver: WebDriver, left: int = 100, top: int = 110) -> tuple[int, int]:
    """Zoom 100% with the graph's corner at (left, top) of the canvas; returns the graph's (width, height)."""
    return tuple(driver.execute_script(SHOW_AT_100_PERCENT_JS, left, top))


def drawn_texts(driver: WebDriver) -> list[str]:
    """Every string the canvas draws in one full redraw (titles, slot names, widget labels and values)."""
    return driver.execute_script(DRAWN_TEXTS_JS)


def overlaps(boxes: dict[str, tuple[float, float, float, float]], gap: float = 0.0) -> list[tuple[str, str]]:
    """Pairs of (x, y, w, h) boxes closer than ``gap`` (overlapping when gap is 0)."""
    names = sorted(boxes)
    found = []
    for i, a in enumerate(names):
        ax, ay, aw, ah = boxes[a]
        for b in names[i + 1 :]:
            bx, by, bw, bh = boxes[b]
            if ax < bx + bw + gap and bx < ax + aw + gap and ay < by + bh + gap and by < ay + ah + gap:
                found.append((a, b))
    return found

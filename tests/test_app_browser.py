"""``flowlift app`` in a real headless Chromium (Selenium, Debian's chromium + chromium-driver).

The server is ``flowlift app`` itself in a subprocess on a free loopback port (this checkout's
sources, a small random upscaler, the real TAEF2). The test drops a corrupt file (its error shows at
once, Upscale is disabled), then a Kodak image, upscales it 4x watching the one progress bar, fetches
the download (exactly 4x the input), and checks the detail view pixel for pixel: the crops shown
on the page, and the screen's own pixels under them, are the written PNG's region at 100% and 200%
(also on a devicePixelRatio-2 screen) beside the input's nearest-resized region; a click on the
overview moves the region. Then a second image is still served, and the server's log has one line
per request and the ``--share`` hint. Screenshots in the test's tmp dir; with
``FLOWLIFT_APP_SCREENSHOTS=DIR`` also ``DIR/app.png`` (the page, halved) and ``DIR/app_detail.png``
(the detail view at 1:1, lossless): how the two in docs/ are made.
"""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from app_helpers import free_port, is_loopback, listening_addresses, process_tree, subprocess_env
from browser import headless_chromium
from builders import save_tiny_unet

# Screenshots hold the page's sRGB pixels unchanged.
CHROMIUM_FLAGS = ("--force-color-profile=srgb",)
SERVER_START_S = 180
REQUEST_S = 180


@pytest.fixture
def app_server(shared, tmp_path):
    """``flowlift app`` in a subprocess on a free loopback port; stopped (and checked) at the end."""
    weights = save_tiny_unet(tmp_path / "flow_upscaler.safetensors")
    port = free_port()
    env = subprocess_env(tmp_path)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # a tiny model: threads only contend
    command = [sys.executable, "-m", "flowlift", "app", "--upscaler", str(weights)]
    command += ["--vae", str(shared / "models" / "taef2"), "--device", "cpu", "--port", str(port)]
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - closed below
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if server.poll() is not None:
                log.seek(0)
                pytest.fail(f"flowlift app exited with {server.returncode}:\n{log.read()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"flowlift app did not answer on {url} within {SERVER_START_S} s")
            time.sleep(0.5)
        listening = listening_addresses(process_tree(server.pid))
        assert listening and all(is_loopback(address) for address, _ in listening), listening
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert not listening_addresses({server.pid})


@pytest.fixture
def browser(tmp_path, headless_browser):
    profile = tempfile.mkdtemp(dir=tmp_path, prefix="chromium-")
    driver = headless_chromium(1400, 1000, profile_dir=profile, extra_flags=CHROMIUM_FLAGS)
    try:
        yield driver
    finally:
        driver.quit()


def _upload(driver, path: Path, status: str) -> None:
    """Put ``path`` into the Upscale tab's image input (clearing a previous image first) and wait
    until the status line under it says ``status`` (the server read the file)."""
    box = driver.find_element(By.ID, "upscale-input")
    for remove in box.find_elements(By.CSS_SELECTOR, "button[aria-label='Remove Image']"):
        remove.click()
    WebDriverWait(driver, 30).until(
        lambda d: (
            d.find_elements(By.CSS_SELECTOR, "#upscale-input input[type=file]")
            and not d.find_elements(By.CSS_SELECTOR, "#upscale-input button[aria-label='Remove Image']")
        )
    )
    driver.find_element(By.CSS_SELECTOR, "#upscale-input input[type=file]").send_keys(str(path))
    WebDriverWait(driver, 60).until(
        EC.presence_of_element_located((By.CSS_SELECTOR, "#upscale-input button[aria-label='Remove Image']"))
    )
    WebDriverWait(driver, 60).until(EC.text_to_be_present_in_element((By.ID, "upscale-upload-status"), status))


def _download_link(driver, name: str):
    """The download link of the Upscale tab once it offers ``name``."""
    selector = f"#upscale-download a[download='{name}']"
    return WebDriverWait(driver, REQUEST_S).until(EC.presence_of_element_located((By.CSS_SELECTOR, selector)))


def _fetch_png(url: str) -> Image.Image:
    with urllib.request.urlopen(url, timeout=30) as response:
        data = response.read()
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


#: Characters that need an emoji font (pictographs, dingbats, the emoji variation selector).
EMOJI = re.compile("[\U0001f000-\U0001faff\u2600-\u27bf\ufe0f]")
LOG_LINE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d flowlift app: upscale REQUEST \d+\.\d s ok"


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def _on_screen(driver, element, expected: np.ndarray) -> bool:
    """Whether the screen (a screenshot in device pixels) shows exactly ``expected`` where ``element`` is.

    The element's position is rounded to device pixels by the compositor and by the screenshot's clip
    in ways that may differ by one pixel, so the match is searched within two pixels of the position.
    """
    left, top, ratio = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.left, r.top, window.devicePixelRatio];", element
    )
    with Image.open(io.BytesIO(driver.get_screenshot_as_png())) as shot:
        screen = _pixels(shot)
    height, width = expected.shape[:2]
    x, y = round(left * ratio), round(top * ratio)
    return any(
        np.array_equal(screen[y + dy : y + dy + height, x + dx : x + dx + width], expected)
        for dy in range(-2, 3)
        for dx in range(-2, 3)
        if y + dy >= 0 and x + dx >= 0
    )


def _shown(driver, element_id: str, expected_of) -> tuple[tuple[int, ...], int]:
    """Check one detail crop: the image the page has (its data URI) and what the screen shows of it
    (once decoded) are ``expected_of(box, zoom)``; returns its data-box and data-zoom."""
    element = driver.find_element(By.ID, element_id)
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    driver.execute_async_script("arguments[0].decode().then(arguments[1], arguments[1])", element)
    box = tuple(int(v) for v in element.get_attribute("data-box").split(","))
    zoom = int(element.get_attribute("data-zoom"))
    expected = expected_of(box, zoom)
    data = element.get_attribute("src").split(",", 1)[1]
    with Image.open(io.BytesIO(base64.b64decode(data))) as image:
        assert np.array_equal(_pixels(image), expected), f"the page's {element_id} is not the file's {box}"
    assert _on_screen(driver, element, expected), f"the screen does not show {element_id} {box} at {zoom}x, 1:1"
    return box, zoom


def _wait_for_box(driver, box: str) -> None:
    WebDriverWait(driver, 60).until(
        lambda d: [e.get_attribute("data-box") for e in d.find_elements(By.ID, "detail-output")] == [box]
    )


def _check_detail(driver, result: np.ndarray, source: np.ndarray, scale: int) -> tuple[int, ...]:
    """Both crops are the files' pixels, on the page and on the screen; returns the region."""

    def output_region(box: tuple[int, ...], zoom: int) -> np.ndarray:
        x0, y0, x1, y1 = box
        return result[y0:y1, x0:x1].repeat(zoom, axis=0).repeat(zoom, axis=1)

    def input_region(box: tuple[int, ...], zoom: int) -> np.ndarray:  # nearest-resized: blocks of scale x zoom
        x0, y0, x1, y1 = (v // scale for v in box)
        return source[y0:y1, x0:x1].repeat(scale * zoom, axis=0).repeat(scale * zoom, axis=1)

    box, _ = _shown(driver, "detail-output", output_region)
    assert _shown(driver, "detail-input", input_region)[0] == box
    return box


def _set_scale(browser, scale: int) -> None:
    """Type ``scale`` into the Upscale tab's number field as a person does (select, type, leave the field)."""
    field = browser.find_element(By.CSS_SELECTOR, "#upscale-scale input")
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(scale), Keys.TAB)
    WebDriverWait(browser, 10).until(lambda _: float(field.get_attribute("value")) == scale)


def test_upscale_in_a_real_browser(app_server, browser, shared, tmp_path):
    source = tmp_path / "kodim23.png"
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as image:
        image.convert("RGB").resize((192, 128), Image.Resampling.BOX).save(source)
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(source.read_bytes()[:300])  # a PNG header, then nothing
    second = tmp_path / "kodim03.png"
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((96, 64), Image.Resampling.BOX).save(second)
    shots = os.environ.get("FLOWLIFT_APP_SCREENSHOTS")

    browser.get(app_server)
    WebDriverWait(browser, 60).until(EC.presence_of_element_located((By.ID, "upscale-button")))
    # a corrupt file: its error shows as soon as it is dropped, and Upscale is off until a good one comes
    _upload(browser, corrupt, "corrupt.png: unreadable or truncated image")
    status = browser.find_element(By.ID, "upscale-upload-status")
    assert status.is_displayed() and status.text.startswith("Error: corrupt.png: unreadable or truncated image")
    assert not browser.find_element(By.ID, "upscale-button").is_enabled()
    browser.save_screenshot(str(tmp_path / "error.png"))

    _upload(browser, source, "Ready: kodim23.png: 192x128 px")
    assert browser.find_element(By.ID, "upscale-button").is_enabled()
    assert browser.find_element(By.CSS_SELECTOR, "#upscale-vae input").get_attribute("value") == "taef2"
    _set_scale(browser, 4)
    browser.find_element(By.ID, "upscale-button").click()
    bars: list[tuple[int, str, str]] = []  # (bars on the page, the panel holding one, its text) while it runs
    while not browser.find_elements(By.CSS_SELECTOR, "#upscale-download a[download='kodim23_x4.png']"):
        seen = browser.execute_script(
            "const bars = document.querySelectorAll('[role=progressbar]');"
            "return [bars.length, bars.length ? bars[0].closest('[id]').id : '',"
            " bars.length ? bars[0].getAttribute('aria-valuetext') : ''];"
        )
        if seen[0]:
            bars.append(tuple(seen))
        time.sleep(0.05)
    assert bars, "no progress bar was seen while the request ran"
    assert {(count, panel) for count, panel, _ in bars} == {(1, "upscale-slider")}, bars  # one bar, over the slider
    assert any(text.startswith("kodim23.png: ") for *_, text in bars), bars
    link = _download_link(browser, "kodim23_x4.png")
    info = (
        WebDriverWait(browser, 30).until(EC.text_to_be_present_in_element((By.ID, "upscale-info"), "768x512"))
        and browser.find_element(By.ID, "upscale-info").text
    )
    assert "192x128" in info and " s" in info
    png = _fetch_png(link.get_attribute("href"))
    assert png.format == "PNG" and png.size == (768, 512) and '"schema": 1' in png.text["flowlift"]
    result = _pixels(png)
    with Image.open(source) as image:
        small = _pixels(image)

    # the detail view: the centre 512x512 px at 100%, pixel for pixel on the screen
    _wait_for_box(browser, "128,0,640,512")
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(tmp_path / "app.png"))
    sizes = browser.execute_script(
        "const img = document.getElementById('detail-output'); const r = img.getBoundingClientRect();"
        "return [img.naturalWidth, img.naturalHeight, r.width, r.height, window.devicePixelRatio];"
    )
    assert sizes == [512, 512, 512, 512, 1]
    assert _check_detail(browser, result, small, 4) == (128, 0, 640, 512)
    detail = browser.find_element(By.ID, "detail-view")
    detail.screenshot(str(tmp_path / "app_detail.png"))
    if shots:
        with Image.open(tmp_path / "app.png") as shot:
            small_page = shot.convert("RGB").resize((shot.width // 2, shot.height // 2), Image.Resampling.LANCZOS)
            small_page.quantize(128).save(Path(shots) / "app.png", optimize=True)
        with Image.open(tmp_path / "app_detail.png") as shot:
            shot.convert("RGB").save(Path(shots) / "app_detail.png", optimize=True)

    # 200%, then a click on the overview's top-left corner moves the region there
    browser.find_element(By.CSS_SELECTOR, "#detail-zoom input[value='200%']").click()
    _wait_for_box(browser, "256,128,512,384")
    assert _check_detail(browser, result, small, 4) == (256, 128, 512, 384)
    overview = browser.find_element(By.CSS_SELECTOR, "#detail-overview img")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", overview)
    width, height, natural_w, natural_h = browser.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.width, r.height, arguments[0].naturalWidth,"
        " arguments[0].naturalHeight];",
        overview,
    )
    shown_scale = min(width / natural_w, height / natural_h, 1.0)  # Gradio shows it scaled down only, centred
    corner = (-int(natural_w * shown_scale / 2) + 3, -int(natural_h * shown_scale / 2) + 3)  # from the centre
    ActionChains(browser).move_to_element_with_offset(overview, *corner).click().perform()
    _wait_for_box(browser, "0,0,256,256")
    assert _check_detail(browser, result, small, 4) == (0, 0, 256, 256)

    # a HiDPI screen (devicePixelRatio 2): 100% is still one image pixel per screen pixel
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 1000, "deviceScaleFactor": 2, "mobile": False}
    )
    try:
        browser.find_element(By.CSS_SELECTOR, "#detail-zoom input[value='100%']").click()
        _wait_for_box(browser, "0,0,512,512")
        WebDriverWait(browser, 30).until(
            lambda d: (
                d.execute_script("return document.getElementById('detail-output').getBoundingClientRect().width") == 256
            )
        )
        assert _check_detail(browser, result, small, 4) == (0, 0, 512, 512)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    assert not EMOJI.search(browser.find_element(By.TAG_NAME, "body").text)

    # the server still serves, and logged one line per request (the corrupt file never was one)
    _upload(browser, second, "Ready: kodim03.png: 96x64 px")
    _set_scale(browser, 2)
    browser.find_element(By.ID, "upscale-button").click()
    again = _fetch_png(_download_link(browser, "kodim03_x2.png").get_attribute("href"))
    assert again.size == (192, 128)
    log = (tmp_path / "server.log").read_text()
    assert "flowlift app --share" in log and "share=True" not in log
    requests = [line for line in log.splitlines() if " flowlift app: upscale " in line]
    expected = ("kodim23.png 192x128 x4 -> 768x512", "kodim03.png 96x64 x2 -> 192x128")
    assert len(requests) == len(expected), log
    for line, request in zip(requests, expected, strict=True):
        assert re.fullmatch(LOG_LINE.replace("REQUEST", re.escape(request)), line), requests

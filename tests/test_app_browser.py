"""``flowlift app`` in a real headless Chromium (Selenium, Debian's chromium + chromium-driver).

The server is ``flowlift app`` itself in a subprocess on a free loopback port (this checkout's
sources, a small random upscaler, the real TAEF2). The test uploads a Kodak image, presses Upscale,
waits for the before/after slider and the download link, fetches the download (a PNG of exactly 2x
the input), then uploads a corrupt file (the error is visible on the page) and a good one again
(still served). Screenshot: ``<tmp>/app.png``; with ``FLOWLIFT_APP_SCREENSHOT=PATH`` also a small
copy at PATH (how ``docs/app.png`` is made).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from app_helpers import free_port, is_loopback, listening_addresses, process_tree, subprocess_env, tiny_upscaler

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
]
SERVER_START_S = 180
REQUEST_S = 180


@pytest.fixture
def app_server(shared, tmp_path):
    """``flowlift app`` in a subprocess on a free loopback port; stopped (and checked) at the end."""
    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
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
def browser(tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail("headless Chromium missing: apt-get install -y chromium chromium-driver (.ci/run does this)")
    options = webdriver.ChromeOptions()
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path, prefix='chromium-')}")
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _upload(driver, path: Path) -> None:
    """Put ``path`` into the Upscale tab's image input (clearing a previous image first)."""
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


def test_upscale_in_a_real_browser(app_server, browser, shared, tmp_path):
    source = tmp_path / "kodim23.png"
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as image:
        image.convert("RGB").resize((192, 128), Image.Resampling.BOX).save(source)
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(source.read_bytes()[:300])  # a PNG header, then nothing
    second = tmp_path / "kodim03.png"
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((96, 64), Image.Resampling.BOX).save(second)

    browser.get(app_server)
    WebDriverWait(browser, 60).until(EC.presence_of_element_located((By.ID, "upscale-button")))
    _upload(browser, source)
    browser.find_element(By.ID, "upscale-button").click()
    link = _download_link(browser, "kodim23_x2.png")
    WebDriverWait(browser, 30).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#upscale-slider img")) >= 2)
    info = (
        WebDriverWait(browser, 30).until(EC.text_to_be_present_in_element((By.ID, "upscale-info"), "384x256"))
        and browser.find_element(By.ID, "upscale-info").text
    )
    assert "192x128" in info and " s" in info
    result = _fetch_png(link.get_attribute("href"))
    assert result.format == "PNG" and result.size == (384, 256)
    assert "flowlift.parameters" in result.text
    browser.save_screenshot(str(tmp_path / "app.png"))
    docs_copy = os.environ.get("FLOWLIFT_APP_SCREENSHOT")
    if docs_copy:
        with Image.open(tmp_path / "app.png") as shot:
            small = shot.convert("RGB").resize((shot.width // 2, shot.height // 2), Image.Resampling.LANCZOS)
            small.quantize(128).save(docs_copy, optimize=True)

    # a corrupt upload: the error is visible on the page, the server keeps serving
    _upload(browser, corrupt)
    browser.find_element(By.ID, "upscale-button").click()
    expected = "corrupt.png: unreadable or truncated image"
    try:
        WebDriverWait(browser, REQUEST_S).until(lambda d: expected in d.find_element(By.TAG_NAME, "body").text)
    finally:
        browser.save_screenshot(str(tmp_path / "error.png"))
    error = next(e for e in browser.find_elements(By.XPATH, f"//*[contains(text(), '{expected}')]"))
    assert error.is_displayed()

    _upload(browser, second)
    browser.find_element(By.ID, "upscale-button").click()
    again = _fetch_png(_download_link(browser, "kodim03_x2.png").get_attribute("href"))
    assert again.size == (192, 128)

"""InvokeAI's own web page in headless Chromium (selenium + chromedriver): load a workflow file as a user does.

:func:`load_workflow` opens the Workflows tab, gives the page's "Load workflow from file" input the
file, confirms, and returns the page's verdict: the notification texts (InvokeAI says "Workflow Loaded"
or "Workflow Loaded with Warnings" when a node type, version or field does not fit its templates) and
the nodes and edges drawn in the editor. Used by tests/test_invokeai.py and docs/invokeai_screenshot.py.
"""

from __future__ import annotations

import time
from pathlib import Path

from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from browser import headless_chromium

PAGE_TIMEOUT_S = 180  # the first load compiles a large bundle on a busy 2-core machine


def chrome(width: int = 1920, height: int = 1200) -> WebDriver:
    """A headless Chromium through Debian's chromedriver (tests/browser.py); the caller quits it."""
    return headless_chromium(width, height)


def _wait_for(driver: WebDriver, css: str, timeout: float = PAGE_TIMEOUT_S, text: str | None = None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            for element in driver.find_elements(By.CSS_SELECTOR, css):
                if element.is_displayed() and (text is None or element.text.strip() == text):
                    return element
        except StaleElementReferenceException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"no {css!r}{f' reading {text!r}' if text else ''} on the page after {timeout} s")
        time.sleep(0.25)


def _click(driver: WebDriver, css: str, timeout: float = PAGE_TIMEOUT_S) -> None:
    """Click the element once it is shown; React re-renders may replace it meanwhile, so retry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            _wait_for(driver, css, max(1.0, deadline - time.monotonic())).click()
            return
        except StaleElementReferenceException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def _click_text(driver: WebDriver, text: str, timeout: float = PAGE_TIMEOUT_S) -> None:
    """Click the innermost shown element whose own text is ``text`` (the panel's tabs have no labels)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            for element in driver.find_elements(By.XPATH, f"//*[normalize-space(text())='{text}']"):
                if element.is_displayed():
                    element.click()
                    return
        except StaleElementReferenceException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing reading {text!r} on the page after {timeout} s")
        time.sleep(0.25)


def _wait_for_node_templates(driver: WebDriver, timeout: float = PAGE_TIMEOUT_S) -> None:
    """Wait until the page has fetched the server's OpenAPI schema (its node templates): a workflow loaded
    before that is checked against no templates and loses its edges, with a warning."""
    fetched = (
        "return performance.getEntriesByType('resource')"
        ".some(e => e.name.split('?')[0].endsWith('/openapi.json') && e.responseEnd > 0)"
    )
    deadline = time.monotonic() + timeout
    while not driver.execute_script(fetched):
        assert time.monotonic() < deadline, f"the page did not fetch /openapi.json within {timeout} s"
        time.sleep(0.25)
    time.sleep(2.0)  # parsed into templates right after the fetch


def _toasts(driver: WebDriver) -> list[str]:
    try:
        return [t.text.strip() for t in driver.find_elements(By.CSS_SELECTOR, "[role=status]") if t.text.strip()]
    except StaleElementReferenceException:
        return []


def load_workflow(driver: WebDriver, url: str, workflow: Path) -> tuple[list[str], int, int]:
    """Load ``workflow`` into the editor of the page at ``url``: (notifications, nodes drawn, edges drawn)."""
    driver.get(url)
    _wait_for_node_templates(driver)
    _click(driver, "button[aria-label='Workflows']")
    _click_text(driver, "Launchpad")  # the tab reopens where it was left: the editor after a first load
    deadline = time.monotonic() + 60
    while True:  # the page's hidden "Load workflow from file" input
        try:
            file_input = [
                i
                for i in driver.find_elements(By.CSS_SELECTOR, "input[type=file]")
                if "json" in (i.get_attribute("accept") or "")
            ][0]
            file_input.send_keys(str(workflow.resolve()))
            break
        except (StaleElementReferenceException, IndexError):
            assert time.monotonic() < deadline, "no workflow file input on the Workflows tab"
            time.sleep(0.25)
    deadline = time.monotonic() + 60
    seen: list[str] = []
    while not any(text.startswith("Workflow Loaded") for text in seen):
        try:
            for button in driver.find_elements(By.CSS_SELECTOR, ".chakra-modal__content-container button"):
                if button.is_displayed() and button.text.strip() == "Load":  # "your workflow has unsaved changes"
                    button.click()
        except StaleElementReferenceException:
            pass
        seen += [text for text in _toasts(driver) if text not in seen]
        assert time.monotonic() < deadline, f"the page never said the workflow loaded: {seen}"
        time.sleep(0.25)
    time.sleep(1.0)
    seen += [text for text in _toasts(driver) if text not in seen]
    _click_text(driver, "Workflow Editor")
    _wait_for(driver, ".react-flow__node")
    time.sleep(1.0)
    nodes = len(driver.find_elements(By.CSS_SELECTOR, ".react-flow__node"))
    edges = len(driver.find_elements(By.CSS_SELECTOR, ".react-flow__edge"))
    return seen, nodes, edges


def editor_screenshot(driver: WebDriver, out: Path) -> None:
    """The editor (the gallery panel hidden, the workflow's form left of it, the graph fitted) as a PNG."""
    if any(e.is_displayed() for e in driver.find_elements(By.XPATH, "//*[text()='Boards']")):
        _click(driver, "button[aria-label='Toggle Right Panel (G)']")
        time.sleep(1.0)
    _click(driver, "button[aria-label='Fit View']")
    canvas = driver.find_element(By.CSS_SELECTOR, ".react-flow__pane")
    ActionChains(driver).move_to_element_with_offset(canvas, 0, -canvas.size["height"] // 2 + 20).perform()
    time.sleep(1.5)  # the fit animation; the button's tooltip gone with the pointer
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))

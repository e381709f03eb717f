"""Debian's headless Chromium and its chromedriver for the browser tests, set up on a fresh machine.

The README's test command alone has to pass on a new machine, so the browser tests provide their browser
as they provide their ComfyUI and InvokeAI venvs:

- :func:`browser_paths` finds ``chromium`` and ``chromedriver``; when either is missing and the tests run as
  root on a Debian-like system, it installs Debian's ``chromium`` and ``chromium-driver`` with ``apt-get``
  (once, under a file lock, so parallel test processes do not run apt twice). Otherwise it raises
  :class:`BrowserMissing` with the one command that fixes it.
- :func:`headless_chromium` starts one headless Chromium through that chromedriver. The driver's path is
  always given to Selenium explicitly, so Selenium Manager (which would try to download a driver from the
  internet) is never run.

``FLOWLIFT_CHROMIUM`` and ``FLOWLIFT_CHROMEDRIVER`` name other binaries; ``FLOWLIFT_NO_APT=1`` forbids the
install (the fixture's own test uses it to check the message a user without root sees).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.webdriver import WebDriver

APT_PACKAGES = ("chromium", "chromium-driver")
INSTALL_COMMAND = "apt-get install -y " + " ".join(APT_PACKAGES)
#: Flags every test browser gets: headless, no sandbox (root), and nothing that reaches for the network.
BASE_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


class BrowserMissing(RuntimeError):
    """Chromium or chromedriver is missing and could not be installed here; the message names the fix."""


def _which(variable: str, names: tuple[str, ...]) -> str | None:
    override = os.environ.get(variable)
    if override:
        return override if Path(override).is_file() else None
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


def find_browser() -> tuple[str, str] | None:
    """(chromium, chromedriver) when both are installed, else None."""
    chromium = _which("FLOWLIFT_CHROMIUM", ("chromium", "chromium-browser"))
    driver = _which("FLOWLIFT_CHROMEDRIVER", ("chromedriver",))
    return (chromium, driver) if chromium and driver else None


def _apt_install() -> None:
    """``apt-get update`` and install Debian's Chromium and its driver, under a lock; RuntimeError on failure."""
    lock_path = Path.home() / ".cache" / "flowlift" / "apt-chromium.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if find_browser():  # another test process installed it while this one waited
            return
        print(f"browser tests: {INSTALL_COMMAND} ...", file=sys.stderr, flush=True)
        for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
            result = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=1200
            )
            if result.returncode != 0:
                tail = "\n".join(result.stdout.splitlines()[-20:])
                raise RuntimeError(f"{' '.join(command)} failed (exit {result.returncode}):\n{tail}")


def ensure_browser(*, allow_install: bool | None = None) -> tuple[str, str]:
    """(chromium, chromedriver), installing Debian's packages when missing and allowed (root, apt-get, not
    ``FLOWLIFT_NO_APT``); :class:`BrowserMissing` naming the command otherwise."""
    found = find_browser()
    if found:
        return found
    if allow_install is None:
        allow_install = (
            os.environ.get("FLOWLIFT_NO_APT") != "1"
            and hasattr(os, "geteuid")
            and os.geteuid() == 0
            and shutil.which("apt-get") is not None
        )
    if not allow_install:
        raise BrowserMissing(
            f"headless Chromium missing: run `sudo {INSTALL_COMMAND}` (as root the tests install it "
            "themselves), or set FLOWLIFT_CHROMIUM and FLOWLIFT_CHROMEDRIVER"
        )
    try:
        _apt_install()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        raise BrowserMissing(f"headless Chromium missing and `{INSTALL_COMMAND}` failed: {error}") from error
    found = find_browser()
    if not found:
        raise BrowserMissing(f"`{INSTALL_COMMAND}` ran but chromium or chromedriver is still not on PATH")
    return found


@functools.lru_cache(maxsize=1)
def browser_paths() -> tuple[str, str]:
    """:func:`ensure_browser`, once per process."""
    return ensure_browser()


def headless_chromium(
    width: int,
    height: int,
    *,
    profile_dir: str | os.PathLike[str] | None = None,
    extra_flags: tuple[str, ...] = (),
    console_log: bool = False,
) -> WebDriver:
    """A new headless Chromium of ``width`` x ``height`` through Debian's chromedriver (never Selenium Manager).

    ``profile_dir``: a fresh user-data folder (the caller removes it); ``console_log`` keeps the page's console
    for ``driver.get_log("browser")``. The caller quits the driver."""
    chromium, chromedriver = browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*BASE_FLAGS, f"--window-size={width},{height}", *extra_flags):
        options.add_argument(flag)
    if profile_dir is not None:
        options.add_argument(f"--user-data-dir={profile_dir}")
    if console_log:
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=chromedriver))

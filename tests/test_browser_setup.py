"""tests/browser.py: a fresh machine gets its browser from the tests, a user without root one line naming the fix.

The install path runs against a stand-in ``apt-get`` on a PATH that holds nothing else, so these tests
behave the same whether or not Chromium is installed on the machine running them.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

import browser

FAKE_APT = """#!/bin/sh
# A stand-in apt-get: records its arguments; "install" puts chromium and chromedriver on PATH.
echo "$@" >> "{log}"
if [ "$1" = "install" ]; then
    for name in chromium chromedriver; do printf '#!/bin/sh\\n' > "{bin}/$name"; /bin/chmod +x "{bin}/$name"; done
fi
"""


@pytest.fixture
def bare_path(tmp_path, monkeypatch) -> Path:
    """A PATH with no browser on it (and no override variables), so the machine's own Chromium is hidden."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the install lock lives under ~/.cache
    for name in ("FLOWLIFT_CHROMIUM", "FLOWLIFT_CHROMEDRIVER", "FLOWLIFT_NO_APT"):
        monkeypatch.delenv(name, raising=False)
    return bin_dir


def _fake_apt(bin_dir: Path, log: Path) -> None:
    script = bin_dir / "apt-get"
    script.write_text(FAKE_APT.format(log=log, bin=bin_dir))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def test_missing_browser_is_installed_with_apt(bare_path, tmp_path):
    log = tmp_path / "apt.log"
    _fake_apt(bare_path, log)
    assert browser.find_browser() is None
    chromium, driver = browser.ensure_browser(allow_install=True)
    assert (chromium, driver) == (str(bare_path / "chromium"), str(bare_path / "chromedriver"))
    assert log.read_text().splitlines() == ["update -qq", "install -y -qq chromium chromium-driver"]
    browser.ensure_browser(allow_install=True)  # installed now: apt is not run again
    assert len(log.read_text().splitlines()) == 2


def test_without_root_or_apt_one_message_names_the_command(bare_path, monkeypatch):
    with pytest.raises(
        browser.BrowserMissing,
        match=r"^headless Chromium missing: run `sudo apt-get install -y "
        r"chromium chromium-driver`",
    ):
        browser.ensure_browser(allow_install=False)
    monkeypatch.setenv("FLOWLIFT_NO_APT", "1")  # the default decision: refused when asked not to install
    with pytest.raises(browser.BrowserMissing, match="apt-get install -y chromium chromium-driver"):
        browser.ensure_browser()
    monkeypatch.delenv("FLOWLIFT_NO_APT")  # allowed, but no apt-get on this PATH (root or not): the same line
    with pytest.raises(browser.BrowserMissing, match="sudo apt-get"):
        browser.ensure_browser()


def test_a_failing_install_is_one_error_with_its_output(bare_path, tmp_path):
    script = bare_path / "apt-get"
    script.write_text("#!/bin/sh\necho 'E: Unable to locate package chromium'\nexit 100\n")
    script.chmod(0o755)
    with pytest.raises(browser.BrowserMissing, match="(?s)failed.*exit 100.*Unable to locate package"):
        browser.ensure_browser(allow_install=True)


def test_selenium_is_given_the_driver_path(monkeypatch):
    """Selenium Manager (which downloads drivers) runs only when the service has no path: ours always has one."""
    seen = {}

    class Recorder:
        def __init__(self, options, service):
            seen["driver"] = service.path
            seen["binary"] = options.binary_location
            seen["args"] = list(options.arguments)

    monkeypatch.setattr(browser, "browser_paths", lambda: ("/opt/chromium", "/opt/chromedriver"))
    monkeypatch.setattr(browser.webdriver, "Chrome", Recorder)
    browser.headless_chromium(320, 200, extra_flags=("--hide-scrollbars",))
    assert seen["driver"] == "/opt/chromedriver"
    assert seen["binary"] == "/opt/chromium"
    assert "--disable-background-networking" in seen["args"] and "--window-size=320,200" in seen["args"]

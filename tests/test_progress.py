"""Progress off a terminal (issue 39 item 2): one plain line per interval, also during one slow step.

The interval is the knob ``FLOWLIFT_PROGRESS_INTERVAL_S``; the spacing of the lines is checked on a
simulated clock (``write_line(now)``), never against the machine's speed.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from builders import kodak_crops
from door_helpers import cpu_upscale_options
from flowlift import console
from flowlift.errors import FlowliftError

REPO = Path(__file__).resolve().parents[1]


class Log(io.StringIO):
    """A log file: not a terminal."""

    def isatty(self) -> bool:
        return False


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def wait_for(condition, timeout_s: float = 30.0) -> bool:
    """Poll ``condition`` until true (a generous deadline: the test waits for an event, it does not time one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_progress_line_counts_rate_and_time_left():
    line = console.progress_line("eval", 3, 12, 60.0, "img")
    assert line == "eval 3/12 img (25%) in 1 min 00 s, 20.0 s/img, about 3 min 00 s left"
    # a resumed loop: the rate is this run's (2 steps in 4 s), the count the whole job's
    assert console.progress_line("train", 12, 20, 4.0, "step", "loss=0.5", initial=10) == (
        "train 12/20 step (60%) in 4.0 s, 2.0 s/step, about 16.0 s left [loss=0.5]"
    )
    assert console.progress_line("distill", 30, None, 10.0, "item") == "distill 30 item in 10.0 s, 3 item/s"
    assert console.progress_line("eval", 0, 5, 0.5, "img") == "eval 0/5 img (0%) in 0.50 s"  # no rate yet


def test_interval_knob(monkeypatch):
    monkeypatch.delenv(console.PROGRESS_INTERVAL_VARIABLE, raising=False)
    assert console.progress_interval() == console.DEFAULT_PROGRESS_INTERVAL_S <= 30
    monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, "2.5")
    assert console.progress_interval() == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, bad)
        with pytest.raises(FlowliftError, match=console.PROGRESS_INTERVAL_VARIABLE):
            console.progress_interval()


def test_a_terminal_gets_a_bar_and_no_progress_gets_nothing(monkeypatch):
    from tqdm.std import tqdm

    monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, "0.01")
    screen = Terminal()
    with console.progress_bar(total=3, desc="eval", unit="img", file=screen) as bar:
        assert isinstance(bar, tqdm) and type(bar) is not console._progress_lines_class()
        bar.update(3)
    assert "\r" in screen.getvalue() and "3/3" in screen.getvalue()
    log = Log()
    with console.progress_bar(total=3, desc="eval", unit="img", enabled=False, file=log) as bar:
        bar.update(1)
        time.sleep(0.1)
    assert log.getvalue() == ""
    forced = Log()
    with console.progress_bar(total=3, desc="eval", unit="img", enabled=True, file=forced) as bar:
        assert type(bar) is not console._progress_lines_class()  # --progress: a bar even in a log


def test_off_a_terminal_a_line_comes_during_one_slow_step_without_updates(monkeypatch):
    """The bug: eval, bands and dataset ran minutes printing nothing in a log. A step slower than the
    interval still gets its line (the ticker does not wait for the loop to advance)."""
    monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, "0.05")
    monkeypatch.setattr(console, "_command", {"name": "eval"})
    log = Log()
    seen = []
    with console.progress_bar(total=4, desc="eval", unit="img", file=log) as bar:
        bar.update(1)
        # one slow step: no update until a line shows the state after the first image
        seen.append(wait_for(lambda: "1/4" in log.getvalue()))
        bar.update(3)
    assert seen == [True], log.getvalue()
    lines = log.getvalue().splitlines()
    assert all(re.fullmatch(r"flowlift eval: \d/4 img \(\d+%\) in .*", line) for line in lines), lines
    assert "\r" not in log.getvalue()
    assert any("left" in line for line in lines)  # rate and time left once something is done
    count = len(lines)
    time.sleep(0.2)
    assert len(log.getvalue().splitlines()) == count  # closed: no more lines
    assert not [t for t in threading.enumerate() if t.name == "flowlift-progress"]


def test_lines_are_one_per_interval_on_a_simulated_clock(monkeypatch):
    monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, "20")
    log = Log()
    with console.progress_bar(total=100, desc="bands", unit="img", file=log) as bar:
        start = bar._last_line
        written = [bar.write_line(start + t) for t in (1, 5, 19.9, 20, 25, 39.9, 40.1, 41, 60.2, 300)]
        # a line at 20, 40.1, 60.2 and 300 s: never two within 20 s, never a gap past 20 s while ticking
        assert written == [False, False, False, True, False, False, True, False, True, True]
    assert len(log.getvalue().splitlines()) == 4


def test_nested_bars_share_one_line(monkeypatch):
    """An image's steps inside the batch's images: one line per interval, the inner state on it."""
    monkeypatch.setenv(console.PROGRESS_INTERVAL_VARIABLE, "1000")
    log = Log()
    with console.progress_bar(total=3, desc="images", unit="img", file=log) as outer:
        with console.progress_bar(total=7, desc="kodim23.png", unit="step", leave=False, file=log) as inner:
            inner.update(2)
            now = outer._last_line + 2000
            assert not inner.write_line(now)  # the inner bar never writes on its own
            assert outer.write_line(now)
    assert log.getvalue().splitlines()[-1].endswith("; kodim23.png 2/7"), log.getvalue()


def _run_with_progress_into_a_log(tmp_path: Path, interval: str, *args: str) -> str:
    """``python -m flowlift ARGS >out 2>log`` in ``tmp_path`` with progress lines every ``interval`` seconds;
    asserts it exits 0 and returns the log."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        console.PROGRESS_INTERVAL_VARIABLE: interval,
        "HF_HUB_OFFLINE": "1",
    }
    with open(tmp_path / "out", "w") as out, open(tmp_path / "log", "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "flowlift", *args],
            stdout=out,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env=env,
            timeout=300,
            cwd=tmp_path,
        )
    text = (tmp_path / "log").read_text()
    assert done.returncode == 0, text
    return text


@pytest.fixture(scope="module")
def photos(tmp_path_factory, shared) -> Path:
    return kodak_crops(shared, tmp_path_factory.mktemp("photos"))


def test_eval_into_a_log_writes_progress_lines(photos, tmp_path):
    """``flowlift eval ... >out 2>log``: neither stream a terminal, progress lines in the log at the interval
    (here a short one), then the table on stdout."""
    text = _run_with_progress_into_a_log(
        tmp_path,
        "0.001",
        "eval",
        str(photos),
        "--reference",
        str(photos),
        "-o",
        str(tmp_path / "report"),
    )
    progress = [line for line in text.splitlines() if re.match(r"flowlift eval: \d/3 img \(\d+%\) in ", line)]
    assert progress, text
    assert "\r" not in text
    assert "| outputs | mean |" in (tmp_path / "out").read_text()


def test_upscale_into_a_log_names_what_loads_then_every_stage_and_its_time_left(tmp_path, shared):
    """Issue 48: off a terminal the lines began with the image loop (2 min of silence while Mage loaded), counted
    from the loop and, for one image, never gave a time left. Now the first line names what loads (the command's
    clock running), and every later line names the image's stage and the time left (or that it is being measured,
    before this run has timed its first stage)."""
    sys.path.insert(0, str(REPO / "tests"))
    from builders import save_tiny_unet as tiny_upscaler

    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    with Image.open(shared / "images" / "kodak" / "kodim23.png") as im:
        im.convert("RGB").crop((0, 0, 96, 64)).save(tmp_path / "kodim23.png")
    text = _run_with_progress_into_a_log(
        tmp_path,
        "0.02",
        "upscale",
        "kodim23.png",
        "--scale",
        "4",
        *cpu_upscale_options(shared, weights),
        "-o",
        "big.png",
    )
    lines = [line for line in text.splitlines() if line.startswith("flowlift upscale: ")]
    first = next(i for i, line in enumerate(lines) if "loading" in line)
    assert re.match(
        r"flowlift upscale: loading the Flow Upscaler \(flow_upscaler\.safetensors, \d+ MB\) and VAE "
        r".*taef2 \(.*\), [\d.]+ s so far$",
        lines[first],
    ), lines[first]
    later = [line for line in lines[first:] if "loading" not in line]
    stages = r"(encode|pass [12]/2|decode(, tile \d+/\d+)?|color fix|writing|done)"
    duration = r"([\d.]+ s|\d+ min \d\d s)"
    left = rf"(about {duration} left|time left: measuring)"
    pattern = rf"flowlift upscale: kodim23\.png: {stages} \(\d+%\) in {duration}, {left}$"
    assert later and all(re.match(pattern, line) for line in later), "\n".join(later)
    assert any("about" in line for line in later) and "\r" not in text

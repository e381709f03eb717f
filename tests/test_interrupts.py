"""Ctrl-C and kill stop any run within seconds (issue 22, item 2).

Root cause of "Ctrl-C is ignored on a capped job": Python leaves an *inherited* ``SIG_IGN`` for SIGINT
in place, and a command started in the background by a non-interactive shell (``flowlift upscale ... &``
in a script, as a harness does) inherits exactly that; the run then went on to its (capped, 16K, very
long) end. And the cap's warning was collected during the work and printed after it. These tests run a
real capped job in a subprocess that inherits an ignored SIGINT, signal it mid-run and check the exit.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from door_helpers import cpu_upscale_options

SRC = Path(__file__).resolve().parents[1] / "src"
TINY_UNET = {"base_channels": 32, "time_dim": 32, "cond_dim": 64}
#: From the signal to the process's exit: the current kernel call plus clean-up, on a loaded machine.
STOP_S = 10.0


@pytest.fixture(scope="module")
def tiny_weights(tmp_path_factory) -> Path:
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    torch.manual_seed(0)
    return save_upscaler(
        FlowUpscalerUNet(**TINY_UNET, dropout=0.0), tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors"
    )


class _Collected:
    """A pipe read to the end in a thread, so the child never blocks on a full pipe."""

    def __init__(self, stream) -> None:
        self.data = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            with self._lock:
                self.data += chunk

    def text(self) -> str:
        with self._lock:
            return self.data.decode(errors="replace")


def _ignore_sigint() -> None:  # what a non-interactive shell does for a background job (`cmd &`)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_capped_job(shared: Path, weights: Path, tmp_path: Path) -> tuple[subprocess.Popen, _Collected]:
    """A real capped upscale in a subprocess that inherits an ignored SIGINT, returned once its encode and a pass
    are done. 3 passes of 2100 px would pass the 16384 px cap: 2 run (8400x960), a job long enough to stop mid-way
    (its decode alone takes ~20 CPU-s on one thread); a strip, so that the encode before the signal is short."""
    Image.new("RGB", (2100, 240), (120, 90, 60)).save(tmp_path / "small.png")
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
    )
    argv = [
        sys.executable,
        "-m",
        "flowlift",
        "upscale",
        "small.png",
        "--passes",
        "3",
        "-o",
        str(out),
        *cpu_upscale_options(shared, weights),
        "--progress",
    ]
    process = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_ignore_sigint
    )
    err = _Collected(process.stderr)
    _Collected(process.stdout)
    try:
        deadline = time.monotonic() + 180
        while not re.search(r"small\.png:.*?\| *[2-4]/5", err.text()):  # encode and a pass done
            assert process.poll() is None, f"ended early ({process.returncode}):\n{err.text()}"
            assert time.monotonic() < deadline, f"no progress within 180 s:\n{err.text()}"
            time.sleep(0.05)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_capped_job_stops_within_seconds_with_130_and_nothing_partial(shared, tiny_weights, tmp_path, signum):
    process, err = _start_capped_job(shared, tiny_weights, tmp_path)
    out = tmp_path / "out"
    try:
        process.send_signal(signum)
        sent = time.monotonic()
        try:
            code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after {signal.Signals(signum).name}:\n{err.text()[-2000:]}")
        stopped = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = err.text()
    assert code == 130, text[-2000:]
    assert stopped < STOP_S, f"{stopped:.1f} s from {signal.Signals(signum).name} to exit"
    assert text.rstrip().endswith("flowlift upscale: interrupted") and "Traceback" not in text
    warning = text.index("warning: Flow Upscaler: 3 pass(es) on a 2100x240 image would exceed")
    work = re.search(r"small\.png: +\d+%", text)  # the image's first progress bar
    assert work and warning < work.start(), "the cap warning must come before the work"
    assert not out.exists() or list(out.iterdir()) == []  # nothing partial, no temporary file left


def test_ctrl_c_then_a_stream_of_sigterm_ends_with_130_and_one_line(shared, tiny_weights, tmp_path):
    """Ctrl-C, then a scheduler's SIGTERM again and again: the command printed "interrupted" and was then killed by
    a SIGTERM during the interpreter's teardown (which gives SIGTERM its default action back): 143, not 130."""
    process, err = _start_capped_job(shared, tiny_weights, tmp_path)
    try:
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            process.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        code = process.wait(timeout=5)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = err.text()
    assert code == 130, (code, text[-2000:])
    assert text.rstrip().endswith("flowlift upscale: interrupted") and text.count("interrupted") == 1, text[-2000:]
    assert "Traceback" not in text
    out = tmp_path / "out"
    assert not out.exists() or list(out.iterdir()) == []


def test_the_command_line_installs_sigint_even_when_it_was_inherited_ignored():
    from flowlift.commands.cli import _signals_interrupt

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt):
            with _signals_interrupt():
                assert signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL)  # the command's
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # an in-process caller gets its own back
    finally:
        signal.signal(signal.SIGINT, previous)

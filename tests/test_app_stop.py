"""``flowlift app`` stops within seconds of Ctrl-C/SIGTERM once a request has loaded its models (issue 48).

It printed ``flowlift app: interrupted`` at once and the process was gone 50-60 s later: the interpreter's final
garbage collection walked every object of the loaded models, Gradio and the web server (a stack dump during the
wait showed only "Garbage-collecting"). A command that owns its process now freezes the collector when it returns
(:func:`flowlift.commands.cli._skip_final_collection`), so the exit frees memory without walking it; since issue 47
every command does (a one-shot command's exit walked torch's objects for 0.3-0.4 CPU-seconds).
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import save_tiny_unet as tiny_upscaler
from flowlift.commands import cli
from flowlift.commands._options import OneLineParser

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from soak_app import STOP_S, start_server  # noqa: E402


def _fake_parser(long_running: bool):
    def interrupted(_args):
        raise KeyboardInterrupt

    parser = OneLineParser(prog="flowlift")  # as build_parser makes it
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("app").set_defaults(_run=interrupted, _long_running=long_running)
    return parser


@pytest.mark.parametrize("long_running", [True, False])
def test_a_command_that_owns_its_process_skips_the_final_collection(monkeypatch, long_running):
    frozen: list[bool] = []
    monkeypatch.setattr(cli, "build_parser", lambda: _fake_parser(long_running))  # _main(None): the process's own
    monkeypatch.setattr(cli, "reuse_freed_memory", lambda: None)
    monkeypatch.setattr("gc.freeze", lambda: frozen.append(True))
    monkeypatch.setattr(sys, "argv", ["flowlift", "app"])
    assert cli._main(None) == 130  # the process's own command line: `flowlift app`, interrupted
    assert frozen == [True, True]  # after torch's import and at the end; long-running or one-shot alike
    assert gc.isenabled()
    assert cli.main(["app"]) == 130 and frozen == [True, True]  # an in-process caller: never


def test_a_command_that_owns_its_process_runs_with_the_collector_on_and_the_imports_frozen(monkeypatch):
    """Issue 47: torch is imported with the collector off, then frozen; the command itself runs with it on."""
    seen: list[tuple[bool, int]] = []

    def record(_args):
        seen.append((gc.isenabled(), gc.get_freeze_count()))

    parser = OneLineParser(prog="flowlift")  # as build_parser makes it
    parser.add_subparsers(dest="command").add_parser("status").set_defaults(_run=record, _long_running=False)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(cli, "reuse_freed_memory", lambda: None)
    monkeypatch.setattr(sys, "argv", ["flowlift", "status"])
    try:
        assert cli._main(None) == 0
    finally:
        gc.unfreeze()  # this test process's objects back to the collector
    assert gc.isenabled() and seen[0][0] and seen[0][1] > 0
    monkeypatch.setattr(sys, "argv", ["flowlift", "--help"])  # ends before torch's import: the collector is back on
    try:
        with pytest.raises(SystemExit):  # argparse's --help
            cli._main(None)
    finally:
        gc.unfreeze()
    assert gc.isenabled()


def _interrupt_and_read(server: subprocess.Popen, again_after_s: float | None = None) -> tuple[int | None, str]:
    """SIGINT to the app (unless it already ended; ``again_after_s``: a second one that long after), its exit code
    within STOP_S (None: killed after) and its log."""
    code = None
    try:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)
        if again_after_s is not None:
            time.sleep(again_after_s)
            if server.poll() is None:
                server.send_signal(signal.SIGINT)
        code = server.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    server.log_file.seek(0)
    log = server.log_file.read()
    server.log_file.close()
    return code, log


def test_the_app_exits_on_sigint_after_a_request_loaded_its_models(tmp_path, shared):
    from gradio_client import Client, handle_file
    from PIL import Image

    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").resize((64, 48)).save(tmp_path / "in.png")
    server, url = start_server(weights, shared / "models" / "taef2", tmp_path)
    try:
        Client(url, verbose=False).predict(handle_file(str(tmp_path / "in.png")), 2, 0, 1.0, 1.0, api_name="/upscale")
        began = time.monotonic()
    finally:
        code, log = _interrupt_and_read(server)
    assert code == 130, f"exit {code} ({STOP_S} s after SIGINT):\n{log}"
    assert "flowlift app: interrupted" in log and "ok" in log and "Closing server" not in log, log
    print(f"flowlift app exited {time.monotonic() - began:.1f} s after SIGINT")  # the figure, never asserted


@pytest.mark.parametrize("again_after_s", [None, 0.05])
def test_the_app_stops_a_running_request_on_sigint_and_exits_130(tmp_path, shared, again_after_s):
    """Ctrl-C while a request ran: the process exited with the handler's thread inside torch, and the C++ runtime
    aborted it ("terminate called without an active exception", exit 134); now the request stops at its next layer
    (the server's stop check) and the app exits 130. A second Ctrl-C 50 ms later broke into that wait and aborted
    the same way (4 of 4 runs): it is held while the app stops."""
    from gradio_client import Client, handle_file
    from PIL import Image

    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    with Image.open(shared / "images" / "kodak" / "kodim03.png") as image:
        image.convert("RGB").save(tmp_path / "in.png")
    server, url = start_server(weights, shared / "models" / "taef2", tmp_path)
    try:
        job = Client(url, verbose=False).submit(
            handle_file(str(tmp_path / "in.png")), 8, 0, 1.0, 1.0, api_name="/upscale"
        )
        deadline = time.monotonic() + 120
        while not (job.status().progress_data or job.done()) and time.monotonic() < deadline:
            time.sleep(0.2)  # until the request reports its first stage: it is running
        assert not job.done(), "the request ended before the test could stop it"
    finally:
        code, log = _interrupt_and_read(server, again_after_s)
    assert code == 130, f"exit {code}:\n{log}"
    assert "the server is stopping" in log and "terminate called" not in log, log


def test_closing_the_app_says_nothing_of_its_own():
    """The stop is flowlift's one line: Gradio's "Closing server running on port: ..." was printed before it."""
    from types import SimpleNamespace

    from flowlift.app.page import _close

    calls = []
    demo = SimpleNamespace(close=lambda **kwargs: calls.append(kwargs))
    one_run = SimpleNamespace(close=lambda timeout: calls.append("run"))
    _close(demo, SimpleNamespace(one_run=one_run))
    assert calls == ["run", {"verbose": False}]

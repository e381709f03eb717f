"""Shared test set-up: offline hub, the ../shared assets, small helpers."""

from __future__ import annotations

import os
from pathlib import Path

# Tests never download: set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
# Every machine runs the float32 reference path on the CPU, whatever bfloat16 support its CPU has (and subprocesses
# too); tests/test_cpu_dtype.py sets the detection's answer itself.
os.environ["FLOWLIFT_CPU_BF16"] = "0"
# Gradio (flowlift app's tests) never phones home.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The shared assets folder: $FLOWLIFT_SHARED, by default ``<repo>/../shared``."""
    return Path(os.environ.get("FLOWLIFT_SHARED", REPO_ROOT.parent / "shared")).resolve()


@pytest.fixture(scope="session")
def shared() -> Path:
    """Path to ../shared; fails (never skips) with a clear message when it is missing."""
    path = shared_dir()
    needed = [path / "models" / "taef2", path / "golden", path / "images"]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        pytest.fail(
            f"test assets missing: {', '.join(missing)}. Set FLOWLIFT_SHARED to the shared/ folder "
            "(models/taef2, golden, images) or place it next to the repository root.",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def headless_browser() -> tuple[str, str]:
    """(chromium, chromedriver) for the browser tests, installing Debian's packages on a fresh machine
    (tests/browser.py); one clear failure naming the command where that cannot be done."""
    from browser import BrowserMissing, browser_paths

    try:
        return browser_paths()
    except BrowserMissing as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="module")
def single_thread_torch():
    """Run a module's tiny models single-threaded (fastest for them, much faster on a busy box); restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: The helper each builder module gives the tests that run in its venv, and that module: a collected test module
#: holding one of these needs that venv.
VENV_USERS = {"session_server": "comfy_venv", "comfy_python": "comfy_venv", "invokeai_python": "invokeai_venv"}
_background_build: list = []  # the Popen of the builds started below, for pytest_sessionfinish


def pytest_collection_finish(session) -> None:
    """Build the ComfyUI and InvokeAI venvs the collected tests will need (minutes each on a fresh machine) in the
    background from the start, at the lowest CPU and I/O priority, so that they take the CPU the earlier tests
    leave idle. A test that needs a venv before it is ready waits on the builder's file lock (tests/comfy_venv.py's
    ``built_venv``), and builds it itself if the background build failed, which then reports the error."""
    import importlib
    import shutil
    import subprocess
    import sys

    if session.config.option.collectonly:
        return
    needed = []
    for module in {getattr(item, "module", None) for item in session.items} - {None}:
        needed += [builder for helper, builder in VENV_USERS.items() if helper in vars(module)]
    missing = []
    for name in dict.fromkeys(sorted(needed)):  # comfy_venv before invokeai_venv: ComfyUI's tests come first
        builder = importlib.import_module(name)
        if not (builder.venv_dir() / builder.MARKER_NAME).is_file():
            missing.append(str(Path(builder.__file__)))
    if not missing:
        return
    script = (  # each builder as `python tests/<builder>.py` runs it (its folder first on sys.path)
        "import os, runpy, sys\nfor path in sys.argv[1:]:\n"
        "    sys.path.insert(0, os.path.dirname(path))\n    runpy.run_path(path, run_name='__main__')\n"
    )
    command = [sys.executable, "-c", script, *missing]
    if shutil.which("ionice"):
        command = ["ionice", "-c", "3", *command]
    log = Path.home() / ".cache" / "flowlift" / "background-venv-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as output:
        _background_build.append(
            subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=lambda: os.nice(19)
            )
        )
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building {len(missing)} test venv(s) in the background (log: {log})")


def pytest_sessionfinish(session, exitstatus) -> None:
    """The background build never outlives the session: stopped with its whole process group (a venv left
    without its completion marker is built again from scratch next time)."""
    import signal
    import subprocess

    for process in _background_build:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def pytest_terminal_summary(terminalreporter) -> None:
    """tests/test_doc_commands.py's table of the documented commands it does not run, each with why."""
    import sys

    module = sys.modules.get("test_doc_commands")
    rows = getattr(module, "SKIPPED_REPORT", None)
    if not rows:
        return
    terminalreporter.section(f"documented commands not run by tests/test_doc_commands.py ({len(rows)})")
    for where, command, reason in rows:
        terminalreporter.write_line(f"{where}: {command}")
        terminalreporter.write_line(f"    not run: {reason}")


@pytest.fixture
def fifo_alarm():
    """A FIFO opened for reading or writing would block for ever: a test that puts one where a command
    writes fails after 120 s instead (SIGALRM), then the previous handler is back."""
    import signal

    def _alarm(signum, frame):
        raise TimeoutError("the command blocked (a FIFO was opened?)")

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def unet():
    """The tiny Flow Upscaler (tests/builders.py's ``tiny_unet``, seed 0), one per module; a module's own ``unet``
    fixture wins."""
    from builders import tiny_unet

    return tiny_unet(seed=0)


@pytest.fixture(scope="module")
def vae(shared):
    """TAEF2 from ../shared on the CPU in float32, one per module; a module's own ``vae`` fixture wins."""
    import torch

    from flowlift.models.vae_loading import load_vae

    return load_vae(str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny_upscaler_weights(tmp_path_factory):
    """The tiny Flow Upscaler (seed 0) saved as a weights file, one per module."""
    from builders import save_tiny_unet

    return save_tiny_unet(tmp_path_factory.mktemp("weights") / "flow_upscaler.safetensors")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny FLUX.2 model folder in the diffusers layout (transformer/, vae/, random weights), one per module; a
    module's own ``model_dir`` fixture wins."""
    from tiny_flux2 import write_model_dir

    return write_model_dir(tmp_path_factory.mktemp("flux2-tiny"))

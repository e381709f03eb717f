"""Issue 43 class 3: SIGINT, SIGTERM and SIGHUP stop ``flowlift`` from its first line, not only once ``main()`` has
built its parser (every command module imported: a second or more on a loaded machine).

Deterministic, no timer: a ``sitecustomize`` on the child's path (the test's, not flowlift's) puts an import
finder in front that sends the signal to its own process when a chosen module is first looked up:

* ``flowlift.errors``: the first import of ``flowlift/__init__.py`` after its signal lines (flowlift's first line);
* ``flowlift.commands.upscale``: while the parser imports the command modules;
* ``datetime``: while numpy's C extension imports it (the parser imports numpy), which turns the KeyboardInterrupt
  into ``ImportError: PyCapsule_Import could not import module "datetime"`` (a 74-line traceback and exit 1);
* ``flowlift.models.taef2``: while the models load (the Flow Upscaler is loaded, the VAE is being built).

Each under SIGINT inherited as ignored (a background job of a non-interactive shell, which Python leaves
ignored), SIGINT with its default disposition, SIGTERM and SIGHUP; through ``python -m flowlift`` and through a
console script named ``flowlift`` (what pip writes). Every run must end with 130, ``interrupted`` as its last
line, no traceback, and fewer outputs than inputs (none here, and no temporary file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

SRC = Path(__file__).resolve().parents[1] / "src"

HOOK = """
import os, signal, sys

_AT, _SIGNAL = os.environ["FLOWLIFT_TEST_SIGNAL_AT"], int(os.environ["FLOWLIFT_TEST_SIGNAL"])


class _SignalOnImport:
    def find_spec(self, name, path=None, target=None):
        if name == _AT and "flowlift" in sys.modules:  # the run's own import, not one of Python's start
            sys.meta_path.remove(self)
            os.kill(os.getpid(), _SIGNAL)
        return None


sys.meta_path.insert(0, _SignalOnImport())
"""

#: What pip's console script ``flowlift`` holds (``[project.scripts]``: flowlift.commands.cli:main).
CONSOLE_SCRIPT = """import sys
from flowlift.commands.cli import main
if __name__ == "__main__":
    sys.exit(main())
"""

POINTS = {
    "first-line": "flowlift.errors",
    "imports": "flowlift.commands.upscale",
    "numpy-datetime": "datetime",
    "model-loading": "flowlift.models.taef2",
}
DISPOSITIONS = {
    "SIGINT-inherited-ignored": (signal.SIGINT, True),
    "SIGINT": (signal.SIGINT, False),
    "SIGTERM": (signal.SIGTERM, False),
    "SIGHUP": (signal.SIGHUP, False),  # a closed terminal: it ended the run with no line, its temporary left
}


@pytest.fixture(scope="module")
def job(tmp_path_factory, shared):
    """(folder with the hook and the console script, inputs folder, argv after the command word)."""
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    root = tmp_path_factory.mktemp("early")
    (root / "hook").mkdir()
    (root / "hook" / "sitecustomize.py").write_text(HOOK)
    (root / "flowlift").write_text(CONSOLE_SCRIPT)
    inputs = root / "inputs"
    inputs.mkdir()
    for index in range(2):
        Image.new("RGB", (64, 48), (40 * index, 90, 60)).save(inputs / f"in{index}.png")
    torch.manual_seed(0)
    weights = save_upscaler(
        FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0), root / "flow_upscaler.safetensors"
    )
    options = ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    return root, inputs, options


def run(job, tmp_path, form: str, point: str | None, signum: int = signal.SIGINT, ignored: bool = False):
    root, inputs, options = job
    out = tmp_path / "out"
    path = os.pathsep.join([str(root / "hook"), str(SRC), os.environ.get("PYTHONPATH", "")])
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        FLOWLIFT_TEST_SIGNAL=str(int(signum)),
        FLOWLIFT_TEST_SIGNAL_AT=POINTS.get(point, "no.such.module"),
        PYTHONPATH=path,
    )
    entry = ["-m", "flowlift"] if form == "module" else [str(root / "flowlift")]
    argv = [sys.executable, *entry, "upscale", str(inputs), "-o", str(out), *options]

    def ignore_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    result = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=env, preexec_fn=ignore_sigint if ignored else None
    )
    outputs = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    return result, outputs


@pytest.mark.parametrize("disposition", list(DISPOSITIONS))
@pytest.mark.parametrize(("form", "point"), [("module", p) for p in POINTS] + [("script", "first-line")])
def test_a_signal_from_the_first_line_on_ends_the_run_with_130(job, tmp_path, form, point, disposition):
    signum, ignored = DISPOSITIONS[disposition]
    result, outputs = run(job, tmp_path, form, point, signum, ignored)
    err = result.stderr
    assert result.returncode == 130, f"exit {result.returncode}:\n{err[-3000:]}"
    assert "Traceback" not in err and err.rstrip().splitlines()[-1].endswith("interrupted"), err[-3000:]
    assert outputs == [], outputs  # fewer outputs than the 2 inputs; no temporary file either


def test_a_sighup_under_nohup_is_ignored_from_the_first_line_on(job, tmp_path):
    """``nohup``'s SIGHUP, inherited as ignored, stays ignored at every point: the run writes every output."""
    root, inputs, options = job
    out = tmp_path / "out"
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        FLOWLIFT_TEST_SIGNAL=str(int(signal.SIGHUP)),
        FLOWLIFT_TEST_SIGNAL_AT=POINTS["model-loading"],
        PYTHONPATH=os.pathsep.join([str(root / "hook"), str(SRC), os.environ.get("PYTHONPATH", "")]),
    )
    argv = [sys.executable, "-m", "flowlift", "upscale", str(inputs), "-o", str(out), *options]

    def nohup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, preexec_fn=nohup)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["in0_x2.png", "in1_x2.png"]


def test_without_a_signal_the_same_run_writes_every_output(job, tmp_path):
    """The control: the hook itself changes nothing (its module never imports), both inputs are upscaled."""
    result, outputs = run(job, tmp_path, "script", None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert outputs == ["in0_x2.png", "in1_x2.png"]


def test_flowlift_is_the_program_only_as_its_command():
    """An import of flowlift (a library user, pytest, ComfyUI) leaves the process's signals alone."""
    code = "import signal, flowlift; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.stdout.strip() == "True", result.stderr


def _failing_parser(signum: int | None):
    """A ``build_parser`` that fails as numpy's import does: with ``signum``, after that signal's KeyboardInterrupt
    (which the C code turns into an ImportError); without, on its own, before any signal."""

    def build_parser():
        if signum is None:
            raise ImportError("a real failure, before any signal")
        try:
            signal.raise_signal(signum)
        except KeyboardInterrupt as stop:
            raise ImportError('PyCapsule_Import could not import module "datetime"') from stop
        raise AssertionError("the signal raised no KeyboardInterrupt")

    return build_parser


def test_an_error_that_follows_a_stop_signal_is_the_stop(monkeypatch, capsys):
    """Once a stop signal has come, what the command raises after it is reported as the stop: 130, one line."""
    from flowlift.commands import cli

    monkeypatch.setattr(cli, "build_parser", _failing_parser(signal.SIGTERM))
    assert cli.main(["upscale", "x.png"]) == cli.INTERRUPTED
    assert capsys.readouterr().err == "flowlift upscale: interrupted\n"
    assert cli.stop_signal() == signal.SIGTERM


def test_an_error_before_any_signal_is_not_taken_for_a_stop(monkeypatch):
    """The same error without a signal is a real failure: it goes up as it is (its traceback), never 130."""
    from flowlift.commands import cli

    monkeypatch.setattr(cli, "build_parser", _failing_parser(None))
    with pytest.raises(ImportError, match="a real failure"):
        cli.main(["upscale", "x.png"])

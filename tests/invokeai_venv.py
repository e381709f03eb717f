"""The InvokeAI test venv: InvokeAI 6.14.2 with its own pins, and flowlift's runtime dependencies under them.

InvokeAI pulls torchvision (a CUDA build on this package index) and pins numpy<2 and diffusers 0.40,
none of which may enter the main test environment (see ``../shared/README.md``), so the tests that run
a real InvokeAI server use this separate venv. It is built in two steps:

1. ``pip install torch==2.13.0 invokeai==6.14.2`` (the torch pin keeps the CPU build);
2. flowlift's ``[project].dependencies`` with every package already installed pinned to its version
   (``pip freeze`` as constraints): flowlift's floors must be met by what InvokeAI installed, and a
   floor above one of InvokeAI's pins fails the build instead of moving the pin. Packages InvokeAI
   provides under another distribution name are skipped (:data:`PROVIDED_BY_INVOKEAI`: ``cv2`` comes
   from its opencv-contrib-python, which conflicts with opencv-python-headless). pytest is added so the
   core tests can run under InvokeAI's pins (tests/test_invokeai.py).

flowlift itself is not installed: the server imports the checkout through the pack's entry point
(``nodes/flowlift`` links to the repository), and core tests run with ``src`` on ``PYTHONPATH``.

- ``invokeai_python()`` builds it if needed (a file lock keeps parallel processes from building it
  twice; a marker written last means a half-built venv is rebuilt) and returns its interpreter.
- ``invokeai_env(**extra)``: os.environ with the CPU shim on ``PYTHONPATH`` and ``HF_HUB_OFFLINE=1``.
- ``python tests/invokeai_venv.py`` builds it from the command line, ahead of the tests (which otherwise build it
  when they first need it).

Location: ``$FLOWLIFT_INVOKEAI_VENV`` if set, else ``~/.cache/flowlift/invokeai-venv-<hash>``, the hash
taken over the pins, flowlift's runtime dependencies and this builder's recipe version.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from comfy_venv import built_venv, flowlift_runtime_dependencies, offline_env, run_step, shared_dir, venv_python

TORCH_PIN = "torch==2.13.0"
INVOKEAI_PIN = "invokeai==6.14.2"
TEST_TOOLS = ("pytest>=8", "websocket-client>=1.6")  # core tests; progress events (tests/invokeai_events.py)
#: flowlift requirement -> the InvokeAI dependency that provides the same import under another name.
PROVIDED_BY_INVOKEAI = {"opencv-python-headless": "opencv-contrib-python"}
RECIPE = 1  # bump when the build steps change
MARKER_NAME = ".flowlift-invokeai-venv-complete"


def _requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def flowlift_requirements() -> list[str]:
    """flowlift's runtime dependencies minus those InvokeAI provides under another distribution name."""
    return [r for r in flowlift_runtime_dependencies() if _requirement_name(r) not in PROVIDED_BY_INVOKEAI]


def venv_dir() -> Path:
    override = os.environ.get("FLOWLIFT_INVOKEAI_VENV")
    if override:
        return Path(override).expanduser().resolve()
    recipe = [RECIPE, TORCH_PIN, INVOKEAI_PIN, flowlift_runtime_dependencies(), TEST_TOOLS, PROVIDED_BY_INVOKEAI]
    key = hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "flowlift" / f"invokeai-venv-{key}"


def _run(command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    return run_step("invokeai venv", command, what, env)


def _imports_diffusers(python: str) -> bool:
    check = [python, "-c", "import diffusers.models.autoencoders.autoencoder_kl_flux2, invokeai.invocation_api"]
    return subprocess.run(check, capture_output=True, env=invokeai_env()).returncode == 0


def _build(venv: Path) -> None:
    _run([sys.executable, "-m", "venv", str(venv)], f"create {venv}")
    python = str(venv_python(venv))
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run([*pip, TORCH_PIN, INVOKEAI_PIN], f"install {INVOKEAI_PIN}")
    installed = _run([python, "-m", "pip", "freeze", "--disable-pip-version-check"], "list InvokeAI's pins")
    pins = [line for line in installed.splitlines() if re.fullmatch(r"[A-Za-z0-9._-]+==[^\s;@]+", line.strip())]
    names = {line.split("==")[0].lower().replace("_", "-") for line in pins}
    missing = sorted(p for p in PROVIDED_BY_INVOKEAI.values() if p not in names)
    if missing:
        raise RuntimeError(f"invokeai venv: {INVOKEAI_PIN} no longer installs {missing}; revisit PROVIDED_BY_INVOKEAI")
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as constraints:
        constraints.write("\n".join(pins) + "\n")
    try:
        _run(
            [*pip, "-c", constraints.name, *flowlift_requirements(), *TEST_TOOLS],
            "install flowlift's runtime dependencies under InvokeAI's pins",
        )
    finally:
        os.unlink(constraints.name)
    # torchaudio's wheel is a CUDA build; through transformers it breaks `import diffusers` even with the shim.
    imports = _imports_diffusers(python)
    if not imports and "torchaudio" in names:
        _run([python, "-m", "pip", "uninstall", "--quiet", "-y", "torchaudio"], "uninstall torchaudio")
        imports = _imports_diffusers(python)
    if not imports:
        raise RuntimeError("invokeai venv: diffusers or invokeai.invocation_api does not import (with the CPU shim)")


def invokeai_python() -> Path:
    """The InvokeAI test venv's python, building the venv first if it is missing or half-built."""
    return built_venv(venv_dir(), _build, MARKER_NAME)


def invokeai_env(**extra: str) -> dict[str, str]:
    """os.environ with the CPU shim first on PYTHONPATH and HF_HUB_OFFLINE=1, plus ``extra``.

    The checkout's ``src`` is deliberately not added: the server must import flowlift through the
    pack's entry point, as a user's InvokeAI does (tests that run core modules add it themselves).
    """
    shim = shared_dir() / "comfyui-cpu-shim"
    if not shim.is_dir():
        raise FileNotFoundError(f"the CPU shim is missing: {shim} (set FLOWLIFT_SHARED to the shared/ folder)")
    return offline_env([str(shim)], **extra)  # PYTHONPATH not inherited: no other checkout's src either


if __name__ == "__main__":
    started = time.monotonic()
    python = invokeai_python()
    print(f"{python} (ready after {time.monotonic() - started:.0f} s)")

"""The ComfyUI test venv: ComfyUI 0.33's requirements next to the pack's ``requirements.txt``, built once.

ComfyUI needs torchvision (and spandrel), which must never enter the main environment (see
``../shared/README.md``), so tests that run a real ComfyUI server or spandrel use this separate venv.

- ``comfy_python()`` builds it if needed and returns its interpreter. A file lock keeps parallel test
  processes from building it twice; a marker file written last means a half-built venv (interrupted
  build, full disk) is rebuilt from scratch instead of being used.
- ``comfy_env(**extra)`` is the environment for a process run with that interpreter: the CPU shim and
  this checkout's ``src`` first on ``PYTHONPATH`` (flowlift itself is not installed into the venv, so
  the checkout under test is what gets imported), ``HF_HUB_OFFLINE=1``.
- ``python tests/comfy_venv.py`` builds it from the command line, ahead of the tests (which otherwise build it
  when they first need it).

The build is the install a user of ComfyUI-Manager gets: ComfyUI's own requirements (torch pinned to the CPU
build), then this pack's ``requirements.txt`` into the same environment, exactly as ComfyUI-Manager installs a
node pack. torchaudio stays installed: the CPU shim makes its CUDA-linked extension count as absent.

Location: ``$FLOWLIFT_COMFY_VENV`` if set, else ``~/.cache/flowlift/comfy-venv-<hash>``, the hash taken
over ComfyUI's ``requirements.txt`` and the pack's ``requirements.txt``, so a change of either builds a
fresh venv.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCH_PIN = "torch==2.13.0"
MARKER_NAME = ".flowlift-comfy-venv-complete"


def shared_dir() -> Path:
    """The shared assets folder: $FLOWLIFT_SHARED, by default ``<repo>/../shared`` (same rule as conftest)."""
    return Path(os.environ.get("FLOWLIFT_SHARED", REPO_ROOT.parent / "shared")).resolve()


#: The ComfyUI release the pack is tested on (the minimum supported version, docs/comfyui.md).
COMFYUI_VERSION = "0.33.0"


def comfyui_dir() -> Path:
    """The read-only ComfyUI 0.33 snapshot in the shared folder."""
    return shared_dir() / "comfyui-0.33"


#: The file ComfyUI-Manager and the Comfy registry install into ComfyUI's environment.
PACK_REQUIREMENTS = REPO_ROOT / "requirements.txt"


def flowlift_runtime_dependencies() -> list[str]:
    """``[project].dependencies`` of this checkout's pyproject.toml."""
    with open(REPO_ROOT / "pyproject.toml", "rb") as handle:
        return list(tomllib.load(handle)["project"]["dependencies"])


def venv_dir() -> Path:
    """Where the venv lives: ``$FLOWLIFT_COMFY_VENV``, else a cache folder keyed by what goes into it."""
    override = os.environ.get("FLOWLIFT_COMFY_VENV")
    if override:
        return Path(override).expanduser().resolve()
    requirements = (comfyui_dir() / "requirements.txt").read_bytes()
    key = hashlib.sha256(requirements + PACK_REQUIREMENTS.read_bytes()).hexdigest()[:12]
    return Path.home() / ".cache" / "flowlift" / f"comfy-venv-{key}"


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def run_step(label: str, command: list[str], what: str, env: dict[str, str] | None = None) -> str:
    """Run one build step, printing ``<label>: <what> ...`` and its time; its output, or RuntimeError with the tail."""
    started = time.monotonic()
    print(f"{label}: {what} ...", file=sys.stderr, flush=True)
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if result.returncode != 0:
        tail = "\n".join(result.stdout.splitlines()[-40:])
        raise RuntimeError(f"{label}: {what} failed (exit {result.returncode}):\n{tail}")
    print(f"{label}: {what} done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return result.stdout


def built_venv(venv: Path, build: Callable[[Path], None], marker: str = MARKER_NAME) -> Path:
    """``venv``'s python, running ``build(venv)`` first unless the completion ``marker`` file is there.

    A file lock keeps parallel test processes from building it twice; the marker, written last, means a
    half-built venv (an interrupted build, a full disk) is built again from scratch.
    """
    if (venv / marker).is_file():
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then re-check
        try:
            if not (venv / marker).is_file():
                if venv.exists():
                    shutil.rmtree(venv)  # no marker: a half-built venv from an interrupted build
                build(venv)
                built = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                (venv / marker).write_text(json.dumps({"built": built}))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv_python(venv)


def _run(command: list[str], what: str) -> None:
    run_step("comfy venv", command, what)


def _build(venv: Path) -> None:
    requirements = comfyui_dir() / "requirements.txt"
    if not requirements.is_file():
        raise FileNotFoundError(f"ComfyUI requirements not found: {requirements} (set FLOWLIFT_SHARED)")
    _run([sys.executable, "-m", "venv", str(venv)], f"create {venv}")
    python = str(venv_python(venv))
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    # The torch pin keeps the CPU build (a bare "torch" requirement would pull a CUDA one on CPU machines).
    _run([*pip, TORCH_PIN, "-r", str(requirements), "requests"], "install ComfyUI's requirements")
    # ComfyUI-Manager's route: the pack's requirements.txt into ComfyUI's environment, its torch kept.
    _run([*pip, TORCH_PIN, "-r", str(PACK_REQUIREMENTS)], "install the pack's requirements.txt")


def comfy_python() -> Path:
    """The ComfyUI test venv's python, building the venv first if it is missing or half-built."""
    return built_venv(venv_dir(), _build)


def comfy_env(**extra: str) -> dict[str, str]:
    """os.environ with the CPU shim and this checkout's src first on PYTHONPATH, HF_HUB_OFFLINE=1, one torch thread
    (unless OMP_NUM_THREADS is set), plus ``extra``."""
    paths = [str(shared_dir() / "comfyui-cpu-shim"), str(REPO_ROOT / "src")]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    # One torch thread unless asked otherwise: the test models are tiny, and on a shared 2-core machine two threads
    # contend (the tiny Klein's forward: 25 ms on one thread, 300-900 ms on two at load average 11).
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return offline_env(paths, **{**threads, **extra})


def offline_env(pythonpath: list[str], **extra: str) -> dict[str, str]:
    """os.environ with PYTHONPATH set to ``pythonpath`` alone and HF_HUB_OFFLINE=1, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


if __name__ == "__main__":
    started = time.monotonic()
    python = comfy_python()
    print(f"{python} (ready after {time.monotonic() - started:.0f} s)")

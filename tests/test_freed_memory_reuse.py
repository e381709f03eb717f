"""A one-shot command keeps the memory it frees for its next allocations (``devices.reuse_freed_memory``).

Each check runs a fresh interpreter (the policy is process-wide and cannot be undone) and reads glibc's
``mallinfo2()`` around the allocation of a 64 MiB tensor: ``hblks`` counts the blocks served by ``mmap``, which
glibc unmaps on free, so every later allocation of that size faults in fresh zeroed pages. With the
policy, big blocks come from the heap (``hblks == 0``) and freed ones stay there for reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flowlift.commands.cli import build_parser


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    try:
        return bool(name) and hasattr(ctypes.CDLL(name), "mallinfo2")
    except OSError:
        return False


SRC = Path(__file__).resolve().parents[1] / "src"

pytestmark = pytest.mark.skipif(not _has_mallinfo2(), reason="glibc's mallinfo2 (glibc >= 2.33) is needed")

PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, json, sys

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    SETUP
    import torch
    before = libc.mallinfo2().hblks
    block = torch.ones(16 * 2**20)  # 64 MiB of float32, far above glibc's mmap threshold
    print("PROBE " + json.dumps({"mmapped_blocks": libc.mallinfo2().hblks - before, "result": RESULT}))
    """
)


def probe(setup: str, result: str = "None", env: dict | None = None) -> dict:
    code = PROBE.replace("SETUP", textwrap.dedent(setup).strip()).replace("RESULT", result)
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), **(env or {})},
    )
    assert run.returncode == 0, run.stderr
    line = next(line for line in run.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


def test_without_the_policy_glibc_maps_big_blocks() -> None:
    """The control: if this failed, the other checks could not tell the policy from the default."""
    assert probe("pass")["mmapped_blocks"] >= 1


def test_the_policy_serves_big_blocks_from_the_heap() -> None:
    found = probe("from flowlift.devices import reuse_freed_memory\nok = reuse_freed_memory()", result="ok")
    assert found == {"mmapped_blocks": 0, "result": True}


def test_the_environment_switch_keeps_glibcs_policy() -> None:
    found = probe(
        "from flowlift.devices import reuse_freed_memory\nok = reuse_freed_memory()",
        result="ok",
        env={"FLOWLIFT_REUSE_FREED_MEMORY": "0"},
    )
    assert found["result"] is False and found["mmapped_blocks"] >= 1


def _command_line(argv: list[str], *, own_process: bool) -> str:
    call = "main()" if own_process else f"main({argv!r})"
    return f"""
        sys.argv = ["flowlift", *{argv!r}]
        from flowlift.commands.cli import main
        code = {call}
    """


@pytest.mark.parametrize(
    ("argv", "own_process", "reuses"),
    [
        (["status", "."], True, True),  # the command line: the process is the command's
        (["upscale", "no-such-input.png"], True, True),
        (["status", "."], False, False),  # an in-process caller (a test, a script) keeps its allocator
        (["upscale", "no-such-input.png", "--max-memory", "6GB"], True, False),  # a memory cap comes first
    ],
)
def test_the_command_line_applies_it_to_one_shot_commands_only(
    argv: list[str], own_process: bool, reuses: bool, tmp_path
) -> None:
    found = probe(_command_line(argv, own_process=own_process), result="code")
    assert isinstance(found["result"], int)
    assert (found["mmapped_blocks"] == 0) is reuses, found


def test_the_app_server_is_long_running() -> None:
    parser = build_parser()
    assert parser.parse_args(["app"])._long_running is True
    for command in (["upscale", "x.png"], ["status", "."], ["img2img", "x.png", "--model", "m"]):
        assert parser.parse_args(command)._long_running is False, command

"""A short run of ``benchmarks/soak_app.py``: 10 requests from 4 concurrent clients to a real ``flowlift app``.

The full run (100 requests, 8 clients) and its memory verdict are the benchmark's; here every answer
must be a valid PNG of the request, the server must log one line per request, keep its open files and
threads bounded, and exit on SIGTERM with status 130 (interrupted), as every command does.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from soak_app import run_soak  # noqa: E402


def test_short_soak_every_answer_valid_and_the_server_exits(shared):
    result = run_soak(10, 4, size=(64, 48), scale=2, shared=shared)
    assert result.errors == [] and result.valid == 10
    assert result.server_exit is not None, "flowlift app did not exit within 30 s of SIGTERM"
    assert result.server_exit == 130, f"SIGTERM is an interruption like Ctrl-C (exit 130), got {result.server_exit}"
    requests = re.findall(r"flowlift app: upscale kodim0\d\.png 64x48 x2 -> 128x96 \d+\.\d s ok", result.server_log)
    assert len(requests) == 10, result.server_log
    assert result.warm is not None and result.end is not None
    assert result.end.open_files <= result.warm.open_files + 4 and result.end.threads <= result.warm.threads + 4

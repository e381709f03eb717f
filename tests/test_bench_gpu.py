"""``benchmarks/bench_gpu.py --device cpu --quick`` runs and prints the whole table (toy sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpu_quick_on_cpu(shared):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FLOWLIFT_SHARED=str(shared))
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py"), "--device", "cpu", "--quick"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    table = result.stdout
    assert "| measure | setting | time | ratio | peak memory | note |" in table
    for row in (
        "| UNet pass, 128 px output | eager fp32 |",
        "| batch, 128 px output, per image | batch 8 eager |",
        "| executor, 256 px output | executor, strips from 64MB |",
        "| executor, 256 px output | executor, staged stores",
        "| pipeline 48x32 -> x2 | max_memory 2GB |",
        "| refine img2img 0.5 x4 steps, 64 px, toy transformer | offload model |",
        "| refine img2img 0.5 x4 steps, 64 px, toy transformer | max_memory 1GB |",
        "| refine img2img 0.5 x4 steps, 64 px, toy transformer | offload group |",
    ):
        assert row in table, row
    assert "skipped: no TAEF2" not in table

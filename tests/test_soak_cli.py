"""``benchmarks/soak_cli.py``, short: 20 images through one ``flowlift upscale`` process, every output valid,
memory, open files and threads flat (issue 22, item 14; the 300-image table is in docs/soak.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_soak_cli_short_run_writes_every_output_valid_and_stays_flat(shared, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FLOWLIFT_SHARED=str(shared), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak_cli.py"),
            "--images",
            "20",
            "--unet",
            "tiny",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert "outputs: 20 of 20 valid" in run.stdout, run.stdout + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]  # flat: memory, open files, threads
    row = [line for line in run.stdout.splitlines() if line.startswith("| flowlift upscale (one process) | 20 |")]
    assert len(row) == 1 and row[0].endswith("| flat |"), run.stdout
    outputs = sorted((tmp_path / "out-20-tiny").iterdir())
    assert len(outputs) == 20 and all(p.name.endswith("_x2.png") for p in outputs)  # nothing else left there
    assert "20 written, 0 skipped, 0 failed (20 inputs)" in run.stderr  # the summary, passed through

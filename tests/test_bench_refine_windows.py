"""``benchmarks/bench_refine_windows.py --tiny`` prints the seed's table: its columns and step counts.

With random weights the HF energy and grey levels mean nothing; what is checked is the table's shape,
the model steps per schedule and strength, and that strength 1 reproduces the txt2img reference row.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from flowlift.flux2.schedule import flux2_sigmas

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "benchmarks" / "bench_refine_windows.py"
    spec = importlib.util.spec_from_file_location("bench_refine_windows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_table_columns_and_step_counts(capsys):
    bench = _bench()
    assert bench.main(["--tiny", "--steps", "4", "--width", "64", "--height", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("command: PYTHONPATH=src python benchmarks/bench_refine_windows.py --tiny")
    header = "| run | schedule | model steps | last sigma before 0 | HF energy | patch grey levels | patch sigma |"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[lines.index(header) + 2 :]]
    assert len(rows) == 1 + 2 * len(bench.STRENGTHS)
    reference = rows[0]
    assert reference[0] == "txt2img 64x64 (reference)"
    seq = 4 * 4
    for row, (strength, schedule) in zip(
        rows[1:], [(s, k) for s in bench.STRENGTHS for k in bench.SCHEDULES], strict=True
    ):
        assert row[0] == f"strength {strength:g}" and row[1] == schedule
        expected = flux2_sigmas(4, seq, 1.0 - strength, schedule=schedule)
        assert int(row[2]) == len(expected) - 1 and row[3] == f"{float(expected[-2]):.3f}"
        if strength == 1.0:
            assert row[4:] == reference[4:]  # img2img at strength 1 is txt2img, bit for bit
    assert [int(r[2]) for r in rows[1:] if r[1] == "respaced"] == [4] * 5
    assert [int(r[2]) for r in rows[1:] if r[1] == "clipped"] == [1, 1, 1, 2, 4]


def test_smoothest_box_finds_the_flat_block():
    import numpy as np

    bench = _bench()
    rng = np.random.default_rng(0)
    luma = rng.uniform(0, 255, (64, 64))
    luma[32:48, 16:32] = 128.0  # a flat "sky" block on a grid point
    assert bench.smoothest_box(luma) == (16, 32, 16, 16)

"""An image identical to its reference measures PSNR ``inf``; the mean and worst rows count it as 100 dB
(:data:`flowlift.measure.evaluate.PSNR_CEILING_DB`, the SR scripts' 100 for a zero MSE), so one identical image no
longer makes a method's mean ``inf`` and hides every other image. The table says the rule and which rows it held;
``results.json`` keeps each image's own ``inf``."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from flowlift.commands.cli import main
from flowlift.measure import evaluate as E


def test_one_identical_image_leaves_a_finite_mean_of_the_others_and_the_ceiling():
    per_image = {"a": {"psnr_gt": math.inf, "psnr_y": math.inf}, "b": {"psnr_gt": 30.0, "psnr_y": 32.0}}
    mean, worst = E.summarize(per_image)
    assert mean == {"psnr_gt": 65.0, "psnr_y": 66.0} and worst == {"psnr_gt": 30.0, "psnr_y": 32.0}
    assert E.capped_counts(per_image) == {"psnr_gt": 1, "psnr_y": 1}
    every = {"a": {"psnr_input": math.inf}, "b": {"psnr_input": 120.0}}  # a finite PSNR past it too (16 bits)
    assert E.summarize(every) == ({"psnr_input": 100.0}, {"psnr_input": 100.0})
    assert E.summarize({"a": {"sharpness": 5.0}, "b": {"sharpness": 200.0}})[0] == {"sharpness": 102.5}  # no PSNR


def _pairs(tmp_path):
    """Three 64x64 photos; the outputs are two of them shifted by 4 levels and the third unchanged."""
    rng = np.random.default_rng(3)
    refs, outs = tmp_path / "refs", tmp_path / "outs"
    refs.mkdir(), outs.mkdir()
    for i, name in enumerate(("a", "b", "c")):
        photo = rng.integers(8, 248, (64, 64, 3), dtype=np.uint8)
        Image.fromarray(photo).save(refs / f"{name}.png")
        Image.fromarray(photo + (4 if i else 0)).save(outs / f"{name}.png")
    return refs, outs


def test_the_table_states_the_rule_and_the_json_keeps_each_images_inf(tmp_path, capsys):
    refs, outs = _pairs(tmp_path)
    report = tmp_path / "report"
    argv = ["eval", str(outs), "--reference", str(refs), "--ground-truth", str(refs), "-o", str(report)]
    assert main([*argv, "--no-progress"]) == 0
    table = (report / "table.md").read_text()
    row = table.split("| outputs | mean |")[1].splitlines()[0]
    assert "inf" not in row, row
    psnr_gt = 20 * math.log10(255 / 4)  # 35.92 dB for the two shifted images
    assert f"| {(2 * psnr_gt + 100) / 3:.2f} |" in row, row
    assert "count each image's PSNR as at most 100 dB (an identical pair's is inf; held there:" in table
    assert "outputs PSNR gt 1" in table and "outputs PSNR-Y 1" in table and "outputs PSNR in 1" in table
    data = json.loads((report / "results.json").read_text())
    assert data["images"]["outputs"]["a"]["psnr_gt"] == "inf"  # each image as measured
    assert data["summary"]["outputs"]["capped"] == {"psnr_input": 1, "psnr_gt": 1, "psnr_y": 1}
    assert data["summary"]["outputs"]["mean"]["psnr_gt"] == pytest.approx((2 * psnr_gt + 100) / 3)
    assert "inf" not in capsys.readouterr().out.split("| outputs | mean |")[1].splitlines()[0]

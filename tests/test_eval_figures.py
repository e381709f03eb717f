"""``metrics.png`` says what ``table.md`` says: its bars are the table's means, so a method whose mean PSNR is ``inf``
(one image identical to its ground truth) is a bar above every measured one, marked ``inf``, not the mean of its
finite images (tested on the panels the figure is drawn from)."""

from __future__ import annotations

import math

from flowlift.measure import report as R
from flowlift.measure.evaluate import EvalReport


def _report() -> EvalReport:
    """Two methods on two images: ``copy`` reproduces image a exactly (PSNR inf) and misses b; ``blur`` is finite."""
    report = EvalReport(config={"mode": "run", "scale": 2})
    report.results = {
        "(ground truth)": {"a": {"sharpness": 9.0}, "b": {"sharpness": 8.0}},
        "copy": {"a": {"psnr_gt": math.inf, "sharpness": 9.0}, "b": {"psnr_gt": 31.0, "sharpness": 8.0}},
        "blur": {"a": {"psnr_gt": 28.0, "sharpness": 2.0}, "b": {"psnr_gt": 26.0, "sharpness": 1.0}},
    }
    return report


def test_an_infinite_mean_psnr_is_a_marked_bar_above_every_finite_one_as_in_the_table():
    report = _report()
    table = R.markdown_table(report)
    assert "| copy | mean |" in table and "| inf |" in table.split("| copy | mean |")[1].splitlines()[0]
    (panel,) = [p for p in R.figure_panels(report) if p.key == "psnr_gt"]
    bars = {bar.label: bar for bar in panel.bars}
    assert bars["copy"].text == "inf"  # the table's word, over the bar
    assert bars["copy"].height == panel.cap > 31.0  # not 31.0, the mean of its one finite image
    assert sorted(bars["copy"].dots) == [31.0, panel.cap]  # the identical image's dot at the cap
    assert bars["blur"].text is None and bars["blur"].height == 27.0 < panel.cap
    assert panel.labels == ("copy", "blur")


def test_every_finite_bar_is_the_tables_mean():
    report = _report()
    summary = report.summary()
    for panel in R.figure_panels(report):
        for bar in panel.bars:
            mean = summary[bar.label]["mean"][panel.key]
            assert bar.height == mean if math.isfinite(mean) else bar.text == R.number_text(mean, "{:.2f}")
    assert R.metrics_png(report)[:4] == b"\x89PNG"  # drawn without a warning about an infinite bar

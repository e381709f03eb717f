"""``metrics.png`` says what ``table.md`` says: its bars are the table's means and its dots every image as the table
counts it, so an image identical to its ground truth (PSNR ``inf``) is a dot at the table's 100 dB ceiling and its
method's bar the table's finite mean (tested on the panels the figure is drawn from)."""

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


def test_an_identical_images_psnr_is_a_dot_at_the_ceiling_and_the_bar_the_tables_mean():
    report = _report()
    table = R.markdown_table(report)
    assert "| 65.50 |" in table.split("| copy | mean |")[1].splitlines()[0]
    (panel,) = [p for p in R.figure_panels(report) if p.key == "psnr_gt"]
    bars = {bar.label: bar for bar in panel.bars}
    assert bars["copy"].text is None and bars["copy"].height == 65.5  # (100 + 31) / 2, as the table
    assert sorted(bars["copy"].dots) == [31.0, 100.0]  # the identical image's dot at the ceiling
    assert bars["blur"].text is None and bars["blur"].height == 27.0
    assert panel.labels == ("copy", "blur")


def test_a_non_finite_mean_is_still_a_marked_bar():
    report = _report()
    report.results["copy"]["a"]["sharpness"] = math.nan  # no metric measures NaN; the figure still says it
    (panel,) = [p for p in R.figure_panels(report) if p.key == "sharpness"]
    bars = {bar.label: bar for bar in panel.bars}
    assert bars["copy"].text == "nan" and bars["blur"].text is None


def test_every_finite_bar_is_the_tables_mean():
    report = _report()
    summary = report.summary()
    for panel in R.figure_panels(report):
        for bar in panel.bars:
            mean = summary[bar.label]["mean"][panel.key]
            assert bar.height == mean if math.isfinite(mean) else bar.text == R.number_text(mean, "{:.2f}")
    assert R.metrics_png(report)[:4] == b"\x89PNG"  # drawn without a warning about an infinite bar

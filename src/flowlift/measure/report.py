"""Rendering an :class:`flowlift.measure.evaluate.EvalReport`: the Markdown table (mean and worst rows), the
metrics and crops figures, and :func:`write_report`, which puts them in place with ``results.json`` as one set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flowlift.files.atomic_set import atomic_write_set
from flowlift.files.own_files import (
    Recogniser,
    flowlift_image,
    json_report,
    markdown_report,
    markdown_stamp,
    report_json,
    software,
)
from flowlift.measure.evaluate import PSNR_CEILING_DB, PSNR_KEYS, EvalReport, summary_values

#: (metric key, column header, format) in table order; a column appears when any row has it.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("cast", "RGB cast R/G/B (/255)", ""),
    ("c_mean_change_pct", "C_mean %", "{:+.2f}"),
    ("dC", "dC", "{:+.2f}"),
    ("c_p99_change", "C p99", "{:+.2f}"),
    ("l_std_change", "L_std", "{:+.2f}"),
    ("l_p5_change", "L p5", "{:+.2f}"),
    ("l_p95_change", "L p95", "{:+.2f}"),
    ("psnr_input", "PSNR in (dB)", "{:.2f}"),
    ("sharpness", "sharpness", "{:.2f}"),
    ("hf_energy", "HF energy", "{:.0f}"),
    ("levels", "levels", "{:.0f}"),
    ("grey_sigma", "grey σ", "{:.2f}"),
    ("l1", "L1 (/255)", "{:.3f}"),
    ("identical_pct", "identical %", "{:.2f}"),
    ("psnr_gt", "PSNR gt (dB)", "{:.2f}"),
    ("ssim_gt", "SSIM gt", "{:.4f}"),
    ("psnr_y", "PSNR-Y (dB)", "{:.2f}"),
    ("ssim_y", "SSIM-Y", "{:.4f}"),
)


def _cell(values: dict[str, float], key: str, fmt: str) -> str:
    if key == "cast":
        if "cast_r" not in values:
            return ""
        return "/".join(f"{values[f'cast_{c}']:+.2f}" for c in "rgb")
    if key not in values:
        return ""
    return number_text(values[key], fmt)


def number_text(value: float, fmt: str) -> str:
    """How the table writes a number: ``fmt`` when finite, else Python's word for it (``inf``, ``-inf``, ``nan``)."""
    return fmt.format(value) if math.isfinite(value) else str(value)


#: The SR field's metrics as the table computes them (docs/measure.md): a pair with a 16-bit image at 16 bits, Y
#: rounded as MATLAB's rgb2ycbcr (``y_channel`` matlab) or not, as BasicSR's (basicsr).
SR_METRICS_NOTE = (
    "; PSNR-Y / SSIM-Y: BT.601 Y at the images' bit depth (8 or 16), {rounding}, the scale in px off each border"
)
Y_ROUNDING = {"matlab": "rounded as MATLAB's rgb2ycbcr", "basicsr": "unrounded as BasicSR's"}


def markdown_table(report: EvalReport) -> str:
    """Markdown table: a mean and a worst row per method (worst per :data:`WORST_RULE`)."""
    summary = report.summary()
    present = {k for s in summary.values() for k in s["mean"]}
    columns = [c for c in COLUMNS if c[0] in present or (c[0] == "cast" and "cast_r" in present)]
    header = ["method", "row"] + [c[1] for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, s in summary.items():
        rows = [("mean", s["mean"])] if label == "(ground truth)" else [("mean", s["mean"]), ("worst", s["worst"])]
        for row_name, values in rows:
            cells = [label, row_name] + [_cell(values, k, f) for k, _, f in columns]
            lines.append("| " + " | ".join(cells) + " |")
    n = len(next(iter(report.results.values()), {}))
    notes = [f"{info['labels']}: {info['note']}" for info in (report.config.get("spandrel") or {}).values()]
    notes += [f"{label}: skipped, {reason}" for label, reason in (report.config.get("skipped") or {}).items()]
    rounding = Y_ROUNDING[report.config.get("y_channel", "matlab")]
    return (
        "\n".join(lines)
        + f"\n\n{n} image(s); drift and PSNR in at input scale (INTER_AREA), Lab units"
        + (SR_METRICS_NOTE.format(rounding=rounding) if "psnr_y" in present else "")
        + ceiling_note(summary)
        + ".\n"
        + "".join(f"{note}\n" for note in notes)
    )


def ceiling_note(summary: dict) -> str:
    """The table's rule for a PSNR past :data:`~flowlift.measure.evaluate.PSNR_CEILING_DB` (an identical pair's
    ``inf``) and the rows it held, when a PSNR column is there: ``; mean and worst rows count each image's PSNR as at
    most 100 dB (an identical pair's is inf; held there: copy PSNR gt 1 image(s))``."""
    if not any(key in s["mean"] for s in summary.values() for key in PSNR_KEYS):
        return ""
    headers = {key: header.removesuffix(" (dB)") for key, header, _ in COLUMNS}
    held = [f"{label} {headers[key]} {n}" for label, s in summary.items() for key, n in s.get("capped", {}).items()]
    where = f"; held there: {', '.join(held)} image(s)" if held else ""
    return (
        f"; mean and worst rows count each image's PSNR as at most {PSNR_CEILING_DB:g} dB "
        f"(an identical pair's is inf{where})"
    )


FIGURE_METRICS = (
    ("cast_max", "max |RGB cast| (/255)"),
    ("c_mean_change_pct", "C_mean change (%)"),
    ("l_std_change", "L_std change"),
    ("psnr_input", "PSNR to input (dB)"),
    ("sharpness", "sharpness (mean |Laplacian|)"),
    ("psnr_gt", "PSNR to ground truth (dB)"),
    ("ssim_gt", "SSIM to ground truth"),
)


def _png_bytes(fig) -> bytes:
    """A matplotlib figure as PNG bytes marked as flowlift's (its ``Software`` text, which a later run looks for)."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": software("eval")})
    return buffer.getvalue()


@dataclass(frozen=True)
class FigureBar:
    """One method's bar in a ``metrics.png`` panel: at ``position``, ``height`` the table's mean (drawn at the panel's
    cap when it is no finite number), ``text`` the table's word for such a mean (``inf``) written over the bar (None
    for a finite one), and every image's value as a dot (``dots``, a non-finite one at the cap too)."""

    label: str
    position: int
    height: float
    text: str | None
    dots: tuple[float, ...]


@dataclass(frozen=True)
class FigurePanel:
    """One metric's panel of ``metrics.png``: its title, every method's name (the x axis), their bars and the ``cap``
    at which a value no bar can reach stands, above every finite bar."""

    key: str
    title: str
    labels: tuple[str, ...]
    cap: float
    bars: tuple[FigureBar, ...]


def bar_cap(values: Sequence[float]) -> float:
    """Where a panel draws an infinite value: 15 % past the largest finite magnitude among ``values`` (1 when there is
    none), so a non-finite mean stands above every measured bar, not as one of them (a PSNR never gets there: the
    table counts it at most :data:`~flowlift.measure.evaluate.PSNR_CEILING_DB`)."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    return 1.15 * max(finite) if finite and max(finite) > 0 else 1.0


def drawn_at(value: float, cap: float) -> float:
    """The height ``value`` is drawn at: itself when finite, ``cap`` for ``inf``, ``-cap`` for ``-inf``, 0 for NaN."""
    if math.isfinite(value):
        return value
    return 0.0 if math.isnan(value) else math.copysign(cap, value)


def figure_panels(report: EvalReport) -> list[FigurePanel]:
    """What ``metrics.png`` shows, panel by panel, from the numbers the table prints: each bar is the table's mean
    (:meth:`~flowlift.measure.evaluate.EvalReport.summary`) and each dot an image as the table counts it (an identical
    image's PSNR at the 100 dB ceiling); a non-finite mean is a bar at the cap marked as the table writes it."""
    summary = report.summary()
    labels = tuple(k for k in report.results if k != "(ground truth)")
    panels = []
    for key, title in FIGURE_METRICS:
        values = {  # as the table counts them: a PSNR at most the ceiling
            label: [float(v) for v in summary_values(key, [m[key] for m in report.results[label].values() if key in m])]
            for label in labels
        }
        if not any(key in m for r in report.results.values() for m in r.values()):
            continue
        cap = bar_cap([v for vs in values.values() for v in vs])
        bars = []
        for position, label in enumerate(labels):
            if not values[label]:
                continue
            mean = summary[label]["mean"][key]
            text = None if math.isfinite(mean) else number_text(mean, "")
            dots = tuple(drawn_at(v, cap) for v in values[label])
            bars.append(FigureBar(label, position, drawn_at(mean, cap), text, dots))
        panels.append(FigurePanel(key, title, labels, cap, tuple(bars)))
    return panels


def metrics_png(report: EvalReport) -> bytes:
    """``metrics.png``: per-metric bars (the table's mean per method) with every image's value as dots; a mean no bar
    can reach (not finite) hatched at the panel's cap and labelled as the table writes it (:func:`figure_panels`)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = figure_panels(report)
    ncols = max(1, min(4, len(panels)))
    nrows = max(1, math.ceil(len(panels) / ncols))
    width = max(2.0, 0.45 * len(panels[0].labels if panels else ()) + 1.2)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 3.4 * nrows), dpi=110, squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels, strict=False):
        for bar in panel.bars:
            ax.bar(bar.position, bar.height, color=f"C{bar.position}", alpha=0.7, hatch="//" if bar.text else None)
            ax.plot(np.full(len(bar.dots), bar.position), bar.dots, "k.", markersize=3)
            if bar.text:
                ax.text(bar.position, bar.height, bar.text, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(panel.labels)), panel.labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(panel.title, fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    data = _png_bytes(fig)
    plt.close(fig)
    return data


def crops_png(report: EvalReport) -> bytes | None:
    """``crops.png``: one row per image, columns input (nearest-upscaled) / outputs / ground truth; None when no
    image has a crop."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    columns = [c for c in report.crop_columns if report.crops.get(c)]
    names = list(report.crops[columns[0]]) if columns else []
    if not names:
        return None
    fig, axes = plt.subplots(
        len(names), len(columns), figsize=(2.2 * len(columns), 2.3 * len(names)), dpi=120, squeeze=False
    )
    for r, name in enumerate(names):
        for c, column in enumerate(columns):
            ax = axes[r][c]
            ax.axis("off")
            crop = report.crops[column].get(name)
            if crop is not None:
                ax.imshow(crop, interpolation="nearest")
            if r == 0:
                ax.set_title(column, fontsize=7)
        axes[r][0].text(
            -0.05, 0.5, name, transform=axes[r][0].transAxes, rotation=90, ha="right", va="center", fontsize=7
        )
    fig.tight_layout()
    data = _png_bytes(fig)
    plt.close(fig)
    return data


def report_paths(out_dir: Path) -> dict[str, Path]:
    """The files :func:`write_report` writes into ``out_dir``, by role."""
    return {
        "json": out_dir / "results.json",
        "table": out_dir / "table.md",
        "metrics": out_dir / "metrics.png",
        "crops": out_dir / "crops.png",
    }


def report_recognisers(out_dir: Path) -> dict[Path, Recogniser]:
    """Each file :func:`write_report` writes, with how flowlift's own is told (the replace rule)."""
    paths = report_paths(out_dir)
    return {
        paths["json"]: json_report("eval", {"config", "summary", "images"}),
        paths["table"]: markdown_report("eval"),
        paths["metrics"]: flowlift_image,
        paths["crops"]: flowlift_image,
    }


def write_report(report: EvalReport, out_dir: Path) -> dict[str, Path]:
    """Write ``results.json``, ``table.md``, ``metrics.png`` and ``crops.png`` into ``out_dir`` as one set, each marked
    as flowlift's (:mod:`flowlift.files.own_files`): every file is rendered in memory and written to its temporary
    first, then all are put in place together (:func:`flowlift.files.atomic_set.atomic_write_set`), so an error or
    Ctrl-C leaves the previous report or the new one, never a mix. Returns the paths written, by role."""
    paths = report_paths(out_dir)
    rendered = {
        "metrics": metrics_png(report),
        "crops": crops_png(report),  # None: no crop to show, and an earlier run's crops.png goes with its report
        "table": (markdown_stamp("eval") + markdown_table(report)).encode(),
        "json": report_json(report.to_json()),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_set({paths[role]: data for role, data in rendered.items()})
    return {role: path for role, path in paths.items() if rendered[role] is not None}

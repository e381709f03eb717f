"""Rendering an :class:`flowlift.measure.evaluate.EvalReport`: the Markdown table (mean and worst rows), the
metrics and crops figures, and :func:`write_report`, which puts them in place with ``results.json`` as one set.
"""

from __future__ import annotations

import math
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
from flowlift.measure.evaluate import EvalReport

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
    return fmt.format(values[key]) if math.isfinite(values[key]) else str(values[key])


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
    return (
        "\n".join(lines)
        + f"\n\n{n} image(s); drift and PSNR in at input scale (INTER_AREA), Lab units"
        + ("; PSNR-Y / SSIM-Y: BT.601 Y of 8-bit RGB, the scale in px off each border" if "psnr_y" in present else "")
        + ".\n"
        + "".join(f"{note}\n" for note in notes)
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


def metrics_png(report: EvalReport) -> bytes:
    """``metrics.png``: per-metric bars (mean per method) with every image's value as dots."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    labels = [k for k in report.results if k != "(ground truth)"]
    keys = [(k, t) for k, t in FIGURE_METRICS if any(k in m for r in report.results.values() for m in r.values())]
    ncols = min(4, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    width = max(2.0, 0.45 * len(labels) + 1.2)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, 3.4 * nrows), dpi=110, squeeze=False)
    for ax in axes.flat[len(keys) :]:
        ax.axis("off")
    for ax, (key, title) in zip(axes.flat, keys, strict=False):
        for j, label in enumerate(labels):
            values = np.array([m[key] for m in report.results[label].values() if key in m], dtype=float)
            values = values[np.isfinite(values)]
            if values.size == 0:
                continue
            ax.bar(j, values.mean(), color=f"C{j}", alpha=0.7)
            ax.plot(np.full(values.size, j), values, "k.", markersize=3)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_title(title, fontsize=8)
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

"""Validation during training: the model against lanczos and latent-bicubic at 2x on held-out images.

Protocol (per held-out image ``hr``, a centre crop whose sides are multiples of 16):

* ``lr = area_downscale_2x(hr)`` (pixel space, :func:`flowlift.training.degrade.downscale`);
* ``lanczos``: Pillow Lanczos-3 of ``lr`` back to ``hr``'s size;
* ``latent-bicubic``: ``decode(bicubic_2x(encode(lr)))`` (the naive latent upscale);
* ``model``: ``decode(FlowUpscalerPipeline.upscale_latents(encode(lr)))`` with the EMA weights.

Metrics (:mod:`flowlift.measure.metrics`): fidelity to ``hr`` (PSNR, SSIM), sharpness (mean absolute
Laplacian of the output; ``sharpness_gt`` is the ground truth's), and protocol-A drift against ``lr``
(``cast_max``, ``dC``, ``psnr_input``). Rows go to ``val.csv`` (one per step and method, means over
images) and :func:`plot_curves` draws loss and metrics to a PNG.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.files.atomic import append_text, atomic_output, atomic_write_text
from flowlift.training.degrade import LatentCodec, downscale, pil_lanczos_resize

VAL_FIELDS = ["step", "method", "psnr", "ssim", "sharpness", "sharpness_gt", "cast_max", "dC", "psnr_input"]
METHODS = ("model", "lanczos", "latent-bicubic")
#: The PNG ``Software`` text of the curves figure: what tells a later run that ``curves.png`` is flowlift's.
CURVES_SOFTWARE = "flowlift train"


def is_val_log(path: Path) -> bool:
    """Whether ``path`` begins with the validator's CSV header (:data:`VAL_FIELDS`): a ``val.csv`` flowlift wrote."""
    with open(path, "rb") as handle:
        return handle.readline(4096).rstrip(b"\r\n").decode("utf-8", "replace") == ",".join(VAL_FIELDS)


def centre_crop(image: torch.Tensor, size: int, multiple: int = 16) -> torch.Tensor:
    """Centre crop (B, C, H, W) to ``size x size`` (or the largest multiple of ``multiple`` that fits)."""
    h, w = image.shape[-2:]
    side_h = min(size, h - h % multiple)
    side_w = min(size, w - w % multiple)
    if side_h <= 0 or side_w <= 0:
        raise FlowliftError(f"validation image of {w}x{h} pixels is smaller than {multiple}x{multiple}")
    top, left = (h - side_h) // 2, (w - side_w) // 2
    return image[..., top : top + side_h, left : left + side_w]


def _named(file: Any, error: FlowliftError) -> FlowliftError:
    text = str(error)
    text = text if text.startswith(str(file)) else f"{file}: {text}"
    return FlowliftError(f"{FIELD_MARK} {text}", field="val_images")


def validation_files(paths: Sequence[str | os.PathLike], count: int) -> list[Path]:
    """The first ``count`` images of ``paths`` (files, folders, globs), each read from its header only: a path that
    matches nothing, no image, an unreadable or too small one is one line naming ``val_images``, before a run loads
    its data or a model, or makes its folder."""
    from flowlift.files.images import image_size, list_images

    try:
        files = list_images([str(p) for p in paths])[:count]
    except FlowliftError as error:
        raise FlowliftError(f"{FIELD_MARK} {error}", field="val_images") from None
    if not files:
        raise FlowliftError(f"no validation images in {', '.join(map(str, paths))}", field="val_images")
    for file in files:
        try:
            width, height = image_size(file)
        except FlowliftError as error:
            raise _named(file, error) from None
        if min(width, height) < 16:  # centre_crop's smallest side
            raise _named(file, FlowliftError(f"validation image of {width}x{height} pixels is smaller than 16x16"))
    return files


def load_validation_images(paths: Sequence[str | os.PathLike], count: int, size: int) -> list[torch.Tensor]:
    """The first ``count`` images of ``paths`` (files, folders, globs), centre-cropped to ``size``."""
    from flowlift.files.images import load_image, to_tensor

    images = []
    for file in validation_files(paths, count):
        try:
            images.append(centre_crop(to_tensor(load_image(file)[0]), size))
        except FlowliftError as error:
            raise _named(file, error) from None
    return images


def image_metrics(output: torch.Tensor, hr: torch.Tensor, lr: torch.Tensor) -> dict[str, float]:
    """Fidelity, sharpness and drift of one output (1, 3, H, W) in [0, 1]."""
    from flowlift.measure import metrics

    out = output[0].detach().float().cpu().clamp(0, 1)
    gt = hr[0].detach().float().cpu()
    small = lr[0].detach().float().cpu()
    drift = metrics.drift_at_input_scale(out, small)
    return {
        "psnr": metrics.psnr(out, gt),
        "ssim": metrics.ssim(out, gt),
        "sharpness": metrics.sharpness(out),
        "sharpness_gt": metrics.sharpness(gt),
        "cast_max": drift["cast_max"],
        "dC": drift["dC"],
        "psnr_input": drift["psnr_input"],
    }


def mean_rows(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys}


@torch.no_grad()
def baseline_outputs(vae: LatentCodec, lr: torch.Tensor, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``lanczos`` and ``latent-bicubic`` 2x outputs of ``lr`` (1, 3, h, w) at ``size``."""
    lanczos = pil_lanczos_resize(lr, size).clamp(0, 1)
    latents = vae.encode(lr)
    bicubic = F.interpolate(latents, scale_factor=2, mode="bicubic", align_corners=False)
    return {"lanczos": lanczos, "latent-bicubic": vae.decode(bicubic).clamp(0, 1)}


def make_model_upscaler(
    model: torch.nn.Module, vae: LatentCodec, device: torch.device, *, seed: int = 0, color_fix: bool = True
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``lr image -> 2x image`` through :meth:`flowlift.upscale.pipeline.FlowUpscalerPipeline.upscale_image`
    (one pass, the user's path: encode, one step, both colour-fix stages when ``color_fix``, decode)."""
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    pipeline = FlowUpscalerPipeline(model, vae, device=device, dtype=torch.float32)

    def upscale(lr: torch.Tensor) -> torch.Tensor:
        out = pipeline.upscale_image(lr.to(device), num_passes=1, seed=seed, color_fix=color_fix, output_type="pt")
        return out.clamp(0, 1)

    return upscale


def evaluate_methods(
    images: Sequence[torch.Tensor],
    vae: LatentCodec,
    upscalers: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    include_baselines: bool = True,
    references: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> dict[str, dict[str, float]]:
    """Mean metrics per method over ``images`` (each (1, 3, H, W) ground truth).

    ``upscalers`` map the 2x-downscaled image to an output of ``hr``'s size; ``references`` (e.g. a
    VAE round trip, the ceiling of latent methods) are given ``hr`` itself.
    """
    per_method: dict[str, list[dict[str, float]]] = {}
    for hr in images:
        lr = downscale(hr, 2, "area")
        outputs = {name: fn(lr) for name, fn in upscalers.items()}
        outputs.update({name: fn(hr) for name, fn in (references or {}).items()})
        if include_baselines:
            outputs.update(baseline_outputs(vae, lr, tuple(hr.shape[-2:])))
        for name, out in outputs.items():
            per_method.setdefault(name, []).append(image_metrics(out, hr, lr))
    return {name: mean_rows(rows) for name, rows in per_method.items()}


class Validator:
    """Evaluates the EMA model every K steps; appends to ``val.csv``; baselines computed once."""

    def __init__(
        self,
        vae: LatentCodec,
        images: Sequence[torch.Tensor],
        *,
        device: torch.device,
        output: Path,
        seed: int = 0,
        color_fix: bool = True,
        start_step: int = 0,
    ) -> None:
        self.vae = vae
        self.images = [im.to(device) for im in images]
        self.device = device
        self.output = Path(output)
        self.seed = seed
        self.color_fix = color_fix
        self.csv_path = self.output / "val.csv"
        self.baselines = evaluate_methods(self.images, vae, {}, include_baselines=True)
        rows = []
        if start_step > 0 and self.csv_path.is_file() and not self.csv_path.is_symlink() and is_val_log(self.csv_path):
            with self.csv_path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start_step]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=VAL_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(self.csv_path, text.getvalue())

    @classmethod
    def from_config(cls, config: Any, *, device: torch.device, output: Path, start_step: int = 0) -> Validator:
        from flowlift.models.vae_loading import ENCODE_DECODE, load_vae

        vae = load_vae(config.vae, device=device, dtype=torch.float32, needs=ENCODE_DECODE)
        images = load_validation_images(config.val_images, config.val_count, config.val_size)
        return cls(
            vae,
            images,
            device=device,
            output=output,
            seed=config.val_seed,
            color_fix=config.val_color_fix,
            start_step=start_step,
        )

    def evaluate(self, step: int, model: torch.nn.Module) -> dict[str, dict[str, float]]:
        was_training = model.training
        model.eval()
        try:
            upscale = make_model_upscaler(model, self.vae, self.device, seed=self.seed, color_fix=self.color_fix)
            results = evaluate_methods(self.images, self.vae, {"model": upscale}, include_baselines=False)
        finally:
            model.train(was_training)
        results.update(self.baselines)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=VAL_FIELDS)
        for method in METHODS:
            row = {"step": step, "method": method}
            row.update({k: f"{v:.6g}" for k, v in results[method].items()})
            writer.writerow(row)
        append_text(self.csv_path, text.getvalue())  # never through a link, never blocking on a FIFO
        return results

    def plot(self, path: Path) -> Path:
        return plot_curves(self.output / "train_log.csv", self.csv_path, path)


def point_style(points: int) -> dict[str, Any]:
    """Line keywords for a curve of ``points`` points: a lone point gets a marker (a line of one point is invisible)."""
    return {"marker": "o", "ms": 4} if points == 1 else {}


def plot_curves(train_csv: Path, val_csv: Path | None, path: Path) -> Path:
    """Loss (log scale) and, if ``val_csv`` exists, validation PSNR and sharpness per method vs step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with Path(train_csv).open(newline="") as f:
        train = list(csv.DictReader(f))
    val = []
    if val_csv is not None and Path(val_csv).is_file():
        with Path(val_csv).open(newline="") as f:
            val = list(csv.DictReader(f))
    panels = 3 if val else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.6), squeeze=False)
    ax = axes[0][0]
    ax.plot([int(r["step"]) for r in train], [float(r["loss"]) for r in train], lw=1, **point_style(len(train)))
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_title("training loss")
    if val:
        for panel, key, title in ((1, "psnr", "PSNR to ground truth (dB)"), (2, "sharpness", "sharpness")):
            ax = axes[0][panel]
            for method in METHODS:
                rows = [r for r in val if r["method"] == method]
                if rows:
                    ax.plot(
                        [int(r["step"]) for r in rows], [float(r[key]) for r in rows], marker="o", ms=3, label=method
                    )  # always marked: validation points are sparse
            if key == "sharpness":
                ax.axhline(float(val[0]["sharpness_gt"]), color="k", ls=":", lw=1, label="ground truth")
            ax.set_xlabel("step")
            ax.set_title(title)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fmt = Path(path).suffix.lstrip(".") or "png"
    with atomic_output(path) as tmp:  # the Software tag is how a later run knows the file is flowlift's
        fig.savefig(tmp, dpi=100, format=fmt, metadata={"Software": CURVES_SOFTWARE} if fmt == "png" else None)
    plt.close(fig)
    return Path(path)

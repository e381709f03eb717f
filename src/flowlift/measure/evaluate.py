"""``flowlift eval``: measure outputs (or run methods) and report drift, detail and fidelity.

Two entry points, both returning an :class:`EvalReport` that :func:`flowlift.measure.report.write_report` saves:

* :func:`flowlift.measure.pairs.evaluate_pairs` -- existing outputs against their inputs (paired by file stem),
  with an optional ground truth: protocol A (:func:`flowlift.measure.metrics.drift_at_input_scale`), B (detail
  of the output; L1 / identical pixels when output and input have the same size) and C (fidelity).
* :func:`evaluate_methods` -- builds low-res inputs from a folder of photos (centre crop to a
  multiple of ``16 * scale``, then ``INTER_AREA`` downscale by ``scale``), runs each method and
  measures A against the low-res input, B on the output and C against the photo.

Methods and their parsing live in :mod:`flowlift.measure.methods`, the low-res inputs and crops in
:mod:`flowlift.measure.inputs`, the per-(method, image) result cache in :mod:`flowlift.measure.cache`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowlift.errors import FlowliftError
from flowlift.measure import metrics as M
from flowlift.measure.cache import CACHE_VERSION, ResultCache, array_digest, cache_key
from flowlift.measure.inputs import (
    Box,
    check_dataset_sizes,
    check_scale,
    dataset_paths,
    default_crop,
    input_crop,
    load_rgb,
    prepare_pair,
)
from flowlift.measure.methods import (
    SESQUI,
    SPANDREL,
    MethodFn,
    MethodSpec,
    check_something_measured,
    make_method_fn,
    method_folder,
    unreachable,
)


@dataclass(frozen=True)
class MeasureSettings:
    """How each output is measured, the same in both modes of ``flowlift eval`` (:func:`evaluate_methods`,
    :func:`flowlift.measure.pairs.evaluate_pairs`): ``box`` (x, y, w, h in output pixels) is where grey levels are
    counted and what the figure crops (None: levels not counted, a centred square shown); ``y_channel`` the luma of
    PSNR-Y / SSIM-Y (:data:`flowlift.measure.sr_metrics.Y_CHANNEL`: ``matlab`` rounded, ``basicsr`` unrounded).
    Checked when made."""

    box: Box | None = None
    y_channel: str = M.Y_CHANNEL.default

    def __post_init__(self) -> None:
        object.__setattr__(self, "box", M.check_box(self.box))
        object.__setattr__(self, "y_channel", M.Y_CHANNEL.check(self.y_channel))


#: The settings a caller who gives none measures with (frozen: one shared default).
MEASURE_DEFAULTS = MeasureSettings()


def measure(
    output: np.ndarray,
    reference: np.ndarray,
    ground_truth: np.ndarray | None = None,
    settings: MeasureSettings = MEASURE_DEFAULTS,
) -> dict[str, float]:
    """All metrics of one output: A against ``reference`` (its input), B on the output (levels in
    ``settings.box``), L1 / identical pixels when output and reference have the same size, C against
    ``ground_truth`` when given (PSNR-Y / SSIM-Y with :func:`y_shave` px off each border)."""
    from flowlift.knobs import check_kind

    check_kind("settings", settings, MeasureSettings, "a MeasureSettings")
    result = M.drift_at_input_scale(output, reference)
    result.update(M.detail(output, settings.box))
    if output.shape == reference.shape:
        result.update(M.pixel_agreement(output, reference))
    if ground_truth is not None:
        if ground_truth.shape != output.shape:
            raise FlowliftError(
                f"ground truth {ground_truth.shape[1]}x{ground_truth.shape[0]} and output "
                f"{output.shape[1]}x{output.shape[0]} differ in size"
            )
        shave = y_shave(output.shape, reference.shape)
        result.update(M.fidelity(output, ground_truth, shave, settings.y_channel))
    return result


def y_shave(output_shape: tuple[int, ...], input_shape: tuple[int, ...]) -> int:
    """Border pixels PSNR-Y / SSIM-Y leave out: the upscale factor, rounded up (``ceil(max(H/h, W/w))``:
    4 at 4x, 2 at 1.5x, 1 for a same-size output), the super-resolution field's ``crop_border = scale``."""
    import math

    return math.ceil(max(output_shape[0] / input_shape[0], output_shape[1] / input_shape[1]) - 1e-9)


#: How the "worst" row picks a value: largest magnitude (sign kept), smallest or largest.
WORST_RULE = {
    "cast_r": "abs",
    "cast_g": "abs",
    "cast_b": "abs",
    "cast_max": "max",
    "c_mean_change_pct": "abs",
    "dC": "abs",
    "c_p99_change": "abs",
    "l_std_change": "abs",
    "l_p5_change": "abs",
    "l_p95_change": "abs",
    "psnr_input": "min",
    "sharpness": "min",
    "hf_energy": "min",
    "levels": "min",
    "grey_sigma": "min",
    "l1": "max",
    "identical_pct": "min",
    "psnr_gt": "min",
    "ssim_gt": "min",
    "psnr_y": "min",
    "ssim_y": "min",
}


#: The PSNRs a report's mean and worst rows hold to :data:`PSNR_CEILING_DB`.
PSNR_KEYS = ("psnr_input", "psnr_gt", "psnr_y")
#: The most a PSNR counts for in a report's mean and worst rows, in dB: an image identical to its reference measures
#: ``inf``, and one such image made the mean ``inf``, hiding every other image. 100 dB, as the SR scripts that return
#: 100 for a zero MSE (BasicSR's and pyiqa's PyTorch PSNRs add 1e-8 to the MSE: 80 dB); above any difference worth
#: telling apart (an 8-bit pair one level apart in one sample of a 256x256 image measures 101 dB). Each image's own
#: PSNR (``results.json``'s ``images``) stays as measured.
PSNR_CEILING_DB = 100.0


def summary_values(key: str, values: Sequence[float]) -> np.ndarray:
    """``values`` of metric ``key`` as a report's rows count them: a PSNR (:data:`PSNR_KEYS`) at most
    :data:`PSNR_CEILING_DB`, anything else as measured."""
    array = np.array(values, dtype=np.float64)
    return np.minimum(array, PSNR_CEILING_DB) if key in PSNR_KEYS else array


def capped_counts(per_image: dict[str, dict[str, float]]) -> dict[str, int]:
    """How many images' PSNR each row holds to :data:`PSNR_CEILING_DB` (only keys with at least one)."""
    counts = {k: sum(k in m and m[k] > PSNR_CEILING_DB for m in per_image.values()) for k in PSNR_KEYS}
    return {k: n for k, n in counts.items() if n}


def summarize(per_image: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """``(mean, worst)`` over images for every metric any image has (worst per :data:`WORST_RULE`), each over the
    images that have it (``l1`` / ``identical_pct``: the same-size pairs only); a PSNR counts for at most
    :data:`PSNR_CEILING_DB` (:func:`summary_values`)."""
    keys = list(dict.fromkeys(k for metrics in per_image.values() for k in metrics))
    mean: dict[str, float] = {}
    worst: dict[str, float] = {}
    for k in keys:
        values = summary_values(k, [m[k] for m in per_image.values() if k in m])
        mean[k] = float(values.mean())
        rule = WORST_RULE.get(k, "abs")
        if rule == "abs":
            worst[k] = float(values[np.argmax(np.abs(values))])
        else:
            worst[k] = float(values.min() if rule == "min" else values.max())
    return mean, worst


@dataclass
class EvalReport:
    """Everything a report needs: per-method per-image metrics, crops for the figure, config."""

    config: dict[str, Any]
    results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # label -> image -> m
    crops: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # column -> image -> crop
    crop_columns: list[str] = field(default_factory=list)
    cached: int = 0
    computed: int = 0

    def summary(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per method: its ``mean`` and ``worst`` rows (:func:`summarize`) and, when it held any image's PSNR to
        :data:`PSNR_CEILING_DB`, ``capped``: how many, per PSNR."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for label, per_image in self.results.items():
            mean, worst = summarize(per_image)
            out[label] = {"mean": mean, "worst": worst}
            if capped := capped_counts(per_image):
                out[label]["capped"] = capped
        return out

    def to_json(self) -> dict[str, Any]:
        from flowlift.files.own_files import stamp

        return {
            "flowlift": stamp("eval"),  # how a later run knows results.json as flowlift's own
            "config": self.config,
            "summary": self.summary(),
            "images": self.results,
            "cache": {"reused": self.cached, "computed": self.computed},
            "figure": {"crop_columns": {c: sorted(self.crops.get(c, {})) for c in self.crop_columns}},
        }


def evaluate_methods(
    methods: Sequence[MethodSpec],
    dataset: Sequence[str | Path],
    scale: float,
    *,
    method_fns: dict[str, MethodFn] | None = None,
    identities: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
    measuring: MeasureSettings = MEASURE_DEFAULTS,
    limit: int | None = None,
    figure_images: int = 3,
    progress: bool | None = False,
    save_outputs: Path | None = None,
    indices: Sequence[int] | None = None,
) -> EvalReport:
    """Run ``methods`` on low-res versions of the ``dataset`` photos and measure them.

    ``save_outputs``: a folder that receives every full output as ``<method>/<stem>_x<scale>.png``, the
    low-resolution inputs as ``inputs/<stem>.png`` and the cropped photos as ``ground-truth/<stem>.png``,
    so ``flowlift eval DIR/<method> --reference DIR/inputs --ground-truth DIR/ground-truth`` recomputes
    the same numbers from files (an output missing there is recomputed instead of read from the cache).

    ``method_fns`` maps a method label to ``fn(lowres, ground_truth) -> output`` (see
    :func:`make_method_fn`; pixel methods are built here when missing). ``identities`` holds what
    enters the cache key of VAE methods (``vae``, ``upscaler``, ``device``, ``dtype``). Rows also
    include ``(ground truth)`` with the photos' own detail metrics. ``indices`` (positions in
    :func:`dataset_paths`) restricts the work to those images: one rank's share of a sharded run,
    whose results reach the merged report through the cache. ``measuring``: how each output is measured
    (:class:`MeasureSettings`: the box, PSNR-Y's luma).

    ``scale`` may be fractional (1.5; :func:`flowlift.measure.inputs.check_scale`). A method that cannot
    reach it (:func:`flowlift.measure.methods.unreachable`) is not run: ``config["skipped"]`` holds its
    reason and the table prints it; when none reaches it, one FlowliftError line names each reason and nothing runs.
    """
    from flowlift.console import progress_bar
    from flowlift.knobs import check_kind

    check_kind("measuring", measuring, MeasureSettings, "a MeasureSettings")
    box = measuring.box
    scale = check_scale(scale)
    check_something_measured(methods, scale)
    skipped = {m.label: reason for m in methods if (reason := unreachable(m, scale))}
    methods = [m for m in methods if m.label not in skipped]
    paths = dataset_paths(dataset, limit)
    check_dataset_sizes(paths, scale, box)  # from the headers, before any method runs
    if indices is not None:
        paths = [paths[i] for i in sorted(set(indices))]
    method_fns = dict(method_fns or {})
    identities = identities or {}
    cache = ResultCache(cache_dir)
    report = EvalReport(
        config={
            "mode": "run",
            "dataset": [str(d) for d in dataset],
            "scale": scale,
            "methods": [m.label for m in methods],
            "skipped": skipped,
            "box": box,
            "y_channel": measuring.y_channel,
            "images": [p.stem for p in paths],
            **{k: v for k, v in identities.items()},
        }
    )
    report.crop_columns = ["input"] + [m.label for m in methods] + ["ground truth"]
    for c in report.crop_columns:
        report.crops[c] = {}
    report.results["(ground truth)"] = {}
    for m in methods:
        report.results[m.label] = {}
    bar = progress_bar(total=len(paths) * len(methods), desc="eval", unit="run", enabled=progress)
    try:
        for i, path in enumerate(paths):
            name = path.stem
            gt, low = prepare_pair(load_rgb(path), scale, name=str(path))
            size = (gt.shape[1], gt.shape[0])
            crop = default_crop(size, box)
            M.crop_box(gt, crop)  # validates the box against the output size
            report.results["(ground truth)"][name] = M.detail(gt, box)
            if i < figure_images:
                report.crops["input"][name] = input_crop(low, size, crop)
                report.crops["ground truth"][name] = M.as_uint8_rgb(M.crop_box(gt, crop))  # a figure's: 8 bits
            base = {"v": CACHE_VERSION, "scale": scale, "box": box, "crop": crop, "input": array_digest(low, gt)}
            base["y_channel"] = measuring.y_channel  # PSNR-Y / SSIM-Y's luma
            if save_outputs is not None:
                _save_pair(Path(save_outputs), name, low, gt)
            for spec in methods:
                metrics, crop_img, cached = _method_result(
                    spec, name, low, gt, crop, base, scale, measuring, identities, cache, method_fns, save_outputs
                )
                report.cached += cached
                report.computed += not cached
                report.results[spec.label][name] = metrics
                if i < figure_images:
                    report.crops[spec.label][name] = crop_img
                bar.update(1)
    finally:
        bar.close()
    return report


def _save_pair(save_outputs: Path, name: str, low: np.ndarray, gt: np.ndarray) -> None:
    """The low-res input and the ground truth as ``inputs/<name>.png`` and ``ground-truth/<name>.png``, each at its
    precision (a 16-bit ground truth as a 16-bit PNG, so the pairs mode measures what this run measured), unless
    flowlift's are there already (run_eval checked the names)."""
    from PIL import Image

    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.own_files import flowlift_image
    from flowlift.files.sixteen_bit import save_image16_atomic

    for folder, array in (("inputs", low), ("ground-truth", gt)):
        target = save_outputs / folder / f"{name}.png"
        if flowlift_image(target):
            continue  # missing, empty, or a foreign one --overwrite let through: written
        meta = {"flowlift": {"eval": folder, "image": name}}
        if array.dtype == np.uint16:
            save_image16_atomic(array, None, target, meta)
        else:
            save_image_atomic(Image.fromarray(array), target, meta, overwrite=True)


def saved_output_paths(save_outputs: Path, labels: Sequence[str], stems: Sequence[str], scale: float) -> list[Path]:
    """Every file ``evaluate_methods(save_outputs=...)`` writes for these methods and images."""
    paths = [save_outputs / folder / f"{stem}.png" for folder in ("inputs", "ground-truth") for stem in stems]
    paths += [save_outputs / method_folder(label) / output_name(stem, scale) for label in labels for stem in stems]
    return paths


def output_name(stem: str, scale: float) -> str:
    """``<stem>_x<scale>.png`` (``_x4``, ``_x1.5``): a saved output's file name."""
    from flowlift.files.naming import upscaled_name

    return upscaled_name(stem, scale, "png")


def _sesqui_identity(path: str) -> str | None:
    """The SesquiLSR file's digest (:func:`flowlift.measure.cache.model_identity`), hashed once per file version."""
    import os

    from flowlift.measure.cache import model_identity

    try:
        stat = os.stat(path)
    except OSError:
        return None
    key = (os.path.realpath(path), stat.st_mtime_ns, stat.st_size)
    if key not in _SESQUI_IDENTITIES:
        _SESQUI_IDENTITIES[key] = model_identity(path)
    return _SESQUI_IDENTITIES[key]


_SESQUI_IDENTITIES: dict[tuple[str, int, int], str | None] = {}


def _method_result(
    spec: MethodSpec,
    name: str,
    low: np.ndarray,
    gt: np.ndarray,
    crop: Box,
    base: dict[str, Any],
    scale: float,
    measuring: MeasureSettings,
    identities: dict[str, Any],
    cache: ResultCache,
    method_fns: dict[str, MethodFn],
    save_outputs: Path | None,
) -> tuple[dict[str, float], np.ndarray, bool]:
    """One method on one image: (metrics, the figure's crop, whether they came from the cache).

    The cache key holds the inputs' digest (``base``) and what the method's output depends on; a miss
    runs the method, checks its output, measures it and stores it (and writes it under ``save_outputs``).
    """
    from PIL import Image

    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.own_files import flowlift_image

    fields = {**base, "method": spec.name, "options": dict(spec.options)}
    if spec.needs_vae:
        fields.update({k: identities.get(k) for k in ("vae", "device", "dtype")})
    if spec.name == "flow":
        fields["upscaler"] = identities.get("upscaler")
    if spec.name == SPANDREL:
        fields.update(_spandrel_key_fields(identities, dict(spec.options)["path"], low.shape))
    if spec.name == SESQUI:
        fields["model"] = _sesqui_identity(dict(spec.options)["path"])
    key = cache_key(fields)
    saved = None
    if save_outputs is not None:
        saved = Path(save_outputs) / method_folder(spec.label) / output_name(name, scale)
    hit = cache.load(spec.label, name, key) if saved is None or flowlift_image(saved) else None
    if hit is not None:
        metrics, crop_img = hit
        return metrics, crop_img, True
    fn = method_fns.get(spec.label) or make_method_fn(spec, scale)
    output = fn(low, gt)
    if output.shape != gt.shape or output.dtype != np.uint8:
        raise FlowliftError(f"method {spec.label} returned {output.shape} {output.dtype}, expected {gt.shape} uint8")
    metrics = measure(output, low, gt, measuring)
    if saved is not None:
        meta = {"flowlift": {**fields, "image": name}}
        save_image_atomic(Image.fromarray(output), saved, meta, overwrite=True)  # run_eval checked the names
    crop_img = np.ascontiguousarray(M.crop_box(output, crop))
    cache.store(spec.label, name, key, metrics, crop_img)
    return metrics, crop_img, False


def _spandrel_key_fields(identities: dict[str, Any], path: str, low_shape: tuple[int, ...]) -> dict[str, Any]:
    """What a spandrel result depends on: the model file's digest, device, dtype, and the tiling
    actually used for this input (none when it fits in one tile)."""
    info = (identities.get("spandrel") or {}).get(path, {})
    tile = info.get("tile")
    tiled = tile is not None and max(low_shape[:2]) > tile
    return {
        "model": info.get("model"),
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "tiling": [tile, info.get("overlap")] if tiled else None,
    }

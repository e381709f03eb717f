"""``flowlift eval``: measure outputs (or run methods) and report drift, detail and fidelity.

Two entry points, both returning an :class:`EvalReport` that :func:`write_report` saves:

* :func:`evaluate_pairs` -- existing outputs against their inputs (paired by file stem), with an
  optional ground truth: protocol A (:func:`flowlift.measure.metrics.drift_at_input_scale`), B (detail of
  the output; L1 / identical pixels when output and input have the same size) and C (fidelity).
* :func:`evaluate_methods` -- builds low-res inputs from a folder of photos (centre crop to a
  multiple of ``16 * scale``, then ``INTER_AREA`` downscale by ``scale``), runs each method and
  measures A against the low-res input, B on the output and C against the photo.

Methods (:func:`parse_methods`): ``lanczos`` / ``bicubic`` (Pillow, pixel space), ``latent-bicubic``
(VAE encode, bicubic ``scale``x in latent space -- raw latents where the VAE has normalization
statistics -- decode), ``vae-roundtrip`` (decode(encode(photo)):
the VAE's ceiling for any latent upscaler) and ``flow`` (the Flow Upscaler pipeline; options
``transplant``, ``color_fix`` (strengths), ``color`` (on/off) and ``seed``, e.g.
``flow:transplant=0.5:seed=1``).

``spandrel:PATH[:label][+colorfix]`` runs any single-image super-resolution model spandrel loads from
a local file (:mod:`flowlift.measure.pixel_upscaler`: native scale, tiled by memory, Lanczos to ``scale`` when
the native scale differs); ``+colorfix`` then applies stage 2 against the low-res input
(:func:`flowlift.upscale.colorfix_image.color_fix_array`).

Results are cached per (method, image) under the cache folder: the key hashes the method and its
options, the scale, the box, the input and ground-truth pixels, and -- for methods that use them --
the VAE / upscaler identity (SHA-256 of their local weight files, or the hub id) and device/dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowlift.errors import FlowliftError
from flowlift.files.atomic import atomic_write_bytes
from flowlift.measure import metrics as M

CACHE_VERSION = 1
PIXEL_METHODS = ("lanczos", "bicubic")
VAE_METHODS = ("latent-bicubic", "vae-roundtrip", "flow")
METHODS = PIXEL_METHODS + VAE_METHODS
#: ``spandrel:PATH[:label][+colorfix]``: a pixel super-resolution model file (see parse_spandrel_method).
SPANDREL = "spandrel"
COLORFIX_SUFFIX = "+colorfix"
FLOW_OPTIONS = {"transplant": float, "color_fix": float, "color": str, "seed": int}
#: Size multiple of the low-res inputs (FLUX.2 latents are patchified 2x2 at 1/8 scale).
INPUT_MULTIPLE = 16

Box = tuple[int, int, int, int]


# --------------------------------------------------------------------------------------------------
# methods


@dataclass(frozen=True)
class MethodSpec:
    """A method name with its options, e.g. ``flow`` with ``(("transplant", 0.5),)``."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        """``name[:key=value...]`` as written on the command line (options sorted); for spandrel
        models ``spandrel:<label>[+colorfix]``."""
        if self.name == SPANDREL:
            opts = dict(self.options)
            return f"{SPANDREL}:{opts['label']}" + (COLORFIX_SUFFIX if opts["colorfix"] else "")
        return ":".join([self.name] + [f"{k}={v}" for k, v in self.options])

    @property
    def needs_vae(self) -> bool:
        return self.name in VAE_METHODS


def parse_methods(text: str | Sequence[str]) -> list[MethodSpec]:
    """Parse ``"lanczos,bicubic,flow:transplant=0.5"`` (or a list of such strings) into specs.

    Methods are separated by commas, a method's options by colons. Unknown methods/options, bad
    values and duplicates raise :class:`FlowliftError`.
    """
    items = [text] if isinstance(text, str) else list(text)
    specs: list[MethodSpec] = []
    for item in items:
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            if part.lower().startswith(SPANDREL + ":"):
                spec = parse_spandrel_method(part)
                if spec.label in (s.label for s in specs):
                    raise FlowliftError(f"method {spec.label} given twice (give models distinct labels)")
                specs.append(spec)
                continue
            name, *opts = part.split(":")
            name = name.strip().lower()
            if name not in METHODS:
                raise FlowliftError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
            options: dict[str, Any] = {}
            for opt in opts:
                key, sep, value = opt.partition("=")
                key = key.strip()
                if name != "flow" or not sep or key not in FLOW_OPTIONS:
                    allowed = ", ".join(f"{k}=" for k in FLOW_OPTIONS) if name == "flow" else "none"
                    raise FlowliftError(f"method {name}: bad option {opt!r} (options: {allowed})")
                options[key] = _parse_flow_option(key, value.strip())
            spec = MethodSpec(name, tuple(sorted(options.items())))
            if spec in specs:
                raise FlowliftError(f"method {spec.label} given twice")
            specs.append(spec)
    if not specs:
        raise FlowliftError("no methods given")
    return specs


def parse_spandrel_method(text: str) -> MethodSpec:
    """``spandrel:PATH[:label][+colorfix]`` -> a spec with options ``colorfix``, ``label``, ``path``.

    ``PATH`` must end in a model suffix (``.safetensors``, ``.pth``, ...); a ``:label`` after it
    names the row (default: the file's stem), so paths may themselves contain colons. ``+colorfix``
    (at the end, or right after the path) adds stage 2 against the low-res input.
    """
    from flowlift.models.weights import WEIGHT_SUFFIXES

    body = text.strip()[len(SPANDREL) + 1 :].strip()
    colorfix = body.lower().endswith(COLORFIX_SUFFIX)
    if colorfix:
        body = body[: -len(COLORFIX_SUFFIX)]
    path, label = body, ""
    head, sep, tail = body.rpartition(":")
    if sep and head.lower().removesuffix(COLORFIX_SUFFIX).endswith(WEIGHT_SUFFIXES):
        path, label = head, tail.strip()
    if path.lower().endswith(COLORFIX_SUFFIX):
        path, colorfix = path[: -len(COLORFIX_SUFFIX)], True
    if not path.lower().endswith(WEIGHT_SUFFIXES):
        raise FlowliftError(
            f"method {text!r}: spandrel: takes a model file ({', '.join(WEIGHT_SUFFIXES)}), "
            "e.g. spandrel:4x-UltraSharp.safetensors:ultrasharp"
        )
    label = label or Path(path).stem
    if not re.fullmatch(r"[A-Za-z0-9_.=-]+", label):
        raise FlowliftError(f"method {text!r}: label {label!r} may hold only letters, digits and _ . = -")
    return MethodSpec(SPANDREL, (("colorfix", colorfix), ("label", label), ("path", path)))


def spandrel_method_fn(model: Any, scale: int, colorfix: bool) -> MethodFn:
    """``fn(lowres, ground_truth)`` of a loaded :class:`flowlift.measure.pixel_upscaler.PixelUpscaler`: the
    model at ``scale`` (Lanczos from its native scale if they differ), then stage 2 against the
    low-res input when ``colorfix``."""

    def run(low: np.ndarray, gt: np.ndarray) -> np.ndarray:
        out = model.upscale(low, scale)
        if colorfix:
            from flowlift.upscale.colorfix_image import color_fix_array

            out = color_fix_array(out, low, 1.0, device=model.device)
        return out

    return run


def _parse_flow_option(key: str, value: str) -> Any:
    if key == "color":
        if value.lower() not in ("on", "off"):
            raise FlowliftError(f"method flow: color must be on or off, got {value!r}")
        return value.lower()
    try:
        parsed = FLOW_OPTIONS[key](value)
    except ValueError:
        raise FlowliftError(f"method flow: {key} must be a number, got {value!r}") from None
    if key in ("transplant", "color_fix") and not 0.0 <= parsed <= 1.0:
        raise FlowliftError(f"method flow: {key} must be in [0, 1], got {value}")
    return parsed


def pixel_upscale(lowres: np.ndarray, scale: int, method: str) -> np.ndarray:
    """Pillow ``LANCZOS`` / ``BICUBIC`` resize of a uint8 HWC image by an integer ``scale``."""
    from PIL import Image

    resample = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC}[method]
    h, w = lowres.shape[:2]
    return np.asarray(Image.fromarray(lowres).resize((w * scale, h * scale), resample=resample))


def latent_bicubic(vae, lowres: np.ndarray, scale: int, device, dtype) -> np.ndarray:
    """Encode, ``torch.nn.functional.interpolate(mode="bicubic", align_corners=False)`` by
    ``scale`` in latent space, decode; uint8 HWC out.

    When the VAE has normalization statistics (``bn_mean`` / ``bn_std``, the FLUX.2 VAE) the
    interpolation runs on the raw latents (``denormalize``, interpolate, ``normalize``): the
    normalization differs per 2x2 sub-position, so interpolating normalized latents would mix those
    statistics. TAEF2 has none and is interpolated in its own latent space.
    """
    import torch

    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.flux2.latents import denormalize, normalize

    mean, std = getattr(vae, "bn_mean", None), getattr(vae, "bn_std", None)
    with torch.no_grad():
        z = vae.encode(to_tensor(lowres, device=device, dtype=dtype))
        if mean is not None and std is not None:
            z = denormalize(z, mean, std)
        z = torch.nn.functional.interpolate(z, scale_factor=scale, mode="bicubic", align_corners=False)
        if mean is not None and std is not None:
            z = normalize(z, mean, std)
        return tensor_to_uint8(vae.decode(z).float())[0]


def vae_roundtrip(vae, image: np.ndarray, device, dtype) -> np.ndarray:
    """``decode(encode(image))``; uint8 HWC out."""
    import torch

    from flowlift.files.images import tensor_to_uint8, to_tensor

    with torch.no_grad():
        return tensor_to_uint8(vae.decode(vae.encode(to_tensor(image, device=device, dtype=dtype))).float())[0]


def flow_kwargs(spec: MethodSpec, scale: int) -> dict[str, Any]:
    """``upscale_image`` keyword arguments of a ``flow`` spec: ``num_passes = log2(scale)``."""
    passes = int(round(math.log2(scale)))
    if 2**passes != scale:
        raise FlowliftError(f"method flow upscales 2x per pass; --scale must be a power of 2, got {scale}")
    opts = dict(spec.options)
    return {
        "num_passes": passes,
        "seed": int(opts.get("seed", 0)),
        "color_fix": opts.get("color", "on") == "on",
        "transplant_strength": float(opts.get("transplant", 1.0)),
        "color_fix_strength": float(opts.get("color_fix", 1.0)),
    }


# --------------------------------------------------------------------------------------------------
# data preparation


def prepare_pair(photo: np.ndarray, scale: int, multiple: int = INPUT_MULTIPLE) -> tuple[np.ndarray, np.ndarray]:
    """``(ground_truth, lowres)`` from a uint8 photo.

    The photo is centre-cropped to a multiple of ``multiple * scale`` (so the low-res input is a
    multiple of ``multiple``), then area-downsampled by :func:`box_downscale_uint8` (the exact box
    mean, rounded half to even in integer arithmetic).
    """
    h, w = photo.shape[:2]
    step = multiple * scale
    nh, nw = h - h % step, w - w % step
    if nh == 0 or nw == 0:
        raise FlowliftError(f"photo {w}x{h} is smaller than {step}x{step} (16 x scale)")
    top, left = (h - nh) // 2, (w - nw) // 2
    gt = np.ascontiguousarray(photo[top : top + nh, left : left + nw])
    return gt, box_downscale_uint8(gt, scale)


def box_downscale_uint8(image: np.ndarray, factor: int) -> np.ndarray:
    """Exact area downscale of a uint8 HWC image by an integer ``factor`` (sides divisible by it).

    ``out = round_half_even(S / n)`` with ``S`` the integer sum of each ``factor x factor`` block and
    ``n = factor**2``: ``q, r = divmod(S, n)``, ``out = q + (2r > n) + (2r == n and q odd)``. For 2x2
    blocks a quarter of the means land exactly on .5; rounding them after float32 arithmetic (where
    ``x.5`` comes out as ``x.5 +- ulp``) biased inputs by up to +0.09/255.
    """
    height, width, channels = image.shape
    if height % factor or width % factor:
        raise FlowliftError(f"box_downscale_uint8: {width}x{height} is not divisible by {factor}")
    blocks = image.astype(np.int64).reshape(height // factor, factor, width // factor, factor, channels)
    sums = blocks.sum(axis=(1, 3))
    n = factor * factor
    quotient, remainder = np.divmod(sums, n)
    rounded = quotient + (2 * remainder > n) + ((2 * remainder == n) & (quotient % 2 == 1))
    return rounded.astype(np.uint8)


def default_crop(size: tuple[int, int], box: Box | None) -> Box:
    """The crop shown in the figure, in output pixels: ``box`` or a centred square of a quarter of the
    short side (at least 32 px)."""
    if box is not None:
        return box
    w, h = size
    side = max(32, min(w, h) // 4)
    side = min(side, w, h)
    return ((w - side) // 2, (h - side) // 2, side, side)


# --------------------------------------------------------------------------------------------------
# identities and cache


def array_digest(*arrays: np.ndarray | None) -> str:
    """SHA-256 over shapes, dtypes and bytes of ``arrays`` (``None`` hashes as absent)."""
    digest = hashlib.sha256()
    for a in arrays:
        if a is None:
            digest.update(b"none")
            continue
        a = np.ascontiguousarray(a)
        digest.update(f"{a.shape}|{a.dtype}|".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def model_identity(spec: str | os.PathLike | None) -> str | None:
    """Identity of weights given as a local file/folder (SHA-256 over their weight/config files,
    names included) or a hub id (the id itself). ``None`` stays ``None``."""
    from flowlift.files.image_outputs import file_sha256
    from flowlift.models.weights import WEIGHT_SUFFIXES

    if spec is None:
        return None
    path = Path(spec).expanduser()
    if not path.exists():
        return f"hub:{spec}"
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.suffix == ".json")
    )
    digest = hashlib.sha256()
    for p in files:
        digest.update(f"{p.relative_to(path) if p != path else p.name}|{file_sha256(p)}|".encode())
    return f"sha256:{digest.hexdigest()}"


def cache_key(fields: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON of ``fields`` (sorted keys)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


class ResultCache:
    """Per-(method, image) results in ``root/<method label>/<image>.<key[:16]>.{json,png}``.

    A ``.json`` entry holds the key and the metrics; the ``.png`` next to it the figure crop. A
    missing root or ``root=None`` disables caching.
    """

    def __init__(self, root: Path | None):
        self.root = root

    def _base(self, label: str, name: str, key: str) -> Path:
        assert self.root is not None
        safe = re.sub(r"[^A-Za-z0-9_.=+-]", "_", label)
        return self.root / safe / f"{name}.{key[:16]}"

    def load(self, label: str, name: str, key: str) -> tuple[dict[str, float], np.ndarray] | None:
        if self.root is None:
            return None
        base = self._base(label, name, key)
        try:
            entry = json.loads(Path(f"{base}.json").read_text())
            if entry.get("key") != key:
                return None
            from PIL import Image

            with Image.open(Path(f"{base}.png")) as im:
                crop = np.asarray(im.convert("RGB"))
        except (OSError, ValueError):
            return None
        return entry["metrics"], crop

    def store(self, label: str, name: str, key: str, metrics: dict[str, float], crop: np.ndarray) -> None:
        if self.root is None:
            return
        import io

        from PIL import Image

        base = self._base(label, name, key)
        buffer = io.BytesIO()
        Image.fromarray(crop).save(buffer, format="PNG")
        atomic_write_bytes(Path(f"{base}.png"), buffer.getvalue())  # crop first: json marks done
        atomic_write_bytes(Path(f"{base}.json"), json.dumps({"key": key, "metrics": metrics}).encode())


# --------------------------------------------------------------------------------------------------
# measuring


def measure(
    output: np.ndarray,
    reference: np.ndarray,
    ground_truth: np.ndarray | None = None,
    box: Box | None = None,
) -> dict[str, float]:
    """All metrics of one output: A against ``reference`` (its input), B on the output (levels in
    ``box``), L1 / identical pixels when output and reference have the same size, C against
    ``ground_truth`` when given."""
    result = M.drift_at_input_scale(output, reference)
    result.update(M.detail(output, box))
    if output.shape == reference.shape:
        result.update(M.pixel_agreement(output, reference))
    if ground_truth is not None:
        if ground_truth.shape != output.shape:
            raise FlowliftError(
                f"ground truth {ground_truth.shape[1]}x{ground_truth.shape[0]} and output "
                f"{output.shape[1]}x{output.shape[0]} differ in size"
            )
        result.update(M.fidelity(output, ground_truth))
    return result


#: How the "worst" row picks a value: largest magnitude (sign kept), smallest or largest.
WORST_RULE = {
    "cast_r": "abs", "cast_g": "abs", "cast_b": "abs", "cast_max": "max",
    "c_mean_change_pct": "abs", "dC": "abs", "c_p99_change": "abs", "l_std_change": "abs",
    "l_p5_change": "abs", "l_p95_change": "abs", "psnr_input": "min", "sharpness": "min",
    "hf_energy": "min", "levels": "min", "grey_sigma": "min", "l1": "max", "identical_pct": "min",
    "psnr_gt": "min", "ssim_gt": "min",
}  # fmt: skip


def summarize(per_image: dict[str, dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """``(mean, worst)`` over images for every metric (worst per :data:`WORST_RULE`)."""
    keys = list(next(iter(per_image.values())).keys()) if per_image else []
    mean: dict[str, float] = {}
    worst: dict[str, float] = {}
    for k in keys:
        values = np.array([m[k] for m in per_image.values() if k in m], dtype=np.float64)
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

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        out = {}
        for label, per_image in self.results.items():
            mean, worst = summarize(per_image)
            out[label] = {"mean": mean, "worst": worst}
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "summary": self.summary(),
            "images": self.results,
            "cache": {"reused": self.cached, "computed": self.computed},
            "figure": {"crop_columns": {c: sorted(self.crops.get(c, {})) for c in self.crop_columns}},
        }


def _nearest_up(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize(size, resample=Image.Resampling.NEAREST))


def _scaled_box(box: Box, factor_x: float, factor_y: float) -> Box:
    x, y, w, h = box
    return (
        int(round(x * factor_x)),
        int(round(y * factor_y)),
        max(1, int(round(w * factor_x))),
        max(1, int(round(h * factor_y))),
    )


def _input_crop(reference: np.ndarray, output_size: tuple[int, int], crop: Box) -> np.ndarray:
    """The crop region of the reference, nearest-upscaled to the crop's output size."""
    w_out, h_out = output_size
    fx, fy = reference.shape[1] / w_out, reference.shape[0] / h_out
    small = M.crop_box(reference, _scaled_box(crop, fx, fy))
    return _nearest_up(small, (crop[2], crop[3]))


def _load_rgb(path: Path) -> np.ndarray:
    from flowlift.files.images import load_image

    return np.asarray(load_image(path)[0])


def _by_stem(paths: Sequence[Path], what: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for p in paths:
        if p.stem in out:
            raise FlowliftError(f"{what}: two files named {p.stem!r} ({out[p.stem].name}, {p.name})")
        out[p.stem] = p
    return out


def evaluate_pairs(
    outputs: Sequence[str | Path],
    reference: str | Path,
    ground_truth: str | Path | None = None,
    *,
    box: Box | None = None,
    label: str = "outputs",
    figure_images: int = 3,
    progress: bool = False,
) -> EvalReport:
    """Measure existing ``outputs`` (files/folders) against their files in ``reference`` (and
    ``ground_truth``): the same stem, or ``<stem>_x<N>`` (``flowlift upscale``'s names) with ``<stem>``
    (:func:`flowlift.files.naming.pair_by_stem`). Images without a counterpart are skipped; none paired is an
    error."""
    from tqdm import tqdm

    from flowlift.files.images import list_images
    from flowlift.files.naming import pair_by_stem

    out_paths = list_images([str(o) for o in outputs])
    _by_stem(out_paths, "outputs")
    pairs, unpaired = pair_by_stem(out_paths, list_images([str(reference)]))
    gts = _by_stem(list_images([str(ground_truth)]), "ground truth") if ground_truth is not None else None
    # keyed by the reference's stem: kodim01_x2.png (an upscale output) is the image "kodim01"
    outs = {ref.stem: out for out, ref in pairs if gts is None or ref.stem in gts}
    refs = {ref.stem: ref for _, ref in pairs}
    names = sorted(outs)
    if not names:
        raise FlowliftError(
            "no output file pairs with a reference (same stem, or <stem>_x<N> for <stem>)"
            + (" that has a ground truth file" if gts is not None else "")
        )
    report = EvalReport(
        config={
            "mode": "pairs",
            "outputs": [str(o) for o in outputs],
            "reference": str(reference),
            "ground_truth": None if ground_truth is None else str(ground_truth),
            "box": box,
            "images": names,
            "unpaired_outputs": sorted(
                [p.stem for p in unpaired] + [out.stem for out, ref in pairs if ref.stem not in outs]
            ),
        }
    )
    report.crop_columns = ["input", label] + (["ground truth"] if gts is not None else [])
    for c in report.crop_columns:
        report.crops[c] = {}
    report.results[label] = {}
    for i, name in enumerate(tqdm(names, desc="eval", unit="img", disable=not progress)):
        out = _load_rgb(outs[name])
        ref = _load_rgb(refs[name])
        gt = _load_rgb(gts[name]) if gts is not None else None
        report.results[label][name] = measure(out, ref, gt, box)
        report.computed += 1
        if i < figure_images:
            crop = default_crop((out.shape[1], out.shape[0]), box)
            report.crops["input"][name] = _input_crop(ref, (out.shape[1], out.shape[0]), crop)
            report.crops[label][name] = M.crop_box(out, crop)
            if gt is not None:
                report.crops["ground truth"][name] = M.crop_box(gt, crop)
    return report


MethodFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


def dataset_paths(dataset: Sequence[str | Path], limit: int | None = None) -> list[Path]:
    """The photos of ``dataset`` (files/folders/globs, as listed by ``list_images``), the first
    ``limit`` of them when given; distinct stems are required (results are keyed by stem)."""
    from flowlift.files.images import list_images

    paths = list_images([str(d) for d in dataset])
    if limit is not None:
        paths = paths[:limit]
    if not paths:
        raise FlowliftError("the dataset holds no images")
    _by_stem(paths, "dataset")
    return paths


def make_method_fn(
    spec: MethodSpec,
    scale: int,
    *,
    vae=None,
    pipeline=None,
    device: Any = "cpu",
    dtype: Any = None,
    pixel_models: dict[str, Any] | None = None,
) -> MethodFn:
    """``fn(lowres, ground_truth) -> output`` (uint8 HWC) for one method. ``pixel_models`` maps a
    spandrel method's path to its loaded :class:`flowlift.measure.pixel_upscaler.PixelUpscaler`."""
    if spec.name == SPANDREL:
        opts = dict(spec.options)
        model = (pixel_models or {}).get(opts["path"])
        if model is None:
            raise FlowliftError(f"method {spec.label} needs its model loaded (flowlift.measure.pixel_upscaler)")
        return spandrel_method_fn(model, scale, opts["colorfix"])
    if spec.name in PIXEL_METHODS:
        return lambda low, gt: pixel_upscale(low, scale, spec.name)
    if vae is None:
        raise FlowliftError(f"method {spec.name} needs a VAE (--vae)")
    if spec.name == "latent-bicubic":
        return lambda low, gt: latent_bicubic(vae, low, scale, device, dtype)
    if spec.name == "vae-roundtrip":
        return lambda low, gt: vae_roundtrip(vae, gt, device, dtype)
    if pipeline is None:
        raise FlowliftError("method flow needs the Flow Upscaler weights (--upscaler)")
    kwargs = flow_kwargs(spec, scale)

    def run_flow(low: np.ndarray, gt: np.ndarray) -> np.ndarray:
        from PIL import Image

        out = np.asarray(pipeline.upscale_image(Image.fromarray(low), **kwargs).convert("RGB"))
        if out.shape != gt.shape:
            raise FlowliftError(
                f"flow output {out.shape[1]}x{out.shape[0]} is not {scale}x the input "
                f"({gt.shape[1]}x{gt.shape[0]} expected)"
            )
        return out

    return run_flow


def method_folder(label: str) -> str:
    """A method label as a folder name (``flow:color=off`` -> ``flow_color=off``)."""
    return "".join(ch if ch.isalnum() or ch in "-_=.," else "_" for ch in label)


def evaluate_methods(
    methods: Sequence[MethodSpec],
    dataset: Sequence[str | Path],
    scale: int,
    *,
    method_fns: dict[str, MethodFn] | None = None,
    identities: dict[str, Any] | None = None,
    cache_dir: Path | None = None,
    box: Box | None = None,
    limit: int | None = None,
    figure_images: int = 3,
    progress: bool = False,
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
    whose results reach the merged report through the cache.
    """
    from PIL import Image
    from tqdm import tqdm

    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.naming import upscaled_name

    if scale < 2:
        raise FlowliftError(f"--scale must be an integer >= 2, got {scale}")
    paths = dataset_paths(dataset, limit)
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
            "box": box,
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
    bar = tqdm(total=len(paths) * len(methods), desc="eval", unit="run", disable=not progress)
    try:
        for i, path in enumerate(paths):
            name = path.stem
            gt, low = prepare_pair(_load_rgb(path), scale)
            size = (gt.shape[1], gt.shape[0])
            crop = default_crop(size, box)
            M.crop_box(gt, crop)  # validates the box against the output size
            report.results["(ground truth)"][name] = M.detail(gt, box)
            if i < figure_images:
                report.crops["input"][name] = _input_crop(low, size, crop)
                report.crops["ground truth"][name] = M.crop_box(gt, crop)
            base = {"v": CACHE_VERSION, "scale": scale, "box": box, "crop": crop, "input": array_digest(low, gt)}
            if save_outputs is not None:
                for folder, array in (("inputs", low), ("ground-truth", gt)):
                    target = Path(save_outputs) / folder / f"{name}.png"
                    if not target.is_file():
                        save_image_atomic(Image.fromarray(array), target)
            for spec in methods:
                fields = {**base, "method": spec.name, "options": dict(spec.options)}
                if spec.needs_vae:
                    fields.update({k: identities.get(k) for k in ("vae", "device", "dtype")})
                if spec.name == "flow":
                    fields["upscaler"] = identities.get("upscaler")
                if spec.name == SPANDREL:
                    fields.update(_spandrel_key_fields(identities, dict(spec.options)["path"], low.shape))
                key = cache_key(fields)
                saved = None
                if save_outputs is not None:
                    saved = Path(save_outputs) / method_folder(spec.label) / upscaled_name(name, scale, "png")
                hit = cache.load(spec.label, name, key) if saved is None or saved.is_file() else None
                if hit is not None:
                    metrics, crop_img = hit
                    report.cached += 1
                else:
                    fn = method_fns.get(spec.label) or make_method_fn(spec, scale)
                    output = fn(low, gt)
                    if output.shape != gt.shape or output.dtype != np.uint8:
                        raise FlowliftError(
                            f"method {spec.label} returned {output.shape} {output.dtype}, "
                            f"expected {gt.shape} uint8"
                        )
                    metrics = measure(output, low, gt, box)
                    if saved is not None:
                        save_image_atomic(Image.fromarray(output), saved, {"flowlift": {**fields, "image": name}})
                    crop_img = np.ascontiguousarray(M.crop_box(output, crop))
                    cache.store(spec.label, name, key, metrics, crop_img)
                    report.computed += 1
                report.results[spec.label][name] = metrics
                if i < figure_images:
                    report.crops[spec.label][name] = crop_img
                bar.update(1)
    finally:
        bar.close()
    return report


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


# --------------------------------------------------------------------------------------------------
# report

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
    return (
        "\n".join(lines)
        + f"\n\n{n} image(s); drift and PSNR in at input scale (INTER_AREA), Lab units.\n"
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


def _save_figure(fig, path: Path) -> None:
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())


def metrics_figure(report: EvalReport, path: Path) -> None:
    """Per-metric bars (mean per method) with every image's value as dots; written atomically."""
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
    _save_figure(fig, path)
    plt.close(fig)


def crops_figure(report: EvalReport, path: Path) -> None:
    """Crop grid: one row per image, columns input (nearest-upscaled) / outputs / ground truth."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    columns = [c for c in report.crop_columns if report.crops.get(c)]
    names = list(report.crops[columns[0]]) if columns else []
    if not names:
        return
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
        axes[r][0].text(-0.05, 0.5, name, transform=axes[r][0].transAxes, rotation=90, ha="right",
                        va="center", fontsize=7)  # fmt: skip
    fig.tight_layout()
    _save_figure(fig, path)
    plt.close(fig)


def write_report(report: EvalReport, out_dir: Path) -> dict[str, Path]:
    """Write ``results.json``, ``table.md``, ``metrics.png`` and ``crops.png`` into ``out_dir``, each
    atomically (rendered in memory, then a temporary file and a rename). Returns the paths."""
    table = markdown_table(report)
    payload = json.dumps(report.to_json(), indent=1, sort_keys=False).encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / "results.json",
        "table": out_dir / "table.md",
        "metrics": out_dir / "metrics.png",
        "crops": out_dir / "crops.png",
    }
    metrics_figure(report, paths["metrics"])
    crops_figure(report, paths["crops"])
    atomic_write_bytes(paths["table"], table.encode())
    atomic_write_bytes(paths["json"], payload)
    return paths

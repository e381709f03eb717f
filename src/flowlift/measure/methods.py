"""The methods ``flowlift eval --run`` compares: :func:`parse_methods` turns ``--run`` into :class:`MethodSpec`
and :func:`make_method_fn` builds each one's ``fn(lowres, ground_truth) -> output``. ``lanczos`` / ``bicubic``
(Pillow), ``latent-bicubic`` / ``vae-roundtrip`` (through the VAE; the latter is its ceiling for any latent
upscaler), ``flow`` (the Flow Upscaler, e.g. ``flow:transplant=0.5:seed=1``),
``spandrel:PATH[:label][+colorfix]`` (a local pixel super-resolution model, :mod:`flowlift.measure.pixel_upscaler`)
and ``sesqui:PATH[:label]`` (SesquiLSR, :mod:`flowlift.models.sesqui_lsr`, on the FLUX.2 VAE's raw latents).

Scales may be fractional (1.5): every method makes an output of the ground truth's size. A method that cannot
reach a scale (:func:`unreachable`: the Flow Upscaler off the powers of two, SesquiLSR past 2x) is skipped
with that reason in the report.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.knobs import SEED, TRANSPLANT_STRENGTH, Knob
from flowlift.upscale.settings import COLOR_FIX_STRENGTH

PIXEL_METHODS = ("lanczos", "bicubic")
VAE_METHODS = ("latent-bicubic", "vae-roundtrip", "flow")
METHODS = PIXEL_METHODS + VAE_METHODS
#: ``spandrel:PATH[:label][+colorfix]``: a pixel super-resolution model file (see parse_spandrel_method).
SPANDREL = "spandrel"
#: ``sesqui:PATH[:label]``: SesquiLSR weights (a .safetensors file), run on the VAE's raw latents.
SESQUI = "sesqui"
COLORFIX_SUFFIX = "+colorfix"
#: ``flow``'s options, each a knob of the tables (the upscaler's; ``color`` switches both colour stages).
FLOW_OPTIONS = {
    "transplant": TRANSPLANT_STRENGTH,
    "color_fix": COLOR_FIX_STRENGTH,
    "color": Knob("color", str, "on", "both colour-drift stages on or off", choices=("on", "off")),
    "seed": SEED,
}

MethodFn = Callable[[np.ndarray, np.ndarray], np.ndarray]


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
        if self.name == SESQUI:
            return f"{SESQUI}:{dict(self.options)['label']}"
        return ":".join([self.name] + [f"{k}={v}" for k, v in self.options])

    @property
    def needs_vae(self) -> bool:
        return self.name in VAE_METHODS or self.name == SESQUI


def parse_methods(text: str | Sequence[str]) -> list[MethodSpec]:
    """Parse ``"lanczos,bicubic,flow:transplant=0.5"`` (or a list of such strings) into specs.

    Methods are separated by commas (:func:`flowlift.knobs.comma_items`: an empty item, ``lanczos,,bicubic``, is
    refused, not skipped), a method's options by colons. Unknown methods/options, bad values and duplicates (also
    spelled two ways: ``flow:seed=1:color=on`` and ``flow:color=on:seed=1``) raise :class:`FlowliftError`.
    """
    from flowlift.knobs import comma_items

    specs: list[MethodSpec] = []
    for part in comma_items(text, "run"):
        spec = _parse_method(part)
        if spec.label in (s.label for s in specs):
            models = " (give models distinct labels)" if spec.name in (SPANDREL, SESQUI) else ""
            raise FlowliftError(f"{FIELD_MARK}: method {spec.label} given twice{models}", field="run")
        specs.append(spec)
    if not specs:
        raise FlowliftError(f"{FIELD_MARK}: no methods given", field="run")
    return specs


def _parse_method(part: str) -> MethodSpec:
    """One item of ``--run`` (:func:`parse_methods`) as its spec."""
    if part.lower().startswith((SPANDREL + ":", SESQUI + ":")):
        return parse_spandrel_method(part) if part.lower().startswith(SPANDREL) else parse_sesqui_method(part)
    name, *opts = part.split(":")
    name = name.strip().lower()
    if name not in METHODS:
        raise FlowliftError(
            f"unknown method {name!r}; choose from {', '.join(METHODS)}, "
            f"{SPANDREL}:MODEL_FILE[:label][{COLORFIX_SUFFIX}] or {SESQUI}:WEIGHTS.safetensors[:label]"
        )
    options: dict[str, Any] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        key = key.strip()
        if name != "flow" or not sep or key not in FLOW_OPTIONS:
            allowed = ", ".join(f"{k}=" for k in FLOW_OPTIONS) if name == "flow" else "none"
            raise FlowliftError(f"method {name}: bad option {opt!r} (options: {allowed})")
        options[key] = _parse_flow_option(key, value.strip())
    return MethodSpec(name, tuple(sorted(options.items())))


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


def parse_sesqui_method(text: str) -> MethodSpec:
    """``sesqui:PATH[:label]`` -> a spec with options ``label`` and ``path``; ``PATH`` is a ``.safetensors``
    file (the released FLUX.2 weights are ``upscaler_Flux2.safetensors``), the label defaults to its stem."""
    body = text.strip()[len(SESQUI) + 1 :].strip()
    path, label = body, ""
    head, sep, tail = body.rpartition(":")
    if sep and head.lower().endswith(".safetensors"):
        path, label = head, tail.strip()
    if not path.lower().endswith(".safetensors"):
        raise FlowliftError(
            f"method {text!r}: sesqui: takes a SesquiLSR .safetensors file, e.g. sesqui:upscaler_Flux2.safetensors"
        )
    label = label or Path(path).stem
    if not re.fullmatch(r"[A-Za-z0-9_.=-]+", label):
        raise FlowliftError(f"method {text!r}: label {label!r} may hold only letters, digits and _ . = -")
    return MethodSpec(SESQUI, (("label", label), ("path", path)))


def unreachable(spec: MethodSpec, scale: float) -> str | None:
    """Why ``spec`` cannot make a ``scale`` x output (the report's skip note), or None when it can.

    The Flow Upscaler doubles per pass (powers of two only); SesquiLSR reaches (1, 2] in one forward.
    Pixel methods, latent bicubic and spandrel models (Lanczos from their native scale) reach any scale.
    """
    if spec.name == "flow" and not (float(scale).is_integer() and int(scale) & (int(scale) - 1) == 0):
        return f"the Flow Upscaler runs 2x per pass: x{scale:g} is not a power of 2"
    if spec.name == SESQUI and not 1 < scale <= 2:
        return f"SesquiLSR reaches factors in [1, 2] in one forward, not x{scale:g}"
    return None


def check_something_measured(specs: Sequence[MethodSpec], scale: float) -> None:
    """One line, before anything is read or loaded, when no method of ``specs`` can reach ``scale``
    (:func:`unreachable`): a report of the ground truth alone is no measurement. It names each method's reason."""
    reasons = {spec.label: unreachable(spec, scale) for spec in specs}
    if specs and all(reasons.values()):
        why = "; ".join(f"{label}: {reason}" for label, reason in reasons.items())
        raise FlowliftError(
            f"no method of {FIELD_MARK} reaches {FIELD_MARK} {scale:g}, so nothing would be measured ({why}); add one "
            f"that does (lanczos, bicubic, latent-bicubic, vae-roundtrip, spandrel:) or choose another {FIELD_MARK}",
            field=("run", "scale", "scale"),
        )


def output_size(lowres: np.ndarray, scale: float) -> tuple[int, int]:
    """``(width, height)`` of a ``scale`` x output of the HWC ``lowres``: each side times ``scale``, rounded."""
    h, w = lowres.shape[:2]
    return int(round(w * scale)), int(round(h * scale))


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
    """One ``flow`` option's value, checked by its knob (numbers parsed exactly, as on the command line)."""
    knob = FLOW_OPTIONS[key]
    try:
        return knob.check(value.lower() if knob.choices else value, key, loose=True)
    except FlowliftError:
        if knob.choices:
            raise FlowliftError(f"method flow: {key} must be {' or '.join(knob.choices)}, got {value!r}") from None
        raise FlowliftError(f"method flow: {key} must be {knob.describe()}, got {value!r}") from None


def pixel_upscale(lowres: np.ndarray, scale: float, method: str) -> np.ndarray:
    """Pillow ``LANCZOS`` / ``BICUBIC`` resize of a uint8 HWC image by ``scale`` (:func:`output_size`)."""
    from PIL import Image

    resample = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC}[method]
    return np.asarray(Image.fromarray(lowres).resize(output_size(lowres, scale), resample=resample))


def latent_bicubic(vae, lowres: np.ndarray, scale: float, device, dtype) -> np.ndarray:
    """Encode, ``torch.nn.functional.interpolate(size, mode="bicubic", align_corners=False)`` to the
    latents of the ``scale`` x output (:func:`output_size` / 8) in latent space, decode; uint8 HWC out.

    When the VAE has normalization statistics (``bn_mean`` / ``bn_std``, the FLUX.2 VAE) the
    interpolation runs on the raw latents (``denormalize``, interpolate, ``normalize``): the
    normalization differs per 2x2 sub-position, so interpolating normalized latents would mix those
    statistics. TAEF2 has none and is interpolated in its own latent space.
    """
    import torch

    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.flux2.latents import denormalize, normalize
    from flowlift.models.weights import finite_result
    from flowlift.upscale.image_steps import vae_input_dtype

    mean, std = getattr(vae, "bn_mean", None), getattr(vae, "bn_std", None)
    with torch.no_grad():
        z = finite_result(
            "the VAE's encoder", vae.encode, to_tensor(lowres, device=device, dtype=vae_input_dtype(vae, dtype))
        )
        if mean is not None and std is not None:
            z = denormalize(z, mean, std)
        width, height = output_size(lowres, scale)
        size = (height // vae.spatial_factor, width // vae.spatial_factor)
        z = torch.nn.functional.interpolate(z, size=size, mode="bicubic", align_corners=False)
        if mean is not None and std is not None:
            z = normalize(z, mean, std)
        return tensor_to_uint8(finite_result("the VAE's decoder", vae.decode, z).float())[0]


def sesqui_upscale(model, vae, lowres: np.ndarray, scale: float, device, dtype) -> np.ndarray:
    """Encode, SesquiLSR to the latents of the ``scale`` x output on the raw latents
    (:func:`flowlift.models.sesqui_lsr.sesqui_upscale_latents`, with the VAE's BN statistics), decode; uint8 HWC."""
    import torch

    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.models.sesqui_lsr import sesqui_upscale_latents
    from flowlift.models.weights import finite_result
    from flowlift.upscale.image_steps import vae_input_dtype

    width, height = output_size(lowres, scale)
    target = (height // vae.spatial_factor, width // vae.spatial_factor)
    with torch.no_grad():
        z = finite_result(
            "the VAE's encoder", vae.encode, to_tensor(lowres, device=device, dtype=vae_input_dtype(vae, dtype))
        )
        z = finite_result("SesquiLSR", sesqui_upscale_latents, model, z, target, vae.bn_mean, vae.bn_std)
        return tensor_to_uint8(finite_result("the VAE's decoder", vae.decode, z).float())[0]


def vae_roundtrip(vae, image: np.ndarray, device, dtype) -> np.ndarray:
    """``decode(encode(image))``; uint8 HWC out."""
    import torch

    from flowlift.files.images import tensor_to_uint8, to_tensor
    from flowlift.models.weights import finite_result
    from flowlift.upscale.image_steps import vae_input_dtype

    with torch.no_grad():
        z = finite_result(
            "the VAE's encoder", vae.encode, to_tensor(image, device=device, dtype=vae_input_dtype(vae, dtype))
        )
        return tensor_to_uint8(finite_result("the VAE's decoder", vae.decode, z).float())[0]


def flow_kwargs(spec: MethodSpec, scale: int) -> dict[str, Any]:
    """``upscale_image`` keyword arguments of a ``flow`` spec: ``num_passes = log2(scale)``."""
    passes = int(round(math.log2(scale)))
    if 2**passes != scale:
        raise FlowliftError(
            f"method flow upscales 2x per pass; {FIELD_MARK} must be a power of 2, got {scale}", field="scale"
        )
    opts = dict(spec.options)
    return {
        "num_passes": passes,
        "seed": int(opts.get("seed", 0)),
        "color_fix": opts.get("color", "on") == "on",
        "transplant_strength": float(opts.get("transplant", 1.0)),
        "color_fix_strength": float(opts.get("color_fix", 1.0)),
    }


def make_method_fn(
    spec: MethodSpec,
    scale: float,
    *,
    vae=None,
    pipeline=None,
    device: Any = "cpu",
    dtype: Any = None,
    pixel_models: dict[str, Any] | None = None,
) -> MethodFn:
    """``fn(lowres, ground_truth) -> output`` (uint8 HWC) for one method. ``pixel_models`` maps a
    spandrel method's path to its loaded :class:`flowlift.measure.pixel_upscaler.PixelUpscaler`; a SesquiLSR
    method loads its weights here (3M parameters). A method :func:`unreachable` at ``scale`` gets a function
    that raises its reason (``evaluate_methods`` skips it instead of calling it)."""
    if reason := unreachable(spec, scale):

        def skipped(low: np.ndarray, gt: np.ndarray) -> np.ndarray:
            raise FlowliftError(f"method {spec.label} is skipped at this scale: {reason}")

        return skipped
    if spec.name == SPANDREL:
        opts = dict(spec.options)
        model = (pixel_models or {}).get(opts["path"])
        if model is None:
            raise FlowliftError(f"method {spec.label} needs its model loaded (flowlift.measure.pixel_upscaler)")
        return spandrel_method_fn(model, scale, opts["colorfix"])
    if spec.name in PIXEL_METHODS:
        return lambda low, gt: pixel_upscale(low, scale, spec.name)
    if vae is None:
        raise FlowliftError(f"method {spec.name} needs a VAE ({FIELD_MARK})", field="vae")
    if spec.name == "latent-bicubic":
        return lambda low, gt: latent_bicubic(vae, low, scale, device, dtype)
    if spec.name == "vae-roundtrip":
        return lambda low, gt: vae_roundtrip(vae, gt, device, dtype)
    if spec.name == SESQUI:
        return _sesqui_method_fn(spec, scale, vae, device, dtype)
    if pipeline is None:
        raise FlowliftError(f"method flow needs the Flow Upscaler weights ({FIELD_MARK})", field="upscaler")
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


def sesqui_vae_refusal(label: str) -> FlowliftError:
    """The one line for a SesquiLSR method (``label``) run with a VAE that has no BN statistics (TAEF2, Mage-VAE):
    raised before anything loads where the VAE's spec tells its kind, else once the VAE has loaded."""
    return FlowliftError(
        f"method {label} works on raw FLUX.2 VAE latents and needs the FLUX.2 VAE (set {FIELD_MARK} to "
        "flux2 or its file): TAEF2 and Mage-VAE latents are already normalized and carry no BN statistics",
        field="vae",
    )


def _sesqui_method_fn(spec: MethodSpec, scale: float, vae, device: Any, dtype: Any) -> MethodFn:
    """A SesquiLSR method's fn, its weights loaded (float32 unless ``dtype`` says otherwise); a VAE without the
    FLUX.2 BN statistics (TAEF2, Mage-VAE) is one line before any work."""
    import torch

    from flowlift.models.sesqui_lsr import load_sesqui_lsr

    if getattr(vae, "bn_mean", None) is None:  # a VAE whose kind its spec did not tell (a module, a pickle)
        raise sesqui_vae_refusal(spec.label)
    model = load_sesqui_lsr(dict(spec.options)["path"], device, dtype or torch.float32)
    return lambda low, gt: sesqui_upscale(model, vae, low, scale, device, dtype)


def method_folder(label: str) -> str:
    """A method label as a folder name (``flow:color=off`` -> ``flow_color=off``)."""
    return "".join(ch if ch.isalnum() or ch in "-_=.," else "_" for ch in label)


#: How the spandrel models of ``eval --run`` tile (input pixels); checked on every run, spandrel or not.
SPANDREL_TILE = Knob(
    "tile",
    int,
    "auto",
    "spandrel models: tile side in input pixels, auto (sized by memory) or none (untiled)",
    low=1,
    words=("auto", "none"),
    unit="px",
)
#: The same as :data:`flowlift.measure.tiled_inference.DEFAULT_OVERLAP` (tests/test_up_front_checks.py).
SPANDREL_TILE_OVERLAP = Knob(
    "tile_overlap", int, 32, "spandrel models: input pixels of context around each tile", low=0, unit="px"
)


def spandrel_tiling(tile: Any = "auto", overlap: Any = None) -> tuple[int | str | None, int]:
    """``(tile, overlap)`` for :func:`flowlift.measure.pixel_upscaler.load_pixel_upscaler`, checked: each in its
    knob's domain (``"none"`` becomes ``None``; numbers are numbers, not text), and a tile larger than twice its
    overlap. One FlowliftError line."""
    overlap = SPANDREL_TILE_OVERLAP.default if overlap is None else SPANDREL_TILE_OVERLAP.check(overlap)
    tile = SPANDREL_TILE.check(tile)
    if isinstance(tile, int) and tile - 2 * overlap < 1:
        raise FlowliftError(
            f"{FIELD_MARK} {tile} must exceed twice the {FIELD_MARK} ({overlap})", field=("tile", "tile_overlap")
        )
    return (None if tile == "none" else tile), overlap

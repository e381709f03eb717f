"""ComfyUI's tensor layouts <-> flowlift's, and the checks the nodes make on their inputs.

ComfyUI ``IMAGE``: float (B, H, W, C) in [0, 1], C = 3 or 4 (RGBA: core JoinImageWithAlpha's). ComfyUI FLUX.2
``LATENT``: ``{"samples": (B, 128, h, w)}``, normalized and patchified
(:func:`flowlift.flux2.latents.to_comfyui_latent`), optionally with ``noise_mask`` and ``batch_index``. No ComfyUI
import here: these are plain tensor functions.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import PATCHIFIED_CHANNELS, from_comfyui_latent, patchify
from flowlift.knobs import SEED_MAX, Knob  # noqa: F401  (SEED_MAX: the seed widgets' maximum)
from flowlift.refine.settings import TILE_OVERLAP
from flowlift.upscale.colorfix_image import integer_scale
from flowlift.upscale.settings import COLOR_FIX_KNOBS, UPSCALE_KNOBS

#: How the node pack names the fields a core error names (``vae``: the VAE a node is given), where its words
#: differ from the Python API's; every other field is the input of the same name.
COMFY_WORDS = {"vae": "the vae input"}


@contextlib.contextmanager
def comfy_words(where: str = "") -> Iterator[None]:
    """Within this block, a :class:`FlowliftError` that names fields is re-raised with them in the node pack's words
    (:data:`COMFY_WORDS`), after ``where`` (``VAE Encode``: a ComfyUI node that runs a flowlift VAE); no core error
    spells the command line's ``--vae`` to a ComfyUI user."""
    try:
        yield
    except FlowliftError as error:
        if not error.fields:
            raise
        raise FlowliftError(f"{where}: " * bool(where) + error.worded(COMFY_WORDS)) from None


#: The knobs behind each node's numeric widgets (input name -> knob of the capability's table).
NODE_KNOBS: dict[str, dict[str, Knob]] = {
    "FlowliftUpscaleLatent": {name: UPSCALE_KNOBS[name] for name in ("scale", "seed", "transplant_strength")},
    "FlowliftUpscaleImage": {
        name: UPSCALE_KNOBS[name] for name in ("scale", "seed", "transplant_strength", "color_fix_strength")
    },
    "FlowliftColorFix": dict(COLOR_FIX_KNOBS),
}
#: The inputs :func:`check_prompt_numbers` holds to their knobs: the nodes' numeric widgets, and the tiled refine's
#: ``tile_overlap`` (a number widget; its tile size and batch are text the node parses).
PROMPT_KNOBS: dict[str, dict[str, Knob]] = {**NODE_KNOBS, "FlowliftTiledFlux2Refine": {"tile_overlap": TILE_OVERLAP}}
#: Every numeric widget of every node, with its (lowest, highest) value and whether it is an integer, from
#: the knob tables: the nodes check theirs with :func:`check_numbers` before any work (ComfyUI's own min/max
#: check lets NaN through, and a node called from Python gets no check at all). A test keeps this equal to
#: the nodes' INT and FLOAT inputs.
NUMERIC_INPUTS: dict[str, dict[str, tuple[float, float, bool]]] = {
    node: {name: (knob.low, knob.high, knob.kind is int) for name, knob in knobs.items()}
    for node, knobs in NODE_KNOBS.items()
}


def widget_range(knob: Knob) -> dict[str, float | int]:
    """A number widget's ``min`` and ``max``: the knob's closed range, both always given. ComfyUI's frontend caps a
    widget without ``max`` at 2048 (a ``tile_overlap`` of 4096 could not be typed), so a knob unbounded on a side,
    or open at an end (no widget can say it), is a programming error here, not a widget that quietly narrows."""
    if knob.low is None or knob.high is None or knob.low_open or knob.high_open:
        raise ValueError(f"a ComfyUI number widget needs a closed range; the knob {knob.name} is {knob.describe()}")
    return {"min": knob.low, "max": knob.high}


def check_numbers(node: str, **values: Any) -> dict[str, float | int]:
    """``values`` (input name -> value) of ``node``'s numeric inputs checked against
    :data:`NUMERIC_INPUTS`: each must be a finite number (an integer where the input is an INT) within
    its range, else one error line naming the node, the input and the value. Returns them as int/float.

    An INT input is its knob's own check (:meth:`flowlift.knobs.Knob.check`, the rule of every door: the seed
    is :data:`flowlift.knobs.SEED`'s), strict as the Python API is: an ``int`` (numpy's too), never a bool, a
    float or text."""
    checked: dict[str, float | int] = {}
    for name, value in values.items():
        low, high, integer = NUMERIC_INPUTS[node][name]
        if integer:
            checked[name] = NODE_KNOBS[node][name].check(value, label=f"{node}: {name}")
            continue
        number = value if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number) or not low <= number <= high:
            raise FlowliftError(f"{node}: {name} must be a finite number in [{low}, {high}], got {value!r}")
        checked[name] = float(number)
    return checked


def check_prompt_numbers(request: Any) -> Any:
    """ComfyUI's ``POST /prompt`` body with every INT input of flowlift's nodes held to its knob's rule, and no
    bool in a FLOAT input (registered as an on-prompt handler by :mod:`flowlift.comfyui.nodes`).

    ComfyUI converts an INT widget's value with ``int()`` and a FLOAT's with ``float()`` before any node code runs
    (5.5 becomes 5, ``true`` becomes 1 or 1.0, ``false`` a colour fix of strength 0), so the nodes never see what
    was sent. Here each INT value is checked as the other JSON doors (the web app's API, InvokeAI) check it:
    :meth:`~flowlift.knobs.Knob.check` with ``loose`` (an integer, a string of digits, a whole float up to 2^53).
    A value it takes is put back as that ``int``; one it refuses (and any bool) is replaced by its error line,
    which ComfyUI's ``int()`` / ``float()`` then refuses, so the prompt is answered HTTP 400 with that line. (An
    on-prompt handler cannot refuse a prompt itself: ComfyUI logs what it raises and goes on.) Other FLOAT values
    reach the node, whose :func:`check_numbers` says what is wrong with them; linked inputs (``[node, output]``)
    and anything that is not a prompt are left as they are."""
    prompt = request.get("prompt") if isinstance(request, dict) else None
    if not isinstance(prompt, dict):
        return request
    for node in prompt.values():
        if not isinstance(node, dict) or not isinstance(node.get("inputs"), dict):
            continue
        class_type, inputs = node.get("class_type"), node["inputs"]
        for name, knob in PROMPT_KNOBS.get(class_type, {}).items() if isinstance(class_type, str) else ():
            value = inputs.get(name)
            if name not in inputs or isinstance(value, list):
                continue
            if isinstance(value, dict) and "__value__" in value:  # ComfyUI's wrapped widget value
                value = value["__value__"]
            if knob.kind is not int and not isinstance(value, bool):
                continue
            try:
                inputs[name] = knob.check(value, label=f"{class_type}: {name}", loose=True)
            except FlowliftError as error:
                inputs[name] = str(error)
    return request


def check_finite_tensor(tensor: torch.Tensor, what: str) -> None:
    """One error line unless every value of an input tensor is finite (NaN/Inf would come out as black)."""
    if not bool(torch.isfinite(tensor).all()):
        raise FlowliftError(f"{what} contains non-finite values (NaN/Inf); check the node that produced it")


#: How far past either end of [0, 1] a ComfyUI IMAGE's values may lie and be taken, clamped. ComfyUI's own resizes
#: leave overshoot unclamped: "bicubic" (ImageScale, ImageScaleBy, ...) is torch's Keys kernel (a = -0.75), whose
#: negative lobes add up to 0.1875 a side, so one resize of a [0, 1] image reaches (1.1875^2 + 0.1875^2) - 1 = 0.445
#: past an end (a fine pattern; measured in tests/test_comfyui_layouts.py). 0.5 takes any such image; pixels on a
#: 0..255 scale pass 1.5 as soon as one is brighter than 1.5/255, and are refused.
IMAGE_OVERSHOOT = 0.5


def checked_pixels(values: torch.Tensor, what: str) -> torch.Tensor:
    """An IMAGE's colour or alpha values in [0, 1]: NaN/Inf and values past :data:`IMAGE_OVERSHOOT` are one line, the
    overshoot of a resize is clamped (a new tensor: the input is another node's too)."""
    if not values.numel():
        raise FlowliftError(f"{what} is empty: shape {tuple(values.shape)}")
    check_finite_tensor(values, what)
    low, high = (float(v) for v in torch.aminmax(values))
    if low < -IMAGE_OVERSHOOT or high > 1.0 + IMAGE_OVERSHOOT:
        raise FlowliftError(
            f"{what} has values in [{low:.4g}, {high:.4g}]: a ComfyUI IMAGE is 0..1 (a resize's overshoot up to "
            f"{IMAGE_OVERSHOOT:g} past an end is clamped), so these look like 0..255 pixels; check the node that "
            "made them"
        )
    return values.clamp(0.0, 1.0) if low < 0.0 or high > 1.0 else values


def _checked_image(image: Any, what: str) -> torch.Tensor:
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise FlowliftError(f"{what}: expected a ComfyUI IMAGE of shape (batch, height, width, 3 or 4), got {shape}")
    return image


def image_to_nchw(image: torch.Tensor, what: str = "image") -> torch.Tensor:
    """ComfyUI IMAGE (B, H, W, 3 or 4) -> float32 (B, 3, H, W) in [0, 1] (:func:`checked_pixels`); the alpha of an
    RGBA IMAGE is :func:`image_alpha`'s."""
    return checked_pixels(_checked_image(image, what)[..., :3].movedim(-1, 1).to(torch.float32), what)


def image_alpha(image: torch.Tensor, what: str = "image") -> torch.Tensor | None:
    """The alpha of an RGBA ComfyUI IMAGE (core JoinImageWithAlpha's fourth channel) as float32 (B, H, W) in [0, 1]
    (:func:`checked_pixels`), None for RGB: the nodes put it back on their output (:func:`nchw_to_image`)."""
    if _checked_image(image, what).shape[-1] != 4:
        return None
    return checked_pixels(image[..., 3].to(torch.float32), f"{what}'s alpha")


def nchw_to_image(images: torch.Tensor, device: torch.device | str, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """float (B, 3, H, W) -> ComfyUI IMAGE (B, H, W, 3) float32 on ``device``, clamped to [0, 1]; with ``alpha``
    (B, h, w) an RGBA IMAGE, the alpha resized to (H, W) as every door resizes it
    (:func:`flowlift.files.alpha.resize_alpha`)."""
    out = images.clamp(0.0, 1.0).movedim(1, -1).to(device=device, dtype=torch.float32)
    if alpha is not None:
        from flowlift.files.alpha import resize_alpha

        size = (images.shape[-1], images.shape[-2])
        resized = torch.stack([resize_alpha(plane, size) for plane in alpha]).to(out)
        out = torch.cat([out, resized[..., None]], dim=-1)
    return out.contiguous()


def flux2_latents(latent: Any, what: str) -> torch.Tensor:
    """A ComfyUI FLUX.2 LATENT dict -> flowlift latents (B, 32, 2h, 2w); anything else (other shapes,
    NaN/Inf values) is one clear error."""
    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.ndim != 4 or samples.shape[1] != PATCHIFIED_CHANNELS:
        shape = tuple(samples.shape) if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise FlowliftError(
            f"{what} needs a FLUX.2 LATENT (batch, {PATCHIFIED_CHANNELS}, h, w) from the FLUX.2 VAE or TAEF2, "
            f"got samples of shape {shape}"
        )
    check_finite_tensor(samples, f"{what}: the LATENT")
    return from_comfyui_latent({"samples": samples.to(torch.float32)})


def upscaled_latent_dict(latent: dict, latents: torch.Tensor, device: torch.device | str) -> dict:
    """The output LATENT: ``latent``'s other entries kept (``batch_index`` ...), ``samples`` replaced by
    ``latents`` patchified, and a ``noise_mask`` resized by the same factor per side as the latent (bilinear; a
    latent upscaler's factor need not be whole: the mask's sides scale as the latent's, rounded)."""
    out = dict(latent)
    old = latent["samples"]
    samples = patchify(latents).to(device=device, dtype=torch.float32)
    out["samples"] = samples
    mask = latent.get("noise_mask")
    if isinstance(mask, torch.Tensor):
        shaped = mask.reshape(-1, 1, *mask.shape[-2:]).to(torch.float32)
        sides = zip(shaped.shape[-2:], samples.shape[-2:], old.shape[-2:], strict=True)
        size = tuple(round(m * new / was) for m, new, was in sides)
        out["noise_mask"] = F.interpolate(shaped, size=size, mode="bilinear", align_corners=False).to(
            device=device, dtype=mask.dtype if mask.is_floating_point() else torch.float32
        )
    return out


def matched_reference(images: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """The colour reference for a batch: a single reference image serves the whole batch; the sizes follow
    the Python API's rule (:func:`flowlift.upscale.colorfix_image.integer_scale`: the same integer >= 2 on both axes,
    as stage 2's exact low-band transplant works on whole area blocks), else one error line."""
    batch, _, height, width = images.shape
    ref_batch, _, h, w = reference.shape
    if ref_batch not in (1, batch):
        raise FlowliftError(f"colour fix: {ref_batch} reference images for {batch} images (give 1 or {batch})")
    try:
        integer_scale((width, height), (w, h))
    except FlowliftError as error:
        raise FlowliftError(f"colour fix: {error}; resize one of them first (e.g. ImageScale)") from None
    return reference.expand(batch, -1, -1, -1) if ref_batch != batch else reference

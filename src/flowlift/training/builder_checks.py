"""The dataset builders' arguments, each quantity checked by one rule, before any work or file write.

:func:`~flowlift.training.datasets.build_distill_dataset` and :func:`~flowlift.training.datasets.build_images_dataset`
check their arguments here, :class:`~flowlift.training.datasets.ShardWriting` its fields when it is made
(:func:`check_writing`), and the command's request objects (:mod:`flowlift.training.dataset_jobs`) take the same
rules for the same quantities: a wrong argument is one FlowliftError line naming it, and no ``dataset.json`` is
written for a call that then fails on its arguments.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.knobs import OVERWRITE, SEED, check_kind, check_paths, check_positive, exact_int
from flowlift.limits import MAX_OUTPUT_SIDE
from flowlift.training.degrade import Degradation
from flowlift.training.shards import CROP_ALIGN, STORAGE_DTYPES


def check_part(part: Any) -> tuple[int, int]:
    """``part`` as ``(index, count)``, a work split (this process builds shards ``k`` with ``k % count == index``):
    two integers with ``0 <= index < count``, else one line naming ``part``."""
    pair = tuple(part) if isinstance(part, (tuple, list)) and len(part) == 2 else ()
    numbers = [exact_int(number) for number in pair]
    if len(numbers) != 2 or None in numbers:
        raise FlowliftError(f"part must be (index, count), two integers, got {part!r}", field="part")
    index, count = numbers
    if count < 1 or not 0 <= index < count:
        raise FlowliftError(f"part must be I/N with 0 <= I < N, got {index}/{count}", field="part")
    return index, count


def check_storage_dtype(dtype: Any) -> torch.dtype:
    """``dtype`` if it is one of :data:`~flowlift.training.shards.STORAGE_DTYPES`' torch dtypes (those the
    ``STORAGE_DTYPE`` knob names), else one line naming ``storage_dtype``: ``"float16"`` is a name, not one."""
    if not isinstance(dtype, torch.dtype) or dtype not in STORAGE_DTYPES.values():
        spelled = ", ".join(f"torch.{name}" for name in STORAGE_DTYPES)
        raise FlowliftError(f"storage_dtype must be one of {spelled}, got {dtype!r}", field="storage_dtype")
    return dtype


def check_writing(shard_size: Any, storage_dtype: Any, device: Any, progress: Any, part: Any) -> tuple:
    """A ``ShardWriting``'s fields checked, each by its name: ``(shard_size, device, part)`` as they are kept
    (an ``int``, a ``torch.device`` that is here, two ``int``)."""
    from flowlift.devices import resolve_device_option

    shard_size = check_positive("shard_size", shard_size, integer=True)
    check_storage_dtype(storage_dtype)
    device = resolve_device_option(device)
    check_kind("progress", progress, bool, "True, False", optional=True)
    return shard_size, device, check_part(part)


def latent_align(factor: int = 2) -> int:
    """The multiple a target latent side must be of, for a degradation by ``factor``: ``lcm(4, 2 factor)``. Four for
    the stream's crop grid (:data:`~flowlift.training.shards.CROP_ALIGN`); ``2 factor`` so that the degraded image,
    ``8 side / factor`` px, is a whole multiple of 16 px, which every VAE encodes (the FLUX.2 VAE's and Mage-VAE's
    patches): 4 for the released factor 2, 12 for 3."""
    return math.lcm(CROP_ALIGN, 2 * factor)


def check_crop(crop: Any, field: str = "crop", factor: int = 2) -> int:
    """``crop``, an images dataset's crop side in pixels: a positive multiple of ``8 latent_align(factor)`` (32 for
    the released factor 2) up to ``MAX_OUTPUT_SIDE``, else one line naming ``field`` (``PhotoCrops``' is
    ``crop_px``) and the nearest sides."""
    align = VAE_SCALE_FACTOR * latent_align(factor)
    largest = MAX_OUTPUT_SIDE // align * align
    number = exact_int(crop)
    if number is None or number <= 0 or number % align or number > largest:
        # the nearest sides of a finite number; NaN and inf have none (int() of them raises)
        real = isinstance(crop, (int, float)) and not isinstance(crop, bool) and math.isfinite(crop)
        near = min(largest, max(align, int(crop) // align * align)) if real else 512 // align * align or align
        fix = f"e.g. {near} or {near + align}" if near not in (crop, largest) else f"e.g. {near}"
        raise FlowliftError(
            f"{field} must be a positive multiple of {align} px up to {largest}, got {crop!r}; {fix}", field=field
        )
    return number


def check_photo_crops(
    crop: Any, crops_per_image: Any, flip: Any, crop_field: str = "crop", factor: int = 2
) -> tuple[int, int, bool]:
    """``(crop, crops_per_image, flip)`` of an images dataset: :func:`check_crop` (for a degradation by ``factor``),
    an integer >= 1, a bool (never a truthy ``"no"``), else one line naming the field."""
    crops_per_image = check_positive("crops_per_image", crops_per_image, integer=True)
    return check_crop(crop, crop_field, factor), crops_per_image, check_kind("flip", flip, bool, "True or False")


def check_build(
    root: Any, vae: Any, seed: Any, batch_size: Any, degradation: Any, overwrite: Any
) -> tuple[Path, int, int, Degradation]:
    """What both builders take: ``(root, seed, batch_size, degradation)`` checked (``degradation`` None: the
    default :class:`Degradation`), ``vae`` a VAE and ``overwrite`` a bool; else one line naming the argument."""
    from flowlift.knobs import check_path

    check_path("root", root)
    if not all(callable(getattr(vae, name, None)) for name in ("encode", "decode")):
        shown = "None" if vae is None else f"a {type(vae).__name__}"
        raise FlowliftError(f"vae must be a VAE (with encode and decode: flowlift.load_vae), got {shown}", field="vae")
    batch_size = check_positive("batch_size", batch_size, integer=True)
    degradation = check_kind("degradation", degradation, Degradation, "a Degradation", optional=True)
    OVERWRITE.check(overwrite)
    return Path(root), SEED.check(seed), batch_size, degradation or Degradation()


def check_latent_size(size: Any, factor: int = 2) -> tuple[int, int]:
    """``size``, a distillation dataset's target latent ``(height, width)``: two positive multiples of
    :func:`latent_align` (4 for the released factor 2) whose images are within ``MAX_OUTPUT_SIDE``, else one line
    naming ``latent_size``."""
    align, largest = latent_align(factor), MAX_OUTPUT_SIDE // VAE_SCALE_FACTOR
    pair = tuple(size) if isinstance(size, (tuple, list)) and len(size) == 2 else ()
    sides = [exact_int(side) for side in pair]
    if len(sides) != 2 or any(side is None or side <= 0 or side % align or side > largest for side in sides):
        raise FlowliftError(
            f"latent_size must be (height, width), two positive multiples of {align} up to {largest} "
            f"(a degradation by {factor}; images of at most {MAX_OUTPUT_SIDE} px), got {size!r}",
            field="latent_size",
        )
    return sides[0], sides[1]


def check_source(source: Any) -> dict[str, Any]:
    """``source`` (what ``dataset.json`` records of a distillation dataset's teacher) if JSON gives it back as it is:
    a dict with text keys holding text, numbers, True/False, None, lists and dicts of them; else one line naming
    ``source`` (a resume compares it with the recorded one: a tuple or a NaN would never be the same)."""
    try:
        same = isinstance(source, dict) and json.loads(json.dumps(source, allow_nan=False)) == source
    except (TypeError, ValueError, RecursionError):
        same = False
    if not same:
        shown = repr(source) if len(repr(source)) <= 80 else f"a {type(source).__name__}"
        raise FlowliftError(
            f"source must be a dict of JSON values (text keys; text, numbers, lists, dicts), got {shown}",
            field="source",
        )
    return source


def check_image_paths(image_paths: Any, vae_name: Any) -> list[Path]:
    """An images dataset's photos as paths (one ``str`` is one photo, never its characters; at least one) and the
    ``vae_name`` it records (text), else one line naming the argument."""
    paths = [Path(path) for path in check_paths("image_paths", image_paths)]
    if not paths:
        raise FlowliftError("image_paths is empty: give at least one image", field="image_paths")
    check_kind("vae_name", vae_name, str, "text (the VAE's name or path, as dataset.json records it)")
    return paths

"""Sizes, pass counts and per-pass noise streams of the Flow Upscaler (pure helpers, no models).

Every 2x pass doubles both sides; inputs are brought to multiples of :data:`~flowlift.limits.PIXEL_MULTIPLE`
(the VAE's 8x downsampling times the UNet's one 2x level) and passes stop at :data:`MAX_OUTPUT_SIDE`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from flowlift.errors import FlowliftError
from flowlift.limits import MAX_OUTPUT_SIDE, PIXEL_MULTIPLE, cap_words

RESIZE_MODES = ("pad", "resample")

__all__ = [
    "MAX_OUTPUT_SIDE",
    "RESIZE_MODES",
    "allowed_passes",
    "PassesDropped",
    "capped_passes",
    "no_pass_fits",
    "dropped_passes_message",
    "image_seeds",
    "output_scale",
    "pad_to_multiple",
    "padded_size",
    "pass_generator",
    "pass_noise",
    "planned_passes",
    "prepared_size",
    "resample_to_multiple",
    "resample_to_size",
    "upscaled_size",
]


def padded_size(height: int, width: int, multiple: int = PIXEL_MULTIPLE) -> tuple[int, int]:
    """Smallest multiple of ``multiple`` at or above each side: ``ceil(side / m) * m``."""
    return -(-height // multiple) * multiple, -(-width // multiple) * multiple


def pad_to_multiple(images: torch.Tensor, multiple: int = PIXEL_MULTIPLE) -> torch.Tensor:
    """Pad (B, C, H, W) on the bottom and right to multiples of ``multiple``.

    Reflection padding (the image mirrored at its edge, no repeated edge row) where the image is
    larger than the pad, edge replication otherwise. The original pixels keep their positions, so
    cropping ``[:H, :W]`` (times the scale) gives back exactly the original area.
    """
    height, width = images.shape[-2:]
    target_h, target_w = padded_size(height, width, multiple)
    pad_h, pad_w = target_h - height, target_w - width
    if pad_h == 0 and pad_w == 0:
        return images
    mode = "reflect" if pad_h < height and pad_w < width else "replicate"
    return F.pad(images, (0, pad_w, 0, pad_h), mode=mode)


def resample_to_multiple(images: torch.Tensor, multiple: int = PIXEL_MULTIPLE) -> torch.Tensor:
    """Resize (B, C, H, W) in [0, 1] to the nearest multiples of ``multiple`` (at least one multiple).

    Bicubic with antialiasing, clamped back to [0, 1]; returned unchanged when already a multiple.
    """
    height, width = images.shape[-2:]
    size = (
        max(multiple, round(height / multiple) * multiple),
        max(multiple, round(width / multiple) * multiple),
    )
    if size == (height, width):
        return images
    resized = F.interpolate(images, size=size, mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp(0.0, 1.0)


def resample_to_size(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, C, H, W) in [0, 1] resampled to exactly ``height x width``, clamped to [0, 1]: the last step of an
    upscale whose size is not the passes' own (``scale=3``: four times, then down to three).

    torch's bicubic (Keys, a = -0.75) with ``antialias=True``: downscaling widens the kernel by the factor (the
    same separable filter as Pillow's BICUBIC), so the 2^n frame is averaged, not aliased, into the asked size.
    Chosen over Pillow's LANCZOS on per-channel ``F`` images because it runs where the decoded frame already is
    (device or host), batched, in float32 with no copy per channel; Lanczos's extra lobe rings more, and stage 2
    then pins the low band anyway. Unchanged when already that size.
    """
    if tuple(images.shape[-2:]) == (height, width):
        return images
    resized = F.interpolate(images, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resized.clamp_(0.0, 1.0)


def allowed_passes(height: int, width: int, num_passes: int, max_side: int = MAX_OUTPUT_SIDE) -> int:
    """The largest ``n <= num_passes`` with ``max(height, width) * 2**n <= max_side`` (0 if none)."""
    passes = 0
    side = max(height, width)
    while passes < num_passes and side * 2 ** (passes + 1) <= max_side:
        passes += 1
    return passes


def prepared_size(height: int, width: int, resize_mode: str = "pad", multiple: int = PIXEL_MULTIPLE) -> tuple[int, int]:
    """The canvas the model computes on: padded up (``"pad"``) or resampled to the nearest multiple."""
    if resize_mode == "pad":
        return padded_size(height, width, multiple)
    if resize_mode == "resample":
        return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)
    raise FlowliftError(f"resize_mode must be one of {', '.join(RESIZE_MODES)}, got {resize_mode!r}")


def planned_passes(
    height: int, width: int, num_passes: int, resize_mode: str = "pad", max_side: int = MAX_OUTPUT_SIDE
) -> int:
    """Passes that run for a ``height x width`` input: the most ``n <= num_passes`` whose *computed canvas*
    (:func:`prepared_size` times ``2**n``) stays within ``max_side``.

    The canvas, not the cropped output, is what is allocated: a 1x1 input is computed on a 16x16
    canvas, so it gets at most 10 passes (a 16384 px canvas), not the 14 its output size would allow.
    """
    canvas_h, canvas_w = prepared_size(height, width, resize_mode)
    return allowed_passes(canvas_h, canvas_w, num_passes, max_side)


def dropped_passes_message(
    width: int, height: int, asked: int, passes: int, resize_mode: str = "pad", max_side: int = MAX_OUTPUT_SIDE
) -> str:
    """The one line that says the cap dropped passes: asked, run, dropped, and the output size and scale.

    Printed by ``flowlift upscale`` when it plans the job (before any work) and warned by the pipeline
    when a caller asks it for more passes than fit.
    """
    out_h, out_w = upscaled_size(height, width, passes, resize_mode)
    return (
        f"Flow Upscaler: {asked} pass(es) on a {width}x{height} image would exceed "
        f"{cap_words(max_side)}; running {passes} pass(es) "
        f"({asked - passes} dropped, output {out_w}x{out_h}, scale {2**passes})"
    )


def no_pass_fits(width: int, height: int, max_side: int = MAX_OUTPUT_SIDE) -> str:
    """Why an image cannot be upscaled at all, any scale (1.5 too: every scale runs one 2x pass first)."""
    return (
        f"a {width}x{height} image cannot be upscaled: every scale runs a first 2x pass, which would pass "
        f"{cap_words(max_side)}; inputs up to {max_side // 2} px a side can be"
    )


def over_cap_refusal(
    asked: str,
    width: int,
    height: int,
    passes: int,
    fit: int,
    resize_mode: str = "pad",
    max_side: int = MAX_OUTPUT_SIDE,
) -> str:
    """The one line of a door that refuses, rather than drops, passes over the cap: ``asked`` as the user gave it
    (``scale 3``), the ``passes`` it needs and the canvas they compute on (what the cap is on), and the largest
    power of two the ``fit`` passes that do fit make (a scale above it needs one more pass)."""
    base_h, base_w = prepared_size(height, width, resize_mode)
    # 2**20000 has 6,000 digits, past what Python writes as text: a canvas that large is said as a power
    canvas = f"{base_w * 2**passes}x{base_h * 2**passes}" if passes <= 64 else f"2^{passes} x {base_w}x{base_h}"
    return (
        f"Flow Upscaler: {asked} on a {width}x{height} image runs {passes} 2x pass(es) on a {canvas} px "
        f"canvas, over {cap_words(max_side)}; choose a scale of at most {2**fit}"
    )


class PassesDropped(UserWarning):
    """The warning of :func:`capped_passes` (:func:`dropped_passes_message`); ``refusal`` is the same news as one
    error line naming the largest scale that fits, for a door that refuses instead of running fewer passes (the
    ComfyUI nodes, whose users never see a warning: ``warnings.simplefilter("error", PassesDropped)``)."""

    def __init__(self, message: str, refusal: str) -> None:
        super().__init__(message)
        self.refusal = refusal


def capped_passes(
    height: int, width: int, num_passes: int, resize_mode: str, max_side: int, stacklevel: int = 2
) -> int:
    """:func:`planned_passes` for an input of this (real, unpadded) size, warning when the cap drops some.

    The cap is on the computed canvas; the warning (:func:`dropped_passes_message`, at ``stacklevel`` counted from
    this function) names the input's own size and the output actually produced. When no pass fits at all although
    some were asked for, the image is refused with one FlowliftError line.
    """
    passes = planned_passes(height, width, num_passes, resize_mode, max_side)
    if passes < num_passes:
        if passes == 0:
            raise FlowliftError(f"Flow Upscaler: {no_pass_fits(width, height, max_side)}")
        message = dropped_passes_message(width, height, num_passes, passes, resize_mode, max_side)
        scale = f"scale {2**num_passes}" if num_passes <= 64 else f"scale 2^{num_passes}"  # as over_cap_refusal
        refusal = over_cap_refusal(scale, width, height, num_passes, passes, resize_mode, max_side)
        warnings.warn(PassesDropped(message, refusal), stacklevel=stacklevel)
    return passes


def upscaled_size(height: int, width: int, passes: int, resize_mode: str = "pad") -> tuple[int, int]:
    """(height, width) of the image ``passes`` passes produce: the input's (``"pad"``) or the resampled
    canvas's (``"resample"``) size times ``2**passes``."""
    base = (height, width) if resize_mode == "pad" else prepared_size(height, width, resize_mode)
    return base[0] * 2**passes, base[1] * 2**passes


def pass_generator(seed: int, pass_index: int) -> torch.Generator:
    """CPU generator of pass ``pass_index``'s noise: seeded from ``SeedSequence([seed, pass_index])``.

    Every (seed, pass) pair gets its own well-separated stream (unlike ``seed + pass``, which makes
    seed 0's second pass equal seed 1's first); the same pair always gives the same noise.
    """
    if seed < 0 or pass_index < 0:
        raise FlowliftError(f"seed must be a non-negative integer, got {seed}")
    state = np.random.SeedSequence([int(seed), int(pass_index)]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator(device="cpu").manual_seed(int(state) & ((1 << 63) - 1))


def image_seeds(seed: int | Sequence[int], batch: int) -> list[int]:
    """One seed per image: ``seed`` repeated ``batch`` times, or the ``batch`` seeds given."""
    seeds = [int(seed)] * batch if isinstance(seed, (int, np.integer)) else [int(s) for s in seed]
    if len(seeds) != batch:
        raise FlowliftError(f"got {len(seeds)} seeds for a batch of {batch} images")
    return seeds


def pass_noise(seeds: Sequence[int], pass_index: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Pass ``pass_index``'s noise for a batch: image ``i`` gets ``randn(shape)`` from
    ``pass_generator(seeds[i], pass_index)`` (CPU, float32), stacked to (len(seeds), *shape).

    Image ``i``'s noise depends only on its own seed, so an image gets the same noise in any batch
    as alone (and a batch of one draws exactly what a single-image call always drew).
    """
    return torch.stack(
        [torch.randn(shape, generator=pass_generator(seed, pass_index), dtype=torch.float32) for seed in seeds]
    )


def output_scale(num_passes: int) -> int:
    """Scale factor of ``num_passes`` 2x passes."""
    return 2**num_passes


def passes_for_output_size(
    input_size: tuple[int, int],
    output_size: tuple[int, int] | None,
    num_passes: int | None,
    *,
    fraction_last: bool = False,
) -> int:
    """The 2x passes of an upscale of an ``input_size`` (width, height) image to ``output_size`` (width, height; None:
    the passes' own size): ``num_passes`` when given, else the one scale -> passes rule
    (:func:`flowlift.limits.passes_for_scale` of the larger side's factor; 1 without a size). One line for a size
    below the input, or past what ``num_passes`` make (``2**n`` times the input) where the 16K cap would let more
    run (:func:`planned_passes`): the rest would be a pixel resample passed off as the upscale (``num_passes=1`` to
    20x, ``num_passes=0`` to 8x). ``fraction_last``: the pipeline
    has a latent upscaler for the fraction (its own plan checks the passes against the size)."""
    from flowlift.knobs import SCALE, check_count
    from flowlift.limits import passes_for_scale

    if num_passes is not None:  # a bool or "2" is refused by name before any size arithmetic
        num_passes = check_count("num_passes", num_passes)
    if output_size is None:
        return 1 if num_passes is None else num_passes
    (width, height), (out_w, out_h) = input_size, output_size
    if out_w < width or out_h < height:
        raise FlowliftError(f"output_size {out_w}x{out_h} is below the {width}x{height} input", field="output_size")
    scale = max(out_w / width, out_h / height)
    if scale > SCALE.high:  # the doors' own bound (the command line's --size / --scale)
        raise FlowliftError(
            f"output_size {out_w}x{out_h} is {scale:.4g}x the {width}x{height} input, over the {SCALE.high:g}x an "
            "upscale makes",
            field="output_size",
        )
    needed = passes_for_scale(scale, fraction_last=fraction_last)
    if num_passes is None:
        return needed
    fit = planned_passes(height, width, needed)  # fewer where the 16K cap drops passes (the doors say so)
    if not fraction_last and num_passes < fit and 2**num_passes < scale:  # passes that make the size: theirs
        raise FlowliftError(
            f"output_size {out_w}x{out_h} is {scale:.4g}x the {width}x{height} input, past the {2**num_passes}x "
            f"num_passes={num_passes} make (the rest would be a pixel resample): give num_passes={needed}, or leave "
            "it out to plan it from the size",
            field="num_passes",
        )
    return num_passes

"""The pixel side of :class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`: the VAE's calls and the decoded frame.

:func:`vae_input_dtype` is the dtype the VAE's inputs are cast to (:func:`vae_dtype`, its weights'); :func:`vae_call`
runs its ``encode`` / ``decode`` with tile progress and cancel checks; :func:`finish_decoded` crops the decoded frame
to ``2**passes`` times the input, resamples it to an asked size and runs stage 2
(:func:`flowlift.upscale.colorfix.lab_lowband_transplant`); :func:`as_output` hands the result over as the caller
asked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.models.weights import NonFiniteResult
from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.inputs import non_finite_refusal
from flowlift.upscale.interrupts import with_check
from flowlift.upscale.loading import first_parameter
from flowlift.upscale.sizes import output_scale, resample_to_size

#: Stage 2's iterations after a resample to an asked size (2 on the passes' own sizes, unchanged): each removes
#: most of what clipping left (a random UNet's 1.5x / 3x: mean cast 0.12 / 0.26 levels at 2, 0.01 / 0.05 at 6).
RESAMPLED_COLOUR_ITERATIONS = 6


def vae_dtype(vae: Any, fallback: torch.dtype) -> torch.dtype:
    """The VAE's floating-point parameter dtype, else its ``dtype`` attribute, else ``fallback``."""
    param = first_parameter(vae)
    if param is not None and param.is_floating_point():
        return param.dtype
    dtype = getattr(vae, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else fallback


def vae_input_dtype(vae: Any, fallback: torch.dtype) -> torch.dtype:
    """The dtype to hand ``vae.encode`` / ``vae.decode`` their images and latents in: float32 for a VAE that says it
    rounds them itself (``rounds_inputs_itself``: flowlift's adapters, ComfyUI's VAEs), after its own float32
    arithmetic, so that they are rounded once; :func:`vae_dtype` for any other object, which may expect its own."""
    return torch.float32 if getattr(vae, "rounds_inputs_itself", False) else vae_dtype(vae, fallback)


def vae_call(
    vae: Any,
    method: str,
    x: torch.Tensor,
    *,
    tiled: bool | None,
    on_tile: Callable[[int, int], None] | None,
    check_interrupt: Callable[[], None] | None,
) -> torch.Tensor:
    """``vae.<method>(x)`` (``tiled`` passed on unless None); ``on_tile(done, total)`` after each tile (with
    ``check_interrupt`` before it), once as ``(1, 1)`` for a VAE without tile progress. No VAE: a FlowliftError; a
    result with NaN or Inf that the VAE refuses itself (flowlift's adapters): the pipeline's line for the stage."""
    if vae is None:
        raise FlowliftError("this pipeline was made without a VAE (vae=None): it upscales latents only")
    fn = getattr(vae, method)
    kwargs: dict[str, Any] = {} if tiled is None else {"tiled": tiled}
    on_tile = with_check(check_interrupt, on_tile)
    try:
        if on_tile is None:
            return fn(x, **kwargs)
        if "on_tile" in inspect.signature(fn).parameters:
            return fn(x, on_tile=on_tile, **kwargs)
        result = fn(x, **kwargs)  # a VAE without tile progress: its decode counts as one tile
    except NonFiniteResult:
        stage = f"the VAE {method.removesuffix('_raw')}r produced"
        raise non_finite_refusal(stage, "latents" if method.startswith("encode") else "pixels") from None
    on_tile(1, 1)
    return result


def finish_decoded(
    decoded: torch.Tensor,
    original: torch.Tensor,
    prepared: torch.Tensor,
    passes: int,
    resize_mode: str,
    *,
    color_fix: bool,
    color_fix_strength: float,
    output_size: tuple[int, int] | None,
    check_interrupt: Callable[[], None] | None,
    content: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The decoded float32 frame -> the result, float32 (B, 3, H, W) in [0, 1].

    Cropped to ``2**passes`` times ``original`` (``resize_mode="pad"``) or ``prepared`` (``"resample"``); with
    ``output_size`` (width, height) resampled to exactly that size, stage 2 then pinning it to ``original`` in
    :data:`RESAMPLED_COLOUR_ITERATIONS` iterations (2 otherwise); without ``color_fix`` (or at strength 0) clamped.
    ``content`` (height, width): the crop instead, for latents SesquiLSR resized (upscale/latent_fraction.py).
    """
    scale = output_scale(passes)
    reference = original if resize_mode == "pad" else prepared
    height, width = content or (reference.shape[-2] * scale, reference.shape[-1] * scale)
    if decoded.shape[-2] < height or decoded.shape[-1] < width:
        raise FlowliftError(f"VAE decoded {decoded.shape[-1]}x{decoded.shape[-2]}, expected at least {width}x{height}")
    decoded = decoded[..., :height, :width]
    iterations = 2
    natural = content is None and reference is original and tuple(output_size or ()) == (width, height)
    if output_size is not None and not natural:
        # the asked size: stage 2 against the input itself, at that size (one the passes make exactly, against
        # the input already: the plain path, so --size 2x the input equals --scale 2 bit for bit)
        decoded = resample_to_size(decoded, output_size[1], output_size[0])
        reference, iterations = original, RESAMPLED_COLOUR_ITERATIONS
    if color_fix and color_fix_strength > 0:
        return lab_lowband_transplant(
            decoded, reference, color_fix_strength, iterations, inplace=True, on_strip=check_interrupt
        )
    return decoded.clamp(0.0, 1.0)


def as_output(result: torch.Tensor, alpha: Any, output_type: str) -> Any:
    """``"pt"``: ``result`` itself; ``"pil"``: a Pillow image per batch item (the one image for a batch of one),
    with the input's ``alpha`` (:func:`~flowlift.upscale.inputs.image_alpha`, taken before the work) attached."""
    if output_type == "pt":
        return result
    from flowlift.files.alpha import attach_alpha
    from flowlift.files.images import tensor_to_pil

    pictures = [attach_alpha(tensor_to_pil(result[i : i + 1]), alpha) for i in range(result.shape[0])]
    return pictures[0] if len(pictures) == 1 else pictures


def to_host_float32(images: torch.Tensor, strip_rows: int = 256) -> torch.Tensor:
    """``images`` (B, C, H, W) as float32 on the host, converted strip by strip.

    The device never holds a float32 copy of the frame, only one strip of it; the values are exactly
    ``images.to("cpu", torch.float32)``.
    """
    if images.device.type == "cpu":
        return images.to(torch.float32)
    return float32_by_rows(images, strip_rows)


def float32_by_rows(images: torch.Tensor, strip_rows: int) -> torch.Tensor:
    """``images`` (B, C, H, W) as float32 on the host, ``strip_rows`` rows at a time (every column of each: the
    strips once sliced the last axis, the width, so a frame wider than its height kept columns past the rows'
    count unwritten)."""
    out = torch.empty(images.shape, dtype=torch.float32, device="cpu")
    for r0 in range(0, images.shape[-2], strip_rows):
        out[:, :, r0 : r0 + strip_rows].copy_(images[:, :, r0 : r0 + strip_rows].to(torch.float32))
    return out

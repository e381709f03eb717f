"""InvokeAI's FLUX.2 latents and the checks the nodes make on their inputs (no InvokeAI import here).

InvokeAI's FLUX.2 nodes pass the VAE's **raw**, unpacked latents, (B, 32, H/8, W/8): ``FLUX2 Denoise``
normalizes them with the VAE's BatchNorm statistics itself and denormalizes its output. The Flow
Upscaler works on normalized latents, so the latent node normalizes on the way in and denormalizes on
the way out (:func:`raw_to_normalized`, :func:`normalized_to_raw`), with the statistics of the VAE the
latents came from.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import BeforeValidator

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import LATENT_CHANNELS, VAE_SCALE_FACTOR, denormalize, normalize
from flowlift.knobs import Knob
from flowlift.limits import cap_words
from flowlift.upscale.sizes import MAX_OUTPUT_SIDE, planned_passes, upscaled_size


def check_output_cap(
    height: int, width: int, passes: int, what: str, scale: float, latent_size: tuple[int, int] | None = None
) -> None:
    """One error line, naming the ``scale`` asked, when the latents node's ``passes`` 2x passes on latents of a
    ``width x height`` image, or the latent (height, width) ``latent_size`` a latent upscaler then makes, would pass
    the 16K cap (the image node's passes: :func:`flowlift.upscale.node_choices.image_plan`).

    flowlift's command line drops the passes beyond the cap with a warning; in a node graph the nodes
    after this one are sized for the scale asked for, so a smaller result would be wrong: refuse instead.
    """
    out_h, out_w = upscaled_size(height, width, passes, "pad")
    made = f"{passes} 2x pass(es) would make {out_w}x{out_h} px"
    if latent_size is not None:
        out_h, out_w = (VAE_SCALE_FACTOR * side for side in latent_size)
        made = f"SesquiLSR would make {out_w}x{out_h} px"
    if planned_passes(height, width, passes, "pad", MAX_OUTPUT_SIDE) < passes or max(out_h, out_w) > MAX_OUTPUT_SIDE:
        raise FlowliftError(
            f"{what}: scale {scale:g} on {width}x{height} px: {made}, over {cap_words()}; choose a smaller scale"
        )


def check_raw_latents(latents: Any, what: str) -> torch.Tensor:
    """InvokeAI FLUX.2 latents as float32 (B, 32, h, w), h and w even, finite; anything else is one error line.

    The sides must be even because the BatchNorm statistics belong to 2x2 patches (an image side that
    is a multiple of 16, as FLUX2 Denoise makes them).
    """
    if not isinstance(latents, torch.Tensor) or latents.ndim != 4 or latents.shape[1] != LATENT_CHANNELS:
        shape = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
        raise FlowliftError(
            f"{what} needs FLUX.2 latents (batch, {LATENT_CHANNELS}, height/8, width/8) from a FLUX.2 node "
            f"(Image to Latents - FLUX2, FLUX2 Denoise), got latents of shape {shape}"
        )
    if not latents.is_floating_point():
        raise FlowliftError(f"{what} needs float latents, got {latents.dtype}")
    if not bool(torch.isfinite(latents).all()):  # a VAE node whose weights overflow: all NaN, black later
        raise FlowliftError(f"{what}: the input latents contain non-finite values (NaN/Inf)")
    height, width = latents.shape[-2:]
    if height % 2 or width % 2 or height == 0 or width == 0:
        raise FlowliftError(
            f"{what}: latents of {width}x{height} (an image of {width * VAE_SCALE_FACTOR}x"
            f"{height * VAE_SCALE_FACTOR} px) need even sides: make the image sides multiples of 16"
        )
    return latents.to(torch.float32)


def raw_to_normalized(raw_latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """InvokeAI's raw FLUX.2 latents -> flowlift's normalized latents (same 32-channel layout)."""
    return normalize(raw_latents, bn_mean, bn_std)


def normalized_to_raw(latents: torch.Tensor, bn_mean: torch.Tensor, bn_std: torch.Tensor) -> torch.Tensor:
    """flowlift's normalized latents -> InvokeAI's raw FLUX.2 latents (the inverse of :func:`raw_to_normalized`)."""
    return denormalize(latents, bn_mean, bn_std)


def seed_field_value(value: Any) -> int:
    """A node's seed as it arrives in a graph's JSON, held to the rule of every JSON door
    (:data:`flowlift.knobs.SEED`'s check with ``loose``: an integer, a string of digits, a whole float up to
    2^53; never ``true``, 5.5, -1 or 2^64). pydantic's own ``int`` would take ``true`` as 1: the nodes'
    seed fields run this first (``BeforeValidator``), and its ValueError is InvokeAI's HTTP 422 naming the
    field and the rule."""
    from flowlift.knobs import SEED

    try:
        return SEED.check(value, loose=True)
    except FlowliftError as error:
        raise ValueError(str(error)) from None


#: The nodes' seed fields' type: an ``int`` that :func:`seed_field_value` checks before pydantic's coercion.
Seed = Annotated[int, BeforeValidator(seed_field_value)]


def not_a_bool(value: Any) -> Any:
    """A number field's value, unless it is ``true``/``false``: pydantic's ``float`` and ``int`` take a bool as 1 or
    0 (``"scale": true`` ran at 1x, ``"strength": true`` redrew the whole image); the ValueError is InvokeAI's HTTP
    422 naming the field."""
    if isinstance(value, bool):
        raise ValueError(f"a number is needed, got {str(value).lower()}")
    return value


#: The nodes' number fields' types (their range and grid from the knob, :func:`flowlift.invokeai.nodes.knob_field`).
Number = Annotated[float, BeforeValidator(not_a_bool)]
Count = Annotated[int, BeforeValidator(not_a_bool)]


def knob_text(knob: Knob) -> Any:
    """A text field's type for a number knob that also takes words (``tile_size``: px, auto or off): the text
    checked by the knob (``loose``) as the graph arrives, so ``"no"`` or ``"0"`` is InvokeAI's HTTP 422 naming the
    field, not a failure after the upstream nodes ran; the node parses the text it gets as before."""

    def checked(value: Any) -> Any:
        try:
            knob.check(value, loose=True)
        except FlowliftError as error:
            raise ValueError(str(error)) from None
        return value

    return Annotated[str, BeforeValidator(checked)]

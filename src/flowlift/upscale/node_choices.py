"""The Flow Upscaler's options as the node packs offer them: the scale and the chunking modes.

ComfyUI and InvokeAI show the same inputs, derived from the knob table
(:data:`flowlift.upscale.settings.UPSCALE_KNOBS`: the scale any factor in [1, 8]); both turn them into the
pipeline's arguments here, so the two packs cannot drift apart.
"""

from __future__ import annotations

from flowlift.errors import FlowliftError
from flowlift.limits import MAX_OUTPUT_SIDE, cap_words, hires_size_or_refuse, passes_for_scale
from flowlift.upscale.asked_size import AskedSize
from flowlift.upscale.settings import CHUNKED

#: The ``chunked`` choices: ``auto`` switches the exact chunked executor on by size (or free memory).
CHUNKING: tuple[str, ...] = CHUNKED.choices


def image_plan(
    scale: float, width: int, height: int, *, fraction_last: bool = False
) -> tuple[int, tuple[int, int] | None]:
    """An image node's ``(passes, output_size)`` for a ``width x height`` image: 2, 4, 8 -> (1/2/3, None), the
    passes' own output; any other factor in [1, 8] -> the fewest passes that reach it and the exact (width, height)
    to resample to (:class:`~flowlift.upscale.asked_size.AskedSize`, its refusals in one line). ``fraction_last``
    (a latent upscaler chosen): the passes below the factor instead, SesquiLSR doing the rest in latent space
    (:func:`~flowlift.upscale.latent_fraction.fraction_passes`, the rule ``flowlift upscale`` plans with).

    Passes whose canvas would pass the 16K cap are one line before any work, naming the scale asked and that
    canvas (:func:`~flowlift.upscale.sizes.over_cap_refusal`): a node's result is sized for the scale asked, where
    ``flowlift upscale`` runs the passes that fit and says so."""
    asked = AskedSize(scale=scale)
    if asked.power_of_two:
        passes, size = asked.passes, None
    else:
        size = asked.target(width, height)
        if fraction_last:
            from flowlift.upscale.latent_fraction import fraction_passes

            passes = fraction_passes(height, width, "pad", size)
        else:
            passes = asked.passes_for(width, height)
    from flowlift.upscale.sizes import no_pass_fits, over_cap_refusal, planned_passes

    fit = planned_passes(height, width, passes)
    if fit < passes:
        refusal = over_cap_refusal(f"scale {asked.scale:g}", width, height, passes, fit)
        raise FlowliftError(refusal if fit else f"Flow Upscaler: {no_pass_fits(width, height)}", field="scale")
    return passes, size


def image_latent_upscaler(spec: str | None, size: tuple[int, int] | None) -> str | None:
    """The latent upscaler an image node hands its pipeline: ``spec`` (``sesqui:PATH``) only where :func:`image_plan`
    gave a size to reach (a fraction); at 2, 4 and 8 (``size`` None) None, so SesquiLSR is neither loaded nor needs
    the FLUX.2 VAE's statistics: a file left selected does not stop TAEF2 or Mage-VAE at those scales."""
    return spec if size is not None else None


def latent_plan(
    scale: float, height: int, width: int, *, fraction_last: bool = False
) -> tuple[int, tuple[int, int] | None]:
    """A latent node's ``(passes, size)`` for ``height x width`` latents: 2, 4, 8 -> (1/2/3, None), whole passes;
    with a latent upscaler (``fraction_last``) any other factor in [1, 8] -> the passes below it and the latent
    (height, width) SesquiLSR resizes to, the hires fix's rule (:func:`~flowlift.limits.passes_for_scale` with
    ``fraction_last``, :func:`~flowlift.limits.hires_latent_size`: even sides, so 1.5x of 64x96 is 96x144);
    without one, any other factor is one line naming the latent upscaler. A size the 16 px grid rounds to no
    enlargement on a side, or one over the 16K cap, is one line naming ``scale``, as the hires fix says it."""
    asked = AskedSize(scale=scale)
    if asked.power_of_two:
        return asked.passes, None
    if not fraction_last:
        shown = (
            f"{asked.scale:g}" if float(f"{asked.scale:g}") == asked.scale else repr(asked.scale)
        )  # 2.0000000000000004
        raise FlowliftError(
            f"a latent upscale runs whole 2x passes (scale 2, 4 or 8), got {shown}; choose a latent upscaler "
            "(SesquiLSR) for any other factor, or upscale the image",
            field="latent_upscaler",
        )
    width_px, height_px = hires_size_or_refuse(8 * width, 8 * height, asked.scale, "scale")  # 1.05x: no larger
    if max(width_px, height_px) > MAX_OUTPUT_SIDE:
        raise FlowliftError(
            f"scale: {asked.scale:g}x of {8 * width}x{8 * height} px would make {width_px}x{height_px} px, over "
            f"{cap_words()}; choose a smaller scale",
            field="scale",
        )
    return passes_for_scale(asked.scale, fraction_last=True), (height_px // 8, width_px // 8)


def image_stage_work(
    passes: int, size: tuple[int, int] | None, width: int, height: int, batch: int = 1, *, fraction_last: bool = False
) -> list[float]:
    """An image node's progress weights for ``batch`` images of ``width x height`` planned by :func:`image_plan`
    (``passes``, ``size``: the (width, height) asked, None for the passes' own output), with SesquiLSR's work where
    ``fraction_last`` and it has some: :func:`~flowlift.upscale.stages.node_stage_work`, as every door plans."""
    from flowlift.upscale.latent_fraction import fraction_runs
    from flowlift.upscale.stages import node_stage_work

    megapixels = batch * width * height / 1e6
    if size is None:
        return node_stage_work(passes, megapixels)
    fraction = fraction_last and fraction_runs(height, width, "pad", passes, size)
    return node_stage_work(passes, megapixels, batch * size[0] * size[1] / 1e6, latent_fraction=fraction)


def latent_stage_work(passes: int, size: tuple[int, int] | None, height: int, width: int) -> list[float]:
    """A latent node's progress weights for ``height x width`` latents planned by :func:`latent_plan` (``passes``,
    ``size``: SesquiLSR's latent (height, width), None when it does not run), in image megapixels (8 px a latent):
    :func:`~flowlift.upscale.stages.latent_node_stage_work`."""
    from flowlift.upscale.stages import latent_node_stage_work

    per_latent = 64 / 1e6
    fraction = None if size is None else size[0] * size[1] * per_latent
    return latent_node_stage_work(passes, height * width * per_latent, fraction)


def chunked_flag(chunked: str) -> bool | None:
    """The pipeline's ``chunked`` argument: 'auto' -> None (decided by size), 'always' -> True, 'never' -> False."""
    if chunked not in CHUNKING:
        raise FlowliftError(f"chunked must be one of {', '.join(CHUNKING)}, got {chunked!r}")
    return {"auto": None, "always": True, "never": False}[chunked]

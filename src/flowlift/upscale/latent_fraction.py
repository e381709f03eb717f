"""``flowlift upscale --latent-upscaler sesqui:PATH``: the fraction of an asked size in latent space (SesquiLSR),
after the Flow passes and before the decode, instead of the pixel resample.

The rule, per input of ``reference`` px (the original for ``resize_mode="pad"``, the resampled input for
``"resample"``) computed on a ``prepared`` canvas (multiples of 16) and asked for ``out`` px:

* a power-of-two scale (2, 4, 8, or ``passes``) is the passes' own output: SesquiLSR does not run (the option is
  still checked: its file, the VAE), the output is the one without the option, byte for byte;
* any other size runs the passes below the smaller side factor of the content (:func:`fraction_passes`:
  :func:`~flowlift.limits.passes_for_scale` with ``fraction_last``: 3 -> 1, 1.5 -> 0, 6 -> 2), then SesquiLSR
  resizes the latents to :func:`fraction_latent_size`: per side ``2 * ceil(prepared * out / (16 * reference))``,
  the smallest even latent size (the FLUX.2 VAE's BN statistics are per 2x2 patch) whose decoded frame covers the
  asked size, kept within SesquiLSR's [1, 2] of the passes' latents;
* the decoded frame's content, ``round(reference * 8 * t / prepared)`` px per side (:func:`content_size`), is
  cropped and resampled to exactly ``out`` (antialiased bicubic, by under 16 px: only where the asked size is off
  the 16-px latent grid, the input was padded, or ``"resample"``'s canvas is not the input's size; nothing when the
  content is the asked size), then stage 2 against the input as always.

For a scale or a long side both side factors lie between the same powers of two, so the passes leave each side
1-2x by construction (``2 * ceil(x / 2) <= 2 * latent`` for ``x <= 2 * latent``); a ``size`` whose aspect is not
the input's, where SesquiLSR's range leaves the content more than :data:`CONTENT_SLACK` px off, is one line
(:func:`check_fraction`), as is a fraction whose passes the 16K cap would drop. No torch here.
"""

from __future__ import annotations

from pathlib import Path

from flowlift.errors import FlowliftError
from flowlift.knobs import LATENT_UPSCALER
from flowlift.limits import SESQUI_MIN_SIDE

#: The field a refusal of the latent upscaler names (each door words it: ``--latent-upscaler``, the app's label).
FIELD = "latent_upscaler"


def fraction_latent_size(
    prepared: tuple[int, int], reference: tuple[int, int], out: tuple[int, int]
) -> tuple[int, int]:
    """The latent (height, width) SesquiLSR resizes to: per side ``2 * ceil(p * o / (16 * r))`` for the prepared
    canvas ``p``, the reference ``r`` (both (height, width) px) and the asked ``out`` (width, height) px: the
    smallest even latent side whose decoded ``8 t`` px hold ``o`` px of content (exact integer arithmetic)."""
    sides = zip(prepared, reference, (out[1], out[0]), strict=True)
    height, width = (2 * -(-p * o // (16 * r)) for p, r, o in sides)
    return height, width


def content_size(prepared: tuple[int, int], reference: tuple[int, int], latent: tuple[int, int]) -> tuple[int, int]:
    """The (height, width) px of the input's content in the decoded frame of ``latent`` (height, width):
    per side ``round(r * 8 t / p)`` (at least the asked size: ``8 t >= p o / r``)."""
    return tuple(round(r * 8 * t / p) for p, r, t in zip(prepared, reference, latent, strict=True))


#: How far (px a side) the decoded content may differ from the asked size before the pixel resample: the even
#: latent grid's rounding (under 16 px), or a resampled canvas's (``resize_mode="resample"``: up to 8 px a side).
CONTENT_SLACK = 16


def check_fraction(
    passes_latent: tuple[int, int],
    target: tuple[int, int],
    content: tuple[int, int],
    out: tuple[int, int],
    spelled: str,
) -> None:
    """One FlowliftError line (naming the latent upscaler) when SesquiLSR's range (each side of ``target`` 1-2x
    ``passes_latent``, both (height, width) latents) leaves the decoded ``content`` (height, width) more than
    :data:`CONTENT_SLACK` px from ``out`` (width, height): a size whose aspect is not the input's."""
    if all(abs(c - o) <= CONTENT_SLACK for c, o in zip(content, (out[1], out[0]), strict=True)):
        return
    factors = [t / s for t, s in zip(target, passes_latent, strict=True)]
    raise FlowliftError(
        f"latent_upscaler: {spelled} needs SesquiLSR at {factors[1]:.3g}x by {factors[0]:.3g}x (width by height) "
        f"after the Flow passes, outside its [1, 2]; ask for a size with the input's aspect, or drop the latent "
        "upscaler to resample in pixels",
        field=FIELD,
    )


def fraction_plan(
    prepared: tuple[int, int], reference: tuple[int, int], passes: int, out: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(SesquiLSR's latent (height, width), the decoded content's (height, width) px) for ``passes`` passes on a
    ``prepared`` canvas of ``reference`` px asked to ``out`` (width, height); None when the passes' own latents are
    already that size (a factor of exactly 1: nothing to do). A side outside [1, 2] is one line."""
    prepared, reference = tuple(prepared), tuple(reference)
    wanted = fraction_latent_size(prepared, reference, out)
    latent = tuple(side * 2**passes // 8 for side in prepared)
    target = tuple(min(max(t, s), 2 * s) for t, s in zip(wanted, latent, strict=True))  # SesquiLSR's [1, 2]
    content = content_size(prepared, reference, target)
    if target == latent and content == (out[1], out[0]):
        return None
    check_fraction(latent, wanted, content, out, f"{out[0]}x{out[1]} after {passes} pass(es)")
    if min(latent) < SESQUI_MIN_SIDE:  # refused by the network itself only after every model loaded and encoded
        raise FlowliftError(
            f"latent_upscaler: {out[0]}x{out[1]} after {passes} pass(es) starts SesquiLSR from {latent[1]}x{latent[0]} "
            f"latents, under its {SESQUI_MIN_SIDE} a side; give a larger image, or drop the latent upscaler to "
            "resample in pixels",
            field=FIELD,
        )
    return target, content


def fraction_runs(height: int, width: int, resize_mode: str, passes: int, out: tuple[int, int]) -> bool:
    """Whether SesquiLSR has work for a ``height x width`` input asked to ``out`` (width, height) after ``passes``
    passes: the pipeline's own test (:func:`fraction_plan` is not None), for the record of what ran (an asked size
    of exactly 2^passes times the input leaves it nothing to do)."""
    from flowlift.upscale.sizes import prepared_size

    prepared = prepared_size(height, width, resize_mode)
    reference = (height, width) if resize_mode == "pad" else prepared
    return fraction_plan(prepared, reference, passes, out) is not None


def fraction_passes(height: int, width: int, resize_mode: str, out: tuple[int, int]) -> int:
    """The passes before SesquiLSR for a ``height x width`` input (its header) asked to ``out`` (width, height),
    checked by :func:`fraction_plan` at planning (one line before any work): the passes below the smaller side
    factor of the content (the input for ``"pad"``, the resampled canvas for ``"resample"``), so each side is left
    1-2x (:func:`~flowlift.limits.passes_for_scale` with ``fraction_last``: 3 -> 1, 1.5 -> 0; 31x1 at 1.5 is 46x2,
    1.48x by 2x: no pass)."""
    from flowlift.limits import cap_words, passes_for_scale
    from flowlift.upscale.sizes import planned_passes, prepared_size

    prepared = prepared_size(height, width, resize_mode)
    reference = (height, width) if resize_mode == "pad" else prepared
    factor = min(out[1] / reference[0], out[0] / reference[1])
    passes = passes_for_scale(factor, fraction_last=True) if factor >= 1 else 0
    if planned_passes(height, width, passes, resize_mode) < passes:  # the 16K cap on the canvas: no fewer passes
        raise FlowliftError(
            f"latent_upscaler: {out[0]}x{out[1]} needs {passes} 2x passes before SesquiLSR, and their canvas is over "
            f"{cap_words()}; drop the latent upscaler to resample in pixels",
            field=FIELD,
        )
    if fraction_plan(prepared, reference, passes, out) is None and passes == 0:  # was written as _x1.0001, exit 0
        raise FlowliftError(
            f"latent_upscaler: {out[0]}x{out[1]} is the input's own size: no Flow pass and nothing for SesquiLSR, only "
            "the VAE's round trip; ask for a larger size, or drop the latent upscaler (one pass, resampled to it)",
            field=FIELD,
        )
    return passes


def sesqui_path(spec: str) -> Path:
    """``"sesqui:PATH"`` -> PATH (the only latent upscaler for fractions today), else one line
    (:data:`flowlift.knobs.LATENT_UPSCALER`)."""
    checked = LATENT_UPSCALER.check(spec)
    if checked is None:
        raise FlowliftError("latent_upscaler must be sesqui:PATH, got None", field="latent_upscaler")
    return Path(checked.partition(":")[2].strip()).expanduser()


def find_sesqui(spec: str) -> Path:
    """``"sesqui:PATH"``'s file, its header checked against SesquiLSR's tensors before anything loads, or the
    loader's one line (no such file and where the released weights are; not safetensors; tensors that do not
    fit: :func:`flowlift.models.sesqui_lsr.check_sesqui_file`)."""
    from flowlift.models.sesqui_lsr import check_sesqui_file

    return check_sesqui_file(sesqui_path(spec))

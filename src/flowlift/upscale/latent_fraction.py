"""``flowlift upscale --latent-upscaler sesqui:PATH``: the fraction of an asked size in latent space (SesquiLSR),
after the Flow passes and before the decode, instead of the pixel resample.

The rule, per input of ``reference`` px (the original for ``resize_mode="pad"``, the resampled input for
``"resample"``) computed on a ``prepared`` canvas (multiples of 16) and asked for ``out`` px:

* a power-of-two scale (2, 4, 8, or ``passes``) is the passes' own output: SesquiLSR does not run (the option is
  still checked: its file, the VAE), the output is the one without the option, byte for byte;
* any other size runs ``passes_for_scale(scale, fraction_last=True)`` passes (3 -> 1, 1.5 -> 0, 6 -> 2), then
  SesquiLSR resizes the latents to :func:`fraction_latent_size`: per side ``2 * ceil(prepared * out / (16 *
  reference))``, the smallest even latent size (SesquiLSR's 2x2 patches) whose decoded frame covers the asked size;
* the decoded frame's content, ``reference * 8 * t / prepared`` px per side (:func:`content_size`), is cropped and
  resampled to exactly ``out`` (antialiased bicubic, by under 16 px: only where the asked size is not on the
  16-px latent grid or the input was padded; none when it is), then stage 2 against the input as always.

Each side's latent factor ``t / (prepared * 2**passes / 8)`` is in [1, 2] by construction for a scale (the passes
stop below it, and ``2 * ceil(x / 2) <= 2 * latent`` for ``x <= 2 * latent``); a ``size`` whose aspect differs
from the input's can ask one side below the passes' size: one line (:func:`check_fraction`). No torch here.
"""

from __future__ import annotations

from flowlift.errors import FlowliftError

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


def check_fraction(passes_latent: tuple[int, int], target: tuple[int, int], spelled: str = "the asked size") -> None:
    """One FlowliftError line (naming the latent upscaler) unless each side of ``target`` is 1-2x
    ``passes_latent`` (both (height, width) latents): SesquiLSR's range."""
    factors = [t / s for t, s in zip(target, passes_latent, strict=True)]
    if all(1.0 <= factor <= 2.0 for factor in factors):
        return
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
    target = fraction_latent_size(prepared, reference, out)
    latent = tuple(side * 2**passes // 8 for side in prepared)
    if target == latent:
        return None
    check_fraction(latent, target, f"{out[0]}x{out[1]} after {passes} pass(es)")
    return target, content_size(prepared, reference, target)


def check_header_fraction(height: int, width: int, passes: int, resize_mode: str, out: tuple[int, int]) -> None:
    """:func:`fraction_plan` for a ``height x width`` input (its header) at planning: one line before any work."""
    from flowlift.upscale.sizes import prepared_size

    prepared = prepared_size(height, width, resize_mode)
    fraction_plan(prepared, (height, width) if resize_mode == "pad" else prepared, passes, out)


def check_statistics(vae: object) -> None:
    """One line unless ``vae`` carries the FLUX.2 VAE's BN statistics (SesquiLSR's raw latents): TAEF2 and
    Mage-VAE have none."""
    if getattr(vae, "bn_mean", None) is None or getattr(vae, "bn_std", None) is None:
        raise FlowliftError(
            "latent_upscaler: SesquiLSR works on raw FLUX.2 VAE latents and needs the FLUX.2 VAE's BN statistics; "
            "this VAE (TAEF2 or Mage-VAE) has none: use the FLUX.2 VAE (flux2) or drop the latent upscaler",
            field=FIELD,
        )

"""The FLUX.2 refiner's knobs, declared once, and one :class:`SamplingSettings` for every mode.

:data:`REFINE_KNOBS` is the table ``flowlift img2img``/``hires`` options, the web app's Refine tab and
:class:`~flowlift.refine.refiner.Flux2Refiner`'s checks derive from (``tests/test_knobs.py`` holds them to
it). No torch here: the commands' help reads this module.

The tiled refine's knobs (``tile_size``, ``tile_overlap``, ``tile_batch``) are here too, with the constants
their domains are made of; :mod:`flowlift.refine.tiling` adds the rule one knob cannot say alone (the overlap
smaller than the tile) on top of :meth:`~flowlift.knobs.Knob.check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.flux2.settings import DEFAULT_MU, EMPIRICAL_MU, MU_RANGE, SAMPLERS, SCHEDULES
from flowlift.knobs import SCALE, SEED, TRANSPLANT_STRENGTH, Knob, exact_int, table  # noqa: F401  (TRANSPLANT_STRENGTH: the hires fix's)
from flowlift.limits import MAX_OUTPUT_SIDE, PIXEL_MULTIPLE, cap_words, hires_size_or_refuse, parse_memory

#: The most steps a refine takes: far past where a flow model stops gaining (28-50), and a bound on what one
#: request to the web app can ask for.
MAX_STEPS = 1000

STRENGTH = Knob(
    "strength",
    float,
    0.5,
    "img2img: how much to change (0 = the VAE round trip, 1 = ignore the input; outpaint starts at 1)",
    low=0.0,
    high=1.0,
    step=0.01,
)
REFINE_STRENGTH = Knob(
    "refine_strength",
    float,
    0.3,
    "hires fix: img2img strength of the refine pass after the upscale",
    low=0.0,
    high=1.0,
    step=0.01,
)
#: Outpaint's strength when none is given: the new border starts from noise (inpaint takes ``STRENGTH``'s default,
#: at every door).
OUTPAINT_STRENGTH = 1.0

#: Where the transformer waits (``auto``: planned from ``max_memory``, else ``none``; :mod:`flowlift.refine.offload`).
OFFLOADS = ("auto", "none", "model", "group")


def check_offload_and_budget(offload: object, max_memory: object, prefix: str) -> None:
    """``offload`` one of :data:`OFFLOADS` and ``max_memory`` a size (:func:`~flowlift.limits.parse_memory`) or None,
    else one line naming the field as ``prefix`` spells it (``source.offload``, ``memory.max_memory``)."""
    if not isinstance(offload, str) or offload not in OFFLOADS:
        raise FlowliftError(
            f"{prefix}offload must be one of {', '.join(OFFLOADS)}, got {offload!r}", field=f"{prefix}offload"
        )
    if max_memory is not None:
        try:
            parse_memory(max_memory)
        except FlowliftError as error:
            raise FlowliftError(f"{prefix}{error}", field=f"{prefix}max_memory") from None


STRENGTH_MAP = Knob(
    "strength_map",
    str,
    "linear",
    "strength -> denoising_start: linear = 1 - s; canvas = 1 - s**0.2 (as canvas apps count it)",
    choices=("linear", "canvas"),
)
#: The steps a step-distilled model (FLUX.2 Klein 4B/9B) is made for; base and dev models take the knob's 28.
DISTILLED_STEPS = 4

STEPS = Knob(
    "steps",
    int,
    28,
    f"steps of the shifted schedule (the model's default: {DISTILLED_STEPS} for a step-distilled Klein, 28 for Klein "
    "base and dev)",
    low=1,
    high=MAX_STEPS,
    unit="steps",
)
SAMPLER = Knob("sampler", str, "euler", "euler (one model call a step) or heun (two)", choices=SAMPLERS)
MU = Knob(
    "mu",
    float,
    DEFAULT_MU,
    "schedule shift mu (InvokeAI's and ComfyUI's FLUX.2 value), or 'empirical' (diffusers' formula from the "
    "image size and steps)",
    low=MU_RANGE[0],
    high=MU_RANGE[1],
    words=(EMPIRICAL_MU,),
)
SCHEDULE = Knob(
    "schedule",
    str,
    "respaced",
    "respaced: a low strength still runs every step, evenly spaced before the shift; clipped: only the full "
    "schedule's points below the strength (diffusers' img2img)",
    choices=SCHEDULES,
)
#: The hires fix's upscale factor: the upscale scale knob (:data:`flowlift.knobs.SCALE`) under the refiner's name.
HIRES_SCALE = replace(
    SCALE,
    name="hires_scale",
    help="hires fix: the upscale before the refine (2 = one Flow pass, 4 = two, 8 = three; any other factor in "
    "[1, 8] needs a latent upscaler for the fraction, SesquiLSR's sesqui:PATH: 1.5 = SesquiLSR alone, "
    "3 = one pass then 1.5x)",
)


def check_txt2img_size(width: int, height: int, field: str | tuple[str, str] = "size") -> tuple[int, int]:
    """``(width, height)`` as ints, or one FlowliftError line naming ``field`` unless ``width x height`` is a txt2img
    size flowlift can write: both sides positive integers (numpy's too), multiples of ``PIXEL_MULTIPLE`` (16: the
    VAE's 8x and the 2x2 patches), at most ``MAX_OUTPUT_SIDE`` (16384 px). Checked where the request is made, before
    any model loads. ``field`` a pair (``("width", "height")``, keywords of their own): the line names the side that
    breaks the rule."""
    if not isinstance(field, str):
        return _check_side(field[0], width), _check_side(field[1], height)
    sides = (exact_int(width), exact_int(height))
    if None in sides:
        raise FlowliftError(f"{field} must be two integers (width, height) in px, got {(width, height)!r}", field=field)
    width, height = sides
    if min(sides) < PIXEL_MULTIPLE or width % PIXEL_MULTIPLE or height % PIXEL_MULTIPLE:
        near = [min(MAX_OUTPUT_SIDE, max(PIXEL_MULTIPLE, round(s / PIXEL_MULTIPLE) * PIXEL_MULTIPLE)) for s in sides]
        fix = "crop or resize the image to" if field == "image" else "e.g."
        raise FlowliftError(
            f"{field} sides must be positive multiples of {PIXEL_MULTIPLE} px, got {width}x{height}; "
            f"{fix} {near[0]}x{near[1]}",
            field=field,
        )
    check_within_cap(width, height, field)
    return width, height


def check_within_cap(width: int, height: int, field: str) -> None:
    """One FlowliftError line naming ``field`` when a ``width x height`` image is over ``MAX_OUTPUT_SIDE`` (16384 px)
    a side: the cap every refine's output keeps, said once for txt2img's size and for img2img's and inpaint's input
    (they write the input's size), before any model loads."""
    if max(width, height) > MAX_OUTPUT_SIDE:
        image = field in ("image", "images")
        raise FlowliftError(
            f"{field} {width}x{height} is over {cap_words()}; "
            f"{'resize the image to' if image else 'use'} at most {MAX_OUTPUT_SIDE} px a side",
            field=field,
        )


def _check_side(name: str, value: object) -> int:
    """:func:`check_txt2img_size`'s rule for one side given as a keyword of its own, ``name``; the side as an int."""
    side = exact_int(value)
    if side is None:
        raise FlowliftError(f"{name} must be an integer (px), got {value!r}", field=name)
    if side < PIXEL_MULTIPLE or side % PIXEL_MULTIPLE or side > MAX_OUTPUT_SIDE:
        near = min(MAX_OUTPUT_SIDE, max(PIXEL_MULTIPLE, round(side / PIXEL_MULTIPLE) * PIXEL_MULTIPLE))
        raise FlowliftError(
            f"{name} must be a multiple of {PIXEL_MULTIPLE} px in {PIXEL_MULTIPLE}..{MAX_OUTPUT_SIDE}, got {side}; "
            f"e.g. {near}",
            field=name,
        )
    return side


def check_hires_size(
    width: int, height: int, scale: float, field: str = "hires.base_size", scale_field: str = "hires.scale"
) -> None:
    """One FlowliftError line (naming ``field``: the base size, or ``image``; a result over the cap that a smaller
    scale fixes names ``scale_field``) unless a hires fix of a ``width x height`` base can run at exactly ``scale``.

    The hires fix refines at ``scale`` times the base (:func:`hires_latent_size`), so every Flow Upscaler pass must
    run: the base
    (:func:`check_txt2img_size`: positive multiples of ``PIXEL_MULTIPLE``, within ``MAX_OUTPUT_SIDE``) and the
    result both within 16384 px, where :func:`flowlift.upscale.sizes.planned_passes` would drop a pass and leave the
    refine a smaller size than it was planned for; and a scale the grid rounds to no enlargement on a side is refused.
    The one size rule of the hires fix: the job checks it before any model loads,
    :meth:`~flowlift.refine.refiner.Flux2Refiner.hires` for a direct caller.
    """
    scale = HIRES_SCALE.check(scale)
    width, height = check_txt2img_size(width, height, field)
    side = max(width, height)
    out_w, out_h = hires_size_or_refuse(width, height, scale, field)  # 1.1x of 64x48 stayed 64x48, named _hires1.1x
    if max(out_h, out_w) > MAX_OUTPUT_SIDE:
        presets = HIRES_SCALE.extra["presets"]
        fits = [choice for choice in presets if side * choice <= MAX_OUTPUT_SIDE]
        most = MAX_OUTPUT_SIDE // math.ceil(scale) // PIXEL_MULTIPLE * PIXEL_MULTIPLE  # what this scale keeps in cap
        base = f"a {width}x{height} {'image' if field in ('image', 'images') else 'base'}"
        over = f"would be {out_w}x{out_h}, over {cap_words()} (a pass would be dropped)"
        if fits:
            raise FlowliftError(
                f"{FIELD_MARK} {scale:g} on {base} {over}; use {FIELD_MARK} {max(fits)}", field=(scale_field,) * 2
            )
        raise FlowliftError(
            f"{field}: hires at {scale:g}x of {base} {over}; use a base of at most {most} px a side", field=field
        )


#: FLUX.2's specified maximum resolution (BFL: 4 megapixels, e.g. 2048x2048; Klein the same).
MAX_UNTILED_PIXELS = 2048 * 2048
#: ``auto``'s tile: 1024 px, the resolution FLUX.2 is trained and most used at (1 MP, 4096 tokens per tile).
DEFAULT_TILE_SIZE = 1024
#: ``auto``'s overlap: 128 px = 16 latent pixels = 8 tokens on each shared edge, the width of the crossfade.
DEFAULT_TILE_OVERLAP = 128
#: The smallest tile (2x2 tokens) and the most tiles ``tile_batch auto`` puts in one call.
MIN_TILE_SIZE = 32
MAX_AUTO_TILE_BATCH = 4
TILE_SIZE_WORDS = ("auto", "off")

TILE_SIZE = Knob(
    "tile_size",
    int,
    "auto",
    f"refine in overlapping tiles of this many pixels per side (a multiple of {PIXEL_MULTIPLE}): auto tiles at "
    f"{DEFAULT_TILE_SIZE} px when the frame exceeds FLUX.2's 4 MP (or a given memory budget needs it), off runs one "
    "transformer call per step",
    low=MIN_TILE_SIZE,
    high=MAX_OUTPUT_SIDE,  # a tile past the 16K cap is the whole frame at most: never 100000
    words=TILE_SIZE_WORDS,
    unit="px",
    step=PIXEL_MULTIPLE,
    multiple=PIXEL_MULTIPLE,
)
TILE_OVERLAP = Knob(
    "tile_overlap",
    int,
    DEFAULT_TILE_OVERLAP,
    f"how far neighbouring tiles overlap (a multiple of {PIXEL_MULTIPLE}, less than the tile); their velocities "
    "crossfade across it",
    low=0,
    high=MAX_OUTPUT_SIDE - PIXEL_MULTIPLE,  # less than the largest tile: the widest overlap any tile allows
    unit="px",
    step=PIXEL_MULTIPLE,
    multiple=PIXEL_MULTIPLE,
)
TILE_BATCH = Knob(
    "tile_batch",
    int,
    "auto",
    f"tiles per transformer call: auto = as many as the memory budget leaves room for (at most {MAX_AUTO_TILE_BATCH}; "
    "1 without a budget)",
    low=1,
    words=("auto",),
    unit="tiles",
)
#: The tiled refine's knobs, in the order the front-ends show them.
TILE_KNOBS = (TILE_SIZE, TILE_OVERLAP, TILE_BATCH)

#: The refiner's knobs (the seed is :data:`flowlift.knobs.SEED`, the same as the upscaler's).
REFINE_KNOBS = table(
    STRENGTH, REFINE_STRENGTH, STRENGTH_MAP, STEPS, SEED, SAMPLER, MU, SCHEDULE, HIRES_SCALE, *TILE_KNOBS
)


@dataclass(frozen=True)
class SamplingSettings:
    """How one refine samples: steps, seed, sampler, and the schedule's ``mu`` and ``schedule``.

    ``mu``/``schedule`` ``None`` mean the refiner's own (set when it was made); ``steps`` None is the model's
    (:attr:`~flowlift.refine.refiner.Flux2Refiner.default_steps`: 4 for a step-distilled Klein). Every field is
    checked by its knob of :data:`REFINE_KNOBS` when the object is made (one line before any work, the only check:
    the loop trusts it); ``mu="empirical"``'s value depends on the image size and is checked per image.
    """

    steps: int | None = STEPS.default
    seed: int = SEED.default
    sampler: str = SAMPLER.default
    mu: float | str | None = None
    schedule: str | None = None

    def __post_init__(self) -> None:
        checked = {"steps": STEPS, "seed": SEED, "sampler": SAMPLER, "mu": MU, "schedule": SCHEDULE}
        for name, knob in checked.items():
            value = getattr(self, name)
            if value is not None or name in ("seed", "sampler"):
                object.__setattr__(self, name, knob.check(value))

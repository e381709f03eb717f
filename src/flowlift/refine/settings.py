"""The FLUX.2 refiner's knobs, declared once, and one :class:`SamplingSettings` for every mode.

:data:`REFINE_KNOBS` is the table ``flowlift img2img``/``hires`` options, the web app's Refine tab and
:class:`~flowlift.refine.refiner.Flux2Refiner`'s checks derive from (``tests/test_knobs.py`` holds them to
it). No torch here: the commands' ``--help`` reads this module.

Room is left for the refine tiling knobs (``tile_size``, ``tile_overlap``, ``tile_batch``): they join
:data:`REFINE_KNOBS` as :class:`~flowlift.knobs.Knob` entries beside these.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.flux2.settings import DEFAULT_MU, EMPIRICAL_MU, MU_RANGE, SAMPLERS, SCHEDULES
from flowlift.knobs import SEED, Knob, table

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
STRENGTH_MAP = Knob(
    "strength_map",
    str,
    "linear",
    "strength -> denoising_start: linear = 1 - s; canvas = 1 - s**0.2 (as canvas apps count it)",
    choices=("linear", "canvas"),
)
STEPS = Knob(
    "steps",
    int,
    28,
    "steps of the shifted schedule (distilled Klein: 4)",
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
HIRES_SCALE = Knob(
    "hires_scale",
    int,
    2,
    "hires fix: the Flow Upscaler's factor before the refine (2 = one pass, 4 = two, 8 = three)",
    choices=(2, 4, 8),
    unit="x",
)

#: The refiner's knobs (the seed is :data:`flowlift.knobs.SEED`, the same as the upscaler's).
REFINE_KNOBS = table(STRENGTH, REFINE_STRENGTH, STRENGTH_MAP, STEPS, SEED, SAMPLER, MU, SCHEDULE, HIRES_SCALE)


@dataclass(frozen=True)
class SamplingSettings:
    """How one refine samples: steps, seed, sampler, and the schedule's ``mu`` and ``schedule``.

    ``mu``/``schedule`` ``None`` mean the refiner's own (set when it was made). ``steps``, ``seed`` and
    ``sampler`` are checked against :data:`REFINE_KNOBS` when the object is made (one line before any work);
    ``mu`` and ``schedule`` when the schedule is built, as ``"empirical"`` depends on the image size.
    """

    steps: int = STEPS.default
    seed: int = SEED.default
    sampler: str = SAMPLER.default
    mu: float | str | None = None
    schedule: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "steps", STEPS.check(self.steps))
        object.__setattr__(self, "seed", SEED.check(self.seed))
        if self.sampler not in SAMPLER.choices:
            raise FlowliftError(f"unknown sampler {self.sampler!r}; flowlift runs {', '.join(SAMPLER.choices)}")


SAMPLING_FIELDS = ("steps", "seed", "sampler", "mu", "schedule")


def sampling_from(sampling: SamplingSettings | None, legacy: dict[str, Any], where: str) -> SamplingSettings:
    """The mode's :class:`SamplingSettings`: ``sampling`` itself, or (for one release) the old keyword arguments
    ``steps/seed/sampler/mu/schedule`` popped from ``legacy``, with a DeprecationWarning. Both at once is an error."""
    old = {name: legacy.pop(name) for name in SAMPLING_FIELDS if name in legacy}
    if not old:
        return sampling if sampling is not None else SamplingSettings()
    if sampling is not None:
        raise FlowliftError(f"{where}: give sampling=SamplingSettings(...) or {', '.join(old)}, not both")
    warnings.warn(
        f"{where}({', '.join(f'{name}=' for name in old)}) is deprecated and goes in the next release; pass "
        "sampling=SamplingSettings(...) (flowlift.refine.settings)",
        DeprecationWarning,
        stacklevel=3,
    )
    return SamplingSettings(**old)

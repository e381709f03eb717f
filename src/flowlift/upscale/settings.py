"""The Flow Upscaler's knobs, declared once, its memory settings as one :class:`MemoryPolicy`, and what an image's
stages share as one :class:`ImageStages`.

:data:`UPSCALE_KNOBS` is the table every front-end derives its controls from (``flowlift upscale``'s
options, the web app's Upscale tab and its checks, the ComfyUI and InvokeAI inputs, the checks of
:class:`~flowlift.upscale.pipeline.FlowUpscalerPipeline`); :data:`COLOR_FIX_KNOBS` is stage 2 alone
(``flowlift colorfix``, the colour-fix nodes). ``tests/test_knobs.py`` holds every front-end to them.
No torch here: the upscale command's help reads this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowlift.errors import FlowliftError
from flowlift.knobs import COLOR_FIX, SCALE, SEED, TRANSPLANT_STRENGTH, Knob, exact_int, table
from flowlift.limits import MAX_OUTPUT_SIDE, parse_memory

COLOR_FIX_STRENGTH = Knob(
    "color_fix_strength",
    float,
    1.0,
    "stage 2, after decoding: share of the input's colour and tone (L*a*b* low band) restored (1 = all)",
    low=0.0,
    high=1.0,
    step=0.05,
)
RESIZE_MODE = Knob(
    "resize_mode",
    str,
    "pad",
    "how inputs reach multiples of 16: pad (exactly 2^n x the input size back) or resample",
    choices=("pad", "resample"),
)
CHUNKED = Knob(
    "chunked",
    str,
    "auto",
    "exact bounded-memory UNet execution in row strips: auto = when the plain pass would not fit",
    choices=("auto", "always", "never"),
)

#: The Flow Upscaler's knobs, in the order the node packs show them.
UPSCALE_KNOBS = table(SCALE, SEED, TRANSPLANT_STRENGTH, COLOR_FIX_STRENGTH, RESIZE_MODE, CHUNKED)
#: Stage 2 alone (``flowlift colorfix``, FlowliftColorFix, flowlift_color_fix): its one strength.
COLOR_FIX_KNOBS = table(replace(COLOR_FIX_STRENGTH, name="strength"))

#: ``torch.compile``'s modes (a pipeline's ``compile="max-autotune"``; ``True``: the device's default mode).
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile(value: Any) -> bool | str:
    """``compile`` as asked: True, False or one of :data:`COMPILE_MODES`, else one line naming it (``"no"`` would be
    a mode refused only after the models loaded, ``""`` quietly no compile)."""
    if isinstance(value, bool) or isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise FlowliftError(
        f"compile must be True, False or a torch.compile mode ({', '.join(COMPILE_MODES)}), got {value!r}",
        field="compile",
    )


@dataclass(frozen=True)
class MemoryPolicy:
    """How an upscale fits in device memory: one object instead of six overlapping arguments.

    Precedence, highest first:

    1. ``chunked``, ``vae_tiled``, ``chunk_rows``, ``offload_device`` given explicitly always hold
       (``chunked``: True/False forces the exact row-strip executor on or off; ``vae_tiled`` is passed to the
       VAE's encode/decode; ``chunk_rows`` fixes the strip height; ``offload_device`` is where strips wait).
    2. ``max_memory`` (bytes or ``"6GB"``): :func:`flowlift.upscale.memory_plan.plan_upscale_memory` decides what
       (1) left unset, for the whole upscale (VAE encode, UNet passes, SesquiLSR, VAE decode, both colour stages),
       and checks an explicit ``chunked`` / ``vae_tiled`` / ``chunk_rows`` / ``offload_device`` against the budget
       (one line when it does not fit: a strip height over the budget is refused, where it ran past it; an
       ``offload_device`` that is the compute device keeps the stores there, counted, named where they do not fit).
    3. ``chunk_budget_bytes`` (only without ``max_memory``): what the plain UNet forward may use before
       chunking switches on by itself (default: half the free CUDA memory, 1 GiB on the CPU).
    4. Nothing set: every decision by size.
    """

    chunked: bool | None = None
    vae_tiled: bool | None = None
    chunk_rows: int | None = None
    offload_device: Any = None
    max_memory: int | str | None = None
    chunk_budget_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("chunked", "vae_tiled"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise FlowliftError(f"MemoryPolicy {name} must be True, False or None, got {value!r}")
        for name in ("chunk_rows", "chunk_budget_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise FlowliftError(f"MemoryPolicy {name} must be a positive integer or None, got {value!r}")
        if self.max_memory is not None:
            parse_memory(self.max_memory)  # a malformed or non-finite size: one line here, not at the pipeline
        if self.offload_device is not None:  # 'bogus' or an absent GPU: one line here, not at a pass's first strip
            from flowlift.devices import resolve_device_option

            resolve_device_option(self.offload_device, field="offload_device")


@dataclass(frozen=True)
class ImageStages:
    """What :meth:`flowlift.upscale.pipeline.FlowUpscalerPipeline.upscale_image` hands its stages as one: its
    parameters, checked before the encoder runs (``color_fix`` a bool; ``output_size`` None or (width, height),
    two integers in 1..``MAX_OUTPUT_SIDE``; the numbers by the pipeline's knobs)."""

    num_passes: int
    seed: int | Sequence[int]
    color_fix: bool
    transplant_strength: float
    color_fix_strength: float
    resize_mode: str
    output_size: tuple[int, int] | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "color_fix", COLOR_FIX.check(self.color_fix))
        object.__setattr__(self, "output_size", checked_output_size(self.output_size))


def checked_output_size(size: Any) -> tuple[int, int] | None:
    """``size`` as ``(width, height)``, two exact integers in 1..``MAX_OUTPUT_SIDE`` (None: none), else one line."""
    if size is None:
        return None
    sides = tuple(exact_int(v) for v in size) if isinstance(size, (tuple, list)) else ()
    if len(sides) != 2 or not all(side is not None and 1 <= side <= MAX_OUTPUT_SIDE for side in sides):
        raise FlowliftError(
            f"output_size must be (width, height), two integers in 1..{MAX_OUTPUT_SIDE}, got {size!r}",
            field="output_size",
        )
    return sides  # type: ignore[return-value]

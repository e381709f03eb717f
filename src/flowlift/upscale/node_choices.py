"""The Flow Upscaler's options as the node packs offer them: scale labels and chunking modes.

ComfyUI and InvokeAI show the same two drop-downs, derived from the knob table
(:data:`flowlift.upscale.settings.UPSCALE_KNOBS`); both turn a choice into the pipeline's arguments
here, so the two packs cannot drift apart.
"""

from __future__ import annotations

from flowlift.errors import FlowliftError
from flowlift.limits import passes_for_scale
from flowlift.upscale.settings import CHUNKED, SCALE

#: The scale choices of the upscale nodes: 2x per pass ("2x", "4x", "8x").
SCALES: tuple[str, ...] = tuple(SCALE.label(factor) for factor in SCALE.choices)
#: The scale the nodes start at.
DEFAULT_SCALE_LABEL = SCALE.label(SCALE.default)
#: The ``chunked`` choices: ``auto`` switches the exact chunked executor on by size (or free memory).
CHUNKING: tuple[str, ...] = CHUNKED.choices


def passes_for(scale: str) -> int:
    """'2x' -> 1, '4x' -> 2, '8x' -> 3 passes."""
    if scale not in SCALES:
        raise FlowliftError(f"scale must be one of {', '.join(SCALES)}, got {scale!r}")
    return passes_for_scale(SCALE.choices[SCALES.index(scale)])


def chunked_flag(chunked: str) -> bool | None:
    """The pipeline's ``chunked`` argument: 'auto' -> None (decided by size), 'always' -> True, 'never' -> False."""
    if chunked not in CHUNKING:
        raise FlowliftError(f"chunked must be one of {', '.join(CHUNKING)}, got {chunked!r}")
    return {"auto": None, "always": True, "never": False}[chunked]

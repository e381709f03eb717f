"""The old home of the Tiled FLUX.2 Denoise node's work, now :mod:`flowlift.refine.tiled_refine` (refine code belongs
to the capability, so every front-end runs the same core). The names stay importable from here for this release,
with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("tiled_refine_raw_latents", "tiling_line")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"flowlift.invokeai.tiled_refine.{name} moved to flowlift.refine.tiled_refine.{name}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        from flowlift.refine import tiled_refine

        return getattr(tiled_refine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

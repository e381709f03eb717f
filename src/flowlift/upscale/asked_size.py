"""The size an upscale is asked for, in one of three spellings: :class:`AskedSize`.

``scale=3`` (any factor in [1, 8], :data:`flowlift.knobs.SCALE`), ``long_side=3840`` or ``size=(3840, 2560)``.
Per input it gives the exact output size, the passes that reach it (the one rule,
:func:`flowlift.limits.passes_for_scale`, on the larger of the two side factors) and the name part of the output
(``x3``, ``x1.5``, ``3840x2560``); a request it cannot meet (over 8x, over the 16384 px cap, a size below the input)
is one FlowliftError line, raised at planning before any model loads. A scale of 2, 4 or 8 is a power of two:
the passes' own output, exactly as before (:attr:`AskedSize.power_of_two`). No torch here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError
from flowlift.knobs import SCALE, exact_int
from flowlift.limits import MAX_OUTPUT_SIDE, cap_words, passes_for_scale

__all__ = ["AskedSize", "parse_size"]

_SIZE = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")


def parse_size(text: str) -> tuple[int, int]:
    """``"3840x2560"`` -> ``(3840, 2560)`` (width, height), else one line."""
    match = _SIZE.fullmatch(str(text))
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise FlowliftError(f"size must be WIDTHxHEIGHT in pixels, e.g. 3840x2560, got {text!r}", field="size")
    return int(match[1]), int(match[2])


@dataclass(frozen=True)
class AskedSize:
    """One of ``scale`` (a factor in [1, 8]), ``long_side`` (pixels) or ``size`` ((width, height) pixels)."""

    scale: float | None = None
    long_side: int | None = None
    size: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("scale", "long_side", "size") if getattr(self, name) is not None]
        if len(given) != 1:
            raise FlowliftError(f"give one of scale, long_side or size, got {', '.join(given) or 'none'}")
        if self.scale is not None:
            object.__setattr__(self, "scale", SCALE.check(self.scale))
        if self.long_side is not None:
            side = exact_int(self.long_side)
            if side is None or not 1 <= side <= MAX_OUTPUT_SIDE:
                raise FlowliftError(
                    f"long_side must be an integer in [1, {MAX_OUTPUT_SIDE}], got {self.long_side!r}", field="long_side"
                )
            object.__setattr__(self, "long_side", side)
        if self.size is not None:
            given = self.size if isinstance(self.size, (tuple, list)) else ()  # a number is no size (was a TypeError)
            size = parse_size(self.size) if isinstance(self.size, str) else tuple(map(exact_int, given))
            if len(size) != 2 or None in size or min(size) < 1:
                raise FlowliftError(f"size must be (width, height) in pixels, got {self.size!r}", field="size")
            object.__setattr__(self, "size", size)

    @classmethod
    def of_passes(cls, passes: int) -> AskedSize:
        """``passes`` whole 2x passes: the scale ``2**passes``."""
        return cls(scale=float(2**passes))

    @property
    def power_of_two(self) -> bool:
        """A scale of 2, 4 or 8: exactly the passes' own output, the cap dropping passes as it always did."""
        return self.scale is not None and self.scale >= 2 and math.log2(self.scale).is_integer()

    @property
    def passes(self) -> int:
        """The passes of a power-of-two scale (input independent)."""
        return passes_for_scale(self.scale) if self.power_of_two else 0

    def target(self, width: int, height: int) -> tuple[int, int]:
        """The exact (width, height) of the output for a ``width x height`` input, or one line why there is none."""
        if self.scale is not None:
            out = max(1, round(width * self.scale)), max(1, round(height * self.scale))
        elif self.long_side is not None:
            factor = self.long_side / max(width, height)
            out = (
                (self.long_side, max(1, round(height * factor)))
                if width >= height
                else (max(1, round(width * factor)), self.long_side)
            )
        else:
            out = self.size
        spelled, field = self.spelled(width, height, out)
        if out[0] < width or out[1] < height:
            raise FlowliftError(
                f"{spelled} is below the {width}x{height} input; flowlift upscale only enlarges", field=field
            )
        if max(out) > MAX_OUTPUT_SIDE:
            raise FlowliftError(
                f"{spelled} is over {cap_words()}; ask for at most {MAX_OUTPUT_SIDE} px a side",
                field=field,
            )
        if max(out[0] / width, out[1] / height) > SCALE.high:
            raise FlowliftError(f"{spelled} is over {SCALE.high:g}x the {width}x{height} input", field=field)
        return out

    def spelled(self, width: int, height: int, out: tuple[int, int]) -> tuple[str, str]:
        """The request as the user gave it, its field marked (:data:`~flowlift.errors.FIELD_MARK`), and the size it
        means, with that field: ``(scale 3 (3072x2048), "scale")``, ``long_side 3840 (3840x2560)``, ``size
        3840x2560`` (the door says each field its way: ``--scale 3``, ``--long-side 3840``, ``--size 3840x2560``)."""
        if self.scale is not None:
            return f"{FIELD_MARK} {self.scale:g} ({out[0]}x{out[1]})", "scale"
        if self.long_side is not None:
            return f"{FIELD_MARK} {self.long_side} ({out[0]}x{out[1]})", "long_side"
        return f"{FIELD_MARK} {out[0]}x{out[1]}", "size"

    def passes_for(self, width: int, height: int) -> int:
        """The fewest 2x passes that reach :meth:`target` (:func:`~flowlift.limits.passes_for_scale`)."""
        out = self.target(width, height)
        return passes_for_scale(max(out[0] / width, out[1] / height))

    def named_by(self, out: tuple[int, int]) -> float | tuple[int, int]:
        """What the output name carries (:func:`flowlift.files.naming.upscaled_name`): the scale (``_x3``,
        ``_x1.5``), or for a long side or a size the output's (width, height) (``_3840x2560``)."""
        return self.scale if self.scale is not None else out

    def record(self) -> dict[str, Any]:
        """The metadata's account of the request: ``{"scale": 3}``, ``{"long_side": 3840}``, ``{"size": [w, h]}``."""
        if self.scale is not None:
            return {"scale": int(self.scale) if self.scale.is_integer() else self.scale}
        if self.long_side is not None:
            return {"long_side": self.long_side}
        return {"size": list(self.size)}

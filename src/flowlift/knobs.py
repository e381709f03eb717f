"""What a user-facing setting is, declared once: :class:`Knob`, and the one seed every door takes.

Each capability package owns a table of its knobs (``flowlift.upscale.settings``,
``flowlift.refine.settings``): name, type, domain (a range or choices), default, unit and a one-line help.
The front-ends derive their controls from those tables — the command line's options, the web app's
components and checks, the ComfyUI and InvokeAI inputs, the Python API's checks — so a limit is written
in one place. Nothing here imports torch.

Integers are parsed exactly on every door: the Python API and the node functions take an ``int`` (numpy's
too); the text and JSON doors (the command line, the web app's API, ComfyUI's ``POST /prompt``, InvokeAI's
graphs) also a string of digits, or a float that is a whole number no larger than 2^53 (beyond that a float
has already lost the integer it was meant to be). A seed is never passed through ``float()`` or ``int()``:
seeds 2^53 and 2^53 + 1 are different seeds, 5.5 and ``true`` are no seeds.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flowlift.errors import FIELD_MARK, FlowliftError

#: The largest seed: what ComfyUI's seed widgets and ``torch.Generator.manual_seed`` accept (2^64 - 1).
SEED_MAX = 2**64 - 1
#: Floats are whole numbers exactly up to here; past it a float cannot carry an exact integer.
EXACT_FLOAT_INT = 2**53
_INTEGER_TEXT = re.compile(r"[+-]?\d+")
#: How the text doors spell ``None`` for an optional knob.
_NONE = ("none", "null")


def exact_int(value: Any, *, loose: bool = False) -> int | None:
    """``value`` as an exact ``int``, or ``None`` when it is not one.

    Accepted: integers (numpy's too, never ``bool``); with ``loose`` (text and JSON doors: the command
    line, the web app's API) also strings of decimal digits (``" 18446744073709551615"``) and whole floats
    ``|x| <= 2^53``. Refused: fractions, NaN/Inf, larger floats, anything else.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if not loose:
        return None
    if isinstance(value, str):
        text = value.strip()
        return int(text) if _INTEGER_TEXT.fullmatch(text) else None
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number) and number.is_integer() and abs(number) <= EXACT_FLOAT_INT:
            return int(number)
    return None


def _non_finite(value: Any) -> bool:
    """Whether ``value`` is a number or numeric string that is NaN or infinite."""
    try:
        return not isinstance(value, bool) and not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _finite_real(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class Knob:
    """One user-facing setting: what every front-end shows and checks for it.

    ``kind`` is ``int``, ``float``, ``str`` (one of ``choices``, or text matching ``pattern``), ``bool`` or
    ``list`` (of strings). ``low``/``high`` close the range of a number (``None``: unbounded on that side;
    ``low_open``/``high_open`` leave that end out: ``lr`` in (0, inf)); ``multiple`` is what an integer
    must be a multiple of; ``words`` are strings a number knob also takes (``mu``'s ``"empirical"``);
    ``optional`` puts ``None`` in the domain (the text doors spell it ``none`` or ``null``). ``step`` is
    the slider step a UI offers, ``unit`` what the number counts; ``extra["spelled"]`` says a pattern in words.
    """

    name: str
    kind: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()
    words: tuple[str, ...] = ()
    unit: str = ""
    step: float | None = None
    low_open: bool = False
    high_open: bool = False
    multiple: int | None = None
    optional: bool = False
    pattern: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kind is str and not self.choices and not self.pattern:
            raise ValueError(f"knob {self.name}: a str knob needs its choices or a pattern")
        self.check(self.default)  # the default lies in the domain, always

    @property
    def domain(self) -> tuple[Any, ...]:
        """``("choices", (...))`` or ``("range", low, high)``, with ``words`` last if any: what a test compares."""
        none = (None,) if self.optional else ()
        if self.choices:
            return ("choices", tuple(self.choices), *none)
        if self.kind is bool:
            return ("choices", (False, True), *none)
        if self.kind is str:
            return ("text", self.pattern, *none)
        if self.kind is list:
            return ("list of text", *none)
        opened = ("open", self.low_open, self.high_open) if self.low_open or self.high_open else ()
        multiple = ("multiple", self.multiple) if self.multiple else ()
        return ("range", self.low, self.high, *opened, *multiple, *self.words, *none)

    def describe(self, *, loose: bool = True) -> str:
        """The domain in words: ``"one of a, b"``, ``"in [0, 1]"``, ``"an integer in [1, 200]"``, ``"in (0, 1)"``; an
        optional knob's absence as the text doors spell it (``or none``), or with ``loose=False`` as Python does
        (``or None``: the string ``"none"`` is no Python value of it)."""
        none = (" or none" if loose else " or None") if self.optional else ""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices)) + none
        if self.kind is bool:
            return "true or false" + none
        if self.kind is str:
            spelled = self.extra.get("spelled") or ("text" if self.pattern == ".*" else f"text matching {self.pattern}")
            return spelled + none
        if self.kind is list:
            return "a list of text (comma-separated on the command line)" + none
        # 15 significant digits, not :g's 6: a bound of 1048576 is said as it is, never rounded to 1.04858e+06
        low = "-inf" if self.low is None else f"{self.low:.15g}" if self.kind is float else str(self.low)
        high = "inf" if self.high is None else f"{self.high:.15g}" if self.kind is float else str(self.high)
        words = "".join(f" or {word}" for word in self.words)
        opening, closing = "(" if self.low_open else "[", ")" if self.high_open else "]"
        multiple = f" and a multiple of {self.multiple}" if self.multiple else ""
        kind = "an integer " if self.kind is int else ""
        if self.high is None and self.low is None:  # "in [-inf, inf]": any number
            return f"{kind.strip() or 'a number'}{multiple}{words}{none}"
        if self.high is None:  # "in [1, inf]" reads as if inf were a value
            return f"{kind or 'a number '}{'>' if self.low_open else '>='} {low}{multiple}{words}{none}"
        return f"{kind}in {opening}{low}, {high}{closing}{multiple}{words}{none}"

    def _error(self, label: str, value: Any, loose: bool) -> FlowliftError:
        if self.kind is int and self.low == 0 and not self.multiple and not self.optional:
            at_most = "" if self.high is None else f" at most {self.high}"
            if self.high == SEED_MAX:
                at_most += " (2^64 - 1)"
            return FlowliftError(f"{label} must be a non-negative integer{at_most}, got {value!r}", field=label)
        if self.kind is float and _non_finite(value):  # say what is wrong with nan / inf, not only the range
            # never "... a number > 0"
            finite = f"a finite number {self.describe(loose=loose).removeprefix('a number')}".strip()
            return FlowliftError(f"{label} must be {' '.join(finite.split())}, got {value!r}", field=label)
        return FlowliftError(f"{label} must be {self.describe(loose=loose)}, got {value!r}", field=label)

    def check(self, value: Any, label: str | None = None, *, loose: bool = False) -> Any:
        """``value`` converted to this knob's type if it lies in the domain, else one FlowliftError line.

        Integers are exact (:func:`exact_int`, ``loose`` for text and JSON doors); floats must be finite
        real numbers (``loose``: numeric strings too); a choice must be one of the choices; ``bool`` takes
        only ``True``/``False``.
        """
        label = label or self.name
        if self.optional and (value is None or loose and isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        if self.choices:
            if loose and self.kind is int:
                value = exact_int(value, loose=True) if exact_int(value, loose=True) is not None else value
            if isinstance(value, bool) and self.kind is not bool or value not in self.choices:
                choices = ", ".join(map(str, self.choices))
                raise FlowliftError(f"{label} must be one of {choices}, got {value!r}", field=label)
            return next(choice for choice in self.choices if choice == value)
        if self.kind is bool:
            if not isinstance(value, bool):
                raise FlowliftError(f"{label} must be true or false, got {value!r}", field=label)
            return value
        if self.kind is str:
            if not isinstance(value, str) or not re.fullmatch(self.pattern, value.strip(), re.DOTALL):
                raise FlowliftError(f"{label} must be {self.describe(loose=loose)}, got {value!r}", field=label)
            return value.strip()
        if self.kind is list:
            if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
                raise FlowliftError(f"{label} must be {self.describe(loose=loose)}, got {value!r}", field=label)
            return list(value)
        if isinstance(value, str) and value.strip().lower() in self.words:
            return value.strip().lower()
        number = exact_int(value, loose=loose) if self.kind is int else _finite_real(value)
        if isinstance(value, str) and self.kind is float and not loose:
            number = None  # the Python API takes numbers; text is for the loose doors
        if number is None:
            raise self._error(label, value, loose)
        below = self.low is not None and (number <= self.low if self.low_open else number < self.low)
        above = self.high is not None and (number >= self.high if self.high_open else number > self.high)
        if below or above:
            raise self._error(label, value, loose)
        if self.multiple and number % self.multiple:
            unit = f" {self.unit}" if self.unit else ""
            raise FlowliftError(f"{label} must be a multiple of {self.multiple}{unit}, got {value!r}", field=label)
        return self.kind(number)

    def parse_text(self, text: str) -> Any:
        """A command-line value: :meth:`check` on the text (numbers parsed exactly), for ``argparse``."""
        try:
            return self.check(text, label="value", loose=True)
        except FlowliftError as error:
            raise FlowliftError(str(error).removeprefix("value ")) from None

    def label(self, value: Any) -> str:
        """How a choice is shown where the node packs show it: ``extra["labels"]`` maps it (``2 -> "2x"``)."""
        labels = self.extra.get("labels")
        return labels[self.choices.index(value)] if labels else str(value)


SEED = Knob(
    "seed",
    int,
    0,
    "noise seed: the same seed gives the same result on every device",
    low=0,
    high=SEED_MAX,
)


#: Whether a file flowlift did not write may be replaced at an output name. A bool and nothing else: a form value
#: such as ``"no"`` is truthy, and reading it as yes would destroy the user's file (issue 43.1).
OVERWRITE = Knob(
    "overwrite",
    bool,
    False,
    "replace a file at an output name that flowlift did not write",
)
#: Stage 2 of the colour fix on or off (the hires fix's ``color_fix``): a bool, never a truthy string.
COLOR_FIX = Knob(
    "color_fix",
    bool,
    True,
    "stage 2 after decoding: restore the input's colour and tone",
)


def check_overwrite(value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``, else one line: the replace rule's own guard, so no caller's truthy
    non-bool (``"no"``, ``"false"``, ``1``) ever counts as permission to replace a user's file."""
    return OVERWRITE.check(value)


#: The upscale factor, declared once for both of its owners: ``flowlift upscale --scale`` (the upscaler's table)
#: and the hires fix's upscale (the refiner's ``hires_scale`` is this knob under its own name). Any real factor in
#: [1, 8]: 2, 4 and 8 are one, two and three 2x passes; any other factor takes the fewest passes that reach it
#: (:func:`flowlift.limits.passes_for_scale`) and is resampled to its size. ``extra["presets"]``: the factors the
#: pages offer as one click (the Refine tab's "hires fix 2x/4x/8x" modes).
SCALE = Knob(
    "scale",
    float,
    2.0,
    "upscale factor in [1, 8]: 2x per pass (2 = one pass, 4 = two, 8 = three); any other factor runs the fewest "
    "passes that reach it, then resamples to the exact size",
    low=1.0,
    high=8.0,
    step=0.05,
    unit="x",
    extra={"presets": (2, 4, 8)},
)
#: Stage 1 of the colour fix, run after every upscale pass: the upscaler's and the hires fix's.
TRANSPLANT_STRENGTH = Knob(
    "transplant_strength",
    float,
    1.0,
    "stage 1, after every pass: share of the latent low band taken from the input (1 = exactly, 0 = off)",
    low=0.0,
    high=1.0,
    step=0.05,
)

#: The latent upscaler for the fraction of a scale that is not 2, 4 or 8, in latent space after the Flow passes:
#: ``sesqui:PATH`` (SesquiLSR's FLUX.2 weights, any factor in [1, 2]); None: ``hires`` refuses such a scale,
#: ``upscale`` resamples in pixels. The FLUX.2 VAE only (it works on raw latents: the VAE's BN statistics).
LATENT_UPSCALER = Knob(
    "latent_upscaler",
    str,
    None,
    "the fraction of a scale that is not 2, 4 or 8 (1.5; 3 = one pass then 1.5x) in latent space: SesquiLSR "
    "FLUX.2 weights (upscaler_Flux2.safetensors from LoganBooker/SesquiLSR's models/; needs the FLUX.2 VAE)",
    pattern=r"sesqui:.+",
    optional=True,
    extra={"spelled": "sesqui:PATH"},
)


def check_seed(seed: Any) -> int | list[int]:
    """A seed in [0, 2^64 - 1] (exact), or a sequence of them (one per image of a batch), else one line."""
    if isinstance(seed, (list, tuple)):
        return [SEED.check(value) for value in seed]
    return SEED.check(seed)


def check_count(name: str, value: Any) -> int:
    """``value`` as an int if it is a non-negative integer (numpy ints too; not bool, not 1.5), else one line."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise FlowliftError(f"{name} must be a non-negative integer, got {value!r}", field=name)
    return int(value)


def check_unit_interval(name: str, value: Any) -> float:
    """``value`` as a float if it is a real number in [0, 1] (not bool, not a string, not NaN), else one line."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise FlowliftError(f"{name} must be in [0, 1], got {value!r}", field=name)
    return float(value)


def check_path(name: str, value: Any, *, optional: bool = False) -> Any:
    """``value`` if it names a file (a non-empty ``str`` or ``os.PathLike``; None too when ``optional``), else one line
    naming ``name``: an empty name would quietly mean the working folder or a default."""
    if value is None and optional:
        return None
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if isinstance(text, str) and not text.strip():  # the door's words: "--mask: an empty name names nothing"
        raise FlowliftError(f"{name}: an empty name names nothing, got {value!r}", field=name)
    if not isinstance(text, str):
        what = "a path" + (" or None" if optional else "")
        raise FlowliftError(f"{name} must be {what}, got {value!r}", field=name)
    return value


def check_paths(name: str, value: Any) -> tuple[Any, ...]:
    """A sequence of paths as a tuple, each :func:`check_path`; one ``str`` (or path) is one path, never its
    characters."""
    if isinstance(value, (str, os.PathLike)):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise FlowliftError(f"{name} must be a path or a sequence of paths, got {value!r}", field=name)
    return tuple(check_path(name, item) for item in value)


def comma_items(text: str | Iterable[str], name: str) -> list[str]:
    """The stripped items of a comma-separated list (``--run a,b``; a repeated option's texts are one list), else one
    line naming ``name``: an empty item (``a,,b``, ``a,``: a typo that dropped an item without a word), a repeat."""
    items: list[str] = []
    for part in [text] if isinstance(text, str) else text:
        for piece in (piece.strip() for piece in str(part).split(",")):
            if not piece or piece in items:
                why = f"gives {piece!r} twice" if piece else "has an empty item (two commas together, or one at an end)"
                raise FlowliftError(f"{FIELD_MARK} {part!r} {why}: give each item once, none empty", field=name)
            items.append(piece)
    return items


def check_quality(quality: object, name: str = "quality") -> int | None:
    """``quality`` (JPEG/WebP) as an int in 1..100, or None (the default), else one line: not True, 95.7 or "95"."""
    if quality is None:
        return None
    number = exact_int(quality)
    if number is None or not 1 <= number <= 100:
        raise FlowliftError(f"{name} must be an integer in 1..100 or None, got {quality!r}", field=name)
    return number


def check_kind(name: str, value: Any, kind: type | tuple[type, ...], spelled: str, *, optional: bool = False) -> Any:
    """``value`` if it is a ``kind`` (None too when ``optional``), else one line naming ``name`` and what it takes
    (``spelled``: "a SamplingSettings"): a settings object's place never takes None, a string or a dict."""
    if value is None and optional:
        return value
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    shown = repr(value) if len(repr(value)) <= 80 and "\n" not in repr(value) else f"a {type(value).__name__}"
    raise FlowliftError(f"{name} must be {spelled}{' or None' if optional else ''}, got {shown}", field=name)


def check_callable(name: str, value: Any, *, optional: bool = True) -> Any:
    """``value`` if it can be called (None too when ``optional``), else one line naming ``name``: a callback that is
    not one (``on_strip="x"``) would otherwise fail as a TypeError where it is first called, minutes into a run."""
    if callable(value) or (value is None and optional):
        return value
    shown = repr(value) if len(repr(value)) <= 80 and "\n" not in repr(value) else f"a {type(value).__name__}"
    raise FlowliftError(f"{name} must be a function{' or None' if optional else ''}, got {shown}", field=name)


def check_dtype(value: Any, name: str = "dtype") -> Any:
    """``value`` if it is a floating ``torch.dtype``, else one line naming ``name``: ``"bf16"`` fails inside torch's
    ``.to()``, and an integer dtype would be blamed on the weights file it was cast to."""
    import torch

    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise FlowliftError(f"{name} must be a floating torch.dtype (torch.bfloat16, ...), got {value!r}", field=name)
    return value


def check_positive(name: str, value: Any, *, integer: bool = False, optional: bool = False) -> Any:
    """``value`` if it is a finite number above 0 (an exact integer >= 1 with ``integer``; None when ``optional``),
    else one line naming ``name``: not bool, not text, not NaN."""
    if value is None and optional:
        return None
    if integer:
        number = exact_int(value)
        if number is None or number < 1:
            raise FlowliftError(f"{name} must be an integer >= 1, got {value!r}", field=name)
        return number
    number = _finite_real(value) if not isinstance(value, str) else None
    if number is None or number <= 0:
        raise FlowliftError(f"{name} must be a finite number above 0, got {value!r}", field=name)
    return number


#: The largest true classifier-free guidance scale a refine takes (ComfyUI's CFG widget stops there too): FLUX.2
#: Klein base models use ~4; far past it the two velocities' difference is amplified into an image of overflow.
MAX_CFG_SCALE = 100.0


def check_cfg_scale(name: str, value: Any) -> float:
    """``value`` if it is a finite number in (0, :data:`MAX_CFG_SCALE`], else one line naming ``name``."""
    number = check_positive(name, value)
    if number > MAX_CFG_SCALE:
        raise FlowliftError(
            f"{name} must be at most {MAX_CFG_SCALE:g} (Klein base models use ~4), got {value!r}", field=name
        )
    return float(number)


def wrap_seed(value: int) -> int:
    """A seed derived by arithmetic (``seed + k``) brought back into [0, 2^64 - 1]: ``value mod 2^64``."""
    return int(value) % (SEED_MAX + 1)


def labels(knobs: Iterable[Knob]) -> dict[str, str]:
    """How the node packs, the web app and a command's value parsers say knobs in a line: ``tile_size`` -> ``tile
    size`` (the words :meth:`flowlift.errors.FlowliftError.worded` puts in a knob's place; the command line's own
    options are ``--tile-size``)."""
    return {knob.name: knob.name.replace("_", " ") for knob in knobs}


def table(*knobs: Knob) -> dict[str, Knob]:
    """A knob table: name -> knob, in the order given (the order the front-ends show them)."""
    found: dict[str, Knob] = {}
    for knob in knobs:
        if knob.name in found:
            raise ValueError(f"knob {knob.name} declared twice")
        found[knob.name] = knob
    return found

"""Options and defaults every subcommand shares, written once so they cannot drift apart.

One set of defaults for the whole command line and the Python API (the README's "Defaults" section
says why): ``--device auto`` (CUDA when available, else CPU), ``--dtype auto`` (bfloat16 on CUDA,
float32 on the CPU; ``upscale`` and ``app`` also bfloat16 on a CPU with native bf16,
:func:`flowlift.devices.auto_dtype`), ``--vae flux2`` (:data:`DEFAULT_VAE`), ``--scale 2`` (:data:`DEFAULT_SCALE`).
Not a subcommand (the leading underscore keeps :mod:`flowlift.commands.cli` from listing it).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from flowlift.devices import DTYPES, resolve_device_dtype  # noqa: F401  (imported by the commands from here)
from flowlift.errors import FlowliftError
from flowlift.knobs import SEED, Knob
from flowlift.models.vae_names import vae_help, vae_metavar
from flowlift.upscale.loading import (
    DEFAULT_UPSCALER,
    DEFAULT_VAE,  # noqa: F401  (the one default, shared with the Python API)
)
from flowlift.upscale.settings import SCALE

#: One 2x pass: the upscaler's native step (``upscale``, ``eval --run``, ``hires``): the knob's default.
DEFAULT_SCALE = SCALE.default


#: Request fields (as the Python API names them) whose option is named otherwise: field -> the option's ``dest``.
#: Every knob is its own option (``tile_size`` -> ``--tile-size``), and so is every field named like its option.
FIELD_DESTS = {
    "prompt.text": "prompt",
    "prompt.embeds": "prompt_embeds",
    "prompt.negative": "negative_prompt",
    "prompt.cfg_scale": "cfg_scale",
    "prompt.guidance": "guidance",
    "source.model": "model",
    "source.vae": "vae",
    "source.transformer": "transformer",
    "source.loras": "lora",
    "source.device": "device",
    "source.dtype": "dtype",
    "source.offload": "offload",
    "source.max_memory": "max_memory",
    "references": "reference",
    "hires.upscaler": "upscaler",
    "upscaler.latent_upscaler": "latent_upscaler",
    "hires.scale": "scale",
    "hires.refine_strength": "refine_strength",
    "hires.base_steps": "base_steps",
    "hires.transplant_strength": "transplant_strength",
    "output_format": "format",
    "settings.upscaler": "upscaler",
    "settings.vae": "vae",
    "vae_tiled": "vae_tiling",
    "hires_scale": "scale",
    "crop": "crop_px",
    "crops.inputs": "inputs",
    "config_file": "config",
    "vaes": "vae",  # flowlift app's repeatable --vae is AppConfig.vaes
}


def option_words(parser: argparse.ArgumentParser) -> dict[str, str]:
    """How ``parser``'s command names each knob and request field in its errors: its option (``--tile-size``), a
    positional by its metavar or name (``INPUT``, ``image``): what :meth:`flowlift.errors.FlowliftError.worded` puts
    in a field's place. A field with its value, ``vae_tiled=False`` (a mode the caller forced), is said as the flag
    that sets it (``--no-vae-tiling``; ``=True``: ``--vae-tiling``)."""
    words: dict[str, str] = {}
    for action in parser._actions:
        longs = [flag for flag in action.option_strings if flag.startswith("--")]
        if longs:
            words.setdefault(action.dest, longs[0])
        elif not action.option_strings and action.dest != argparse.SUPPRESS:
            words.setdefault(action.dest, str(action.metavar or action.dest))
        if isinstance(action, argparse.BooleanOptionalAction) and longs:
            words.setdefault(f"{action.dest}=True", longs[0])
            words.setdefault(f"{action.dest}=False", next(f for f in action.option_strings if f.startswith("--no-")))
    for field, dest in FIELD_DESTS.items():
        words.update({field + said: words[dest + said] for said in ("", "=True", "=False") if dest + said in words})
    if "model_vae" in words:  # flowlift app: --vae is the Upscale tab's, --model-vae the refiner's (source.vae)
        words["source.vae"] = words["model_vae"]
    if "width" in words and "height" in words:
        words["hires.base_size"] = words["base_size"] = f"{words['width']}/{words['height']}"
    return words


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples epilog's line breaks and appends ``(default: X)`` to every option whose help
    does not already state its default (``none`` when it is unset; flags that are off unless given and
    required options need none); a help that states it is written ``(default: X ...)`` too: one notation."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = re.sub(r"\(default (?!:)", "(default: ", action.help or "")  # one notation: "(default: X)"
        if "default" in text.lower() or action.required or not action.option_strings or action.help is None:
            return text
        if isinstance(action, argparse._StoreConstAction) or action.default is argparse.SUPPRESS:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2, like every other user error.

    argparse prints the whole usage block before its error line; a bad ``--seed`` then buries the one
    line that matters under thirty lines of options. This parser prints
    ``flowlift CMD: error: MESSAGE (flowlift CMD -h lists the options)`` instead. Used for the root parser;
    its subparsers (and theirs) are made of the same class. Unknown options are reported by the deepest
    command that was chosen (``flowlift upscale: error: unrecognized arguments: --sed``), not by the root.
    A prefix of an option is refused (``allow_abbrev=False``): ``--color-fix 0.5`` is not silently
    ``--color-fix-strength 0.5``, and adding an option never changes what an old command line means.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]  (argparse's returns NoReturn too)
        text = " ".join(str(message).split())  # argparse's messages are one line; keep it so
        if text.startswith("argument ") and text.endswith("expected one argument"):  # "--outpaint -16,0,0,0"
            names = text.split()[1].rstrip(":").split("/")
            given = getattr(self, "given", [])
            after = [given[i + 1] for i, arg in enumerate(given[:-1]) if arg in names]
            if any(value.startswith("-") for value in after):
                text += f" (a value that starts with '-' is given as {names[-1]}=VALUE)"
        text += self._did_you_mean(text)
        print(f"{self.prog}: error: {text} ({self.prog} -h lists the options)", file=sys.stderr)
        self.exit(2)

    def _did_you_mean(self, text: str) -> str:
        """``; did you mean --steps?`` for a misspelled option or command (Python 3.11's argparse has no such hint),
        else nothing."""
        import difflib
        import re

        if choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", text):  # a command: "upscal"
            known, asked = re.findall(r"'([^']*)'", choice.group(2)), [choice.group(1)]
        elif text.startswith("unrecognized arguments: "):
            known = [flag for action in self._actions for flag in action.option_strings]
            asked = [word.split("=")[0] for word in text.split()[2:] if word.startswith("--")]
        else:
            return ""
        near = [match for word in asked for match in difflib.get_close_matches(word, known, n=1)]
        return f"; did you mean {' '.join(dict.fromkeys(near))}?" if near else ""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self.given = list(sys.argv[1:] if args is None else args)  # what error() looks at
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._chosen_command(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _chosen_command(self, parsed: argparse.Namespace) -> OneLineParser:
        """The parser of the innermost subcommand named on the command line (this one when none was)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None))
                if isinstance(chosen, OneLineParser):
                    return chosen._chosen_command(parsed)
        return self


#: The one help text of ``--vae`` (every command that takes a VAE; a command adds only what is its own).
#: Its names come from the one declaration of the VAE names (flowlift.models.vae_names).
VAE_HELP = vae_help()


def add_output_option(
    parser: argparse.ArgumentParser, help: str, *, required: bool = False, metavar: str = "OUT"
) -> argparse.Action:
    """``-o/--output``, the one spelling of every command's output."""
    return parser.add_argument("-o", "--output", type=name_or_path, metavar=metavar, help=help, required=required)


def add_vae_option(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, own: str = "", **kwargs: Any
) -> argparse.Action:
    """``--vae`` with the one help text (:data:`VAE_HELP`), ``own`` appended (what only this command does with it)."""
    kwargs.setdefault("metavar", vae_metavar())
    kwargs.setdefault("type", name_or_path)
    return parser.add_argument("--vae", help=VAE_HELP + (f"; {own}" if own else ""), **kwargs)


def add_upscaler_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup, own: str = "") -> argparse.Action:
    """``--upscaler``, the Flow Upscaler's weights, with the one help text (``own``: what only this command does)."""
    return parser.add_argument(
        "--upscaler",
        type=name_or_path,
        default=None,
        metavar="PATH|REPO",
        help=f"Flow Upscaler weights{own}: file, folder or hub repo (default {DEFAULT_UPSCALER})",
    )


def add_image_output_option(parser: argparse.ArgumentParser, beside: str) -> None:
    """``-o`` of the commands that write one image per input (upscale, colorfix): a folder, or for one input a file
    whose suffix is a format flowlift writes (:func:`flowlift.files.output_paths.output_target`, the one rule)."""
    from flowlift.files.output_checks import OUTPUT_SUFFIXES

    parser.add_argument(
        "-o",
        "--output",
        type=name_or_path,
        metavar="OUT",
        help=f"output folder (default: next to {beside}); for one input, a file name ending "
        f"{', '.join(OUTPUT_SUFFIXES[:-1])} or {OUTPUT_SUFFIXES[-1]}, its suffix the format (a name with another "
        "suffix is refused; a folder with a dot in its name ends in /)",
    )


def add_image_format_options(parser: argparse.ArgumentParser) -> None:
    """``--format`` and ``--quality`` of the commands that write images (upscale, colorfix)."""
    parser.add_argument(
        "--format",
        choices=OUTPUT_FORMATS,
        default=None,
        help="output format (default: the suffix of -o FILE, else png); ICC profile and EXIF are kept in all three "
        "(-o FILE may also end .tif/.tiff, which keeps them too, or .bmp, which keeps neither)",
    )
    parser.add_argument(
        "--quality",
        type=quality,
        default=None,
        metavar="Q",
        help="JPEG/WebP quality 1-100 (default 95; WebP at 100 is lossless)",
    )


def add_report_overwrite_option(parser: argparse.ArgumentParser) -> None:
    """``--overwrite`` of the commands that write a report folder (eval, bands)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files at the report's names that flowlift did not write (without it, only "
        "flowlift's own reports and empty files are replaced)",
    )


def examples(*lines: str) -> str:
    """An epilog of example command lines: ``examples:`` and one indented line each."""
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def add_device_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, what: str = "models", *, cpu_bf16: bool = False
) -> None:
    """``--device`` and ``--dtype`` with the one set of defaults (``cpu_bf16``: the command's Flow Upscaler
    runs in bfloat16 on a CPU with native bfloat16, :func:`flowlift.devices.auto_dtype`)."""
    native = "bfloat16 for the Flow Upscaler and TAEF2 on a CPU with native bf16 (AMX/AVX512-BF16), else float32"
    cpu = native if cpu_bf16 else "float32 on the CPU"
    parser.add_argument(
        "--device",
        default="auto",
        help=f"torch device for the {what}: auto (default: CUDA if available, else cpu), cpu, cuda, cuda:1, ...",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help=f"precision (default: auto, which is bfloat16 on CUDA, {cpu}; float16 on the CPU is very slow)",
    )


def name_or_path(text: str) -> str:
    """A file, folder, model name or hub id: any text but an empty or blank one, which names nothing (an empty
    ``-o`` would write into the working folder, an empty path read it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"an empty value names no file, folder or model, got {text!r}")
    return text


def number(text: str, kind: type[int] | type[float] = float, wrong: str | None = None) -> Any:
    """``kind(text)`` for an option's ``type``, or argparse's one line: ``not an integer: 'x'`` / ``not a number:
    'x'`` (``wrong``: the option's own line instead)."""
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            wrong or f"not {'an integer' if kind is int else 'a number'}: {text!r}"
        ) from None


def finite_float(text: str) -> float:
    """A float option that refuses ``nan``, ``inf`` and ``-inf`` (``float()`` accepts all three)."""
    value = number(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


#: Formats the image-writing commands (upscale, colorfix) write.
OUTPUT_FORMATS = ("png", "jpg", "webp")


def unit_interval(text: str) -> float:
    """A fraction: a number in [0, 1]."""
    value = number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An option's ``type``: an integer >= ``low`` (``must be >= 1, got -1``)."""

    def parse(text: str) -> int:
        value = number(text, int)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


#: A count of at least one (images, steps, passes, pixels): an integer >= 1.
positive_int = int_at_least(1)
#: A count that may be 0 (``--tile-overlap``, ``--val-every 0`` = never): an integer >= 0.
non_negative_int = int_at_least(0)


def knob_type(knob: Knob):
    """The argparse ``type`` of a knob: its exact parse (:meth:`Knob.parse_text`), a bad value one line, exit 2."""

    def parse(text: str) -> Any:
        try:
            return knob.parse_text(text)
        except FlowliftError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = knob.name  # argparse names the type in "invalid <name> value"
    return parse


def add_knob(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, knob: Knob, flag: str | None = None, **overrides: Any
) -> argparse.Action:
    """``--<knob-name>`` from a knob table entry: its exact parse, its choices, its default and its help.

    ``overrides`` are for what only the command line has (``metavar``, a ``default`` of None where the
    command resolves the knob's default itself, a help line naming other options).
    """
    kwargs: dict[str, Any] = {"type": knob_type(knob), "default": knob.default, "help": knob.help}
    if knob.choices:  # argparse checks the choices itself ("invalid choice: ... (choose from ...)")
        kwargs["choices"] = knob.choices
        kwargs["type"] = None if knob.kind is str else knob_type(replace(knob, choices=(), low=None, high=None))
    elif knob.kind in (int, float):
        kwargs["metavar"] = "N" if knob.kind is int else "X"
        kwargs["help"] = f"{knob.help}; {knob.describe()}"
    kwargs.update(overrides)
    return parser.add_argument(flag or "--" + knob.name.replace("_", "-"), **kwargs)


#: ``--seed``'s type: an exact integer in [0, 2^64 - 1] (:data:`flowlift.knobs.SEED`), never through float.
seed_value = knob_type(SEED)


def quality(text: str) -> int:
    """``--quality`` for JPEG/WebP: an integer in 1..100."""
    value = number(text, int)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"must be in 1..100, got {value}")
    return value


def sampling_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~flowlift.refine.settings.SamplingSettings` of ``--steps --seed --sampler --mu --schedule``."""
    from flowlift.refine.settings import SamplingSettings

    return SamplingSettings(steps=args.steps, seed=args.seed, sampler=args.sampler, mu=args.mu, schedule=args.schedule)

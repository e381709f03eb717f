"""``--tile-size``, ``--tile-overlap`` and ``--tile-batch`` of ``img2img`` and ``hires``: the tiled refine's knobs,
derived from their one declaration (:data:`flowlift.refine.settings.TILE_KNOBS`: name, domain, default, help).

Not a subcommand (the leading underscore keeps :mod:`flowlift.commands.cli` from listing it).
``flowlift.refine.tiling`` imports no torch, so ``--help`` stays fast. Each option is :func:`add_knob` of its knob
with the tiling module's parse as its type (the knob's check, its range and 16-px grid); the options are checked
together (the overlap against the tile) by :func:`flowlift.refine.jobs.find_weights`, before any weights load.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from flowlift.commands._options import add_knob
from flowlift.errors import FlowliftError
from flowlift.knobs import labels
from flowlift.refine.settings import TILE_KNOBS
from flowlift.refine.tiling import parse_tile_batch, parse_tile_overlap, parse_tile_size

_PARSERS: dict[str, Callable[[Any], Any]] = {
    "tile_size": parse_tile_size,
    "tile_overlap": parse_tile_overlap,
    "tile_batch": parse_tile_batch,
}
_METAVARS = {"tile_size": "PX|auto|off", "tile_overlap": "PX", "tile_batch": "N|auto"}


def _option_type(name: str, parse: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a knob's parser: its FlowliftError becomes argparse's one usage line (exit 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except FlowliftError as error:
            raise argparse.ArgumentTypeError(error.worded(labels(TILE_KNOBS))) from None

    convert.__name__ = name  # argparse names the type in "invalid <name> value"
    return convert


def add_tile_arguments(parser: argparse.ArgumentParser) -> None:
    """The tiling knobs, one option each, as an argument group."""
    group = parser.add_argument_group("tiled refine (frames above FLUX.2's 4 MP)")
    for knob in TILE_KNOBS:
        add_knob(
            group,
            knob,
            type=_option_type(knob.name, _PARSERS[knob.name]),
            metavar=_METAVARS[knob.name],
            help=f"{knob.help}; {knob.describe()} (default {knob.default})",
        )

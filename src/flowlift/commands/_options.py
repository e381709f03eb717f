"""argparse value types shared by the subcommands (not a subcommand: the leading underscore hides it)."""

from __future__ import annotations

import argparse
import math


def finite_float(text: str) -> float:
    """A float option that refuses ``nan``, ``inf`` and ``-inf`` (``float()`` accepts all three)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value

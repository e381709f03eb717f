"""Helpers the door tests share (command lines, subprocess runs, file kinds at a name): each one builds or does
one thing the tests would otherwise spell out again."""

from __future__ import annotations

from pathlib import Path


def cpu_upscale_options(shared: Path, weights: Path) -> list[str]:
    """``flowlift upscale``'s options for a run on the CPU with the upscaler at ``weights`` and the shared TAEF2."""
    return ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]

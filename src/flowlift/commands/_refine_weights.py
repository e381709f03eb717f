"""``--transformer``, ``--lora``, ``--offload`` and ``--max-memory`` of ``img2img`` and ``hires``: the transformer
files users have, their LoRAs, and fitting the refine pass in the device memory they have.

Not a subcommand (the leading underscore keeps :mod:`flowlift.commands.cli` from listing it). What they name is
checked before any weights load by :func:`flowlift.refine.source_checks.check_refiner_source`: files exist and are what
they claim (headers only), the extras they need are installed, the budget parses.
"""

from __future__ import annotations

import argparse

from flowlift.commands._options import name_or_path
from flowlift.refine.settings import OFFLOADS


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this module, as one argument group."""
    group = parser.add_argument_group("transformer files, LoRAs and memory")
    group.add_argument(
        "--transformer",
        type=name_or_path,
        metavar="FILE|PATH|REPO",
        help="the transformer from elsewhere, as users have it: a BFL/ComfyUI single .safetensors (bf16/fp16/fp32, "
        "fp8 e4m3fn plain or scaled), a .gguf (city96 layout; flowlift[gguf]), a folder or a hub id; the VAE "
        "and the text encoder still come from --model",
    )
    group.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:SCALE]",
        help="a LoRA .safetensors at SCALE (default 1), repeatable; diffusers, kohya and ComfyUI key formats "
        "(flowlift[lora]). Active in every pass (hires: the base and the refine pass)",
    )
    group.add_argument(
        "--offload",
        choices=OFFLOADS,
        default="auto",
        help="where the transformer waits: none (on the device), model (in host memory outside the sampling "
        "loops), group (streamed block by block); auto: planned from --max-memory, else none (default auto)",
    )
    group.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="device memory budget, e.g. 12GB or 11.5GiB: picks --offload (auto) and the VAE's tiling, and gives "
        "the hires upscaler what the transformer leaves (default: no plan)",
    )

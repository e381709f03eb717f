"""``--transformer``, ``--lora``, ``--offload`` and ``--max-memory`` of ``img2img`` and ``hires``: the transformer
files users have, their LoRAs, and fitting the refine pass in the device memory they have.

Not a subcommand (the leading underscore keeps :mod:`flowlift.commands.cli` from listing it). Everything here is
checked before any weights load: files exist and are what they claim (headers only), the extras they need are
installed, the budget parses.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

from flowlift.errors import FlowliftError

#: Mirrors flowlift.refine.offload.OFFLOAD_MODES plus "auto" (kept literal so --help does not import torch).
OFFLOAD_CHOICES = ("auto", "none", "model", "group")


def add_weights_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of this module, as one argument group."""
    group = parser.add_argument_group("transformer files, LoRAs and memory")
    group.add_argument(
        "--transformer",
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
        choices=OFFLOAD_CHOICES,
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


def lora_specs(args: argparse.Namespace) -> list[tuple[str, float]]:
    from flowlift.refine.loras import parse_lora_spec

    return [parse_lora_spec(text) for text in args.lora]


def check_weights_arguments(args: argparse.Namespace) -> None:
    """Everything these options name, checked before any weights load (one FlowliftError line)."""
    from flowlift.models.hub import looks_like_path

    if args.transformer is not None:
        path = Path(args.transformer).expanduser()
        if path.is_file():
            from flowlift.models.flux2_transformer_files import inspect_transformer_file

            info = inspect_transformer_file(path, option="--transformer")  # headers only: what it is
            if info.container == "gguf" and importlib.util.find_spec("accelerate") is None:
                raise FlowliftError(f"--transformer {path}: GGUF needs the gguf extra (pip install 'flowlift[gguf]')")
        elif not path.exists() and looks_like_path(args.transformer):
            raise FlowliftError(f"--transformer {args.transformer}: no such file or folder")
    for path, _ in lora_specs(args):
        if not Path(path).is_file():
            raise FlowliftError(f"--lora {path}: no such file")
        if Path(path).suffix.lower() != ".safetensors":
            raise FlowliftError(f"--lora {path}: LoRAs are read from .safetensors only")
    if args.lora and (importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None):
        raise FlowliftError(
            "--lora needs peft (pip install 'flowlift[lora]', from a checkout pip install -e '.[lora]')"
        )
    if args.offload == "group" and importlib.util.find_spec("accelerate") is None:
        raise FlowliftError("--offload group needs accelerate (pip install 'flowlift[offload]')")
    if args.max_memory is not None:
        from flowlift.upscale.memory_plan import parse_memory

        try:
            parse_memory(args.max_memory)
        except FlowliftError as error:
            raise FlowliftError(f"--max-memory: {error}") from None


def weights_kwargs(args: argparse.Namespace, image_size: tuple[int, int], text_tokens: int | None) -> dict[str, Any]:
    """The :func:`flowlift.refine.loading.load_refiner` arguments of these options; ``image_size`` (height, width)
    is the largest image the refine pass decodes (what the memory plan is made for)."""
    return {
        "transformer": args.transformer,
        "loras": lora_specs(args),
        "offload": args.offload,
        "max_memory": args.max_memory,
        "image_size": image_size,
        "text_tokens": text_tokens,
    }

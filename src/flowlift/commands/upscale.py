"""``flowlift upscale``: images in, 2x/4x/8x images out (Flow Upscaler + two-stage colour fix).

``--scale`` takes any factor in [1, 8] and ``--long-side N`` / ``--size WxH`` name the output size: the fewest
2x passes that reach it, then an antialiased resample to exactly that size, stage 2 against the input at it.
Inputs are files, folders (their images, not recursive) or glob patterns. Each output is written
atomically (temporary file + rename) as ``OUT/<stem>_x<scale>.<format>`` (``_x3``, ``_x1.5``; ``_<W>x<H>`` for
a size; next to the input without ``-o``); existing outputs are skipped unless ``--overwrite``, so an
interrupted batch resumes where it stopped, and an output path that is one of the inputs is refused. A bad
input prints one line and the batch goes on; the exit status is 1 when any image failed.
"""

from __future__ import annotations

import argparse

from flowlift.commands._options import (
    DEFAULT_SCALE,
    DEFAULT_VAE,
    add_device_options,
    add_image_format_options,
    add_image_output_option,
    add_knob,
    add_upscaler_option,
    add_vae_option,
    examples,
    positive_int,
    resolve_device_dtype,
)
from flowlift.console import show_progress
from flowlift.errors import FlowliftError
from flowlift.knobs import LATENT_UPSCALER, SEED
from flowlift.limits import passes_for_scale
from flowlift.upscale.settings import COLOR_FIX_STRENGTH, RESIZE_MODE, SCALE, TRANSPLANT_STRENGTH

NAME = "upscale"
HELP = "upscale images 2x/4x/8x (or any factor up to 8x, or a size) with the Flow Upscaler, colour drift corrected"
EXAMPLES = examples(
    "flowlift upscale photo.png --scale 4                       # -> photo_x4.png next to it",
    'flowlift upscale photos/ "more/*.jpg" -o out/ --vae taef2   # a batch; rerun to resume',
    "flowlift upscale photo.png --long-side 3840 -o big.jpg     # 3840 px long side; ICC profile and EXIF kept",
)


def size_value(text: str) -> tuple[int, int]:
    """``--size WxH``: (width, height) in pixels (:func:`flowlift.upscale.asked_size.parse_size`)."""
    from flowlift.upscale.asked_size import parse_size

    try:
        return parse_size(text)
    except FlowliftError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("size ")) from None


def settings_from_args(args: argparse.Namespace):
    """The :class:`~flowlift.upscale.outputs.UpscaleSettings` that this command's options ask for."""
    from flowlift.upscale.outputs import UpscaleSettings

    return UpscaleSettings(
        seed=args.seed,
        color_fix=not args.no_color_fix,
        transplant_strength=args.transplant_strength,
        color_fix_strength=args.color_fix_strength,
        resize_mode=args.resize_mode,
        vae=args.vae,
        upscaler=args.upscaler,
        quality=args.quality,
        latent_upscaler=args.latent_upscaler,
    )


#: The most 2x passes one run asks for: those of the largest --scale.
MAX_PASSES = passes_for_scale(SCALE.high)


def _passes(text: str) -> int:
    """``--passes N``: a positive integer up to :data:`MAX_PASSES` (more would ask past the largest scale)."""
    passes = positive_int(text)
    if passes > MAX_PASSES:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PASSES} (scale {2**MAX_PASSES}), got {text}")
    return passes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="image files, folders or glob patterns")
    add_image_output_option(parser, "each input")
    scale = parser.add_mutually_exclusive_group()
    # --scale's default is applied in run(): a default here would hide "--scale 2 --passes 3" from the group
    add_knob(scale, SCALE, default=None, help=f"{SCALE.help} (default {DEFAULT_SCALE})")
    scale.add_argument(
        "--passes", type=_passes, metavar="N", help=f"number of 2x passes (scale 2**N), at most {MAX_PASSES}"
    )
    scale.add_argument(
        "--long-side",
        type=positive_int,
        metavar="N",
        help="output long side in px, resampled after the passes (default: --scale 2)",
    )
    scale.add_argument(
        "--size",
        type=size_value,
        metavar="WxH",
        help="output size in px, e.g. 3840x2560, resampled likewise, stretched where its aspect is not the "
        "input's (default: --scale 2)",
    )
    add_knob(parser, SEED, metavar="SEED")
    parser.add_argument("--no-color-fix", action="store_true", help="switch both colour-drift stages off")
    add_knob(parser, TRANSPLANT_STRENGTH)
    add_knob(parser, COLOR_FIX_STRENGTH)
    add_vae_option(parser, default=DEFAULT_VAE)
    add_upscaler_option(parser)
    add_knob(
        parser,
        LATENT_UPSCALER,
        metavar="sesqui:PATH",
        help=f"{LATENT_UPSCALER.help}, instead of the pixel resample; 2, 4, 8 do not run it (default: none)",
    )
    add_device_options(parser, cpu_bf16=True)
    add_image_format_options(parser)
    add_knob(parser, RESIZE_MODE)
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs instead of skipping")
    parser.add_argument(
        "--chunked",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force (or with --no-chunked forbid) the UNet's bounded-memory strip execution (default: by size)",
    )
    parser.add_argument(
        "--vae-tiling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force or forbid VAE tiling (default: by size)",
    )
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="device memory budget for the whole upscale, e.g. 6GB or 5.5GiB: VAE encode, UNet, SesquiLSR, VAE "
        "decode and colour fix run plain, chunked, banded, tiled or offloaded to fit; --chunked and --vae-tiling "
        "given explicitly are checked against it (default: by size and free memory)",
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the UNet (one compile per image size; CUDA graphs)"
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="upscale up to N same-size inputs at once (each gets the noise it gets alone; default 1)",
    )
    from flowlift.jobs.distributed import add_barrier_timeout_argument

    add_barrier_timeout_argument(parser)


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.upscale.plan.UpscaleRequest`, planned and run by
    :func:`flowlift.upscale.plan.run_upscale`."""
    from flowlift.files.image_outputs import output_format
    from flowlift.upscale.plan import UpscaleRequest, run_upscale

    if not args.inputs:
        raise FlowliftError("give INPUT images")
    device, dtype = resolve_device_dtype(args.device, args.dtype, cpu_bf16=True)  # bad --device: one line, first
    settings = settings_from_args(args)
    scale = None if args.passes is not None or args.long_side or args.size else args.scale or DEFAULT_SCALE
    request = UpscaleRequest(
        inputs=args.inputs,
        output=args.output,
        passes=args.passes,
        scale=scale,
        long_side=args.long_side,
        size=args.size,
        output_format=output_format(args.output, args.format),
        settings=settings,
        overwrite=args.overwrite,
        batch_size=args.batch_size,
        device=device,
        dtype=dtype,
        chunked=args.chunked,
        vae_tiled=args.vae_tiling,
        max_memory=args.max_memory,
        compile=args.compile,
        barrier_timeout=args.barrier_timeout,
        progress=show_progress(args),
    )
    return run_upscale(request)

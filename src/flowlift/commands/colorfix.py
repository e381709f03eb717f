"""``flowlift colorfix``: stage 2 of the colour fix for images made by any upscaler.

    flowlift colorfix UPSCALED... --reference SOURCES [-o OUT] [--color-fix-strength S]

Each upscaled image is paired with the source image it was made from by name (the same stem, or
``<stem>_x<N>`` for ``<stem>``, as ``flowlift eval`` pairs them; one folder may hold both sides, and
one file given with one ``--reference`` file is a pair whatever their names); the scale is inferred
from the two sizes and must be one integer on both axes. The output, ``<stem>_colorfix.<format>``
(in ``-o`` or next to the upscaled image; ``flowlift eval`` pairs it with the source too), has the
source's colour and tone below the source's resolution and the
upscaled image's detail above it (:func:`flowlift.upscale.colorfix_image.color_fix_image`). Batches behave as
in ``flowlift upscale`` (:mod:`flowlift.upscale.colorfix_job` on :mod:`flowlift.jobs.batch`): atomic
writes, existing outputs skipped unless
``--overwrite``, one line per failed image and exit status 1, metadata (PNG text, JPEG/WebP EXIF),
the upscaled image's ICC profile and EXIF kept.
"""

from __future__ import annotations

import argparse

from flowlift.commands._options import add_image_format_options, add_image_output_option, add_knob
from flowlift.upscale.settings import COLOR_FIX_STRENGTH

NAME = "colorfix"
HELP = "fix the colour drift of images from any upscaler against their sources (flowlift's stage 2)"

EXAMPLES = (
    "examples:\n"
    "  flowlift colorfix esrgan-out/ --reference photos/ -o fixed/    # photo_x4.png pairs with photos/photo.png\n"
    "  flowlift colorfix big.png --reference small.png --color-fix-strength 0.5  # one file and its source: any names\n"
    "  flowlift eval fixed/ --reference photos/ -o report/         # photo_x4_colorfix.png pairs with photo.png"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="UPSCALED", help="upscaled image files, folders or glob patterns")
    parser.add_argument(
        "--reference",
        required=True,
        action="append",
        metavar="SOURCES",
        help="the images they were upscaled from (files or folders), paired by name: <stem> or <stem>_x<N> with <stem>",
    )
    add_image_output_option(parser, "each upscaled image")
    add_knob(parser, COLOR_FIX_STRENGTH, metavar="S")
    add_image_format_options(parser)
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs instead of skipping")
    parser.add_argument(
        "--device", default="auto", help="torch device: auto (CUDA when available, else cpu), cpu, cuda, cuda:N, mps"
    )


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.upscale.colorfix_job.ColorFixRequest`, planned and run by
    :func:`flowlift.upscale.colorfix_job.run_colorfix`."""
    from flowlift.devices import resolve_device_option
    from flowlift.files.image_outputs import output_format
    from flowlift.upscale.colorfix_job import ColorFixRequest, run_colorfix

    device = resolve_device_option(args.device)  # a bad or absent device is one line, before any image is read
    request = ColorFixRequest(
        inputs=args.inputs,
        references=args.reference,
        output=args.output,
        strength=args.color_fix_strength,
        output_format=output_format(args.output, args.format),
        quality=args.quality,
        overwrite=args.overwrite,
        device=device,
    )
    return run_colorfix(request)

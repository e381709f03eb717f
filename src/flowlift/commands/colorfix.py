"""``flowlift colorfix``: stage 2 of the colour fix for images made by any upscaler.

    flowlift colorfix UPSCALED... --reference SOURCES [-o OUT] [--strength S]

Each upscaled image is paired with the source image it was made from by name (the same stem, or
``<stem>_x<N>`` for ``<stem>``, as ``flowlift eval`` pairs them); the scale is inferred from the two
sizes and must be one integer on both axes. The output, ``<stem>_colorfix.<format>`` (in ``-o`` or
next to the upscaled image), has the source's colour and tone below the source's resolution and the
upscaled image's detail above it (:func:`flowlift.upscale.colorfix_image.color_fix_image`). Batches behave as
in ``flowlift upscale`` (:mod:`flowlift.jobs.batch`): atomic writes, existing outputs skipped unless
``--overwrite``, one line per failed image and exit status 1, metadata (PNG text, JPEG/WebP EXIF),
the upscaled image's ICC profile and EXIF kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowlift.commands._options import OUTPUT_FORMATS, quality, unit_interval

NAME = "colorfix"
HELP = "fix the colour drift of images from any upscaler against their sources (flowlift's stage 2)"

EXAMPLES = (
    "examples:\n"
    "  flowlift colorfix esrgan-out/ --reference photos/ -o fixed/    # photo_x4.png pairs with photos/photo.png\n"
    "  flowlift colorfix photo_x4.png --reference photo.png --strength 0.5  # half the colour/tone difference"
)







def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="UPSCALED", help="upscaled image files, folders or glob patterns")
    parser.add_argument("--reference", required=True, action="append", metavar="SOURCES",
                        help="the images they were upscaled from (files or folders), paired by name: "
                        "<stem> or <stem>_x<N> with <stem>")  # fmt: skip
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="output folder (default: next to each upscaled image); for one input, a file name")
    parser.add_argument("--strength", type=unit_interval, default=1.0, metavar="S",
                        help="0..1: share of the colour/tone difference removed (default 1: all of it)")
    parser.add_argument("--format", choices=OUTPUT_FORMATS, default=None,
                        help="output format (default: the suffix of -o FILE, else png); ICC profile and EXIF kept")
    parser.add_argument("--quality", type=quality, default=None, metavar="Q",
                        help="JPEG/WebP quality 1-100 (default 95; WebP at 100 is lossless)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs instead of skipping")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")  # fmt: skip


def _metadata(args: argparse.Namespace, source: Path, reference: Path, scale: int) -> dict[str, object]:
    from flowlift import __version__
    from flowlift.files.image_outputs import file_sha256

    return {
        "Software": f"flowlift {__version__} colorfix",
        "flowlift.parameters": {"color_fix_strength": args.strength, "scale": scale},
        "flowlift.source": {"name": source.name, "sha256": file_sha256(source)},
        "flowlift.reference": {"name": reference.name, "sha256": file_sha256(reference)},
    }


def run(args: argparse.Namespace) -> int:
    from flowlift.commands.upscale import output_format
    from flowlift.devices import resolve_device_option
    from flowlift.errors import FlowliftError
    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.images import IMAGE_SUFFIXES, list_images, load_image
    from flowlift.files.naming import index_by_stem, reference_stem
    from flowlift.jobs.batch import Job, plan_jobs, run_jobs
    from flowlift.upscale.colorfix_image import color_fix_image, integer_scale

    device = resolve_device_option(args.device)  # a bad or absent device is one line, before any image is read
    inputs = list_images(args.inputs)
    if not inputs:
        raise FlowliftError("no input images found")
    references = index_by_stem(list_images(args.reference), "reference")
    fmt = output_format(args.output, args.format)
    # sources kept beside their upscales (a.png next to a_x4.png, both given) are references, not inputs;
    # planning without them also keeps batch's "<stem>_x<N> beside <stem> is an old output" guard off a_x4.png
    reference_files = {p.resolve() for p in references.values()}
    jobs = [Job(p, None, "skipped, it is a reference") for p in inputs if p.resolve() in reference_files]
    upscaled = [p for p in inputs if p.resolve() not in reference_files]
    jobs += plan_jobs(upscaled, args.output, lambda path: f"{path.stem}_colorfix.{fmt}", IMAGE_SUFFIXES)

    def fix_one(path: Path, out: Path) -> None:
        stem = reference_stem(path.stem, references)
        if stem is None:
            raise FlowliftError(f"no reference named {path.stem} or (for <stem>_x<N>) <stem> among --reference")
        image, alpha = load_image(path)
        source, _ = load_image(references[stem])
        scale = integer_scale(image.size, source.size)
        if alpha is not None:
            image.putalpha(alpha)
        result = color_fix_image(image, source, args.strength, device=device)
        save_image_atomic(
            result,
            out,
            _metadata(args, path, references[stem], scale),
            source=path,  # the upscaled image's ICC profile and EXIF
            quality=args.quality,
        )

    return run_jobs(jobs, fix_one, command=NAME, overwrite=args.overwrite).exit_code

"""``flowlift colorfix``: stage 2 of the colour fix for images made by any upscaler.

    flowlift colorfix UPSCALED... --reference SOURCES [-o OUT] [--strength S]

Each upscaled image is paired with the source image it was made from by name (the same stem, or
``<stem>_x<N>`` for ``<stem>``, as ``flowlift eval`` pairs them; one folder may hold both sides, and
one file given with one ``--reference`` file is a pair whatever their names); the scale is inferred
from the two sizes and must be one integer on both axes. The output, ``<stem>_colorfix.<format>``
(in ``-o`` or next to the upscaled image; ``flowlift eval`` pairs it with the source too), has the
source's colour and tone below the source's resolution and the
upscaled image's detail above it (:func:`flowlift.upscale.colorfix_image.color_fix_image`). Batches behave as
in ``flowlift upscale`` (:mod:`flowlift.jobs.batch`): atomic writes, existing outputs skipped unless
``--overwrite``, one line per failed image and exit status 1, metadata (PNG text, JPEG/WebP EXIF),
the upscaled image's ICC profile and EXIF kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flowlift.commands._options import OUTPUT_FORMATS, add_knob, quality
from flowlift.errors import FlowliftError
from flowlift.upscale.settings import COLOR_FIX_KNOBS

NAME = "colorfix"
HELP = "fix the colour drift of images from any upscaler against their sources (flowlift's stage 2)"

EXAMPLES = (
    "examples:\n"
    "  flowlift colorfix esrgan-out/ --reference photos/ -o fixed/    # photo_x4.png pairs with photos/photo.png\n"
    "  flowlift colorfix big.png --reference small.png --strength 0.5  # one file and its source: any names\n"
    "  flowlift eval fixed/ --reference photos/ --out report/         # photo_x4_colorfix.png pairs with photo.png"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="UPSCALED", help="upscaled image files, folders or glob patterns")
    parser.add_argument("--reference", required=True, action="append", metavar="SOURCES",
                        help="the images they were upscaled from (files or folders), paired by name: "
                        "<stem> or <stem>_x<N> with <stem>")  # fmt: skip
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="output folder (default: next to each upscaled image); for one input, a file name")
    add_knob(parser, COLOR_FIX_KNOBS["strength"], metavar="S")
    parser.add_argument("--format", choices=OUTPUT_FORMATS, default=None,
                        help="output format (default: the suffix of -o FILE, else png); ICC profile and EXIF kept")
    parser.add_argument("--quality", type=quality, default=None, metavar="Q",
                        help="JPEG/WebP quality 1-100 (default 95; WebP at 100 is lossless)")  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs instead of skipping")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")  # fmt: skip


def _metadata(args: argparse.Namespace, source: Path, reference: Path, scale: int) -> dict[str, object]:
    from flowlift.files.image_outputs import file_sha256
    from flowlift.version import __version__

    return {
        "Software": f"flowlift {__version__} colorfix",
        "flowlift.parameters": {"color_fix_strength": args.strength, "scale": scale},
        "flowlift.source": {"name": source.name, "sha256": file_sha256(source)},
        "flowlift.reference": {"name": reference.name, "sha256": file_sha256(reference)},
    }


def plan(args: argparse.Namespace, fmt: str) -> tuple[list, dict[Path, Path]]:
    """The jobs (:func:`flowlift.jobs.batch.plan_jobs`) and each upscaled input's reference.

    Inputs pair with references by name (:func:`flowlift.files.naming.reference_of`), never with
    themselves, so ``DIR --reference DIR`` fixes ``photo_x2.png`` against ``photo.png``; an input
    that pairs with nothing is skipped when it is itself a reference (a source given with its
    upscales), else refused in one line.
    """
    from flowlift.files.images import IMAGE_SUFFIXES, image_size, list_images
    from flowlift.files.naming import colorfix_name, explicit_pair, index_by_stem, reference_of
    from flowlift.files.output_paths import check_not_an_input
    from flowlift.jobs.batch import Job, plan_jobs

    pair = explicit_pair(args.inputs, args.reference)
    inputs = list_images(args.inputs)
    if not inputs:
        raise FlowliftError("no input images found")
    if pair is not None:
        paired = {inputs[0]: pair[1]}
        reference_files: set[Path] = set()
    else:
        references = index_by_stem(list_images(args.reference), "reference")
        paired = {p: ref for p in inputs if (ref := reference_of(p, references)) is not None}
        reference_files = {p.resolve() for p in references.values()}
    jobs = []
    for p in inputs:
        if p in paired:
            continue
        if p.resolve() in reference_files:
            jobs.append(Job.skip(p, "skipped, it is a reference"))
        else:
            jobs.append(Job.refusal(p, f"no reference named {p.stem} or (for <stem>_x<N>) <stem> among --reference"))
    upscaled = [p for p in inputs if p in paired]
    jobs += plan_jobs(upscaled, args.output, lambda path: colorfix_name(path.stem, fmt), IMAGE_SUFFIXES,
                      expected_size=image_size,
                      check_output=lambda path, out: check_not_an_input(out, {"reference": paired[path]}))  # fmt: skip
    return jobs, paired


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from flowlift.devices import resolve_device_option
    from flowlift.files.image_outputs import output_format, save_image_atomic
    from flowlift.files.images import load_image
    from flowlift.files.sixteen_bit import (
        has_16bit_samples,
        load_image_16bit,
        save_image16_atomic,
        sixteen_bit_source,
    )
    from flowlift.jobs.batch import run_jobs
    from flowlift.upscale.colorfix_image import color_fix_array, color_fix_image, integer_scale

    device = resolve_device_option(args.device)  # a bad or absent device is one line, before any image is read
    fmt = output_format(args.output, args.format)
    jobs, paired = plan(args, fmt)

    def fix_one(path: Path, out: Path) -> None:
        reference = paired[path]
        image, alpha = load_image(path)
        source, _ = load_image(reference)
        scale = integer_scale(image.size, source.size)
        metadata = _metadata(args, path, reference, scale)
        deep = sixteen_bit_source(path, out)
        if deep is not None:  # 16 bits in, 16 bits out: the fix runs on the samples themselves
            ref16 = load_image_16bit(reference) if has_16bit_samples(reference) else None
            ref = ref16[0] if ref16 is not None else np.asarray(source)
            fixed = color_fix_array(deep[0], ref, args.strength, device=device)
            save_image16_atomic(fixed, deep[1] if alpha is not None else None, out, metadata, source=path)
            return
        if alpha is not None:
            image.putalpha(alpha)
        result = color_fix_image(image, source, args.strength, device=device)
        save_image_atomic(result, out, metadata, source=path, quality=args.quality)  # path's ICC profile, EXIF

    return run_jobs(jobs, fix_one, command=NAME, overwrite=args.overwrite).exit_code

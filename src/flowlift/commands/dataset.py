"""``flowlift dataset``: build sharded training data for the Flow Upscaler.

* ``flowlift dataset distill``: a FLUX.2 teacher turns stored noise into target latents (flow
  distillation pairs: noise, target, conditioning).
* ``flowlift dataset images``: targets are VAE encodings of random crops of real photos.

Both are resumable (run the same command again) and show progress bars.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flowlift.commands._options import (
    HelpFormatter,
    add_output_option,
    add_vae_option,
    examples,
    finite_float,
    name_or_path,
    positive_int,
    quality,
    resolve_device_dtype,
    seed_value,
)
from flowlift.console import add_console_options, show_progress
from flowlift.training.dataset_settings import STORAGE_DTYPE, TEACHER_DTYPE

NAME = "dataset"
NESTED_COMMANDS = True
HELP = "build training shards: teacher distillation pairs or encoded photo crops"
EXAMPLES = examples(
    "flowlift dataset images photos/ --crop-px 512 --crops-per-image 8 --vae taef2 -o data/photos",
    "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B --prompts prompts.txt --num 20000 "
    "--vae flux2 -o data/distill",
)


def _common(parser: argparse.ArgumentParser) -> None:
    add_output_option(parser, "dataset folder (created; an existing one is resumed)", required=True)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files at the dataset's names (dataset.json, shard-*.safetensors) that "
        "flowlift did not write (without it, only flowlift's own and empty files are replaced)",
    )
    add_vae_option(parser, "decodes the targets and encodes the degraded conditions", required=True)
    parser.add_argument("--seed", type=seed_value, default=0, help="seed of crops, flips and stored noise")
    parser.add_argument("--shard-size", type=positive_int, default=256, help="items per shard file (default 256)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="items processed together (default 4)")
    parser.add_argument(
        "--storage-dtype", choices=STORAGE_DTYPE.choices, default=STORAGE_DTYPE.default, help=STORAGE_DTYPE.help
    )
    parser.add_argument("--device", default="auto", help="auto (default: CUDA if available, else cpu), cpu, cuda, ...")
    parser.add_argument(
        "--filter",
        default="area",
        choices=("area", "bicubic", "bilinear", "lanczos"),
        help="antialiased 2x pixel-space downscale for the conditioning (default area)",
    )
    parser.add_argument("--jpeg-quality", type=quality, help="also JPEG-compress the downscaled image (1-100)")
    parser.add_argument(
        "--noise-std", type=finite_float, default=0.0, help="also add Gaussian pixel noise (0..1 units)"
    )
    parser.add_argument(
        "--part",
        default="0/1",
        metavar="I/N",
        help="build only shards k with k %% N == I (run N processes or machines on one --output)",
    )
    add_console_options(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="dataset_kind", metavar="KIND", required=True)
    distill = sub.add_parser(
        "distill",
        help="teacher-generated distillation pairs",
        description="generate target latents with a FLUX.2 teacher from stored noise",
        formatter_class=HelpFormatter,
        epilog=examples(
            "flowlift dataset distill --teacher black-forest-labs/FLUX.2-klein-4B "
            "--prompts prompts.txt --num 20000 --vae flux2 -o data/distill"
        ),
    )
    _common(distill)
    distill.add_argument(
        "--teacher",
        type=name_or_path,
        required=True,
        help="a FLUX.2 diffusers pipeline (folder or hub id) or a Flux2Transformer2DModel folder",
    )
    distill.add_argument("--prompts", help="text file, one prompt per line (pipeline teachers); item i uses line i")
    distill.add_argument("--prompt-embeds", help="safetensors file with 'prompt_embeds' (L, D) (transformer teachers)")
    distill.add_argument("--num", type=positive_int, required=True, help="number of items")
    distill.add_argument(
        "--width", type=positive_int, default=1024, help="target image width in pixels (multiple of 32)"
    )
    distill.add_argument(
        "--height", type=positive_int, default=1024, help="target image height in pixels (multiple of 32)"
    )
    distill.add_argument("--steps", type=positive_int, default=4, help="teacher sampling steps (default 4)")
    distill.add_argument("--guidance", type=finite_float, help="teacher guidance scale")
    distill.add_argument(
        "--teacher-dtype",
        choices=TEACHER_DTYPE.choices,
        default=TEACHER_DTYPE.default,
        help=TEACHER_DTYPE.help,
    )
    images = sub.add_parser(
        "images",
        help="encoded crops of real photos",
        description="encode random crops (and flips) of photos; noise is drawn at train time",
        formatter_class=HelpFormatter,
        epilog=examples("flowlift dataset images photos/ --crop-px 512 --crops-per-image 8 --vae taef2 -o data/photos"),
    )
    _common(images)
    images.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or glob patterns")
    images.add_argument(
        "--crop-px", type=positive_int, default=512, help="crop side in image pixels (multiple of 32; default 512)"
    )
    images.add_argument("--crops-per-image", type=positive_int, default=4, help="random crops taken from each photo")
    images.add_argument("--no-flip", action="store_true", help="no random horizontal flips")


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.training.dataset_jobs.DatasetRequest`, built by
    :func:`flowlift.training.dataset_jobs.run_dataset`; one line printed."""
    from flowlift.errors import FlowliftError
    from flowlift.training.dataset_jobs import DatasetRequest, PhotoCrops, TeacherSource, run_dataset

    device = resolve_device_dtype(args.device, "auto")[0]
    try:
        part = tuple(int(x) for x in args.part.split("/"))
    except ValueError:
        part = ()
    if len(part) != 2:
        raise FlowliftError(f"--part must look like I/N (e.g. 0/4), got {args.part!r}")
    if args.dataset_kind == "distill":
        source = dict(
            teacher=TeacherSource(
                args.teacher,
                args.num,
                prompts=args.prompts,
                prompt_embeds=args.prompt_embeds,
                width=args.width,
                height=args.height,
                steps=args.steps,
                guidance=args.guidance,
                teacher_dtype=args.teacher_dtype,
            )
        )
    else:
        source = dict(crops=PhotoCrops(args.inputs, args.crop_px, args.crops_per_image, flip=not args.no_flip))
    request = DatasetRequest(
        args.output,
        args.vae,
        **source,
        overwrite=args.overwrite,
        seed=args.seed,
        shard_size=args.shard_size,
        batch_size=args.batch_size,
        storage_dtype=args.storage_dtype,
        device=device,
        filter=args.filter,
        jpeg_quality=args.jpeg_quality,
        noise_std=args.noise_std,
        part=part,
        progress=show_progress(args),
    )
    manifest = run_dataset(request)
    print(
        f"{args.dataset_kind} dataset: {manifest['num_items']} items of {manifest['target_shape']} in "
        f"{os.fspath(Path(args.output))}"
    )
    return 0

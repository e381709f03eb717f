"""``flowlift upscale``: images in, 2x/4x/8x images out (Flow Upscaler + two-stage colour fix).

Inputs are files, folders (their images, not recursive) or glob patterns. Each output is written
atomically (temporary file + rename) as ``OUT/<stem>_x<scale>.<format>`` (next to the input without
``-o``); existing outputs are skipped unless ``--overwrite``, so an interrupted batch resumes where
it stopped, and an output path that is one of the inputs is refused. A bad input prints one line and
the batch goes on; the exit status is 1 when any image failed.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

from flowlift.commands._options import (
    DEFAULT_SCALE,
    DEFAULT_VAE,
    OUTPUT_FORMATS,
    add_device_options,
    examples,
    positive_int,
    quality,
    resolve_device_dtype,
    seed_value,
    unit_interval,
)
from flowlift.console import show_progress

NAME = "upscale"
HELP = "upscale images 2x/4x/8x with the Flow Upscaler, colour drift corrected"
EXAMPLES = examples(
    "flowlift upscale photo.png --scale 4                       # -> photo_x4.png next to it",
    'flowlift upscale photos/ "more/*.jpg" -o out/ --vae taef2   # a batch; rerun to resume',
    "flowlift upscale photo.png -o big.jpg --quality 90         # format from -o, ICC profile and EXIF kept",
)


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
    )


def output_format(output: str | None, requested: str | None) -> str:
    """The output format: ``--format``, or the suffix of ``-o FILE``; both given and different is an error."""
    from flowlift.errors import FlowliftError
    from flowlift.files.image_outputs import check_output_format
    from flowlift.files.images import IMAGE_SUFFIXES

    suffix = Path(output).suffix.lower() if output else ""
    if output and suffix in IMAGE_SUFFIXES and not Path(output).expanduser().is_dir():
        named = check_output_format(output)
        if requested is not None and requested != named:
            raise FlowliftError(
                f"-o {output} is a .{suffix.lstrip('.')} file name but --format {requested} was given; "
                "drop one, or give -o a folder"
            )
        return named
    return requested or "png"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="*", metavar="INPUT", help="image files, folders or glob patterns")
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output folder (default: next to each input); for a single input, a file name with an image suffix",
    )
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--scale", type=int, choices=(2, 4, 8), help=f"upscale factor (default {DEFAULT_SCALE})")
    scale.add_argument("--passes", type=positive_int, metavar="N", help="number of 2x passes (scale 2**N)")
    parser.add_argument("--seed", type=seed_value, default=0, help="noise seed (default 0)")
    parser.add_argument("--no-color-fix", action="store_true", help="switch both colour-drift stages off")
    parser.add_argument(
        "--transplant-strength",
        type=unit_interval,
        default=1.0,
        metavar="X",
        help="stage 1 latent low-band transplant, 0..1 (lower: truer to the input; 1: crisper; default 1)",
    )
    parser.add_argument(
        "--color-fix-strength",
        type=unit_interval,
        default=1.0,
        metavar="X",
        help="stage 2 pixel L*a*b* low-band transplant, 0..1 (default 1)",
    )
    parser.add_argument(
        "--vae",
        default=DEFAULT_VAE,
        metavar="flux2|taef2|PATH|REPO",
        help=f"VAE: flux2 (the full FLUX.2 VAE), taef2 (fast, approximate), a file/folder or hub id "
        f"(default {DEFAULT_VAE})",
    )
    parser.add_argument(
        "--upscaler",
        default=None,
        metavar="PATH|REPO",
        help="Flow Upscaler weights: file, folder or hub repo (default TensorForger/FlowUpscaler)",
    )
    add_device_options(parser, cpu_bf16=True)
    parser.add_argument(
        "--format",
        choices=OUTPUT_FORMATS,
        default=None,
        help="output format (default: the suffix of -o FILE, else png); ICC profile and EXIF are kept in all three",
    )
    parser.add_argument(
        "--quality",
        type=quality,
        default=None,
        metavar="Q",
        help="JPEG/WebP quality 1-100 (default 95; WebP at 100 is lossless)",
    )
    parser.add_argument(
        "--resize-mode",
        choices=("pad", "resample"),
        default="pad",
        help="how inputs reach multiples of 16: pad (default; exact 2^n x the input size back) or resample",
    )
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
        help="device memory budget for the whole upscale, e.g. 6GB or 5.5GiB: UNet, VAE decode and colour fix "
        "run plain, chunked, tiled or offloaded to fit (default: by size and free memory)",
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

    parser.add_argument("--status", metavar="OUT", help="print the state of the job in output folder OUT (its "
                        "torchrun manifest, else what the files there show: done, partial, broken, missing), "
                        "then exit")  # fmt: skip
    add_barrier_timeout_argument(parser)


def _check_output_option(output: str | None) -> None:
    """``-o x.gif``: a file name in a format flowlift does not write is a user error, before any work."""
    if not output:
        return
    from PIL import Image

    from flowlift.errors import FlowliftError
    from flowlift.files.images import IMAGE_SUFFIXES

    target = Path(output).expanduser()
    suffix = target.suffix.lower()
    if suffix and suffix not in IMAGE_SUFFIXES and suffix in Image.registered_extensions() and not target.is_dir():
        raise FlowliftError(
            f"-o {target}: unsupported output format {suffix}; use {', '.join('.' + f for f in OUTPUT_FORMATS)} "
            "or a folder"
        )


def _print_status(args: argparse.Namespace) -> int:
    """``--status OUT``: the manifest's account of the job, or without one (a plain run) the account
    the files in OUT give (:mod:`flowlift.jobs.folder_status`); exit 0 when it is complete, else 1."""
    from flowlift.errors import FlowliftError
    from flowlift.jobs.folder_status import folder_status, format_folder_status
    from flowlift.jobs.manifest import Manifest, format_status, job_status

    if args.inputs:
        raise FlowliftError("--status OUT reads the output folder; give no INPUT images with it")
    if not Manifest(args.status).exists():
        found = folder_status(args.status)
        print(format_folder_status(found))
        return 0 if found.complete else 1
    status = job_status(args.status)
    print(format_status(status))
    return 0 if status.complete else 1


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from flowlift.errors import FlowliftError
    from flowlift.files.images import IMAGE_SUFFIXES, list_images
    from flowlift.jobs.batch import Job, pending, plan_jobs, report
    from flowlift.jobs.distributed import DistEnv, rank_device
    from flowlift.jobs.scaleout import run_batch
    from flowlift.upscale.loading import DEFAULT_UPSCALER
    from flowlift.upscale.outputs import (
        OutputSizes,
        batched_process,
        check_format_limit,
        model_hashes,
        output_name,
        upscale_file,
    )
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.sizes import passes_for_scale

    if args.status is not None:
        return _print_status(args)
    if not args.inputs:
        raise FlowliftError("give INPUT images (or --status OUT)")
    resolve_device_dtype(args.device, args.dtype)  # a bad --device is one line, before any input is read
    passes = args.passes if args.passes is not None else passes_for_scale(args.scale or DEFAULT_SCALE)
    _check_output_option(args.output)
    fmt = output_format(args.output, args.format)
    problems: list[tuple[str, str]] = []
    inputs = list_images(args.inputs, problems)
    if not inputs and not problems:
        raise FlowliftError("no input images found")
    if not inputs and len(args.inputs) == 1 and not glob.has_magic(args.inputs[0]):
        item, message = problems[0]  # the one file asked for is not there: a user error (exit 2), not a batch
        raise FlowliftError(f"{item}: {message}")
    bars = show_progress(args)
    sizes = OutputSizes(passes, args.resize_mode)  # named by the scale the cap lets run, from the header
    jobs = [Job(Path(item), None, message) for item, message in problems] + plan_jobs(
        inputs,
        args.output,
        lambda path: output_name(path, sizes.scale(path), fmt),
        IMAGE_SUFFIXES,
        expected_size=sizes.output_size,
        check_output=lambda path, out: check_format_limit(out, sizes.output_size(path)),
    )
    env = DistEnv.from_environ()
    if env.is_main:  # the cap's note before any work (and once, not per rank), not after the image
        for job in pending(jobs, args.overwrite):
            note = sizes.dropped_note(job.source)
            if note:
                report(NAME, job.source, f"warning: {note}")
    settings = settings_from_args(args)
    pipeline = hashes = None

    def make_process():  # called only when there is work (on this rank): nothing to compute loads no model
        nonlocal pipeline, hashes
        device, dtype = resolve_device_dtype(args.device, args.dtype, cpu_bf16=True)  # bf16 on a native-bf16 CPU
        pipeline = FlowUpscalerPipeline(
            args.upscaler or DEFAULT_UPSCALER,
            args.vae,
            dtype=dtype,
            device=rank_device(str(device), env) if env.distributed else device,  # cuda:LOCAL_RANK
            chunked=args.chunked,
            vae_tiled=args.vae_tiling,
            max_memory=args.max_memory,
            compile=args.compile,
        )
        hashes = model_hashes(pipeline)
        if args.batch_size > 1 and env.distributed:
            note = "flowlift upscale: --batch-size is not applied under torchrun; images run one by one"
            print(note, file=sys.stderr)
        elif args.batch_size > 1:
            return batched_process(
                settings, pipeline, jobs, sizes.passes_for, hashes, batch_size=args.batch_size,
                overwrite=args.overwrite,
            )
        return upscale_one

    def upscale_one(path: Path, out: Path) -> None:
        count = sizes.passes_for(path)  # the passes the cap lets run, already said at planning
        steps = tqdm(total=count + 3, desc=path.name, unit="step", leave=False, disable=not bars, file=sys.stderr)
        with steps:
            _, _, notes = upscale_file(
                pipeline, settings, count, path, out, hashes, on_stage=lambda _stage, bar=steps: bar.update(1)
            )
        for note in notes:  # anything the pipeline warned about this image: one line, not a stack
            report(NAME, path, f"warning: {note}", write=lambda line: tqdm.write(line, file=sys.stderr))

    return run_batch(jobs, make_process, command=NAME, output=args.output, overwrite=args.overwrite,
                     barrier_timeout=args.barrier_timeout, env=env, progress=bars)  # fmt: skip

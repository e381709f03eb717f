"""``flowlift upscale``: images in, 2x/4x/8x images out (Flow Upscaler + two-stage colour fix).

Inputs are files, folders (their images, not recursive) or glob patterns. Each output is written
atomically (temporary file + rename) as ``OUT/<stem>_x<scale>.<format>`` (next to the input without
``-o``); existing outputs are skipped unless ``--overwrite``, so an interrupted batch resumes where
it stopped, and an output path that is one of the inputs is refused. A bad input prints one line and
the batch goes on; the exit status is 1 when any image failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

NAME = "upscale"
HELP = "upscale images 2x/4x/8x with the Flow Upscaler, colour drift corrected"

OUTPUT_FORMATS = ("png", "jpg", "webp")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or glob patterns")
    parser.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="output folder (default: next to each input); for a single input, a file name with an image suffix",
    )
    scale = parser.add_mutually_exclusive_group()
    scale.add_argument("--scale", type=int, choices=(2, 4, 8), help="upscale factor (default 2)")
    scale.add_argument("--passes", type=_positive_int, metavar="N", help="number of 2x passes (scale 2**N)")
    parser.add_argument("--seed", type=_seed, default=0, help="noise seed (default 0)")
    parser.add_argument("--no-color-fix", action="store_true", help="switch both colour-drift stages off")
    parser.add_argument(
        "--transplant-strength",
        type=_unit_interval,
        default=1.0,
        metavar="X",
        help="stage 1 latent low-band transplant, 0..1 (lower: truer to the input; 1: crisper; default 1)",
    )
    parser.add_argument(
        "--color-fix-strength",
        type=_unit_interval,
        default=1.0,
        metavar="X",
        help="stage 2 pixel L*a*b* low-band transplant, 0..1 (default 1)",
    )
    parser.add_argument("--vae", default="flux2", metavar="taef2|flux2|PATH", help="VAE (default flux2)")
    parser.add_argument(
        "--upscaler",
        default=None,
        metavar="PATH|REPO",
        help="Flow Upscaler weights: file, folder or hub repo (default TensorForger/FlowUpscaler)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--format", choices=OUTPUT_FORMATS, default="png", help="output format (default png)")
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


def _metadata(args: argparse.Namespace, passes: int, source: Path, hashes: dict[str, str]) -> dict[str, object]:
    from flowlift import __version__
    from flowlift.images import file_sha256

    return {
        "Software": f"flowlift {__version__} upscale",
        "flowlift.parameters": {
            "scale": 2**passes,
            "passes": passes,
            "seed": args.seed,
            "color_fix": not args.no_color_fix,
            "transplant_strength": args.transplant_strength,
            "color_fix_strength": args.color_fix_strength,
            "resize_mode": args.resize_mode,
            "vae": args.vae,
            "upscaler": args.upscaler or "TensorForger/FlowUpscaler",
            "dtype": args.dtype,
        },
        "flowlift.models": hashes,
        "flowlift.source": {"name": source.name, "sha256": file_sha256(source)},
    }


#: Largest side each output format can store (WebP's 14-bit dimensions; JPEG's 16-bit).
FORMAT_MAX_SIDE = {".webp": 16383, ".jpg": 65535, ".jpeg": 65535}


class _OutputSizes:
    """Per input, from its header only: the passes that will run (the cap may drop some), the scale
    the output is named by, and the (width, height) a complete output has."""

    def __init__(self, passes: int, resize_mode: str) -> None:
        self.passes = passes
        self.resize_mode = resize_mode
        self._cache: dict[Path, tuple[int, tuple[int, int]]] = {}

    def _plan(self, path: Path) -> tuple[int, tuple[int, int]]:
        from flowlift.errors import FlowliftError
        from flowlift.images import image_size
        from flowlift.pipeline import MAX_OUTPUT_SIDE
        from flowlift.upscale_sizes import planned_passes, upscaled_size

        if path not in self._cache:
            width, height = image_size(path)
            run = planned_passes(height, width, self.passes, self.resize_mode, MAX_OUTPUT_SIDE)
            if run == 0:
                raise FlowliftError(
                    f"{path}: a {width}x{height} image cannot be upscaled: one 2x pass would exceed "
                    f"MAX_OUTPUT_SIDE={MAX_OUTPUT_SIDE} px"
                )
            out_h, out_w = upscaled_size(height, width, run, self.resize_mode)
            self._cache[path] = run, (out_w, out_h)
        return self._cache[path]

    def scale(self, path: Path) -> int:
        return 2 ** self._plan(path)[0]

    def output_size(self, path: Path) -> tuple[int, int]:
        return self._plan(path)[1]


def _check_output_option(output: str | None) -> None:
    """``-o x.gif``: a file name in a format flowlift does not write is a user error, before any work."""
    if not output:
        return
    from PIL import Image

    from flowlift.errors import FlowliftError
    from flowlift.images import IMAGE_SUFFIXES

    target = Path(output).expanduser()
    suffix = target.suffix.lower()
    if suffix and suffix not in IMAGE_SUFFIXES and suffix in Image.registered_extensions() and not target.is_dir():
        raise FlowliftError(
            f"-o {target}: unsupported output format {suffix}; use {', '.join('.' + f for f in OUTPUT_FORMATS)} "
            "or a folder"
        )


def _check_format_limit(out: Path, size: tuple[int, int]) -> None:
    from flowlift.errors import FlowliftError

    limit = FORMAT_MAX_SIDE.get(out.suffix.lower())
    if limit is not None and max(size) > limit:
        raise FlowliftError(
            f"output {out} would be {size[0]}x{size[1]}, over {out.suffix} format's {limit} px limit; use --format png"
        )


def _nothing_to_do(source: Path, output: Path) -> None:
    raise AssertionError(f"no job was pending, yet {source} -> {output} was run")


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from flowlift.batch import Job, pending, plan_jobs, report, run_jobs
    from flowlift.devices import resolve_device
    from flowlift.errors import FlowliftError
    from flowlift.images import IMAGE_SUFFIXES, attach_alpha, file_sha256, list_images, load_image, save_image_atomic
    from flowlift.pipeline import DEFAULT_UPSCALER, FlowUpscalerPipeline, passes_for_scale

    device = resolve_device(args.device)  # once, before any input is read
    passes = args.passes if args.passes is not None else passes_for_scale(args.scale or 2)
    _check_output_option(args.output)
    problems: list[tuple[str, str]] = []
    inputs = list_images(args.inputs, problems)
    if not inputs and not problems:
        raise FlowliftError("no input images found")
    sizes = _OutputSizes(passes, args.resize_mode)
    jobs = [Job(Path(item), None, message) for item, message in problems] + plan_jobs(
        inputs,
        args.output,
        lambda path: f"{path.stem}_x{sizes.scale(path)}.{args.format}",
        IMAGE_SUFFIXES,
        expected_size=sizes.output_size,
        check_output=lambda path, out: _check_format_limit(out, sizes.output_size(path)),
    )
    if not pending(jobs, args.overwrite):  # nothing to compute: report the plan without loading a model
        return run_jobs(jobs, _nothing_to_do, command=NAME, overwrite=args.overwrite).exit_code

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    pipeline = FlowUpscalerPipeline(
        args.upscaler or DEFAULT_UPSCALER,
        args.vae,
        dtype=dtype,
        device=device,
        chunked=args.chunked,
        vae_tiled=args.vae_tiling,
    )
    hashes = {role: {p.name: file_sha256(p) for p in paths} for role, paths in pipeline.model_files().items() if paths}

    def upscale_one(path: Path, out: Path) -> None:
        image, alpha = load_image(path)
        steps = tqdm(total=passes + 3, desc=path.name, unit="step", leave=False, disable=None, file=sys.stderr)
        with steps, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            result = pipeline.upscale_image(
                image,
                num_passes=passes,
                seed=args.seed,
                color_fix=not args.no_color_fix,
                transplant_strength=args.transplant_strength,
                color_fix_strength=args.color_fix_strength,
                resize_mode=args.resize_mode,
                callback=lambda _stage, bar=steps: bar.update(1),
            )
        for warning in caught:  # e.g. passes dropped at MAX_OUTPUT_SIDE: one line, not a stack
            report(NAME, path, f"warning: {warning.message}", write=lambda line: tqdm.write(line, file=sys.stderr))
        if alpha is not None:
            result = attach_alpha(result, alpha)
        # passes actually run (fewer when MAX_OUTPUT_SIDE dropped some); the output is named by them
        done = max(0, round(math.log2(max(result.size[0] / image.size[0], 1.0))))
        if tuple(result.size) != sizes.output_size(path):
            raise FlowliftError(f"produced {result.size[0]}x{result.size[1]}, planned {sizes.output_size(path)}")
        save_image_atomic(result, out, _metadata(args, done, path, hashes))

    return run_jobs(jobs, upscale_one, command=NAME, overwrite=args.overwrite).exit_code

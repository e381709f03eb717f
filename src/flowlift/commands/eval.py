"""``flowlift eval``: drift / detail / fidelity tables, JSON and figures for outputs or methods.

Two modes::

    flowlift eval OUTPUTS... --reference INPUTS [--ground-truth GT] [--box x,y,w,h] -o DIR
    flowlift eval --run lanczos,bicubic,latent-bicubic,vae-roundtrip --dataset PHOTOS --scale 4 \
        --vae PATH [--upscaler PATH] -o DIR
    flowlift eval --run lanczos,spandrel:4x-UltraSharp.pth:ultrasharp,spandrel:4x-UltraSharp.pth+colorfix \
        --dataset PHOTOS --scale 4 -o DIR

Both print a Markdown table (mean and worst rows) and write ``results.json``, ``table.md``,
``metrics.png`` and ``crops.png`` into ``--output``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flowlift.commands._options import (
    DEFAULT_SCALE,
    DEFAULT_VAE,
    add_device_options,
    add_knob,
    add_output_option,
    add_vae_option,
    examples,
    name_or_path,
    positive_int,
    resolve_device_dtype,
)
from flowlift.console import show_progress
from flowlift.measure.methods import SPANDREL_TILE, SPANDREL_TILE_OVERLAP, spandrel_tiling

EPILOG = """\
methods for --run:
  lanczos, bicubic                      Pillow resize (pixel space)
  latent-bicubic, vae-roundtrip         through --vae (default flux2, as for flowlift upscale)
  flow[:transplant=F][:color_fix=F][:color=on|off][:seed=N]
                                        the Flow Upscaler (--upscaler, default the released
                                        weights, and --vae)
  spandrel:PATH[:label][+colorfix]      any single-image super-resolution model spandrel loads from a
                                        local .safetensors/.pth file (Real-ESRGAN, HAT, SwinIR, ...;
                                        pip install -e ".[pixel]"); run at its native scale, tiled by
                                        memory, Lanczos-resized to --scale if that differs; +colorfix
                                        adds flowlift's stage-2 colour fix against the input

"""

NAME = "eval"
HELP = "measure colour drift, detail and fidelity of outputs or of upscaling methods; write tables and plots"
EXAMPLES = examples(
    "flowlift eval out/ --reference photos/ -o report/          # kodim01_x2.png pairs with kodim01.png",
    "flowlift eval --run lanczos,latent-bicubic,vae-roundtrip --dataset ../shared/images/kodak --scale 4 "
    "--vae taef2 -o eval-kodak4",
    "flowlift eval --run lanczos --run spandrel:models/4x-UltraSharp.pth:ultrasharp+colorfix --dataset photos/ "
    "--scale 4 --save-outputs -o report/",
)


def _box(text: str) -> tuple[int, int, int, int]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"box must be x,y,w,h integers, got {text!r}") from None
    if len(values) != 4 or values[2] <= 0 or values[3] <= 0 or min(values[:2]) < 0:
        raise argparse.ArgumentTypeError(f"box must be x,y,w,h with w,h > 0, got {text!r}")
    return values  # type: ignore[return-value]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG.rstrip() + "\n\n" + EXAMPLES
    parser.add_argument("outputs", nargs="*", help="output images or folders (paired with --reference by name)")
    parser.add_argument("--reference", type=name_or_path, help="folder of the inputs the outputs were made from")
    parser.add_argument("--ground-truth", type=name_or_path,
                        help="folder of same-named ground-truth images (adds PSNR/SSIM)")  # fmt: skip
    parser.add_argument("--run", action="append", metavar="METHODS",
                        help="methods to run, comma-separated: lanczos, bicubic, latent-bicubic, vae-roundtrip, "
                        "flow, spandrel:PATH; flow takes options as flow:transplant=F, flow:color_fix=F, "
                        "flow:color=on|off, flow:seed=N (chained: flow:color=off:seed=1); spandrel models as "
                        "spandrel:PATH:label or spandrel:PATH+colorfix (see below)")  # fmt: skip
    parser.add_argument("--dataset", action="append", help="photos (files/folders) to build low-res inputs from")
    parser.add_argument("--scale", type=positive_int, default=DEFAULT_SCALE, help="upscale factor for --run")
    parser.add_argument("--limit", type=positive_int, help="use only the first N dataset images")
    parser.add_argument("--box", type=_box, help="x,y,w,h in output pixels: grey levels are counted here, "
                        "and the figure crops it")  # fmt: skip
    add_vae_option(parser, "the latent methods' (latent-bicubic, vae-roundtrip, flow), as for flowlift upscale",
                   default=DEFAULT_VAE)
    parser.add_argument("--upscaler", type=name_or_path, default=None, metavar="PATH|REPO",
                        help="Flow Upscaler weights for the flow method: file, folder or hub repo "
                        "(default TensorForger/FlowUpscaler, as for flowlift upscale)")  # fmt: skip
    add_device_options(parser, "VAE, upscaler and spandrel models")
    add_knob(parser, SPANDREL_TILE, metavar="PX|auto|none",
             help=f"{SPANDREL_TILE.help}; {SPANDREL_TILE.describe()} (default auto)")  # fmt: skip
    add_knob(parser, SPANDREL_TILE_OVERLAP, default=None, metavar="PX",
             help=f"{SPANDREL_TILE_OVERLAP.help} (default {SPANDREL_TILE_OVERLAP.default})")  # fmt: skip
    add_output_option(parser, "folder for results.json, table.md, metrics.png, crops.png", required=True, old="--out")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files at the report's names that flowlift did not write (without it, only "
                        "flowlift's own reports and empty files are replaced)")  # fmt: skip
    parser.add_argument("--cache", type=name_or_path, default=None, help="result cache folder (default OUT/cache)")
    parser.add_argument("--no-cache", action="store_true", help="recompute everything, store nothing")
    parser.add_argument(
        "--save-outputs",
        action="store_true",
        help="with --run: also write every full output to OUT/outputs/<method>/<stem>_x<scale>.png, with the "
        "low-res inputs and ground truth beside them, so the numbers can be recomputed from files",
    )
    parser.add_argument("--figure-images", type=positive_int, default=3, help="images in the crop grid (default 3)")
    from flowlift.jobs.distributed import add_barrier_timeout_argument

    add_barrier_timeout_argument(parser)


def run(args: argparse.Namespace) -> int:
    from flowlift.errors import FlowliftError
    from flowlift.files.output_paths import folder_problem
    from flowlift.measure.evaluate import evaluate_pairs
    from flowlift.measure.report import markdown_table, write_report

    spandrel_tiling(args.tile, args.tile_overlap)  # with or without a spandrel method: a bad value is refused
    out_dir = Path(args.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise FlowliftError(f"--output {out_dir} exists and is not a folder")
    if problem := folder_problem(out_dir):  # before any model loads or metric runs
        raise FlowliftError(problem)
    _check_reports_are_no_input(args, out_dir)
    if args.run:
        if args.outputs or args.reference:
            raise FlowliftError("give either OUTPUTS --reference, or --run with --dataset, not both")
        if not args.dataset:
            raise FlowliftError("--run needs --dataset (a folder of photos)")
        if args.limit is not None and args.limit < 1:
            raise FlowliftError("--limit must be >= 1")
        _check_replace_rule(args, out_dir)
        from flowlift.jobs.distributed import DistEnv, process_group

        env = DistEnv.from_environ()
        with process_group(env, args.barrier_timeout):
            report = _run_methods(args, env)
        if report is None:  # a rank other than 0 of a sharded run: its share is in the cache
            return 0
    else:
        if args.save_outputs:
            raise FlowliftError("--save-outputs goes with --run (OUTPUTS --reference are files already)")
        if not args.outputs or not args.reference:
            raise FlowliftError("give OUTPUTS and --reference INPUTS (or --run METHODS --dataset DIR)")
        _check_replace_rule(args, out_dir)
        report = evaluate_pairs(
            args.outputs,
            args.reference,
            args.ground_truth,
            box=args.box,
            figure_images=args.figure_images,
            progress=show_progress(args),
        )
    paths = write_report(report, out_dir)
    print(markdown_table(report))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.config.get("mode") == "run":
        print(f"cache: {report.cached} reused, {report.computed} computed")
    return 0


def _check_reports_are_no_input(args: argparse.Namespace, out_dir: Path) -> None:
    """No report file is one of the images measured (issue 36.2: by identity, e.g. ``eval OUT ... -o OUT``)."""
    from flowlift.errors import FlowliftError
    from flowlift.files.images import list_images
    from flowlift.files.output_paths import check_not_an_input
    from flowlift.measure.report import report_paths

    inputs: dict[str, list[Path]] = {}
    for role, given in (("OUTPUTS", args.outputs), ("--reference", args.reference), ("--dataset", args.dataset)):
        if given:
            try:
                inputs[role] = list_images([given] if isinstance(given, str) else list(given))
            except FlowliftError:
                pass  # a missing input is named by the measuring itself, in its own words
    for path in report_paths(out_dir).values():
        check_not_an_input(path, inputs)


def _check_replace_rule(args: argparse.Namespace, out_dir: Path) -> None:
    """The replace rule (:mod:`flowlift.files.own_files`) at every name the run writes, before any work:
    the reports, with ``--save-outputs`` every output, input and ground-truth file, and the cache's entries."""
    from flowlift.errors import FlowliftError
    from flowlift.files.own_files import check_replaceable, flowlift_image, folder_refusal
    from flowlift.measure.cache import ResultCache
    from flowlift.measure.evaluate import saved_output_paths
    from flowlift.measure.inputs import dataset_paths
    from flowlift.measure.methods import method_folder, parse_methods
    from flowlift.measure.report import report_recognisers

    check_replaceable(report_recognisers(out_dir), args.overwrite, NAME)
    if not args.run:
        return
    labels = [spec.label for spec in parse_methods(args.run)]
    if args.save_outputs:
        saved = out_dir / "outputs"
        for folder in [saved] + [saved / name for name in ("inputs", "ground-truth", *map(method_folder, labels))]:
            if refusal := folder_refusal(folder):
                raise FlowliftError(refusal)
        stems = [path.stem for path in dataset_paths(args.dataset, args.limit)]
        names = saved_output_paths(saved, labels, stems, args.scale)
        check_replaceable(dict.fromkeys(names, flowlift_image), args.overwrite, NAME)
    if not args.no_cache:
        root = Path(args.cache) if args.cache else out_dir / "cache"
        if args.cache and os.path.isdir(root):
            root = Path(os.path.realpath(root))  # a --cache given as a link to a folder is the user's choice
        if problem := ResultCache(root).problems(labels, args.overwrite):
            raise FlowliftError(problem)


def _run_methods(args: argparse.Namespace, env):
    import torch

    from flowlift.jobs.distributed import rank_device
    from flowlift.measure.cache import model_identity
    from flowlift.measure.evaluate import evaluate_methods
    from flowlift.measure.methods import flow_kwargs, make_method_fn, parse_methods

    specs = parse_methods(args.run)
    given, dtype = resolve_device_dtype(args.device, args.dtype)
    # under torchrun each rank computes on its own cuda:LOCAL_RANK; cache keys and reports name the device given
    device = torch.device(rank_device(str(given), env)) if env.distributed else given
    needs_vae = any(s.needs_vae for s in specs)
    needs_flow = any(s.name == "flow" for s in specs)
    for s in specs:
        if s.name == "flow":
            flow_kwargs(s, args.scale)  # validates the scale before any work
    if needs_vae:  # every weight found (or every missing one named, in one line) before any loads
        from flowlift.models.weights import require_all
        from flowlift.upscale.loading import DEFAULT_UPSCALER, upscale_weight_checks

        if needs_flow:
            args.upscaler = args.upscaler or DEFAULT_UPSCALER
        require_all(upscale_weight_checks(args.upscaler if needs_flow else None, [args.vae]))
    vae = pipeline = None
    identities: dict = {}
    if needs_vae:
        from flowlift.models.vae_loading import load_vae

        vae = load_vae(args.vae, device=device, dtype=dtype)
        identities.update(
            vae=model_identity(args.vae), device=str(given), dtype=str(dtype).removeprefix("torch."),
            vae_spec=str(args.vae),
        )
        if getattr(vae, "approximate_decode", False):
            identities["vae_note"] = "approximate decoder"
    if needs_flow:
        from flowlift.upscale.pipeline import FlowUpscalerPipeline

        pipeline = FlowUpscalerPipeline(args.upscaler, vae, device=device, dtype=dtype)
        identities.update(upscaler=model_identity(args.upscaler), upscaler_spec=str(args.upscaler))
    pixel_models = _load_pixel_models(args, specs, device, dtype, identities, given)
    fns = {
        s.label: make_method_fn(
            s, args.scale, vae=vae, pipeline=pipeline, device=device, dtype=dtype, pixel_models=pixel_models
        )
        for s in specs
    }
    cache_dir = None if args.no_cache else Path(args.cache) if args.cache else Path(args.output) / "cache"

    def evaluate(indices=None):
        return evaluate_methods(
            specs,
            args.dataset,
            args.scale,
            method_fns=fns,
            identities=identities,
            cache_dir=cache_dir,
            box=args.box,
            limit=args.limit,
            figure_images=args.figure_images,
            progress=show_progress(args) if env.is_main else False,  # a launched eval: rank 0's progress only
            save_outputs=Path(args.output) / "outputs" if args.save_outputs else None,
            indices=indices,
        )

    if not env.distributed:
        return evaluate()
    return _run_sharded(args, env, evaluate, cache_dir)

def _run_sharded(args: argparse.Namespace, env, evaluate, cache_dir):
    """Each rank measures its pixel-balanced share into the shared cache; after the barrier rank 0
    builds the report from the cache, exactly as a single process would on a second run (anything a
    rank could not leave in the cache, e.g. a cache folder not shared between hosts, it computes)."""
    from flowlift.errors import FlowliftError
    from flowlift.jobs.distributed import finish, image_pixels, probe_and_gather, shard_by_pixels, total_counts
    from flowlift.measure.inputs import dataset_paths

    if cache_dir is None:
        raise FlowliftError("a sharded eval --run merges the ranks' results through the cache; drop --no-cache")
    paths = dataset_paths(args.dataset, args.limit)
    pixels = probe_and_gather(env, paths, image_pixels)
    share = evaluate(shard_by_pixels(pixels, env.world_size)[env.rank])
    per_rank, reason = finish(env, {"computed": share.computed, "cached": share.cached}, args.barrier_timeout)
    if not env.is_main:
        return None
    if per_rank is None:
        raise FlowliftError(f"not every rank finished its share, no report written: {reason}")
    report = evaluate()
    totals = total_counts(per_rank)
    report.computed += totals["computed"]
    report.cached = totals["cached"]
    report.config["world_size"] = env.world_size
    return report


def _load_pixel_models(args: argparse.Namespace, specs, device, dtype, identities: dict, given=None) -> dict:
    """Load every spandrel model once (by path); record what identifies it in ``identities["spandrel"]``
    (with the device ``given``, default ``device``: under torchrun the setting, not the rank's cuda:N)."""
    given = device if given is None else given
    from flowlift.measure.cache import model_identity
    from flowlift.measure.methods import SPANDREL
    from flowlift.measure.pixel_upscaler import load_pixel_upscaler

    paths: dict[str, list[str]] = {}
    for s in specs:
        if s.name == SPANDREL:
            paths.setdefault(dict(s.options)["path"], []).append(s.label)
    if not paths:
        return {}
    tile, overlap = spandrel_tiling(args.tile, args.tile_overlap)
    models = {}
    info = identities.setdefault("spandrel", {})
    for path, labels in paths.items():
        model = load_pixel_upscaler(path, device, dtype, tile=tile, overlap=overlap)
        models[path] = model
        info[path] = {
            "labels": ", ".join(labels),
            "model": model_identity(path),
            "architecture": model.architecture,
            "native_scale": model.native_scale,
            "tile": model.tile,
            "overlap": model.overlap,
            "device": str(given),  # as given, not the rank's cuda:N: one cache key for all ranks
            "dtype": str(dtype).removeprefix("torch."),
            "note": model.describe(args.scale),
        }
    return models

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

from flowlift.commands._options import (
    DEFAULT_SCALE,
    DEFAULT_VAE,
    add_device_options,
    add_knob,
    add_output_option,
    add_report_overwrite_option,
    add_upscaler_option,
    add_vae_option,
    examples,
    name_or_path,
    positive_int,
)
from flowlift.console import show_progress
from flowlift.measure.inputs import scale_argument
from flowlift.measure.methods import SPANDREL_TILE, SPANDREL_TILE_OVERLAP
from flowlift.measure.sr_metrics import Y_CHANNEL

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
  sesqui:PATH[:label]                   SesquiLSR (upscaler_Flux2.safetensors from the models/ folder of
                                        github.com/LoganBooker/SesquiLSR) on the FLUX.2 VAE's raw latents;
                                        --scale in (1, 2]
--scale may be fractional (1.5, 1.25): the low-res inputs are then Lanczos-downsampled; a method that
cannot reach the scale (flow off the powers of 2, sesqui past 2x) is skipped, its reason in the table.

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
    """``--box x,y,w,h``: the request's own rule (:func:`flowlift.measure.metrics.check_box`) on the text."""
    from flowlift.errors import FlowliftError
    from flowlift.measure.metrics import check_box

    try:
        return check_box(text, loose=True)  # type: ignore[return-value]
    except FlowliftError as error:  # argparse names the option
        raise argparse.ArgumentTypeError(error.worded({"box": ""}).strip()) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG.rstrip() + "\n\n" + EXAMPLES
    parser.add_argument(
        "outputs", nargs="*", metavar="OUTPUTS", help="output images or folders (paired with --reference by name)"
    )
    parser.add_argument("--reference", type=name_or_path, help="folder of the inputs the outputs were made from")
    parser.add_argument(
        "--ground-truth", type=name_or_path, help="folder of same-named ground-truth images (adds PSNR/SSIM)"
    )
    parser.add_argument(
        "--run",
        action="append",
        metavar="METHODS",
        help="methods to run, comma-separated: lanczos, bicubic, latent-bicubic, vae-roundtrip, "
        "flow, spandrel:PATH; flow takes options as flow:transplant=F, flow:color_fix=F, "
        "flow:color=on|off, flow:seed=N (chained: flow:color=off:seed=1); spandrel models as "
        "spandrel:PATH:label or spandrel:PATH+colorfix; SesquiLSR as sesqui:PATH[:label] "
        "(see below)",
    )
    parser.add_argument("--dataset", action="append", help="photos (files/folders) to build low-res inputs from")
    parser.add_argument(
        "--scale",
        type=scale_argument,
        default=DEFAULT_SCALE,
        help="upscale factor for --run: above 1, at most 16, whole or p/q with q <= 16 (1.5)",
    )
    parser.add_argument("--limit", type=positive_int, help="use only the first N dataset images")
    parser.add_argument(
        "--box", type=_box, help="x,y,w,h in output pixels: grey levels are counted here, and the figure crops it"
    )
    add_vae_option(
        parser,
        "the latent methods' (latent-bicubic, vae-roundtrip, flow), as for flowlift upscale",
        default=DEFAULT_VAE,
    )
    add_upscaler_option(parser, " for the flow method")
    add_device_options(parser, "VAE, upscaler and spandrel models")
    add_knob(
        parser,
        SPANDREL_TILE,
        metavar="PX|auto|none",
        help=f"{SPANDREL_TILE.help}; {SPANDREL_TILE.describe()} (default auto)",
    )
    add_knob(
        parser,
        SPANDREL_TILE_OVERLAP,
        default=None,
        metavar="PX",
        help=f"{SPANDREL_TILE_OVERLAP.help} (default {SPANDREL_TILE_OVERLAP.default})",
    )
    add_knob(parser, Y_CHANNEL)
    add_output_option(parser, "folder for results.json, table.md, metrics.png, crops.png", required=True)
    add_report_overwrite_option(parser)
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
    """The options as one :class:`~flowlift.measure.eval_job.EvalRequest`, run by
    :func:`flowlift.measure.eval_job.run_eval`; the table and the files written printed."""
    from flowlift.measure.eval_job import EvalRequest, run_eval
    from flowlift.measure.report import markdown_table

    request = EvalRequest(
        output=args.output,
        outputs=args.outputs,
        reference=args.reference,
        ground_truth=args.ground_truth,
        run=args.run,
        dataset=args.dataset,
        scale=args.scale,
        limit=args.limit,
        box=args.box,
        vae=args.vae,
        upscaler=args.upscaler,
        device=args.device,
        dtype=args.dtype,
        tile=args.tile,
        tile_overlap=args.tile_overlap,
        overwrite=args.overwrite,
        cache=args.cache,
        no_cache=args.no_cache,
        save_outputs=args.save_outputs,
        figure_images=args.figure_images,
        y_channel=args.y_channel,
        barrier_timeout=args.barrier_timeout,
        progress=show_progress(args),
    )
    result = run_eval(request)
    if result is None:  # a rank other than 0 of a sharded run: its share is in the cache
        return 0
    report, paths = result
    print(markdown_table(report))
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if report.config.get("mode") == "run":
        print(f"cache: {report.cached} reused, {report.computed} computed")
    return 0

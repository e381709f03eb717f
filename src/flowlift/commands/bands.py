"""``flowlift bands``: how a VAE decoder maps latent frequency bands to pixel frequency bands.

    flowlift bands IMAGES... --vae PATH [-o DIR] [--full]

Encodes each image, perturbs one latent band at a time (0.1 sigma, FFT mask), decodes and
integrates the luma response spectrum per pixel band (:mod:`flowlift.measure.bands`). Prints the table
(with the model card's Mage decoder figures alongside), and writes ``bands.json``, ``bands.md`` and
``bands.png`` (heat map) into ``--output``.
"""

from __future__ import annotations

import argparse

from flowlift.commands._options import (
    add_device_options,
    add_knob,
    add_output_option,
    add_report_overwrite_option,
    add_vae_option,
    examples,
    positive_int,
    seed_value,
)
from flowlift.console import show_progress
from flowlift.measure.bands_job import AMPLITUDE, MAX_SIDE

NAME = "bands"
HELP = "measure a VAE decoder's latent->pixel band response (the model card's band table)"
EXAMPLES = examples(
    "flowlift bands ../shared/images/kodak --vae ../shared/models/taef2 --max-side 512 -o bands-taef2",
    "flowlift bands photos/ --vae flux2 --full -o bands-flux2",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="+", metavar="IMAGES", help="image files or folders (non-recursive)")
    add_vae_option(parser, required=True)
    add_output_option(parser, "folder for bands.json, bands.md, bands.png", required=True)
    add_knob(parser, AMPLITUDE)
    parser.add_argument("--seed", type=seed_value, default=0, help="noise seed (band k uses seed + k)")
    add_knob(parser, MAX_SIDE)
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N images")
    parser.add_argument("--full", action="store_true", help="print every pixel band, not only the two summaries")
    add_report_overwrite_option(parser)
    add_device_options(parser, "VAE")


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.measure.bands_job.BandsRequest`, run by
    :func:`flowlift.measure.bands_job.run_bands_report`; the table and the files written printed."""
    from flowlift.measure.bands_job import BandsRequest, run_bands_report

    request = BandsRequest(
        images=args.images,
        vae=args.vae,
        output=args.output,
        amplitude=args.amplitude,
        seed=args.seed,
        max_side=args.max_side,
        limit=args.limit,
        full=args.full,
        overwrite=args.overwrite,
        device=args.device,
        dtype=args.dtype,
        progress=show_progress(args),
    )
    result = run_bands_report(request)
    print(result.table)
    print(f"wrote {', '.join(str(p) for p in result.paths)}")
    return 0

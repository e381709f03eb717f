"""``flowlift bands``: how a VAE decoder maps latent frequency bands to pixel frequency bands.

    flowlift bands IMAGES... --vae PATH [-o DIR] [--full]

Encodes each image, perturbs one latent band at a time (0.1 sigma, FFT mask), decodes and
integrates the luma response spectrum per pixel band (:mod:`flowlift.measure.bands`). Prints the table
(with the model card's Mage decoder figures alongside), and writes ``bands.json``, ``bands.md`` and
``bands.png`` (heat map) into ``--output``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flowlift.commands._options import (
    add_device_options,
    add_output_option,
    add_vae_option,
    examples,
    finite_float,
    positive_int,
    resolve_device_dtype,
    seed_value,
)
from flowlift.console import show_progress

NAME = "bands"
HELP = "measure a VAE decoder's latent->pixel band response (the model card's band table)"
EXAMPLES = examples(
    "flowlift bands ../shared/images/kodak --vae ../shared/models/taef2 --max-side 512 -o bands-taef2",
    "flowlift bands photos/ --vae flux2 --full -o bands-flux2",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="+", help="image files or folders (non-recursive)")
    add_vae_option(parser, required=True)
    add_output_option(parser, "folder for bands.json, bands.md, bands.png", required=True)
    parser.add_argument("--amplitude", type=finite_float, default=0.1, help="perturbation RMS in latent sigma (0.1)")
    parser.add_argument("--seed", type=seed_value, default=0, help="noise seed (band k uses seed + k)")
    parser.add_argument("--max-side", type=positive_int, default=None,
                        help="downscale images (INTER_AREA) so the long side is at most this")  # fmt: skip
    parser.add_argument("--limit", type=positive_int, default=None, help="use only the first N images")
    parser.add_argument("--full", action="store_true", help="print every pixel band, not only the two summaries")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace files at the report's names that flowlift did not write (without it, only "
                        "flowlift's own reports and empty files are replaced)")  # fmt: skip
    add_device_options(parser, "VAE")


def report_recognisers(out_dir: Path) -> dict:
    """The files ``flowlift bands`` writes into ``out_dir``, with how flowlift's own is told."""
    from flowlift.files.own_files import flowlift_image, json_report, markdown_report

    return {
        out_dir / "bands.json": json_report(NAME, {"vae", "band_edges", "mean_percent"}),
        out_dir / "bands.md": markdown_report(NAME),
        out_dir / "bands.png": flowlift_image,
    }


def run(args: argparse.Namespace) -> int:
    import json

    import numpy as np

    from flowlift.errors import FlowliftError
    from flowlift.files.atomic import atomic_write_bytes
    from flowlift.files.images import list_images, load_image, to_tensor
    from flowlift.measure import bands as B
    from flowlift.measure import metrics as M
    from flowlift.measure.cache import model_identity
    from flowlift.models.vae_loading import load_vae

    if not args.amplitude > 0:
        raise FlowliftError(f"--amplitude must be > 0, got {args.amplitude}")
    if args.max_side is not None and args.max_side < 64:
        raise FlowliftError(f"--max-side must be >= 64, got {args.max_side}")
    if args.limit is not None and args.limit < 1:
        raise FlowliftError("--limit must be >= 1")
    device, dtype = resolve_device_dtype(args.device, args.dtype)  # before anything is read
    out_dir = Path(args.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise FlowliftError(f"--output {out_dir} exists and is not a folder")
    from flowlift.files.own_files import check_replaceable, markdown_stamp, stamp

    check_replaceable(report_recognisers(out_dir), args.overwrite, NAME)  # before any image or model loads
    paths = list_images(args.images)[: args.limit]
    if not paths:
        raise FlowliftError("no images given")
    images = []
    for p in paths:
        a = np.asarray(load_image(p)[0])
        h, w = a.shape[:2]
        if args.max_side is not None and max(h, w) > args.max_side:
            s = args.max_side / max(h, w)
            a = np.rint(M.area_resize(a, (round(w * s), round(h * s))) * 255).astype(np.uint8)
        images.append(to_tensor(a))
    vae = load_vae(args.vae, device=device, dtype=dtype)
    mean, per_image = B.run_bands(
        vae, images, device=device, dtype=dtype, amplitude=args.amplitude, seed=args.seed,
        progress=show_progress(args),
    )
    factor = int(vae.spatial_factor)
    bins = {p.stem: B.latent_bin_counts(*B.latent_size(*im.shape[-2:], factor)) for p, im in zip(paths, images,
                                                                                                   strict=True)}
    sparse = {stem: counts for stem, counts in bins.items() if min(counts) < B.MIN_BINS_PER_BAND}
    if sparse:
        stem, counts = min(sparse.items(), key=lambda item: min(item[1]))
        print(
            f"flowlift bands: warning: {len(sparse)} image(s) too small for every band to hold "
            f">= {B.MIN_BINS_PER_BAND} latent FFT bins (e.g. {stem}: {counts} per band, lowest first); "
            f"their low-band rows are noise — use images of at least {64 * factor} px (--max-side)",
            file=sys.stderr,
        )
    title = f"{Path(str(args.vae)).name}: latent->pixel band response, {len(images)} image(s)"
    table = B.format_table(mean, full=args.full, reference=B.MAGE_REFERENCE)
    full_table = B.format_table(mean, full=True)
    payload = {
        "flowlift": stamp(NAME),  # how a later run knows bands.json as flowlift's own
        "vae": str(args.vae),
        "vae_identity": model_identity(args.vae),
        "spatial_factor": int(vae.spatial_factor),
        "amplitude": args.amplitude,
        "seed": args.seed,
        "max_side": args.max_side,
        "band_edges": list(B.BAND_EDGES),
        "labels": B.band_labels(),
        "columns": B.band_labels() + ["finer than latent Nyquist"],
        "mean_percent": mean.tolist(),
        "min_bins_per_band": B.MIN_BINS_PER_BAND,
        "latent_bins_per_band": bins,
        "images": {p.stem: m.tolist() for p, m in zip(paths, per_image, strict=True)},
        "reference_mage_same_finer": [list(r) for r in B.MAGE_REFERENCE],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    B.heatmap_figure(mean, str(out_dir / "bands.png"), title)
    markdown = f"{markdown_stamp(NAME)}{title}\n\n{table}\n\nFull rows (% per pixel band):\n\n{full_table}\n"
    atomic_write_bytes(out_dir / "bands.md", markdown.encode())
    atomic_write_bytes(out_dir / "bands.json", json.dumps(payload, indent=1).encode())
    print(table)
    print(f"wrote {out_dir / 'bands.json'}, {out_dir / 'bands.md'}, {out_dir / 'bands.png'}")
    return 0

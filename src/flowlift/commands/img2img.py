"""``flowlift img2img``: refine an image with a FLUX.2 transformer (img2img, inpaint, outpaint)."""

from __future__ import annotations

import argparse

from flowlift.commands._options import add_knob, examples
from flowlift.commands._refine_options import (  # noqa: F401  (the choices, read here by tests and scripts)
    DEFAULT_MU,
    MU_RANGE,
    SAMPLERS,
    SCHEDULES,
    STRENGTH_MAPS,
    add_model_arguments,
    request_fields,
)
from flowlift.errors import FlowliftError
from flowlift.refine.settings import STRENGTH

NAME = "img2img"
HELP = (
    "refine an image with a FLUX.2 Klein/dev transformer: img2img, inpaint (--mask) or outpaint (--outpaint) "
    "on the shifted schedule"
)
EXAMPLES = examples(
    'flowlift img2img photo.png --model black-forest-labs/FLUX.2-klein-4B --prompt "a watercolour harbour" '
    "--strength 0.6 --steps 4 -o harbour.png",
    'flowlift img2img photo.png --mask mask.png --strength 1 --model /models/FLUX.2-klein-4B --prompt "a red door" '
    "--steps 4 --sampler heun",
    "flowlift img2img photo.png --outpaint 0,0,256,0 --model /models/FLUX.2-klein-4B --prompt-embeds emb.safetensors",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("image", help="input image")
    add_knob(parser, STRENGTH, default=None, help=f"{STRENGTH.help}; {STRENGTH.describe()} (default 0.5)")
    parser.add_argument("--mask", metavar="IMAGE", help="inpaint mask, same size: white = regenerate, black = keep")
    parser.add_argument(
        "--outpaint",
        metavar="L,T,R,B",
        help="outpaint: extend the canvas by these pixel borders (rounded up to 16) and paint them in",
    )
    parser.add_argument(
        "--reference",
        action="append",
        default=[],
        metavar="IMAGE",
        help="reference image (repeatable): clean latents the model attends to (t = 10, 20, ...)",
    )
    add_model_arguments(parser)


def parse_outpaint(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 4 or any(v < 0 for v in values):
        raise FlowliftError(f"--outpaint takes four non-negative pixel borders L,T,R,B, got {text!r}")
    if not any(values):
        raise FlowliftError(f"--outpaint {text}: every border is 0, nothing to paint (use img2img without it)")
    return values  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.refine.request.RefineRequest`, planned and run by
    :func:`flowlift.refine.jobs.run_refine`."""
    from flowlift.refine.jobs import run_refine
    from flowlift.refine.request import RefineRequest

    pads = parse_outpaint(args.outpaint) if args.outpaint is not None else None  # "" is refused, not img2img
    request = RefineRequest(
        mode="outpaint" if pads else "inpaint" if args.mask else "img2img",
        **request_fields(args),
        mask=args.mask,
        outpaint=pads,
        references=tuple(args.reference),
        strength=args.strength,
        command=NAME,
    )
    print(f"wrote {run_refine(request)}")
    return 0

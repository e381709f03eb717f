"""``flowlift hires``: the hires fix -- generate or load, Flow-Upscale the latents, refine, decode."""

from __future__ import annotations

import argparse

from flowlift.commands._options import (
    add_knob,
    add_upscaler_option,
    examples,
    positive_int,
)
from flowlift.commands._refine_options import add_model_arguments, request_fields
from flowlift.errors import FlowliftError
from flowlift.knobs import LATENT_UPSCALER
from flowlift.refine.request import DEFAULT_SIZE
from flowlift.refine.settings import HIRES_SCALE, REFINE_STRENGTH, STEPS, TRANSPLANT_STRENGTH

NAME = "hires"
HELP = (
    "hires fix: txt2img (--prompt) or an --image, upscaled 2x/4x/8x in latent space by the Flow Upscaler, "
    "then refined by FLUX.2 at low strength (in overlapping tiles above 4 MP)"
)
EXAMPLES = examples(
    'flowlift hires --prompt "a lighthouse at dusk" --model black-forest-labs/FLUX.2-klein-4B --steps 4 -o out.png',
    'flowlift hires --image photo.png --prompt "..." --model black-forest-labs/FLUX.2-klein-4B --scale 2 '
    "--refine-strength 0.3",
    "flowlift hires --image photo.png --prompt-embeds emb.safetensors --model black-forest-labs/FLUX.2-klein-9B "
    "--transformer flux-2-klein-9b-Q4_K_M.gguf --scale 4 --max-memory 11GB --steps 8  # tiled refine at 4096 px",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    base = parser.add_argument_group("base image")
    base.add_argument("--image", help="start from this image instead of a txt2img generation")
    width, height = DEFAULT_SIZE
    base.add_argument(
        "--width", type=positive_int, default=None, help=f"txt2img width (multiple of 16; default {width})"
    )
    base.add_argument(
        "--height", type=positive_int, default=None, help=f"txt2img height (multiple of 16; default {height})"
    )
    add_knob(
        base,
        STEPS,
        "--base-steps",
        default=None,
        help=f"txt2img steps, {STEPS.describe()} (default: the model's, as --steps)",
    )
    up = parser.add_argument_group("upscale")
    add_knob(up, HIRES_SCALE, "--scale")
    add_upscaler_option(up)
    add_knob(
        up, LATENT_UPSCALER, metavar="sesqui:PATH", help=f"{LATENT_UPSCALER.help} (default: none, so only 2, 4, 8)"
    )
    add_knob(up, TRANSPLANT_STRENGTH)
    up.add_argument("--no-color-fix", action="store_true", help="switch the upscaler's colour fix off")
    refine = parser.add_argument_group("refine")
    add_knob(
        refine,
        REFINE_STRENGTH,
        help=f"{REFINE_STRENGTH.help}, {REFINE_STRENGTH.describe()}; it runs --steps steps (with --schedule "
        "clipped only the few points of the full schedule below it)",
    )
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """The options as one :class:`~flowlift.refine.request.RefineRequest` (its hires fix on the Flow Upscaler,
    :class:`~flowlift.upscale.latent_source.FlowUpscalerSource`), planned and run by
    :func:`flowlift.refine.jobs.run_refine`."""
    from flowlift.refine.jobs import run_refine
    from flowlift.refine.request import HiresSettings, RefineRequest
    from flowlift.upscale.latent_source import FlowUpscalerSource

    base_options = {"--width": args.width, "--height": args.height, "--base-steps": args.base_steps}
    if args.image is not None and (given := [name for name, value in base_options.items() if value is not None]):
        drop = "it" if len(given) == 1 else "them"
        raise FlowliftError(f"{', '.join(given)}: for a txt2img base, which --image replaces; drop {drop}")
    width, height = DEFAULT_SIZE
    request = RefineRequest(
        mode="hires",
        **request_fields(args),
        hires=HiresSettings(
            upscaler=FlowUpscalerSource(args.upscaler, latent_upscaler=args.latent_upscaler),
            scale=args.scale,
            refine_strength=args.refine_strength,
            base_steps=args.base_steps,
            base_size=(args.width or width, args.height or height),
            transplant_strength=args.transplant_strength,
            color_fix=not args.no_color_fix,
        ),
        command=NAME,
    )
    print(f"wrote {run_refine(request)}")
    return 0

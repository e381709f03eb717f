"""``flowlift hires``: the hires fix -- generate or load, Flow-Upscale the latents, refine, decode."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowlift.commands._options import add_knob, examples, positive_int, sampling_from_args
from flowlift.commands._refine_options import (
    add_model_arguments,
    check_model_sources,
    check_mu_for_size,
    check_output,
    check_prompt_args,
    load_refiner_from_args,
    refine_inputs,
)
from flowlift.errors import FlowliftError
from flowlift.refine.settings import HIRES_SCALE, REFINE_STRENGTH, STEPS, check_hires_size
from flowlift.upscale.settings import TRANSPLANT_STRENGTH

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
    base.add_argument("--width", type=positive_int, default=1024, help="txt2img width (multiple of 16; default 1024)")
    base.add_argument("--height", type=positive_int, default=1024, help="txt2img height (multiple of 16)")
    add_knob(base, STEPS, "--base-steps", help=f"txt2img steps, {STEPS.describe()}")
    up = parser.add_argument_group("upscale")
    add_knob(up, HIRES_SCALE, "--scale")
    up.add_argument(
        "--upscaler",
        metavar="PATH|REPO",
        help="Flow Upscaler weights (file, folder or hub id; default TensorForger/FlowUpscaler)",
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
    from flowlift.files.image_outputs import input_hashes, save_image_atomic
    from flowlift.files.images import attach_alpha, load_image, tensor_to_pil, to_tensor
    from flowlift.files.naming import refined_output

    check_prompt_args(args)
    output = Path(args.output) if args.output else refined_output(args.image, f"hires{args.scale}x")
    check_output(output, args.overwrite, refine_inputs(args))
    images = alpha = None
    if args.image:
        rgb, alpha = load_image(args.image)
        images = to_tensor(rgb)
        if images.shape[-1] % 16 or images.shape[-2] % 16:
            raise FlowliftError(
                f"--image sides must be multiples of 16 px, got {images.shape[-1]}x{images.shape[-2]}; crop it first"
            )
    elif args.width % 16 or args.height % 16:
        raise FlowliftError(f"--width/--height must be multiples of 16, got {args.width}x{args.height}")
    base_w, base_h = (images.shape[-1], images.shape[-2]) if images is not None else (args.width, args.height)
    check_hires_size(base_w, base_h, args.scale)  # 16384 px cap for the base and the result, before any model
    check_mu_for_size(args, base_w * args.scale, base_h * args.scale)  # the refine pass's size
    try:
        from flowlift.upscale.pipeline import FlowUpscalerPipeline
    except ImportError:
        raise FlowliftError("this flowlift build has no Flow Upscaler pipeline (flowlift.upscale.pipeline)") from None

    from flowlift.upscale.loading import DEFAULT_UPSCALER
    from flowlift.upscale.settings import SCALE_PASSES, MemoryPolicy

    upscaler_file = check_model_sources(args, args.upscaler or DEFAULT_UPSCALER)  # all before the transformer loads
    refiner, conditioning = load_refiner_from_args(args, image_size=(base_h * args.scale, base_w * args.scale))
    plan = refiner.memory_plan  # the upscaler gets what the transformer leaves of --max-memory
    upscaler = FlowUpscalerPipeline(
        upscaler_file,
        refiner.vae,
        device=refiner.device,
        dtype=refiner.dtype,
        memory=MemoryPolicy(max_memory=plan.upscaler_budget_bytes if plan is not None else None),
    )
    passes = SCALE_PASSES[args.scale]

    def upscale(latents):
        return upscaler.upscale_latents(
            latents,
            num_passes=passes,
            seed=args.seed,
            transplant_strength=args.transplant_strength,
            color_fix=not args.no_color_fix,
        )

    result = refiner.hires(
        upscale,
        images=images,
        height=args.height,
        width=args.width,
        base_steps=args.base_steps,
        refine_strength=args.refine_strength,
        strength_map=args.strength_map,
        sampling=sampling_from_args(args),
        scale=args.scale,
        **conditioning,
    )
    metadata = dict(result.parameters)
    metadata.update(
        command="hires",
        input=args.image,
        upscaler=args.upscaler or "TensorForger/FlowUpscaler",
        transplant_strength=args.transplant_strength,
        color_fix=not args.no_color_fix,
        prompt_embeds=args.prompt_embeds,
        vae=args.vae or args.model,
        **input_hashes({"input": args.image, "prompt_embeds": args.prompt_embeds}),
    )
    metadata = {k: v for k, v in metadata.items() if v is not None}
    if not args.image:
        metadata.pop("input", None)
    image = attach_alpha(tensor_to_pil(result.images[0]), alpha)
    save_image_atomic(image, output, {"flowlift": metadata}, source=args.image)  # ICC profile and EXIF kept
    print(f"wrote {output}")
    return 0

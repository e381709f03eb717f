"""``flowlift img2img``: refine an image with a FLUX.2 transformer (img2img, inpaint, outpaint)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flowlift.commands._options import add_knob, examples, sampling_from_args
from flowlift.commands._refine_options import (  # noqa: F401  (the choices, read here by tests and scripts)
    DEFAULT_MU,
    MU_RANGE,
    SAMPLERS,
    SCHEDULES,
    STRENGTH_MAPS,
    add_model_arguments,
    check_model_sources,
    check_mu_for_size,
    check_output,
    check_prompt_args,
    load_refiner_from_args,
    refine_inputs,
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
    from flowlift.files.image_outputs import input_hashes, save_image_atomic
    from flowlift.files.images import attach_alpha, load_image, tensor_to_pil, to_tensor
    from flowlift.files.naming import refined_output

    # validate everything before loading weights
    check_prompt_args(args)
    if args.mask and args.outpaint:
        raise FlowliftError("--mask and --outpaint are exclusive")
    pads = parse_outpaint(args.outpaint) if args.outpaint else None
    output = Path(args.output) if args.output else refined_output(args.image, "outpaint" if pads else "img2img")
    check_output(output, args.overwrite, refine_inputs(args))
    rgb, alpha = load_image(args.image)
    from flowlift.refine.canvas import outpaint_pads

    size = (rgb.width, rgb.height)
    if pads:
        rounded = outpaint_pads(rgb.height, rgb.width, *pads)  # the size cap, before any weights are loaded
        size = (rgb.width + rounded[0] + rounded[2], rgb.height + rounded[1] + rounded[3])
    check_mu_for_size(args, *size)
    images = to_tensor(rgb)
    mask = None
    if args.mask:
        mask_rgb, _ = load_image(args.mask)
        if mask_rgb.size != rgb.size:
            raise FlowliftError(
                f"--mask is {mask_rgb.size[0]}x{mask_rgb.size[1]}, the image {rgb.size[0]}x{rgb.size[1]}"
            )
        mask = to_tensor(mask_rgb.convert("L").convert("RGB"))[:, :1]
    references = [to_tensor(load_image(path)[0]) for path in args.reference]
    for path, ref in zip(args.reference, references, strict=True):
        if ref.shape[-1] % 16 or ref.shape[-2] % 16:
            raise FlowliftError(
                f"--reference {path}: sides must be multiples of 16 px, got {ref.shape[-1]}x{ref.shape[-2]}"
            )
    strength = args.strength if args.strength is not None else (1.0 if pads else STRENGTH.default)
    check_model_sources(args)

    canvas = (-(-rgb.height // 16) * 16, -(-rgb.width // 16) * 16)  # what the model sees: padded, or the canvas
    if pads:
        left, top, right, bottom = outpaint_pads(rgb.height, rgb.width, *pads)
        canvas = (rgb.height + top + bottom, rgb.width + left + right)
    refiner, conditioning = load_refiner_from_args(args, image_size=canvas)
    common = dict(
        strength=strength,
        strength_map=args.strength_map,
        sampling=sampling_from_args(args),
        reference_images=references,
        **conditioning,
    )
    if pads is not None:
        left, top, right, bottom = pads
        result = refiner.outpaint(images, left=left, top=top, right=right, bottom=bottom, **common)
        alpha = None
    else:
        result = refiner.img2img(images, mask=mask, **common)

    metadata = dict(result.parameters)
    metadata.update(
        command="img2img",
        input=os.fspath(args.image),
        mask=args.mask,
        references=args.reference or None,
        prompt_embeds=args.prompt_embeds,
        vae=args.vae or args.model,
        **input_hashes({"input": args.image, "mask": args.mask, "prompt_embeds": args.prompt_embeds}),
    )
    metadata = {k: v for k, v in metadata.items() if v is not None}
    image = attach_alpha(tensor_to_pil(result.images[0]), alpha)
    save_image_atomic(image, output, {"flowlift": metadata}, source=args.image)  # ICC profile and EXIF kept
    print(f"wrote {output}")
    return 0

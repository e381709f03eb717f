"""``flowlift img2img``: refine an image with a FLUX.2 transformer (img2img, inpaint, outpaint)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from flowlift.commands._options import (
    add_device_options,
    add_knob,
    examples,
    finite_float,
    resolve_device_dtype,
    sampling_from_args,
)
from flowlift.commands._refine_weights import add_weights_arguments, check_weights_arguments, weights_kwargs
from flowlift.console import show_progress
from flowlift.errors import FlowliftError
from flowlift.knobs import SEED
from flowlift.refine.settings import MU, SAMPLER, SCHEDULE, STEPS, STRENGTH, STRENGTH_MAP

#: The knob tables' values (torch-free modules, so --help stays fast).
SAMPLERS = SAMPLER.choices
STRENGTH_MAPS = STRENGTH_MAP.choices
SCHEDULES = SCHEDULE.choices
DEFAULT_MU = MU.default
MU_RANGE = (MU.low, MU.high)

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


# ------------------------------------------------------------------------------------ shared options


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, prompt, sampling and device options shared by ``img2img`` and ``hires``."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        metavar="PATH|REPO",
        help="FLUX.2 Klein or dev weights: a diffusers folder or hub id (transformer/ and vae/ subfolders, "
        "e.g. black-forest-labs/FLUX.2-klein-4B), a transformer folder, or a single .safetensors file",
    )
    model.add_argument(
        "--vae",
        metavar="SPEC",
        help="VAE (flowlift.models.vae_loading.load_vae spec); default: the model's own vae/ folder",
    )
    add_device_options(model, "transformer and VAE")
    add_weights_arguments(parser)
    prompt = parser.add_argument_group("prompt")
    prompt.add_argument("--prompt", help="the prompt (embedded with the model's own text encoder, flowlift[text])")
    prompt.add_argument(
        "--prompt-embeds",
        metavar="FILE",
        help="precomputed embeddings: a .safetensors with 'prompt_embeds' (B|1, L, D) and optionally "
        "'negative_prompt_embeds'; no text encoder is loaded",
    )
    prompt.add_argument("--negative-prompt", help="negative prompt for true CFG (default '' when --cfg-scale > 1)")
    prompt.add_argument(
        "--cfg-scale",
        type=finite_float,
        default=1.0,
        help="true classifier-free guidance scale (two model calls per step); 1 = off. "
        "FLUX.2 Klein base models use ~4, the distilled Klein and dev models 1",
    )
    prompt.add_argument(
        "--guidance",
        type=finite_float,
        help="embedded guidance of FLUX.2 dev (default 4.0); not accepted by Klein (no guidance embedding)",
    )
    sampling = parser.add_argument_group("sampling")
    add_knob(
        sampling,
        STEPS,
        help=f"{STEPS.help}, {STEPS.describe()}; img2img runs them in the window below sigma = 1 - "
        "denoising_start (with --schedule clipped, only the full schedule's points there)",
    )
    add_knob(sampling, SAMPLER)
    add_knob(sampling, SEED, metavar="SEED")
    add_knob(sampling, STRENGTH_MAP)
    add_schedule_arguments(sampling)
    out = parser.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="PATH", help="output image (PNG keeps all parameters as metadata)")
    out.add_argument("--overwrite", action="store_true",
                     help="replace an existing image at the output path that flowlift did not write")  # fmt: skip


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


# --------------------------------------------------------------------------------- schedule options


def mu_option(text: str) -> float | str:
    """``--mu``: ``empirical`` or a finite number in :data:`MU_RANGE` (argparse: one line, exit 2)."""
    if text.strip().lower() == "empirical":
        return "empirical"
    value = finite_float(text)
    if not MU_RANGE[0] <= value <= MU_RANGE[1]:
        raise argparse.ArgumentTypeError(
            f"must be in [{MU_RANGE[0]:g}, {MU_RANGE[1]:g}] (0 = no shift), got {value:g}"
        )
    return value


def add_schedule_arguments(sampling: argparse._ArgumentGroup) -> None:
    """``--mu`` and ``--schedule``: the shift and how a low-strength window is filled (docs/refine.md)."""
    sampling.add_argument(
        "--mu",
        type=mu_option,
        default=DEFAULT_MU,
        metavar="2.02|empirical|FLOAT",
        help=f"schedule shift mu (default {DEFAULT_MU}, InvokeAI's and ComfyUI's FLUX.2 value); 'empirical' = "
        f"diffusers' formula from the image size and --steps (3.23 at 2048 px); a number in "
        f"[{MU_RANGE[0]:g}, {MU_RANGE[1]:g}]",
    )
    add_knob(sampling, SCHEDULE)


def check_mu_for_size(args: argparse.Namespace, width: int, height: int) -> None:
    """``--mu empirical`` at this model size (pixels) must give a mu in range: refused before weights load."""
    if args.mu != "empirical":
        return
    from flowlift.flux2.schedule import resolve_mu

    tokens = -(-height // 16) * -(-width // 16)
    try:
        resolve_mu("empirical", tokens, args.steps)
    except ValueError as error:
        raise FlowliftError(f"--mu: {error} ({width}x{height} px)") from None


# ------------------------------------------------------------------------------------------ helpers


def check_prompt_args(args: argparse.Namespace) -> None:
    if args.prompt is None and args.prompt_embeds is None:
        raise FlowliftError("give --prompt TEXT or --prompt-embeds FILE")
    if args.prompt_embeds is not None and not Path(args.prompt_embeds).is_file():
        raise FlowliftError(f"--prompt-embeds: file not found: {args.prompt_embeds}")
    if args.cfg_scale <= 0:
        raise FlowliftError(f"--cfg-scale must be > 0, got {args.cfg_scale}")
    if args.prompt_embeds is None or (args.cfg_scale != 1.0 and args.negative_prompt is not None):
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            from flowlift.console import install_command

            raise FlowliftError(
                f"--prompt needs the FLUX.2 text encoder, in the text extra ({install_command('text')}); "
                "or pass precomputed --prompt-embeds"
            )


def check_model_sources(args: argparse.Namespace, upscaler: str | None = None) -> Path | None:
    """Every weight the command needs, found before any loads: the transformer, the VAE, the text encoder
    when a prompt is embedded here and (``upscaler``, for hires) the Flow Upscaler; all missing ones are
    named in one message. Returns the upscaler's file when one was asked for."""
    from flowlift.models.weights import require_all
    from flowlift.refine.loading import refiner_weight_checks
    from flowlift.upscale.loading import resolve_upscaler_file

    check_weights_arguments(args)  # --transformer, --lora, --offload, --max-memory: what they name and need
    checks = refiner_weight_checks(
        args.model, vae=args.vae, text_encoder=args.prompt_embeds is None, transformer=args.transformer
    )
    if upscaler is not None:
        checks.append(lambda: resolve_upscaler_file(upscaler))
    found = require_all(checks)
    return found[-1] if upscaler is not None else None


def load_refiner_from_args(args: argparse.Namespace, image_size: tuple[int, int] = (1024, 1024)):
    """Build the refiner and the conditioning kwargs. Prompts given as text are embedded first, by a text encoder
    that is freed before the transformer loads; ``image_size`` (height, width) is what --max-memory plans for."""
    from flowlift.refine.loading import load_refiner
    from flowlift.refine.prompts import embed_prompts, load_prompt_embeds

    device, dtype = resolve_device_dtype(args.device, args.dtype)
    embeds = negative = None
    if args.prompt_embeds is not None:
        embeds, negative = load_prompt_embeds(args.prompt_embeds)
    need_negative = args.cfg_scale != 1.0 and negative is None
    negative_text = args.negative_prompt
    if embeds is None or need_negative:
        negative_text = "" if args.negative_prompt is None and need_negative else args.negative_prompt
        texts = ([args.prompt] if embeds is None else []) + ([negative_text] if need_negative else [])
        encoded = embed_prompts(args.model, texts, device=device, dtype=dtype)
        embeds = encoded.pop(0) if embeds is None else embeds
        negative = encoded.pop(0) if need_negative else negative
    refiner = load_refiner(
        args.model,
        vae=args.vae,
        device=device,
        dtype=dtype,
        progress=show_progress(args),
        **weights_kwargs(args, image_size, text_tokens=embeds.shape[1]),
    )
    conditioning: dict[str, Any] = {
        "prompt": args.prompt,
        "prompt_embeds": embeds,
        "negative_prompt": negative_text,
        "negative_prompt_embeds": negative,
        "cfg_scale": args.cfg_scale,
        "guidance": args.guidance,
    }
    return refiner, conditioning


def check_output(path: Path, overwrite: bool = False) -> None:
    """The output path is writable in a format flowlift writes, and replacing what is there destroys
    nothing of the user's: an existing whole image without flowlift's metadata needs ``overwrite``
    (empty or broken files, and flowlift's own earlier results, are replaced)."""
    from flowlift.files.atomic import remove_stale_temporaries
    from flowlift.files.image_outputs import inspect_existing
    from flowlift.files.images import IMAGE_SUFFIXES

    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise FlowliftError(f"--output {path}: unsupported image format {path.suffix or '(none)'}")
    if path.is_dir():
        raise FlowliftError(f"--output {path} is a directory")
    remove_stale_temporaries(path.parent)  # a killed run's debris (never a live writer's)
    if path.is_file() and not overwrite:
        found = inspect_existing(path)
        if found.image and found.complete and not found.by_flowlift:
            raise FlowliftError(
                f"--output {path} exists and was not written by flowlift; use --overwrite to replace it"
            )


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
    check_output(output, args.overwrite)
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

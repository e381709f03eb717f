"""What the refine commands share (``img2img`` and ``hires``): the model, prompt, sampling and output
options, and the checks and loading that follow from them. Not a subcommand (the leading underscore
keeps :mod:`flowlift.commands.cli` from listing it); the choices come from torch-free modules
(the knob tables of :mod:`flowlift.refine.settings`, on :mod:`flowlift.flux2.settings`), so ``--help``
imports no torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flowlift.commands._options import (
    add_device_options,
    add_knob,
    finite_float,
    resolve_device_dtype,
)
from flowlift.commands._refine_tiles import add_tile_arguments, check_tile_arguments, tile_kwargs
from flowlift.commands._refine_weights import add_weights_arguments, check_weights_arguments, weights_kwargs
from flowlift.console import show_progress
from flowlift.errors import FlowliftError
from flowlift.knobs import SEED
from flowlift.refine.settings import MU, SAMPLER, SCHEDULE, STEPS, STRENGTH_MAP

#: The knob tables' values (torch-free modules, so --help stays fast).
SAMPLERS = SAMPLER.choices
STRENGTH_MAPS = STRENGTH_MAP.choices
SCHEDULES = SCHEDULE.choices
DEFAULT_MU = MU.default
MU_RANGE = (MU.low, MU.high)

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
    add_tile_arguments(parser)
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
    check_tile_arguments(args)
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
        **tile_kwargs(args),
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


#: The file arguments of the refine commands: an output is never one of them (issue 36.2).
INPUT_OPTIONS = ("image", "mask", "reference", "prompt_embeds", "negative_prompt_embeds", "lora", "model",
                 "transformer", "vae", "upscaler")  # fmt: skip


def refine_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """``{"--image": path, ...}``: every file argument of a refine command that was given."""
    return {f"--{name.replace('_', '-')}": getattr(args, name) for name in INPUT_OPTIONS if getattr(args, name, None)}


def check_output(path: Path, overwrite: bool = False, inputs: dict[str, Any] | None = None) -> None:
    """The output path is writable in a format flowlift writes (name length, folder, what is there:
    :func:`flowlift.files.output_paths.output_file_problem`), is none of ``inputs`` (by identity:
    :func:`flowlift.files.output_paths.same_file_problem`, ``--overwrite`` or not), and replacing what
    is there destroys nothing of the user's: only a regular file may be replaced, and one without
    flowlift's metadata needs ``overwrite`` (an empty file, and flowlift's own earlier results, are
    replaced). Checked before any model loads."""
    from flowlift.files.atomic import remove_stale_temporaries
    from flowlift.files.image_outputs import inspect_existing
    from flowlift.files.images import IMAGE_SUFFIXES
    from flowlift.files.output_paths import check_not_an_input, output_file_problem

    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise FlowliftError(f"--output {path}: unsupported image format {path.suffix or '(none)'}")
    check_not_an_input(path, inputs or {})
    if problem := output_file_problem(path):  # first: a name too long cannot even be looked at
        raise FlowliftError(problem)
    remove_stale_temporaries(path.parent)  # a killed run's debris (never a live writer's)
    if path.is_file() and not overwrite:
        found = inspect_existing(path)
        if not found.empty and not found.by_flowlift:  # the user's: an image, or any other file
            raise FlowliftError(
                f"--output {path} exists and was not written by flowlift; use --overwrite to replace it"
            )

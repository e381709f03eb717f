"""What the refine commands share (``img2img`` and ``hires``): the model, prompt, sampling and output
options, and the settings objects of a :class:`~flowlift.refine.request.RefineRequest` they become (the
request is planned, checked and run by :mod:`flowlift.refine.jobs`). Not a subcommand (the leading underscore
keeps :mod:`flowlift.commands.cli` from listing it); the choices come from torch-free modules
(the knob tables of :mod:`flowlift.refine.settings`, on :mod:`flowlift.flux2.settings`), so ``--help``
imports no torch.
"""

from __future__ import annotations

import argparse
from typing import Any

from flowlift.commands._options import (
    add_device_options,
    add_knob,
    add_vae_option,
    finite_float,
    name_or_path,
    sampling_from_args,
)
from flowlift.commands._refine_tiles import add_tile_arguments
from flowlift.commands._refine_weights import add_weights_arguments
from flowlift.console import show_progress
from flowlift.knobs import SEED
from flowlift.refine.settings import DISTILLED_STEPS, MU, SAMPLER, SCHEDULE, STEPS, STRENGTH_MAP

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
        type=name_or_path,
        required=True,
        metavar="PATH|REPO",
        help="FLUX.2 Klein or dev weights: a diffusers folder or hub id (transformer/ and vae/ subfolders, "
        "e.g. black-forest-labs/FLUX.2-klein-4B), a transformer folder, or a single .safetensors file",
    )
    add_vae_option(model, "default: the model's own vae/ folder")
    add_device_options(model, "transformer and VAE")
    add_weights_arguments(parser)
    add_tile_arguments(parser)
    prompt = parser.add_argument_group("prompt")
    prompt.add_argument("--prompt", help="the prompt (embedded with the model's own text encoder, flowlift[text])")
    prompt.add_argument(
        "--prompt-embeds",
        metavar="FILE",
        help="precomputed embeddings: a .safetensors with 'prompt_embeds' (1, L, D) and optionally "
        "'negative_prompt_embeds' (a batch of 1: one prompt for the one image); no text encoder is loaded",
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
        default=None,  # the model's: the refiner resolves it (SamplingSettings(steps=None))
        help=f"steps of the shifted schedule, {STEPS.describe()}; img2img runs them in the window below sigma = 1 - "
        "denoising_start (with --schedule clipped, only the full schedule's points there) (default: the model's: "
        f"{DISTILLED_STEPS} for a step-distilled Klein, by its model_index.json or a Klein file name without 'base'; "
        f"{STEPS.default} for Klein base and dev)",
    )
    add_knob(sampling, SAMPLER)
    add_knob(sampling, SEED, metavar="SEED")
    add_knob(sampling, STRENGTH_MAP)
    add_schedule_arguments(sampling)
    out = parser.add_argument_group("output")
    out.add_argument(
        "-o",
        "--output",
        type=name_or_path,
        metavar="PATH",
        help="output image (PNG keeps all parameters as metadata; default: beside the input, "
        "<stem>_img2img.png, <stem>_hires<N>x.png ..., by the command)",
    )
    out.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing image at the output path that flowlift did not write",
    )


# --------------------------------------------------------------------------------- schedule options


def add_schedule_arguments(sampling: argparse._ArgumentGroup) -> None:
    """``--mu`` and ``--schedule``: the shift and how a low-strength window is filled (docs/refine.md), both from
    their knobs (``--mu``: a number in the knob's range, or its word ``empirical``)."""
    add_knob(
        sampling,
        MU,
        metavar="2.02|empirical|FLOAT",
        help=f"schedule shift mu (default {DEFAULT_MU}, InvokeAI's and ComfyUI's FLUX.2 value); 'empirical' = "
        f"diffusers' formula from the image size and --steps (3.23 at 2048 px); {MU.describe()}",
    )
    add_knob(sampling, SCHEDULE)


# ------------------------------------------------------------------------------------ the request


def prompt_request(args: argparse.Namespace) -> Any:
    """The :class:`~flowlift.refine.request.PromptRequest` of ``--prompt --prompt-embeds --negative-prompt
    --cfg-scale --guidance``."""
    from flowlift.refine.request import PromptRequest

    return PromptRequest(args.prompt, args.prompt_embeds, args.negative_prompt, args.cfg_scale, args.guidance)


def refiner_source(args: argparse.Namespace) -> Any:
    """The :class:`~flowlift.refine.request.RefinerSource` of ``--model --vae --transformer --lora --device --dtype
    --offload --max-memory``."""
    from flowlift.refine.request import RefinerSource

    return RefinerSource(
        args.model, args.vae, args.transformer, tuple(args.lora), args.device, args.dtype, args.offload, args.max_memory
    )


def tile_request(args: argparse.Namespace) -> Any:
    """The :class:`~flowlift.refine.tiling.TileRequest` of ``--tile-size --tile-overlap --tile-batch`` (each parsed
    by its knob; the request checks the overlap against the tile when it is made)."""
    from flowlift.refine.tiling import TileRequest

    return TileRequest(args.tile_size, args.tile_overlap, args.tile_batch)


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`~flowlift.refine.request.RefineRequest` fields that ``img2img`` and ``hires`` fill from the same
    options: the prompt, the model, the image and its output, the strength map, the sampling, the tiles, the bar."""
    return {
        "prompt": prompt_request(args),
        "source": refiner_source(args),
        "image": args.image,
        "output": args.output,
        "overwrite": args.overwrite,
        "strength_map": args.strength_map,
        "sampling": sampling_from_args(args),
        "tiles": tile_request(args),
        "progress": show_progress(args),
    }

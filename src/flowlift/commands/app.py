"""``flowlift app``: a local web page for upscaling (and refining with ``--model``), Gradio 6.

Bound to 127.0.0.1 unless ``--host`` says otherwise; a public Gradio share link only with ``--share``.
Every weight the page needs is found at start-up (missing ones: one error line, exit 2); the models
load on the first request and stay loaded for the life of the process.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from flowlift.app.settings import MAX_UPLOAD
from flowlift.commands._options import (
    DEFAULT_VAE,
    add_device_options,
    add_knob,
    add_upscaler_option,
    add_vae_option,
    name_or_path,
    number,
)
from flowlift.knobs import LATENT_UPSCALER

if TYPE_CHECKING:  # the service is imported when the app starts, not when any command's parser is built
    from flowlift.app.service import AppConfig

NAME = "app"
#: A server: its allocator keeps glibc's policy (and gives freed memory back after each request).
LONG_RUNNING = True
HELP = "serve a local web page (Gradio) for upscaling, batches and, with --model, refining"
EXAMPLES = """examples:
  flowlift app                                   # http://127.0.0.1:7860, upscaling with the released weights
  flowlift app --vae taef2 --vae flux2 --upscaler flow_upscaler.safetensors
  flowlift app --model black-forest-labs/FLUX.2-klein-4B   # adds the Refine tab"""


def _port(text: str) -> int:
    value = number(text, int, f"must be a port number in 1..65535, got {text!r}")
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=None, help="port (default: Gradio's, 7860 or the next free)")
    parser.add_argument(
        "--share", action="store_true", help="also open a public *.gradio.live link (off unless given explicitly)"
    )
    add_upscaler_option(parser)
    add_vae_option(
        parser,
        f"repeatable: the VAEs the page offers, the first the default (default {DEFAULT_VAE}, as for flowlift upscale)",
        action="append",
    )
    add_knob(
        parser,
        LATENT_UPSCALER,
        metavar="sesqui:PATH",
        help=f"{LATENT_UPSCALER.help}: the Upscale and Batch tabs offer it for a scale off 2, 4, 8 (default: none)",
    )
    add_device_options(parser, cpu_bf16=True)
    add_knob(parser, MAX_UPLOAD, metavar="MB")
    parser.add_argument(
        "--model",
        type=name_or_path,
        default=None,
        metavar="PATH|REPO",
        help="FLUX.2 Klein/dev weights for the Refine tab (as for flowlift img2img); no Refine tab without it",
    )
    parser.add_argument(
        "--model-vae",
        default=None,
        metavar="SPEC",
        help="the VAE the Refine tab encodes and decodes --model's latents with: flux2, mage, taef2, "
        "a weights file or a folder (default: --model's own vae/ folder)",
    )


def check_weights(config: AppConfig) -> None:
    """Every weight the page will load, found at start-up (the same lookups as ``flowlift upscale`` and
    ``flowlift img2img``): the upscaler, each offered VAE and, with ``--model``, the refiner's transformer
    and VAE. All missing ones are one error line (exit 2) instead of a page whose first click fails."""
    from flowlift.models.weights import require_all
    from flowlift.refine.source_checks import refiner_weight_checks
    from flowlift.upscale.loading import DEFAULT_UPSCALER, upscale_weight_checks

    checks = upscale_weight_checks(config.upscaler or DEFAULT_UPSCALER, config.vaes, config.latent_upscaler)
    if config.model:
        checks += refiner_weight_checks(config.model, vae=config.model_vae)
    require_all(checks)


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from flowlift.errors import FlowliftError

    if importlib.util.find_spec("gradio") is None:  # before anything slow: the fix is an install
        from flowlift.console import install_command

        raise FlowliftError(f"the app needs Gradio 6: {install_command('app')}")
    from flowlift.app.page import build_app, check_bind_address, launch
    from flowlift.app.service import AppConfig, AppService

    # every value checked by the config, as for a Python caller (a missing cuda/mps: one line, now); the errors
    # name its fields, which the command line says as its options (--device, --max-upload-mb, --vae)
    config = AppConfig(
        upscaler=args.upscaler,
        vaes=args.vae or [DEFAULT_VAE],
        device=args.device,
        dtype=args.dtype,
        max_upload_mb=args.max_upload_mb,
        model=args.model,
        model_vae=args.model_vae,
        latent_upscaler=args.latent_upscaler,
    )
    check_bind_address(args.host, args.port)  # a host that does not resolve: one line, not a server retrying
    check_weights(config)
    service = AppService(config)
    try:
        demo = build_app(service)
        try:
            launch(demo, service, host=args.host, port=args.port, share=args.share)
        except OSError as error:  # port taken, address not available
            where = f"{args.host}:{args.port}" if args.port else args.host
            raise FlowliftError(f"cannot serve on {where}: {str(error).splitlines()[0]}") from None
    finally:
        service.close()
    return 0

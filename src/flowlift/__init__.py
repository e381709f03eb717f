"""flowlift: FLUX.2 latent-space image work.

Conventions used everywhere in the package (documented once, here and in the README):

* images are float tensors in [0, 1], NCHW, RGB;
* latents are *normalized*, *unpatchified*, 32-channel FLUX.2 latents at 1/8 of the image size,
  unless a name says otherwise (``packed``: (B, h*w, 128) transformer tokens; ``raw``: the VAE's
  un-normalized output; ``patchified``: (B, 128, H/2, W/2)).

The names a user needs are here (``from flowlift import FlowUpscalerPipeline, load_vae``); each is
imported from its capability package on first use, so ``import flowlift`` stays cheap: it never
imports torch, downloads, allocates large tensors or touches the network. The map of the packages
is docs/architecture.md.
"""

from __future__ import annotations

import signal as _signal
import sys as _sys


def _is_the_program() -> bool:
    """This process is the ``flowlift`` command: the console script (``argv[0]`` named flowlift) or
    ``python [options] -m flowlift`` (or ``-m flowlift.commands.cli``); never a library import, a test runner
    or a host such as ComfyUI."""
    name = _sys.argv[0].replace("\\", "/").rsplit("/", 1)[-1] if _sys.argv and _sys.argv[0] else ""
    if name.removesuffix(".exe").removesuffix("-script.py") == "flowlift":
        return True
    args = list(getattr(_sys, "orig_argv", ())[1:])
    while args and args[0].startswith("-") and args[0] not in ("-c", "-"):
        option = args.pop(0)
        if option.startswith("-m"):
            module = option[2:] or (args[0] if args else "")
            return module in ("flowlift", "flowlift.commands.cli")
        if option in ("-W", "-X") and args:
            args.pop(0)  # the option's value
    return False


def _hold(signum: int, frame: object) -> None:
    """A stop signal (:data:`flowlift.stop_signals.STOP_SIGNALS`) before ``main()`` takes them over: remembered
    (``_hold.held``), and ``main()`` ends the run with status 130 as its first act. Raising here instead would
    print a traceback from the middle of an import, and an inherited SIG_IGN would lose the signal."""
    _hold.held = signum  # type: ignore[attr-defined]


if _is_the_program():  # flowlift's first line: signals are the run's from here on (see commands/cli.py)
    from flowlift.stop_signals import taken_stop_signals as _taken_stop_signals  # no flowlift import before it

    for _signum in _taken_stop_signals():  # a SIGHUP ignored by nohup stays ignored
        _signal.signal(_signum, _hold)

import importlib  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from flowlift.errors import FlowliftError  # noqa: E402
from flowlift.version import __version__  # noqa: E402

#: Public name -> the module that defines it (imported on first access).
_PUBLIC = {
    "FlowUpscalerPipeline": "flowlift.upscale.pipeline",
    "color_fix_image": "flowlift.upscale.colorfix_image",
    "Flux2Refiner": "flowlift.refine.refiner",
    "load_refiner": "flowlift.refine.loading",
    "refine_latents": "flowlift.refine.loop",
    "flux2_sigmas": "flowlift.flux2.schedule",
    "load_vae": "flowlift.models.vae_loading",
    "load_upscaler": "flowlift.models.upscaler_weights",
    "save_upscaler": "flowlift.models.upscaler_weights",
    "FlowUpscalerUNet": "flowlift.models.upscaler_unet",
    "load_image": "flowlift.files.images",
    "save_image_atomic": "flowlift.files.image_outputs",
}

__all__ = [  # grouped as _PUBLIC is
    "FlowliftError",
    "__version__",
    "FlowUpscalerPipeline",
    "color_fix_image",
    "Flux2Refiner",
    "load_refiner",
    "refine_latents",
    "flux2_sigmas",
    "load_vae",
    "load_upscaler",
    "save_upscaler",
    "FlowUpscalerUNet",
    "load_image",
    "save_image_atomic",
]

if TYPE_CHECKING:  # what static tools see; at run time __getattr__ imports on demand
    from flowlift.files.image_outputs import save_image_atomic
    from flowlift.files.images import load_image
    from flowlift.flux2.schedule import flux2_sigmas
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import load_upscaler, save_upscaler
    from flowlift.models.vae_loading import load_vae
    from flowlift.refine.loading import load_refiner
    from flowlift.refine.loop import refine_latents
    from flowlift.refine.refiner import Flux2Refiner
    from flowlift.upscale.colorfix_image import color_fix_image
    from flowlift.upscale.pipeline import FlowUpscalerPipeline


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'flowlift' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})

"""Helpers the door tests share (command lines, configs, stand-ins, the test servers' process handling, shared
checks): each one builds or does one thing the tests would otherwise spell out again. The model and file builders
live in builders.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowlift.training.config import TrainConfig


#: The ComfyUI nodes' inputs in their saved order: saved workflows depend on it (a change is a breaking change
#: for users).
COMFY_WIDGET_ORDER = {
    "FlowliftUpscalerLoader": ["upscaler_name"],
    "FlowliftUpscaleLatent": ["upscaler", "samples", "scale", "seed", "transplant_strength", "chunked"],
    "FlowliftUpscaleImage": [
        "image",
        "upscaler",
        "vae",
        "scale",
        "seed",
        "transplant_strength",
        "color_fix_strength",
        "chunked",
    ],
    "FlowliftColorFix": ["image", "reference", "strength"],
    "FlowliftTAEF2Loader": ["taef2_name"],
    "FlowliftMageVAELoader": ["mage_name"],
}
#: The nodes' optional inputs, in their saved order (absent from a saved workflow: their default).
COMFY_OPTIONAL_INPUTS = {
    "FlowliftUpscaleLatent": ["latent_upscaler", "vae"],
    "FlowliftUpscaleImage": ["latent_upscaler"],
}


def cpu_upscale_options(shared: Path, weights: Path) -> list[str]:
    """``flowlift upscale``'s options for a run on the CPU with the upscaler at ``weights`` and the shared TAEF2."""
    return ["--upscaler", str(weights), "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]


def quiet_train_config(data: Path, output: Path, **values: Any) -> TrainConfig:
    """``flowlift train``'s config (no progress bar) reading ``data`` and writing ``output``, with ``values``."""
    from flowlift.training.config import build_config

    return build_config(None, {"data": str(data), "output": str(output), "progress": False, **values})


def one_crop_dataset_args(images: Path | str, vae: Path | str) -> list[Path | str]:
    """``flowlift dataset images IMAGES --vae VAE``: one 64 px crop an image, on the CPU (values kept as given)."""
    return ["dataset", "images", images, "--vae", vae, "--crop-px", "64", "--crops-per-image", "1", "--device", "cpu"]


def taef2_distill_args(out: Path, shared: Path, teacher: Path) -> list[str]:
    """``flowlift dataset distill -o OUT`` from the transformer folder ``teacher``, encoding with the shared TAEF2."""
    return ["dataset", "distill", "-o", str(out), "--vae", str(shared / "models" / "taef2"), "--teacher", str(teacher)]


def classic_eval_args(photos: Path, scale: int) -> list[str]:
    """``flowlift eval`` of Lanczos and bicubic at ``scale`` on the images in ``photos``, keeping the outputs."""
    return ["eval", "--run", "lanczos,bicubic", "--dataset", str(photos), "--scale", str(scale), "--save-outputs"]


class LocalServer:
    """A test server started on 127.0.0.1:``port`` from its folder ``root``: its process and its log file."""

    #: How many of the log's last lines :meth:`log_tail` gives by default.
    TAIL_LINES = 40

    def __init__(self, root: Path, port: int, process: subprocess.Popen, log: Path) -> None:
        self.root, self.port, self.process, self.log = root, port, process, log
        self.url = f"http://127.0.0.1:{port}"

    def log_tail(self, lines: int | None = None) -> str:
        """The log's last ``lines`` lines (:data:`TAIL_LINES` by default)."""
        count = self.TAIL_LINES if lines is None else lines
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-count:])


def stop_process_group(process: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM to ``process``'s group, SIGKILL after ``grace_s``; returns its exit status (it has exited)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=grace_s)
    assert process.poll() is not None
    return process.returncode


class UnusedVAE:
    """A VAE stand-in (8x) for runs that stay in latent space: any encode or decode fails the test."""

    spatial_factor = 8

    def encode(self, images, tiled=None):
        raise AssertionError("not used")

    def decode(self, latents, tiled=None):
        raise AssertionError("not used")


def assert_refuses_misshapen_inputs(vae) -> None:
    """``vae`` (a loaded flowlift VAE) refuses in one FlowliftError each: an image whose side is no multiple of 16,
    latents whose side is no multiple of 2, and latents of 128 channels (it takes 32)."""
    import pytest
    import torch

    from flowlift.errors import FlowliftError

    with pytest.raises(FlowliftError, match="multiples of 16"):
        vae.encode(torch.rand(1, 3, 24, 32))
    with pytest.raises(FlowliftError, match="multiples of 2"):
        vae.decode(torch.rand(1, 32, 3, 4))
    with pytest.raises(FlowliftError, match="32"):
        vae.decode(torch.rand(1, 128, 4, 4))

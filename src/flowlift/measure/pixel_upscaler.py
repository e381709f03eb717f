"""Pixel super-resolution models (Real-ESRGAN, HAT, SwinIR, 4x-UltraSharp...) through ``spandrel``.

``spandrel`` -- the library ComfyUI and chaiNNer load these models with -- is an optional extra
(``pip install -e ".[pixel]"``) and is imported only when a model is loaded. flowlift reads the file
itself (safetensors, or ``torch.load(weights_only=True)``; pickles that need more are refused) and
hands the state dict to spandrel's architecture registry, so spandrel's own unpickler never runs.

The weights pass the checks every flowlift loader applies (:mod:`flowlift.models.weights`: no
integer or bool tensor where the model holds floats, no NaN or Inf), and whatever the model does
wrong later -- a self-inconsistent file that builds but cannot run, NaN or Inf in its output -- is
one :class:`FlowliftError` line naming the file, never a traceback or a plausible-looking image.

A model runs at its native scale, tiled with overlap when the image is larger than a tile
(:func:`flowlift.measure.tiled_inference.run_tiled`, tile size from the memory a probe pass needs:
:func:`auto_tile_size`), and its
output is resized with Lanczos to the requested scale when that differs from the native one.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowlift.errors import FlowliftError
from flowlift.measure.tiled_inference import (
    DEFAULT_OVERLAP,
    PROBE_SIDE,
    memory_budget,
    peak_bytes_per_pixel,
    run_tiled,
    tile_side_for,
)
from flowlift.models.weights import check_finite_state, dtype_mismatch

MODEL_SUFFIXES = (".safetensors", ".pth", ".pt", ".ckpt", ".bin")


# --------------------------------------------------------------------------------------------------
# reading a model file


def read_model_state(path: str | os.PathLike) -> dict[str, Any]:
    """The state dict in a model file, read without running any pickled code.

    ``.safetensors`` through :mod:`safetensors`; ``.pth`` / ``.pt`` / ``.ckpt`` / ``.bin`` only with
    ``torch.load(weights_only=True)``. A pickle that needs more (pickled classes or code, TorchScript)
    is refused with one :class:`FlowliftError` line. Nested dicts (``params_ema``, ``state_dict``)
    are returned as they are; spandrel's canonicalisation unwraps them.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FlowliftError(f"model file not found: {path}")
    if path.suffix.lower() not in MODEL_SUFFIXES:
        raise FlowliftError(f"{path}: not a model file ({', '.join(MODEL_SUFFIXES)})")
    try:
        if path.suffix.lower() == ".safetensors":
            from safetensors.torch import load_file

            return dict(load_file(str(path), device="cpu"))
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # torch words a cut pickle and one holding code alike: the file tells them apart
        from flowlift.models.pickle_checks import unsafe_globals

        unsafe = unsafe_globals(path)
        if unsafe:
            raise FlowliftError(
                f"{path}: refused: this pickle needs more than torch.load(weights_only=True) allows "
                f"(pickled code or classes: {', '.join(unsafe[:3])}); use a .safetensors export of the model"
            ) from None
        raise FlowliftError(
            f"{path}: cannot read: not a complete PyTorch checkpoint (truncated, corrupt, or another format)"
        ) from None
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise FlowliftError(f"{path}: cannot read: {first}") from None
    if not isinstance(state, dict):
        raise FlowliftError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


# --------------------------------------------------------------------------------------------------
# the model


@dataclass
class PixelUpscaler:
    """A spandrel image model loaded from a local file, with flowlift's tiling and resizing."""

    descriptor: Any
    path: Path
    device: torch.device
    dtype: torch.dtype
    overlap: int = DEFAULT_OVERLAP
    tile: int | None = None  # None: no tiling; set by load_pixel_upscaler ("auto" sizes it by memory)
    _last: tuple[bytes, int, np.ndarray] | None = field(default=None, repr=False)

    @property
    def architecture(self) -> str:
        return str(self.descriptor.architecture.name)

    @property
    def native_scale(self) -> int:
        return int(self.descriptor.scale)

    def describe(self, scale: int) -> str:
        """One line for reports: architecture, native scale, tiling and any resize to ``scale``."""
        tiling = f"tiled above {self.tile} px (overlap {self.overlap} px)" if self.tile else "untiled"
        text = f"{self.architecture}, native {self.native_scale}x, {tiling}"
        if self.native_scale != scale:
            text += f"; resized {self.native_scale}x -> {scale}x with Lanczos"
        return text

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        # spandrel builds whatever the file's shapes describe; a file whose shapes contradict each
        # other (SCUNet with dim 16 < its head size 32) only fails here, in the model's own code
        try:
            return self.descriptor(x)
        except torch.OutOfMemoryError:
            raise FlowliftError(
                f"{self.path}: {self.architecture} ran out of memory on a {x.shape[-2]}x{x.shape[-1]} input; "
                "use a smaller --tile"
            ) from None
        except Exception as error:  # noqa: BLE001 - any failure inside the model is a bad model file
            raise FlowliftError(
                f"{self.path}: {self.architecture} cannot run on a {x.shape[-2]}x{x.shape[-1]} input "
                f"(the file is inconsistent or not a model spandrel runs): {_first_line(error)}"
            ) from None

    def upscale_tensor(self, image: torch.Tensor) -> torch.Tensor:
        """(1, 3, h, w) float in [0, 1] -> (1, 3, h * native_scale, w * native_scale), tiled as set."""
        x = image.to(device=self.device, dtype=self.dtype)
        with torch.no_grad():
            out = run_tiled(self._forward, x, self.native_scale, self.tile, self.overlap)
        if not bool(torch.isfinite(out).all()):  # clamped to uint8 it would pass for an image
            raise FlowliftError(
                f"{self.path}: {self.architecture} gave NaN or Inf for a {x.shape[-2]}x{x.shape[-1]} input "
                f"(in {str(self.dtype).removeprefix('torch.')}; try --dtype float32)"
            )
        return out

    def upscale(self, image: np.ndarray, scale: float) -> np.ndarray:
        """uint8 HWC RGB in, uint8 HWC RGB out at ``scale`` times the size (rounded): the model at its native
        scale, then a Lanczos resize when ``scale`` differs. The last result is kept, so a method and
        its ``+colorfix`` variant run the model once."""
        from PIL import Image

        from flowlift.files.images import tensor_to_uint8, to_tensor

        digest = image.tobytes()
        if self._last is not None and self._last[0] == digest and self._last[1] == scale:
            return self._last[2]
        out = tensor_to_uint8(self.upscale_tensor(to_tensor(image)).float())[0]
        h, w = image.shape[:2]
        size = (int(round(w * scale)), int(round(h * scale)))
        if out.shape[:2] != size[::-1]:
            out = np.asarray(Image.fromarray(out).resize(size, Image.Resampling.LANCZOS))
        self._last = (digest, scale, out)
        return out


def load_pixel_upscaler(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    tile: int | str | None = "auto",
    overlap: int = DEFAULT_OVERLAP,
) -> PixelUpscaler:
    """Load a single-image super-resolution model from a local file with spandrel.

    The file is read by :func:`read_model_state`; spandrel detects the architecture. Models that are
    not single-image RGB models (inpainting, masks, grayscale) are refused with one line. ``tile``:
    an input-pixel side, ``None`` (never tile) or ``"auto"`` (:func:`auto_tile_size`; models that
    tile internally are not tiled again).
    """
    state = read_model_state(path)
    try:
        import spandrel
    except ImportError as error:
        from flowlift.console import install_command

        hint = install_command("pixel")
        raise FlowliftError(f"spandrel: methods need the optional extra: {hint} ({error})") from None
    device = torch.device(device)
    try:
        state = spandrel.canonicalize_state_dict(state)
        tensors = {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
        check_finite_state(tensors, what=f"{path}: weights")
        descriptor = spandrel.ModelLoader(device="cpu").load_from_state_dict(state)
    except FlowliftError:
        raise
    except spandrel.UnsupportedModelError:
        raise FlowliftError(f"{path}: spandrel does not recognise this model's architecture") from None
    except Exception as error:  # noqa: BLE001 - whatever the architecture's builder trips on is a bad file
        raise FlowliftError(f"{path}: spandrel cannot build the model: {_first_line(error)}") from None
    # load_state_dict has already cast an int8 file into the float model, silently: refuse it by the file's dtypes
    problem = dtype_mismatch(descriptor.model, tensors)
    if problem:
        raise FlowliftError(f"{path}: weights do not fit {descriptor.architecture.name}: {problem}")
    if not isinstance(descriptor, spandrel.ImageModelDescriptor):
        raise FlowliftError(f"{path}: {descriptor.architecture.name} is not a single-image model")
    if descriptor.input_channels != 3 or descriptor.output_channels != 3:
        raise FlowliftError(
            f"{path}: {descriptor.architecture.name} takes {descriptor.input_channels} and gives "
            f"{descriptor.output_channels} channels; only RGB models are supported"
        )
    try:
        descriptor.to(device=device, dtype=dtype)
    except spandrel.UnsupportedDtypeError as error:
        raise FlowliftError(f"{path}: {error}") from None
    if dtype != torch.float32:  # float16 overflows past 65504: a finite file can become Inf here
        cast = str(dtype).removeprefix("torch.")
        check_finite_state(descriptor.model.state_dict(), what=f"{path}: weights in {cast}")
    descriptor.eval()
    model = PixelUpscaler(descriptor, Path(path), device, dtype, overlap=overlap)
    if tile == "auto":
        internal = descriptor.tiling == spandrel.ModelTiling.INTERNAL
        model.tile = None if internal else auto_tile_size(model)
    elif tile is not None:
        model.tile = int(tile)
        if model.tile - 2 * overlap < 1:
            raise FlowliftError(f"tile {tile} must exceed twice the overlap ({overlap})")
    return model


def _first_line(error: BaseException) -> str:
    """An exception's type and the first and last non-empty lines of its text (einops puts the
    pattern first and the actual mismatch last), as one line."""
    lines = [line.strip()[:200] for line in str(error).splitlines() if line.strip()]
    text = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def auto_tile_size(model: PixelUpscaler) -> int:
    """Tile side (input pixels) from the probe's peak memory per pixel and :func:`memory_budget`."""
    requirements = model.descriptor.size_requirements
    side = max(PROBE_SIDE, requirements.minimum)
    side += -side % requirements.multiple_of
    per_pixel = peak_bytes_per_pixel(model._forward, model.device, model.dtype, side)
    return tile_side_for(
        per_pixel, memory_budget(model.device), model.overlap, requirements.multiple_of, requirements.minimum
    )

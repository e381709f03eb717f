"""Pixel super-resolution models (Real-ESRGAN, HAT, SwinIR, 4x-UltraSharp...) through ``spandrel``.

``spandrel`` -- the library ComfyUI and chaiNNer load these models with -- is an optional extra
(``pip install -e ".[pixel]"``) and is imported only when a model is loaded. flowlift reads the file
itself (safetensors, or ``torch.load(weights_only=True)``; pickles that need more are refused) and
hands the state dict to spandrel's architecture registry, so spandrel's own unpickler never runs.

A model runs at its native scale, tiled with overlap when the image is larger than a tile
(:func:`run_tiled`, tile size from the memory a probe pass needs: :func:`auto_tile_size`), and its
output is resized with Lanczos to the requested scale when that differs from the native one.
"""

from __future__ import annotations

import math
import os
import pickle
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowlift.errors import FlowliftError

MODEL_SUFFIXES = (".safetensors", ".pth", ".pt", ".ckpt", ".bin")
#: Input pixels of context kept on each side of a tile's core (see :func:`tile_spans`).
DEFAULT_OVERLAP = 32
#: Side of the square probe tile whose peak memory sizes the tiles.
PROBE_SIDE = 64
MAX_TILE_SIDE = 2048
#: Share of the free memory a tile may take (CUDA: free device memory; CPU: available RAM, capped).
MEMORY_SHARE = 0.5
CPU_BUDGET_CAP = 4 << 30


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
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error) or "Weights only" in str(error):
            raise FlowliftError(
                f"{path}: refused: this pickle needs more than torch.load(weights_only=True) allows "
                "(pickled code or classes); use a .safetensors export of the model"
            ) from None
        raise FlowliftError(f"{path}: cannot read: {str(error).splitlines()[0][:200]}") from None
    except Exception as error:  # noqa: BLE001 - any reader failure is a bad file to the user
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise FlowliftError(f"{path}: cannot read: {first}") from None
    if not isinstance(state, dict):
        raise FlowliftError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


# --------------------------------------------------------------------------------------------------
# tiling


def tile_spans(length: int, tile: int, overlap: int) -> list[tuple[int, int, int, int]]:
    """Tiles along one axis: ``(core_start, core_end, context_start, context_end)`` in input pixels.

    The cores (``tile - 2 * overlap`` long, the last one shorter) partition ``[0, length)``; each
    context window is ``tile`` long (or ``length`` when the axis fits in one tile), contains its core
    and reaches at least ``overlap`` pixels past it on every side that is not the image border. So a
    model whose receptive field reaches at most ``overlap`` input pixels gives every core pixel the
    same value tiled as untiled.
    """
    if length <= tile:
        return [(0, length, 0, length)]
    core = tile - 2 * overlap
    if core < 1:
        raise FlowliftError(f"tile {tile} leaves no core inside an overlap of {overlap} on both sides")
    spans = []
    for start in range(0, length, core):
        end = min(length, start + core)
        context = min(max(0, start - overlap), length - tile)
        spans.append((start, end, context, context + tile))
    return spans


def run_tiled(
    model: Callable[[torch.Tensor], torch.Tensor],
    image: torch.Tensor,
    scale: int,
    tile: int | None,
    overlap: int = DEFAULT_OVERLAP,
) -> torch.Tensor:
    """``model`` (``(1, C, h, w) -> (1, C, h * scale, w * scale)``) over ``image`` in overlapping tiles.

    Each output pixel is taken from the tile in whose core it lies (:func:`tile_spans`), without
    blending: with an ``overlap`` at least the model's receptive radius (in input pixels) the result
    equals ``model(image)``; with less, seams differ by what the model draws from beyond the tile.
    ``tile=None`` or an image within one tile runs the model once on the whole image.
    """
    height, width = image.shape[-2:]
    if tile is None or (height <= tile and width <= tile):
        return model(image)
    rows, cols = tile_spans(height, tile, overlap), tile_spans(width, tile, overlap)
    out = None
    for r0, r1, y0, y1 in rows:
        for c0, c1, x0, x1 in cols:
            piece = model(image[..., y0:y1, x0:x1])
            if piece.shape[-2:] != ((y1 - y0) * scale, (x1 - x0) * scale):
                raise FlowliftError(
                    f"model returned {tuple(piece.shape[-2:])} for a {y1 - y0}x{x1 - x0} tile at scale {scale}"
                )
            if out is None:
                out = piece.new_empty(*piece.shape[:2], height * scale, width * scale)
            out[..., r0 * scale : r1 * scale, c0 * scale : c1 * scale] = piece[
                ..., (r0 - y0) * scale : (r1 - y0) * scale, (c0 - x0) * scale : (c1 - x0) * scale
            ]
    assert out is not None
    return out


class _PeakTensorMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages created by the ops run under this mode (any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], list[int]] = {}  # (device, data_ptr) -> [bytes, refs]
        self.current = 0
        self.peak = 0

    def _release(self, key: tuple[str, int]) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key = (str(value.device), storage.data_ptr())
                if key in self.live:
                    self.live[key][1] += 1
                else:
                    self.live[key] = [storage.nbytes(), 1]
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                weakref.finalize(value, self._release, key)
        return result


def peak_bytes_per_pixel(
    model: Callable[[torch.Tensor], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    side: int = PROBE_SIDE,
    channels: int = 3,
) -> float:
    """Peak extra memory of one ``model`` call per input pixel, measured on a ``side`` x ``side`` probe.

    CUDA: ``torch.cuda.max_memory_allocated`` above the memory in use before the call. Elsewhere:
    the peak of the live tensors the call's operators create (a dispatch mode tracking storages),
    which leaves out kernels' internal scratch memory.
    """
    probe = torch.rand(1, channels, side, side, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    with torch.no_grad():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            model(probe)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            tracker = _PeakTensorMemory()
            with tracker:
                model(probe)
            peak = tracker.peak
    return max(float(peak), 1.0) / (side * side)


def memory_budget(device: torch.device) -> int:
    """Bytes one tile may use: :data:`MEMORY_SHARE` of the free CUDA memory, or of the available RAM
    capped at :data:`CPU_BUDGET_CAP` (the machine is shared with the rest of the process)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(MEMORY_SHARE * free)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 2 * CPU_BUDGET_CAP
    return int(min(CPU_BUDGET_CAP, MEMORY_SHARE * available))


def tile_side_for(bytes_per_pixel: float, budget: int, overlap: int, multiple_of: int = 1, minimum: int = 0) -> int:
    """Largest square tile side ``t`` with ``t * t * bytes_per_pixel <= budget``, rounded down to
    ``multiple_of``, at least ``max(2 * overlap + 32, minimum)`` and at most :data:`MAX_TILE_SIDE`."""
    side = int(math.sqrt(budget / max(bytes_per_pixel, 1e-9)))
    side = min(MAX_TILE_SIDE, side)
    side = max(side, 2 * overlap + 32, minimum)
    return max(multiple_of, side - side % multiple_of)


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
        return self.descriptor(x)

    def upscale_tensor(self, image: torch.Tensor) -> torch.Tensor:
        """(1, 3, h, w) float in [0, 1] -> (1, 3, h * native_scale, w * native_scale), tiled as set."""
        x = image.to(device=self.device, dtype=self.dtype)
        with torch.no_grad():
            return run_tiled(self._forward, x, self.native_scale, self.tile, self.overlap)

    def upscale(self, image: np.ndarray, scale: int) -> np.ndarray:
        """uint8 HWC RGB in, uint8 HWC RGB out at ``scale`` times the size: the model at its native
        scale, then a Lanczos resize when ``scale`` differs. The last result is kept, so a method and
        its ``+colorfix`` variant run the model once."""
        from PIL import Image

        from flowlift.images import tensor_to_uint8, to_tensor

        digest = image.tobytes()
        if self._last is not None and self._last[0] == digest and self._last[1] == scale:
            return self._last[2]
        out = tensor_to_uint8(self.upscale_tensor(to_tensor(image)).float())[0]
        h, w = image.shape[:2]
        if out.shape[:2] != (h * scale, w * scale):
            out = np.asarray(Image.fromarray(out).resize((w * scale, h * scale), Image.Resampling.LANCZOS))
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
        raise FlowliftError(
            f"spandrel: methods need the optional extra: pip install -e \".[pixel]\" ({error})"
        ) from None
    device = torch.device(device)
    try:
        descriptor = spandrel.ModelLoader(device="cpu").load_from_state_dict(spandrel.canonicalize_state_dict(state))
    except spandrel.UnsupportedModelError:
        raise FlowliftError(f"{path}: spandrel does not recognise this model's architecture") from None
    except (KeyError, RuntimeError, ValueError, AssertionError) as error:
        first = str(error).splitlines()[0][:200] if str(error) else type(error).__name__
        raise FlowliftError(f"{path}: spandrel cannot build the model: {first}") from None
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


def auto_tile_size(model: PixelUpscaler) -> int:
    """Tile side (input pixels) from the probe's peak memory per pixel and :func:`memory_budget`."""
    requirements = model.descriptor.size_requirements
    side = max(PROBE_SIDE, requirements.minimum)
    side += -side % requirements.multiple_of
    per_pixel = peak_bytes_per_pixel(model._forward, model.device, model.dtype, side)
    return tile_side_for(
        per_pixel, memory_budget(model.device), model.overlap, requirements.multiple_of, requirements.minimum
    )

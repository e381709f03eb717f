"""Tiled inference for image-to-image models of integer scale, with tiles sized by memory.

* :func:`tile_spans` / :func:`run_tiled`: overlapping tiles whose cores partition the image; each
  output pixel comes from the tile it lies in the core of, so a model whose receptive field reaches
  at most ``overlap`` input pixels gives exactly its untiled result.
* :func:`peak_bytes_per_pixel`, :func:`memory_budget`, :func:`tile_side_for`: the largest tile a
  probe pass's peak memory says fits in a share of the free memory.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowlift.errors import FlowliftError

#: Input pixels of context kept on each side of a tile's core (see :func:`tile_spans`).
DEFAULT_OVERLAP = 32
#: Side of the square probe tile whose peak memory sizes the tiles.
PROBE_SIDE = 64
MAX_TILE_SIDE = 2048
#: Share of the free memory a tile may take (CUDA: free device memory; CPU: available RAM, capped).
MEMORY_SHARE = 0.5
CPU_BUDGET_CAP = 4 << 30


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

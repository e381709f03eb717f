"""Device memory of a chunked UNet pass: byte estimates, when to chunk, and how tall a strip may be.

Pure arithmetic on sizes and dtypes (plus, without a budget, the free CUDA memory): the plain forward's
peak, the :class:`~flowlift.upscale.chunked.executor.ChunkedExecutor`'s full-frame stores and per-row strip
temporaries (frame counts calibrated by ``benchmarks/calibrate_memory.py``), and the strip heights they
allow. :mod:`flowlift.upscale.memory_plan` plans a whole upscale on these numbers.
"""

from __future__ import annotations

import torch

from flowlift.limits import dtype_bytes

__all__ = [
    "CHUNKED_STORE_FRAMES",
    "CUDA_BUDGET_FRACTION",
    "DEFAULT_CPU_BUDGET_BYTES",
    "DEFAULT_STRIP_PIXELS",
    "MIN_DEVICE_STRIP_ROWS",
    "PLAIN_PEAK_FRAMES",
    "STRIP_ROW_FRAMES",
    "chunked_store_bytes",
    "default_budget_bytes",
    "default_chunk",
    "frame_bytes",
    "plain_peak_bytes",
    "should_chunk",
    "strip_bytes_per_row",
    "strip_rows_for_budget",
]

#: Plain forward's activation peak in (B, base_channels, H, W) frames (fp32, CPU, 2048 px output; docs/unet.md).
PLAIN_PEAK_FRAMES = 10.0
#: ChunkedExecutor's full-frame stores in the same unit (two frames at the full-resolution level plus the
#: long skip, the lower levels' frames and the conditioning features). Measured on the CPU (peak RSS, fp32,
#: base 64, 256x256 latent, benchmarks/calibrate_memory.py): about 2.3 frames; the H200 run of issue 13
#: (16384^2, bf16) measured 7.3 GiB = 2.4 frames including the strips.
CHUNKED_STORE_FRAMES = 2.5
#: ChunkedExecutor's strip temporaries per output row, in (B, base_channels, 1, W) rows: the up stage's
#: first block reads two parts with a halo, normalizes each and convolves them (inputs, normalized
#: copies, partial sums), and the strip being written back (plus, offloaded, the predicted next strip).
#: Measured 4-8.5 per row on the CPU (same run); 12 keeps a margin.
STRIP_ROW_FRAMES = 12.0
#: Below this many rows per strip at the output resolution a device-resident chunked run is all kernel
#: launches; offloading the stores buys taller strips from the same budget.
MIN_DEVICE_STRIP_ROWS = 8

# Default strip size on the CPU: this many latent pixels per strip at the output resolution (64 rows
# at 1024 px output, 32 at 2048 px, 4 at 16K): ~12 MiB per 384-channel fp32 strip temporary, sized
# for CPU caches. On a GPU strips are sized from the memory budget instead (:func:`strip_rows_for_budget`).
DEFAULT_STRIP_PIXELS = 8192
DEFAULT_CPU_BUDGET_BYTES = 1 << 30
CUDA_BUDGET_FRACTION = 0.5


def frame_bytes(batch: int, channels: int, height: int, width: int, dtype: torch.dtype) -> int:
    """Bytes of a (batch, channels, height, width) tensor: ``b * c * h * w * itemsize``."""
    return batch * channels * height * width * dtype_bytes(dtype)


def plain_peak_bytes(
    height: int, width: int, *, batch: int = 1, base_channels: int = 384, dtype: torch.dtype = torch.float32
) -> int:
    """Estimated activation peak of the plain forward for a (batch, 32, height, width) sample.

    ``PLAIN_PEAK_FRAMES * batch * base_channels * height * width * itemsize``.
    """
    return int(PLAIN_PEAK_FRAMES * frame_bytes(batch, base_channels, height, width, dtype))


def chunked_store_bytes(
    height: int, width: int, *, batch: int = 1, base_channels: int = 384, dtype: torch.dtype = torch.float32
) -> int:
    """ChunkedExecutor's full-frame stores: ``CHUNKED_STORE_FRAMES * b * base * h * w * itemsize``."""
    return int(CHUNKED_STORE_FRAMES * frame_bytes(batch, base_channels, height, width, dtype))


def strip_bytes_per_row(
    width: int, *, batch: int = 1, base_channels: int = 384, dtype: torch.dtype = torch.float32
) -> int:
    """Strip temporaries per output row: ``STRIP_ROW_FRAMES * b * base * w * itemsize``.

    Lower-resolution levels take proportionally more rows per strip, so a strip's bytes are about the
    same at every level.
    """
    return int(STRIP_ROW_FRAMES * frame_bytes(batch, base_channels, 1, width, dtype))


def strip_rows_for_budget(
    budget_bytes: int,
    height: int,
    width: int,
    *,
    offloaded: bool,
    batch: int = 1,
    base_channels: int = 384,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Rows per strip (at the output resolution) for a (batch, 32, height, width) sample when the executor may
    use ``budget_bytes``.

    The stores (:func:`chunked_store_bytes`, none when ``offloaded``) come off the budget first; the rest is
    strip temporaries: ``clamp(floor(rest / strip_bytes_per_row(width)) - 2, 1, height)`` (two rows of halo);
    at least one row, even when the budget is smaller (the caller decides whether that is acceptable).
    """
    sizes = {"batch": batch, "base_channels": base_channels, "dtype": dtype}
    stores = 0 if offloaded else chunked_store_bytes(height, width, **sizes)
    per_row = strip_bytes_per_row(width, **sizes)
    rows = int((budget_bytes - stores) // max(1, per_row)) - 2
    return max(1, min(height, rows))


def should_chunk(
    height: int,
    width: int,
    device: str | torch.device,
    *,
    batch: int = 1,
    base_channels: int = 384,
    dtype: torch.dtype = torch.float32,
    force: bool | None = None,
    budget_bytes: int | None = None,
) -> bool:
    """Whether to run the UNet through :class:`ChunkedExecutor` for a sample of ``height x width`` latents.

    ``force=True``/``False`` forces or forbids chunking. Otherwise chunk when :func:`plain_peak_bytes`
    exceeds ``budget_bytes``; by default that is ``CUDA_BUDGET_FRACTION`` of the free memory of a CUDA
    device, and ``DEFAULT_CPU_BUDGET_BYTES`` (1 GiB: above about 2100 px output in fp32) elsewhere.
    """
    if force is not None:
        return bool(force)
    need = plain_peak_bytes(height, width, batch=batch, base_channels=base_channels, dtype=dtype)
    return need > default_budget_bytes(device, budget_bytes)


def default_budget_bytes(device: str | torch.device, budget_bytes: int | None = None) -> int:
    """What a stage may hold without a ``max_memory`` plan: ``budget_bytes`` when given, else
    ``CUDA_BUDGET_FRACTION`` of a CUDA device's free memory, else ``DEFAULT_CPU_BUDGET_BYTES``."""
    if budget_bytes is not None:
        return budget_bytes
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_BUDGET_FRACTION)
    return DEFAULT_CPU_BUDGET_BYTES


def default_chunk(width: int) -> int:
    """Rows per strip at the output resolution on the CPU: ``max(1, DEFAULT_STRIP_PIXELS // width)``."""
    return max(1, DEFAULT_STRIP_PIXELS // max(1, width))

"""The limits and the byte arithmetic that the upscaler and the refiner share, below both of them.

The output cap (:data:`MAX_OUTPUT_SIDE`), the ``--max-memory`` size parser and the estimates both memory
plans count with (a dtype's bytes, a model's bytes, a VAE decode's peak). Here rather than in
:mod:`flowlift.upscale` so that :mod:`flowlift.refine` and :mod:`flowlift.upscale` are siblings: neither
imports the other. Nothing here imports torch at import time (the commands' ``--help`` reads this module).

Sizes: image sizes are pixels; ``frame = b * h * w``; ``itemsize`` is a dtype's bytes per element.
"""

from __future__ import annotations

import re
from typing import Any

from flowlift.errors import FlowliftError

__all__ = [
    "DECODE_PLAIN_CHANNELS",
    "DECODE_TILE_BYTES",
    "MAX_OUTPUT_SIDE",
    "decode_peak_bytes",
    "dtype_bytes",
    "format_bytes",
    "model_bytes",
    "parse_memory",
    "vae_kind",
]

#: The largest output side flowlift writes (16K): upscale passes stop before it, an outpaint canvas stays in it.
MAX_OUTPUT_SIDE = 16384
#: Latent channels of a FLUX.2 latent (what a decode reads).
_LATENT_CHANNELS = 32
#: Decoder activation peak per output pixel, in channels of the VAE's dtype (whole-frame decode): TAEF2's
#: 8x stage runs 64-channel convolutions at full resolution (input, output, a residual), the FLUX.2 VAE's
#: last up block 128 channels plus a GroupNorm copy.
DECODE_PLAIN_CHANNELS = {"taef2": 3 * 64, "flux2": 4 * 128}
#: Tiled decode's working set besides the latent and the output image: one tile's activations.
#: TAEF2: bands of 128x128 latent px (64 ch at 2x/4x) and 64x64-latent tiles at 8x; FLUX.2 VAE (diffusers
#: tiling): 512 px tiles through 128-512 channels.
DECODE_TILE_BYTES = {"taef2": 600 << 20, "flux2": 2 << 30}

_UNITS = {
    "": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
    "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_memory(value: str | int | float) -> int:
    """Bytes from ``6GB``, ``6.5 GiB``, ``512MB``, ``3g`` or a plain number of bytes.

    Decimal units (k, M, G, T, with or without ``B``) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB) powers of 1024, so ``6GB`` = 6e9 bytes (5.59 GiB). Anything else, or a value below 1 MB, is one
    :class:`FlowliftError` line.
    """
    if isinstance(value, bool):
        raise FlowliftError(f"max_memory must be a size like 6GB, got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise FlowliftError(f"max_memory must be a size like 6GB, 512MiB or a number of bytes, got {value!r}")
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size < 10**6:
        raise FlowliftError(f"max_memory {value!r} is below 1 MB; give a unit, e.g. 6GB")
    return size


def format_bytes(size: int | float) -> str:
    """``size`` in GiB/MiB with two decimals (``6.00 GiB``), for messages."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype (``itemsize``)."""
    import torch

    return torch.empty((), dtype=dtype).element_size()


def decode_peak_bytes(vae_kind: str, height: int, width: int, *, batch: int = 1, dtype: Any = None,
                      tiled: bool) -> int:  # fmt: skip
    """Device peak of decoding a (batch, 32, height/8, width/8) latent to a (batch, 3, height, width) image.

    Whole frame: ``b * h * w * itemsize * (DECODE_PLAIN_CHANNELS + 3)``. Tiled: the output image and
    the latent plus one tile's working set, ``b * h * w * itemsize * (3 + 32/64) + DECODE_TILE_BYTES``.
    Unknown VAEs are costed like the FLUX.2 VAE (the larger one); ``dtype`` None is float32.
    """
    kind = vae_kind if vae_kind in DECODE_PLAIN_CHANNELS else "flux2"
    pixels = batch * height * width
    itemsize = 4 if dtype is None else dtype_bytes(dtype)
    if tiled:
        return int(pixels * itemsize * (3 + _LATENT_CHANNELS / 64) + DECODE_TILE_BYTES[kind])
    return int(pixels * itemsize * (DECODE_PLAIN_CHANNELS[kind] + 3))


def model_bytes(model: object) -> int:
    """Bytes of a module's parameters and buffers (0 for anything without them)."""
    total = 0
    for attr in ("parameters", "buffers"):
        tensors = getattr(model, attr, None)
        if callable(tensors):
            total += sum(t.numel() * t.element_size() for t in tensors())
    inner = getattr(model, "model", None)  # flowlift's VAE adapters hold the module as .model
    if total == 0 and inner is not None and inner is not model:
        return model_bytes(inner)
    return total


def vae_kind(vae: object) -> str:
    """``"taef2"`` for flowlift's TAEF2 adapter, else ``"flux2"`` (the larger decoder, costed conservatively)."""
    return "taef2" if type(vae).__name__.upper().startswith("TAEF2") else "flux2"

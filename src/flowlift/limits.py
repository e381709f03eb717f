"""The limits and the byte arithmetic that the upscaler and the refiner share, below both of them.

The output cap (:data:`MAX_OUTPUT_SIDE`), the FLUX.2 latent geometry both work on (:data:`LATENT_CHANNELS`,
the 16-px grid :data:`PIXEL_MULTIPLE`), the one scale -> passes rule (:func:`passes_for_scale`), the
``--max-memory`` size parser and the estimates both memory plans count with (a dtype's bytes, a model's bytes, a
VAE encode's and decode's peaks). Here rather than in
:mod:`flowlift.upscale` so that :mod:`flowlift.refine` and :mod:`flowlift.upscale` are siblings: neither
imports the other. Nothing here imports torch at import time (the commands' ``--help`` reads this module).

Sizes: image sizes are pixels; ``frame = b * h * w``; ``itemsize`` is a dtype's bytes per element.
"""

from __future__ import annotations

import math
import re
from typing import Any

from flowlift.errors import FlowliftError

__all__ = [
    "cap_words",
    "DECODE_PLAIN_CHANNELS",
    "DECODE_TILE_BYTES",
    "ENCODE_PLAIN_CHANNELS",
    "ENCODE_TILED_CHANNELS",
    "ENCODE_TILE_VALUES",
    "LATENT_CHANNELS",
    "MAX_OUTPUT_SIDE",
    "PIXEL_MULTIPLE",
    "SESQUI_MIN_SIDE",
    "TAEF2_LATENT_STAGE_CHANNELS",
    "decode_peak_bytes",
    "decoded_image_dtype",
    "dtype_bytes",
    "encode_peak_bytes",
    "format_bytes",
    "hires_size_or_refuse",
    "model_bytes",
    "parse_memory",
    "passes_for_scale",
    "vae_kind",
]

#: The largest output side flowlift writes (16K): upscale passes stop before it, an outpaint canvas stays in it.
MAX_OUTPUT_SIDE = 16384


#: SesquiLSR's smallest latent side (its 3x3 and 5x5 reflection pads need a side longer than the pad): here, torch-free,
#: so that the upscale plan refuses a small input before any model loads.
SESQUI_MIN_SIDE = 3


def cap_words(max_side: int = MAX_OUTPUT_SIDE) -> str:
    """The cap as every message says it, by its value (never the constant's name): ``the 16384 px cap a side``."""
    return f"the {max_side} px cap a side"


#: Channels of a FLUX.2 latent (normalized, unpatchified, at 1/8 of the image's size): what every VAE here encodes
#: to, the Flow Upscaler's samples, the transformer's latents before its 2x2 patches.
LATENT_CHANNELS = 32
#: The grid FLUX.2 images live on: the VAE's 8x times the 2x2 patches (the transformer's tokens, the Flow
#: Upscaler's one 2x level). Image sides, tile sides and tile offsets are multiples of it.
PIXEL_MULTIPLE = 16
#: Mage-VAE, measured on the CPU in float32 (benchmarks/bench_vae.py, benchmarks/bench_mage_tiling.py,
#: docs/vae.md): the whole-frame decode peak per output pixel in values (the per-pixel MLP's 32-wide features,
#: their adaLN modulations, the MLP's hidden and output, RGB: 288-325 measured at 1 Mpx, contiguous and
#: channels-last; costed at 352), and the tiled decode's working set beside the frame-sized tensors.
MAGE_PLAIN_CHANNELS = 11 * 32
MAGE_TILE_BYTES = 768 << 20
#: Decoder activation peak per output pixel, in channels of the VAE's dtype (whole-frame decode): TAEF2's
#: 8x stage runs 64-channel convolutions at full resolution (input, output, a residual), the FLUX.2 VAE's
#: last up block 128 channels plus a GroupNorm copy; Mage-VAE's per-pixel MLP holds about a dozen
#: 32-feature tensors per pixel (measured 1.13 KB/px in float32 at 1024²).
DECODE_PLAIN_CHANNELS = {"taef2": 3 * 64, "flux2": 4 * 128, "mage": MAGE_PLAIN_CHANNELS}
#: Tiled decode's working set besides the latent and the output image: one tile's activations.
#: TAEF2: bands of 128x128 latent px (64 ch at 2x/4x) and 64x64-latent tiles at 8x; FLUX.2 VAE (diffusers'
#: tiles of ``tile_sample_min_size`` px through 128-512 channels, run by :mod:`flowlift.models.flux2_tiling`, which
#: also keeps a strip of the blend's rows across the frame: ~34 MB at 16384 px wide in bfloat16); Mage-VAE: a
#: 128x128-position tile through the DiCo MLP or a 32x32-position (512 px) tile of the per-pixel MLP (measured
#: <= 581 MB at 2560²).
DECODE_TILE_BYTES = {"taef2": 600 << 20, "flux2": 2 << 30, "mage": MAGE_TILE_BYTES}
#: TAEF2's tiled decode runs its latent-resolution stage (the GroupNorm blocks) on the whole frame first and holds
#: that 64-channel output while the bands run (:meth:`flowlift.models.taef2.TAEF2.decode_tiled`).
TAEF2_LATENT_STAGE_CHANNELS = 64
#: Mage-VAE's tiled decode also holds, for one sample at a time, three (384, h/16, w/16) stores:
#: ``3 * 384 / 256`` values per output pixel (:mod:`flowlift.models.mage_tiling`), and the patchified
#: copy of the latent (another ``32 / 64`` per pixel).
MAGE_STORE_CHANNELS = 3 * 384 / 256

#: Encoder peak per input pixel, in values of the VAE's dtype beside a float32 copy of the image (3 values at 4
#: bytes), whole frame. Measured on the CPU with flowlift's tensor tracker (benchmarks/measure_encode_memory.py): TAEF2
#: holds three 64-channel full-resolution activations and its input (792 B/px in float32, 390 in bfloat16), the
#: FLUX.2 VAE five 128-channel ones (2572 B/px in float32), Mage-VAE its 16x16-pixel patches through 768 channels and
#: the 384-wide blocks at 1/16 (156 B/px in float32).
ENCODE_PLAIN_CHANNELS = {"taef2": 3 * 64 + 3, "flux2": 5 * 128, "mage": 36}
#: Tiled encode: values per input pixel that stay whole-frame (the latent-resolution parts, the latent) beside the
#: image's float32 copy, and one tile's working set in values of the VAE's dtype. TAEF2 (64-latent-px stem tiles,
#: 128-px bands): 300.6 / 328.5 / 402.1 / 1024 MiB measured at 1 / 2 / 4 / 16 Mpx in float32 (144 / 152 / 177 MiB
#: at 1 / 2 / 4 Mpx in bfloat16). The FLUX.2 VAE (diffusers' tiles of ``tile_sample_min_size``, 1024 px): one
#: tile's whole-frame encode, 2587 MiB at 1536x1536 in float32; :mod:`flowlift.models.flux2_tiling` makes each tile
#: ``2x - 1`` on its own, so its 3 * 4 bytes a pixel hold the raw float32 latent and its normalized copy. Mage-VAE:
#: a frame of up to two 128-position tiles' area (8 Mpx) runs its blocks whole (176 B/px measured at 1 and 4 Mpx in
#: float32), larger ones in tiles (1089.5 MiB at 4096x4096).
ENCODE_TILED_CHANNELS = {"taef2": 10, "flux2": 1, "mage": 8}
ENCODE_TILE_VALUES = {"taef2": 64 << 20, "flux2": 1024 * 1024 * 5 * 128, "mage": 272 << 20}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def passes_for_scale(scale: float, *, fraction_last: bool = False) -> int:
    """The fewest 2x passes that reach ``scale``: the least ``n >= 1`` with ``2**n >= scale`` (2 -> 1, 4 -> 2,
    8 -> 3). Every pass doubles both sides; a scale between two powers of two takes the larger (3 -> 2, 1.5 -> 1,
    1 -> 1), and the caller resamples the result down to its size (``flowlift upscale``). With ``fraction_last``
    (a latent upscaler that does any factor in [1, 2] as the last step: ``hires --latent-upscaler sesqui:PATH``)
    a scale that is not a power of two takes one pass fewer and leaves the fraction ``scale / 2**n`` in (1, 2)
    to that step (1.5 -> 0, 3 -> 1, 6 -> 2). Which scales a door offers is its knob's domain
    (:data:`flowlift.knobs.SCALE`); anything not a finite number of at least 1 is one line here.
    """
    import math
    import numbers

    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale < 1:
        raise FlowliftError(f"scale must be a finite number of at least 1, got {scale!r}")
    passes = 1
    while 2**passes < scale:
        passes += 1
    if fraction_last and 2**passes != scale:
        passes -= 1
    return passes


def whole_passes(scale: float) -> bool:
    """Whether ``scale`` is 2, 4 or 8 (a whole number of 2x passes, no fraction left)."""
    return scale >= 2 and math.log2(scale).is_integer()


def hires_latent_size(height: int, width: int, scale: float) -> tuple[int, int]:
    """The latent (height, width) of ``height x width`` latents at ``scale``: the size a hires fix refines at and
    InvokeAI's Flow Upscale Latents makes. ``scale`` times for 2, 4, 8; for any other factor
    ``floor(side * scale / 2 + 1/2) * 2`` (even latent sides, halves up: the image on the 16-px grid that FLUX.2's
    2x2 patches need, so 1.5x of 1008 px is 1520 px)."""
    if whole_passes(scale):
        return height * int(scale), width * int(scale)
    return (max(2, math.floor(height * scale / 2 + 0.5) * 2), max(2, math.floor(width * scale / 2 + 0.5) * 2))


def hires_size_or_refuse(width: int, height: int, scale: float, field: str) -> tuple[int, int]:
    """The (width, height) px a hires fix of a ``width x height`` image makes at ``scale`` (:func:`hires_latent_size`
    on the 16 px grid), or one FlowliftError line naming ``field`` when the grid rounds it to no enlargement on a
    side (1.1x of 64x48 is 64x48: the least scale that enlarges is named). Every door's rule: the hires fix's
    (``flowlift.refine.settings.check_hires_size``) and the latent nodes' (``flowlift.upscale.node_choices``)."""
    out_h, out_w = (8 * n for n in hires_latent_size(height // 8, width // 8, scale))
    if out_w <= width or out_h <= height:
        least = math.ceil((1 + PIXEL_MULTIPLE / 2 / min(width, height)) * 1000) / 1000  # half a grid step up
        raise FlowliftError(
            f"{field}: hires at {scale:g}x of a {width}x{height} base is {out_w}x{out_h} on the {PIXEL_MULTIPLE} px "
            f"grid the refine needs, no larger on one side; use a scale of at least {least:g}",
            field=field,
        )
    return out_w, out_h


def parse_memory(value: str | int | float) -> int:
    """Bytes from ``6GB``, ``6.5 GiB``, ``512MB``, ``3g`` or a plain number of bytes.

    Decimal units (k, M, G, T, with or without ``B``) are powers of 1000, binary ones (KiB, MiB, GiB,
    TiB) powers of 1024, so ``6GB`` = 6e9 bytes (5.59 GiB). Anything else (an infinite or NaN float too), or a
    value below 1 MB, is one :class:`FlowliftError` line.
    """
    if isinstance(value, bool):
        raise FlowliftError(f"max_memory must be a size like 6GB, got {value!r}", field="max_memory")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):  # int() of it: OverflowError, ValueError
            raise FlowliftError(f"max_memory must be a finite size like 6GB, got {value!r}", field="max_memory")
        number, unit = float(value), ""
    else:
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if match is None or match.group(2).lower() not in _UNITS:
            raise FlowliftError(
                f"max_memory must be a size like 6GB, 512MiB or a number of bytes, got {value!r}", field="max_memory"
            )
        number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * _UNITS[unit])
    if size < 10**6:
        raise FlowliftError(f"max_memory {value!r} is below 1 MB; give a unit, e.g. 6GB", field="max_memory")
    return size


def format_bytes(size: int | float) -> str:
    """``size`` in GiB/MiB (``6.00 GiB``, ``286.1 MiB``), for messages; a whole number of decimal megabytes that is
    no whole number of MiB (a budget given as ``300MB``) is said as it was given first: ``300 MB (286.1 MiB)``."""
    binary = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    if size > 0 and size % 10**6 == 0 and size % 2**20:
        decimal = f"{int(size) // 10**9} GB" if size % 10**9 == 0 else f"{int(size) // 10**6} MB"
        return f"{decimal} ({binary})"
    return binary


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a torch dtype (``itemsize``)."""
    import torch

    return torch.empty((), dtype=dtype).element_size()


def decoded_image_dtype(vae_kind: str, dtype: Any = None) -> Any:
    """The dtype a VAE of ``vae_kind`` running in ``dtype`` (None: float32) hands its decoded image back in:
    float32 for Mage-VAE, whose last layer computes the pixels in float32 and keeps them
    (:meth:`flowlift.models.vae.MageVAE.decode`), and for the FLUX.2 VAE, which makes ``(x + 1) / 2`` of its
    float32 raw latents' decode in float32 (:meth:`flowlift.models.vae.Flux2VAE.decode_raw`; the pipelines hand it
    float32 latents), and for TAEF2, which answers in its latents' dtype (float32 from the pipelines) and writes its
    tiles straight into that frame (:meth:`flowlift.models.taef2.TAEF2.decode_tiled`), else ``dtype``."""
    import torch

    return torch.float32 if vae_kind in ("mage", "flux2", "taef2") or dtype is None else dtype


def decode_peak_bytes(vae_kind: str, height: int, width: int, *, batch: int = 1, dtype: Any = None, tiled: bool) -> int:
    """Device peak of decoding a (batch, 32, height/8, width/8) latent to a (batch, 3, height, width) image.

    Whole frame: ``b * h * w * (itemsize * DECODE_PLAIN_CHANNELS + 3 * image_itemsize)``. Tiled: the output
    image and the latent plus one tile's working set, ``b * h * w * (3 * image_itemsize + itemsize * 32/64) +
    DECODE_TILE_BYTES``; for TAEF2 also its latent-resolution stage's output (``b * h * w * itemsize * 64/64``); for
    the FLUX.2 VAE also its float32 raw latent (``b * h * w * 4 * 32/64``, the
    normalization undone in float32); for Mage-VAE also the patchified latent (``b * h * w * itemsize * 32/64``) and
    one sample's stores, ``h * w * itemsize * MAGE_STORE_CHANNELS``: its exact executor is bounded by the tile
    *plus* 4.5 values per pixel of one image (its global GroupNorm / channel means need the
    1/16-resolution activations of the whole frame). The image in :func:`decoded_image_dtype` (Mage-VAE's and the
    FLUX.2 VAE's in float32). Unknown VAEs are costed like the FLUX.2 VAE (the larger one); ``dtype`` None is float32.
    """
    kind = vae_kind if vae_kind in DECODE_PLAIN_CHANNELS else "flux2"
    pixels = batch * height * width
    itemsize = 4 if dtype is None else dtype_bytes(dtype)
    image = pixels * 3 * dtype_bytes(decoded_image_dtype(kind, dtype))
    if tiled:
        tiled_bytes = image + pixels * itemsize * LATENT_CHANNELS / 64 + DECODE_TILE_BYTES[kind]
        if kind == "flux2":
            tiled_bytes += pixels * 4 * LATENT_CHANNELS / 64
        if kind == "taef2":  # the latent-resolution stage's 64-channel output, held while the bands run
            tiled_bytes += pixels * itemsize * TAEF2_LATENT_STAGE_CHANNELS / 64
        if kind == "mage":
            tiled_bytes += pixels * itemsize * LATENT_CHANNELS / 64 + height * width * itemsize * MAGE_STORE_CHANNELS
        return int(tiled_bytes)
    return int(image + pixels * itemsize * DECODE_PLAIN_CHANNELS[kind])


def encode_peak_bytes(vae_kind: str, height: int, width: int, *, batch: int = 1, dtype: Any = None, tiled: bool) -> int:
    """Device peak of encoding a (batch, 3, height, width) image to its (batch, 32, height/8, width/8) latent, the
    encoder's input copies and its output included (the caller's own image frames are not).

    Whole frame: ``b * h * w * (3 * 4 + itemsize * ENCODE_PLAIN_CHANNELS)``. Tiled: ``b * h * w * (3 * 4 + itemsize *
    ENCODE_TILED_CHANNELS) + itemsize * ENCODE_TILE_VALUES`` (one tile's working set, as :func:`decode_peak_bytes`
    costs the decode's). Unknown VAEs are costed like the FLUX.2 VAE (the larger one); ``dtype`` None is float32.
    """
    kind = vae_kind if vae_kind in ENCODE_PLAIN_CHANNELS else "flux2"
    pixels, itemsize = batch * height * width, 4 if dtype is None else dtype_bytes(dtype)
    if tiled:
        return int(pixels * (3 * 4 + itemsize * ENCODE_TILED_CHANNELS[kind]) + itemsize * ENCODE_TILE_VALUES[kind])
    return int(pixels * (3 * 4 + itemsize * ENCODE_PLAIN_CHANNELS[kind]))


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
    """``"taef2"`` / ``"mage"`` for flowlift's TAEF2 / Mage-VAE adapters, else ``"flux2"`` (costed conservatively)."""
    name = type(vae).__name__.upper()
    if name.startswith("TAEF2"):
        return "taef2"
    return "mage" if name.startswith("MAGE") else "flux2"

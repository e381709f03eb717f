"""One device-memory budget for a refine (img2img, inpaint, outpaint, hires): where the transformer lives, whether
the VAE tiles, whether the transformer runs in tiles and how many per call.

The same ``max_memory`` the upscaler plans with (:mod:`flowlift.limits`: its size parser, its VAE
decode estimates). :func:`plan_refine` is a pure function of sizes, dtypes and the budget. It tries the
transformer's frames from most to least context (the whole frame when it is within FLUX.2's 4 MP, then tiles,
:mod:`flowlift.refine.tiling`), within each the offload modes from fastest to leanest (``none``, ``model``,
``group``, :mod:`flowlift.refine.offload`) and within each a whole-frame VAE before a tiled one (tiling the VAE
costs far less time than offloading), and returns the first plan whose every stage fits; with ``tile_batch auto``
it then puts as many tiles in one call as still fit (at most :data:`~flowlift.refine.settings.MAX_AUTO_TILE_BATCH`):

* sampling: the transformer's resident weights (all of them; with ``group`` the layers outside the blocks plus
  two blocks, the running one and the one being prefetched) + the VAE's weights + one forward's activations,
  ``TRANSFORMER_PEAK_FRAMES * tiles_per_call * tokens * width * itemsize`` (tokens: one tile's image tokens, or the
  frame's, + text + reference tokens: references go to every tile) + the frame's latent buffers,
  ``LATENT_FRAME_BUFFERS * 32 * (h/8) * (w/8) * 4`` bytes (the only term that grows with the frame when tiled);
* VAE encode/decode at the output size, whole or tiled: the larger of the decode
  (:func:`flowlift.limits.decode_peak_bytes`) and the encode of an image that size (an img2img's;
  :func:`flowlift.limits.encode_peak_bytes` beside the image's float32 frame on the device)
  + the VAE's weights + the transformer's weights when ``none`` keeps them on the device;
* hires: the Flow Upscaler gets what the transformer leaves (:attr:`RefinePlan.upscaler_budget_bytes`) and plans
  its own passes in it.

Every figure is an estimate (activation frames calibrated on the CPU by ``benchmarks/calibrate_refine_memory.py``);
a budget too small for the leanest plan is one FlowliftError line saying what that plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.latents import VAE_SCALE_FACTOR
from flowlift.knobs import check_positive, exact_int
from flowlift.limits import (
    LATENT_CHANNELS,
    PIXEL_MULTIPLE,
    decode_peak_bytes,
    dtype_bytes,
    encode_peak_bytes,
    format_bytes,
)
from flowlift.refine.settings import DEFAULT_TILE_SIZE, MAX_AUTO_TILE_BATCH, check_offload_and_budget
from flowlift.refine.tiling import TileRequest, exceeds_untiled_limit, resolve_tile_size, tile_count

#: One forward's activation peak in (tokens, width) frames of the compute dtype. Measured on the CPU (peak RSS,
#: fp32, width 1024, 1+1 blocks, 1024-9216 image + 512 text tokens): 23.5-28.7 frames, flat in the token count
#: (attention memory is linear); the norms' and rotary embedding's float32 temporaries weigh more in bf16: 32.
TRANSFORMER_PEAK_FRAMES = 32.0
#: Text tokens when the prompt embeddings are not known yet (the FLUX.2 pipelines pad prompts to 512).
DEFAULT_TEXT_TOKENS = 512
#: float32 (B, 32, h/8, w/8) frames the sampling loop holds: the latent, the start noise, the init, Heun's
#: velocity and predictor, the tiled velocity's blend, the inpaint merge's re-noised init and its result.
LATENT_FRAME_BUFFERS = 8


@dataclass(frozen=True)
class TransformerSizes:
    """What the planner needs to know of a transformer: bytes in all, of its largest block, outside the blocks."""

    total_bytes: int
    largest_block_bytes: int
    outside_blocks_bytes: int
    width: int


def transformer_sizes(transformer: torch.nn.Module) -> TransformerSizes:
    """Bytes as stored (fp8, GGUF blocks, bf16...) of a ``Flux2Transformer2DModel``'s parts."""

    def size(module: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])

    blocks = [*getattr(transformer, "transformer_blocks", []), *getattr(transformer, "single_transformer_blocks", [])]
    total = size(transformer)
    block_sizes = [size(block) for block in blocks]
    config = getattr(transformer, "config", {})
    width = int(config.get("num_attention_heads", 24)) * int(config.get("attention_head_dim", 128))
    return TransformerSizes(total, max(block_sizes, default=total), total - sum(block_sizes), width)


@dataclass(frozen=True)
class RefinePlan:
    """How a refine runs under ``budget_bytes``: ``offload`` mode, VAE tiling, estimated peaks."""

    budget_bytes: int
    offload: str
    vae_tiled: bool
    peak_bytes: int
    upscaler_budget_bytes: int
    stage_peaks: dict[str, int] = field(default_factory=dict)
    tile_size: int | None = None
    tile_batch: int = 1

    def describe(self) -> str:
        """One line: the choices and the estimated peak against the budget."""
        tiles = "whole frame" if self.tile_size is None else f"{self.tile_size} px tiles, {self.tile_batch} per call"
        return (
            f"max_memory {format_bytes(self.budget_bytes)}: transformer offload {self.offload}, {tiles}; "
            f"VAE {'tiled' if self.vae_tiled else 'whole frame'}; estimated peak {format_bytes(self.peak_bytes)}"
        )


def transformer_activation_bytes(
    tokens: int, width: int, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16
) -> int:
    """One forward's activation peak: ``TRANSFORMER_PEAK_FRAMES * batch * tokens * width * itemsize``."""
    return int(TRANSFORMER_PEAK_FRAMES * batch * tokens * width * dtype_bytes(dtype))


def latent_buffer_bytes(height: int, width: int, *, batch: int = 1) -> int:
    """The sampling loop's float32 latents: ``LATENT_FRAME_BUFFERS * batch * 32 * (height/8) * (width/8) * 4``."""
    latent_h, latent_w = -(-height // VAE_SCALE_FACTOR), -(-width // VAE_SCALE_FACTOR)
    return LATENT_FRAME_BUFFERS * batch * LATENT_CHANNELS * latent_h * latent_w * 4


def tile_candidates(height: int, width: int, request: TileRequest) -> list[int | None]:
    """Transformer frames to try, most context first: None (the whole frame) while it is within 4 MP, then tiles
    (``auto``: :data:`~flowlift.refine.settings.DEFAULT_TILE_SIZE`; a number: that; ``off``: the whole frame only)."""
    if request.size == "off":
        return [None]
    if isinstance(request.size, int):
        return [resolve_tile_size(height, width, request.size)]
    tiled = resolve_tile_size(height, width, DEFAULT_TILE_SIZE)
    return [tiled] if exceeds_untiled_limit(height, width) else list(dict.fromkeys([None, tiled]))


def refine_tokens(height: int, width: int, *, text_tokens: int = DEFAULT_TEXT_TOKENS, reference_tokens: int = 0) -> int:
    """Tokens of one transformer call on a ``height x width`` image: image + text + reference tokens."""
    side = PIXEL_MULTIPLE  # one latent token: 8x VAE, 2x2 patches
    return -(-height // side) * -(-width // side) + text_tokens + reference_tokens


@dataclass(frozen=True)
class RefineMemory:
    """How a refiner is fitted in device memory, as asked: ``offload`` (``auto``: planned from ``max_memory``,
    else ``none``; or none/model/group), ``max_memory`` (``12GB``, bytes; None: no plan), and what the plan is made
    for: ``image_size`` (height, width px, the largest image decoded) and ``text_tokens`` (None: 512). Every field is
    checked when it is made (``memory.max_memory`` ...: the words of ``load_refiner(memory=...)``)."""

    offload: str = "auto"
    max_memory: str | int | None = None
    image_size: tuple[int, int] = (1024, 1024)
    text_tokens: int | None = None

    def __post_init__(self) -> None:
        # Checked here, not where the plan is made: that is after the weights have loaded.
        check_offload_and_budget(self.offload, self.max_memory, "memory.")
        size = self.image_size if isinstance(self.image_size, (tuple, list)) else ()
        sides = tuple(exact_int(side) for side in size)
        if len(sides) != 2 or any(side is None or side < 1 for side in sides):
            raise FlowliftError(
                f"memory.image_size must be two integers >= 1 (height, width px), got {self.image_size!r}",
                field="memory.image_size",
            )
        object.__setattr__(self, "image_size", sides)
        check_positive("memory.text_tokens", self.text_tokens, integer=True, optional=True)


@dataclass(frozen=True)
class VAESizes:
    """What the planner needs to know of the VAE: its ``kind`` (``taef2`` or ``flux2``, whose decode peaks differ),
    its weights' ``bytes`` and the ``dtype`` it runs in."""

    kind: str = "flux2"
    bytes: int = 0
    dtype: Any = torch.bfloat16


def vae_peak_bytes(vae: VAESizes, height: int, width: int, batch: int, tiled: bool) -> int:
    """The VAE's peak at a ``height x width`` frame, ``tiled`` or whole: the larger of its decode and the encode of
    an image that size (an img2img encodes at the size it decodes; the whole-frame FLUX.2 encode is the larger), the
    encode beside the image's float32 frame on the device. Weights not included."""
    sizes = {"batch": batch, "dtype": vae.dtype, "tiled": tiled}
    image = batch * 3 * height * width * 4
    encode = image + encode_peak_bytes(vae.kind, height, width, **sizes)
    return max(decode_peak_bytes(vae.kind, height, width, **sizes), encode)


def plan_refine(
    height: int,
    width: int,
    budget_bytes: int,
    sizes: TransformerSizes,
    *,
    dtype: torch.dtype = torch.bfloat16,
    vae: VAESizes | None = None,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    reference_tokens: int = 0,
    batch: int = 1,
    offload: str | None = None,
    tiles: TileRequest | None = None,
) -> RefinePlan:
    """The fastest plan for a refine whose largest image is ``height x width`` pixels within ``budget_bytes``.

    ``offload`` given: only that mode is considered (the VAE's tiling is still planned). ``tiles`` are the tiling
    knobs (:class:`~flowlift.refine.tiling.TileRequest`): ``auto`` keeps the frame whole when it is within 4 MP and
    fits, else tiles it. Raises one FlowliftError line when nothing fits.
    """
    request = tiles if tiles is not None else TileRequest()
    vae = vae if vae is not None else VAESizes()
    vae_bytes = vae.bytes
    resident_while_sampling = {
        "none": sizes.total_bytes,
        "model": sizes.total_bytes,
        "group": sizes.outside_blocks_bytes + 2 * sizes.largest_block_bytes,
    }
    buffers = latent_buffer_bytes(height, width, batch=batch)

    def activations(tile: int | None, per_call: int) -> int:
        side = (height, width) if tile is None else (min(tile, height), min(tile, width))
        tokens = refine_tokens(*side, text_tokens=text_tokens, reference_tokens=reference_tokens)
        return transformer_activation_bytes(tokens, sizes.width, batch=batch * per_call, dtype=dtype)

    def sampling(mode: str, tile: int | None, per_call: int) -> int:
        return resident_while_sampling[mode] + vae_bytes + activations(tile, per_call) + buffers

    def most_per_call(tile: int) -> int:  # tile_batch auto: tiles in one call, at most
        return min(MAX_AUTO_TILE_BATCH, tile_count(height, width, tile, request.overlap))

    first = request.batch if isinstance(request.batch, int) else 1
    candidates = [offload] if offload is not None else ["none", "model", "group"]
    tiles = tile_candidates(height, width, request)
    decode = {tiled: vae_peak_bytes(vae, height, width, batch, tiled) for tiled in (False, True)}
    leanest = None
    for tile in tiles:
        per_call = first if tile is not None else 1
        for mode in candidates:
            kept = sizes.total_bytes if mode == "none" else 0  # the transformer's weights during the VAE's stages
            for tiled in (False, True):
                coding = kept + vae_bytes + decode[tiled]
                peak = max(sampling(mode, tile, per_call), coding)
                leanest = peak if leanest is None else min(leanest, peak)
                if peak > budget_bytes:
                    continue
                if request.batch == "auto" and tile is not None and batch == 1:
                    most = most_per_call(tile)
                    while per_call < most and max(sampling(mode, tile, per_call + 1), coding) <= budget_bytes:
                        per_call += 1
                peak = max(sampling(mode, tile, per_call), coding)
                return RefinePlan(
                    budget_bytes=budget_bytes,
                    offload=mode,
                    vae_tiled=tiled,
                    peak_bytes=peak,
                    upscaler_budget_bytes=budget_bytes - kept,
                    stage_peaks={"sampling": sampling(mode, tile, per_call), "vae": coding},
                    tile_size=tile,
                    tile_batch=per_call,
                )
    what = f"offload {offload}" if offload is not None else "group offload"
    what += " and a tiled VAE" if tiles[-1] is None else f", a tiled VAE and {tiles[-1]} px tiles"
    raise FlowliftError(
        f"max_memory {format_bytes(budget_bytes)} is too small to refine a {width}x{height} image: even {what} "
        f"needs about {format_bytes(leanest or 0)} (transformer {format_bytes(sizes.total_bytes)}, one forward's "
        f"activations {format_bytes(activations(tiles[-1], 1))})",
        field="max_memory",
    )

"""One device-memory budget for a refine (img2img, inpaint, outpaint, hires): where the transformer lives, whether
the VAE tiles.

The same ``--max-memory`` the upscaler plans with (:mod:`flowlift.upscale.memory_plan`: its size parser, its VAE
decode estimates). :func:`plan_refine` is a pure function of sizes, dtypes and the budget. It tries the offload
modes from fastest to leanest (``none``, ``model``, ``group``, :mod:`flowlift.refine.offload`) and, within each,
a whole-frame VAE before a tiled one (tiling costs far less time than offloading), and returns the first plan whose
every stage fits:

* sampling: the transformer's resident weights (all of them; with ``group`` the layers outside the blocks plus
  two blocks, the running one and the one being prefetched) + the VAE's weights + one forward's activations,
  ``TRANSFORMER_PEAK_FRAMES * tokens * width * itemsize`` (tokens: image + text + reference tokens);
* VAE encode/decode at the output size (:func:`flowlift.upscale.memory_plan.decode_peak_bytes`, whole or tiled)
  + the VAE's weights + the transformer's weights when ``none`` keeps them on the device;
* hires: the Flow Upscaler gets what the transformer leaves (:attr:`RefinePlan.upscaler_budget_bytes`) and plans
  its own passes in it.

Every figure is an estimate (activation frames calibrated on the CPU by ``benchmarks/calibrate_refine_memory.py``);
a budget too small for the leanest plan is one FlowliftError line saying what that plan needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowlift.errors import FlowliftError
from flowlift.upscale.chunked.budget import dtype_bytes
from flowlift.upscale.memory_plan import decode_peak_bytes, format_bytes

#: One forward's activation peak in (tokens, width) frames of the compute dtype. Measured on the CPU (peak RSS,
#: fp32, width 1024, 1+1 blocks, 1024-9216 image + 512 text tokens): 23.5-28.7 frames, flat in the token count
#: (attention memory is linear); the norms' and rotary embedding's float32 temporaries weigh more in bf16: 32.
TRANSFORMER_PEAK_FRAMES = 32.0
#: Text tokens when the prompt embeddings are not known yet (the FLUX.2 pipelines pad prompts to 512).
DEFAULT_TEXT_TOKENS = 512
#: Image side (pixels) of one latent token: 8x VAE, 2x2 patches.
PIXELS_PER_TOKEN_SIDE = 16


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

    def describe(self) -> str:
        """One line: the choices and the estimated peak against the budget."""
        return (
            f"max_memory {format_bytes(self.budget_bytes)}: transformer offload {self.offload}; "
            f"VAE {'tiled' if self.vae_tiled else 'whole frame'}; estimated peak {format_bytes(self.peak_bytes)}"
        )


def transformer_activation_bytes(
    tokens: int, width: int, *, batch: int = 1, dtype: torch.dtype = torch.bfloat16
) -> int:
    """One forward's activation peak: ``TRANSFORMER_PEAK_FRAMES * batch * tokens * width * itemsize``."""
    return int(TRANSFORMER_PEAK_FRAMES * batch * tokens * width * dtype_bytes(dtype))


def refine_tokens(height: int, width: int, *, text_tokens: int = DEFAULT_TEXT_TOKENS, reference_tokens: int = 0) -> int:
    """Tokens of one transformer call on a ``height x width`` image: image + text + reference tokens."""
    side = PIXELS_PER_TOKEN_SIDE
    return -(-height // side) * -(-width // side) + text_tokens + reference_tokens


def plan_refine(
    height: int,
    width: int,
    budget_bytes: int,
    sizes: TransformerSizes,
    *,
    dtype: torch.dtype = torch.bfloat16,
    vae_kind: str = "flux2",
    vae_bytes: int = 0,
    vae_dtype: torch.dtype = torch.bfloat16,
    text_tokens: int = DEFAULT_TEXT_TOKENS,
    reference_tokens: int = 0,
    batch: int = 1,
    offload: str | None = None,
) -> RefinePlan:
    """The fastest plan for a refine whose largest image is ``height x width`` pixels within ``budget_bytes``.

    ``offload`` given: only that mode is considered (the VAE's tiling is still planned). Raises one
    FlowliftError line when nothing fits.
    """
    tokens = refine_tokens(height, width, text_tokens=text_tokens, reference_tokens=reference_tokens)
    activations = transformer_activation_bytes(tokens, sizes.width, batch=batch, dtype=dtype)
    vae = {
        tiled: decode_peak_bytes(vae_kind, height, width, batch=batch, dtype=vae_dtype, tiled=tiled)
        for tiled in (False, True)
    }
    resident_while_sampling = {
        "none": sizes.total_bytes,
        "model": sizes.total_bytes,
        "group": sizes.outside_blocks_bytes + 2 * sizes.largest_block_bytes,
    }
    candidates = [offload] if offload is not None else ["none", "model", "group"]
    leanest = None
    for mode in candidates:
        sampling = resident_while_sampling[mode] + vae_bytes + activations
        kept = sizes.total_bytes if mode == "none" else 0  # the transformer's weights during the VAE's stages
        for tiled in (False, True):
            coding = kept + vae_bytes + vae[tiled]
            peak = max(sampling, coding)
            leanest = peak if leanest is None else min(leanest, peak)
            if peak <= budget_bytes:
                return RefinePlan(
                    budget_bytes=budget_bytes,
                    offload=mode,
                    vae_tiled=tiled,
                    peak_bytes=peak,
                    upscaler_budget_bytes=budget_bytes - kept,
                    stage_peaks={"sampling": sampling, "vae": coding},
                )
    what = f"offload {offload}" if offload is not None else "group offload and a tiled VAE"
    raise FlowliftError(
        f"max_memory {format_bytes(budget_bytes)} is too small to refine a {width}x{height} image: even {what} "
        f"needs about {format_bytes(leanest or 0)} (transformer {format_bytes(sizes.total_bytes)}, one forward's "
        f"activations {format_bytes(activations)})"
    )

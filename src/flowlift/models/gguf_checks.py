"""NaN / Inf in a GGUF file's quantized tensors, found without dequantizing them.

A quantized GGUF tensor is stored as uint8 blocks (diffusers' ``GGUFParameter``), so the float check every other
weight format gets (:func:`flowlift.models.weights.first_non_finite`) skips it. Each block's values are integers
times its float16 scale ``d`` (and minus ``dmin`` times integers, for the types with a minimum): they are finite
exactly when those scales are, so reading the scales, 2 bytes of every 18 to 210, is the whole check. The block
layouts are ggml's (``ggml-common.h``: ``block_q4_0`` ... ``block_iq4_xs``), the ones diffusers' dequantizers
split; a type not listed here is dequantized in bounded chunks instead.
"""

from __future__ import annotations

import math

import torch

#: Byte offsets of the float16 scale fields in one block of each quantized type diffusers reads; every other field
#: of these blocks is an integer (quants, packed sub-block scales, high bits) or a fixed table's index.
FP16_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,),  # d, qs[16]
    "Q4_1": (0, 2),  # d, m, qs[16]
    "Q5_0": (0,),  # d, qh[4], qs[16]
    "Q5_1": (0, 2),  # d, m, qh[4], qs[16]
    "Q8_0": (0,),  # d, qs[32]
    "Q2_K": (80, 82),  # scales[16], qs[64], d, dmin
    "Q3_K": (108,),  # hmask[32], qs[64], scales[12], d
    "Q4_K": (0, 2),  # d, dmin, scales[12], qs[128]
    "Q5_K": (0, 2),  # d, dmin, scales[12], qh[32], qs[128]
    "Q6_K": (208,),  # ql[128], qh[64], scales[16], d
    "IQ4_NL": (0,),  # d, qs[16]
    "IQ4_XS": (0,),  # d, scales_h, scales_l[4], qs[128]
}
#: Blocks dequantized at a time for a type without a known layout (float32 values: 64 MB for 256-value blocks).
_CHUNK_BLOCKS = 1 << 16


def _kind(values: torch.Tensor) -> str | None:
    """``"NaN"`` / ``"Inf"`` when the float ``values`` hold one, else None (one reduction; a NaN reaches both ends)."""
    if not values.numel():
        return None
    low, high = (float(v) for v in torch.aminmax(values))
    if math.isfinite(low) and math.isfinite(high):
        return None
    return "NaN" if math.isnan(low) or math.isnan(high) else "Inf"


def quantized_non_finite(tensor: torch.Tensor, quant_type: object) -> str | None:
    """``"NaN"`` / ``"Inf"`` when the GGUF tensor ``tensor`` (its raw uint8 blocks) of ``quant_type`` (a
    ``gguf.GGMLQuantizationType``) would dequantize to one, else None.

    The listed types: each block's float16 scales, strided views of the tensor (no copy of it). BF16: every value,
    viewed as bfloat16. Any other type: diffusers' dequantizer, ``_CHUNK_BLOCKS`` blocks at a time.
    """
    from gguf import GGML_QUANT_SIZES

    raw = tensor.as_subclass(torch.Tensor).detach().contiguous().view(torch.uint8).reshape(-1)
    name = getattr(quant_type, "name", str(quant_type))
    if name == "BF16":
        return _kind(raw.view(torch.bfloat16))
    _, type_size = GGML_QUANT_SIZES[quant_type]
    blocks = raw.reshape(-1, type_size)
    offsets = FP16_SCALE_OFFSETS.get(name)
    if offsets is None:
        return _dequantized_non_finite(blocks, quant_type)
    halves = blocks.view(torch.float16)  # every listed type's block size and offsets are even
    for offset in offsets:
        kind = _kind(halves[:, offset // 2])
        if kind:
            return kind
    return None


def _dequantized_non_finite(blocks: torch.Tensor, quant_type: object) -> str | None:
    """The check of :func:`quantized_non_finite` for a type without a listed layout: dequantized in chunks by the
    dequantizer diffusers runs it with (13 to 50 s per GB on a 2-core CPU, where the listed types' scales take
    0.15 to 0.45 s)."""
    from diffusers.quantizers.gguf.utils import dequantize_functions
    from gguf import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    dequantize = dequantize_functions[quant_type]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        kind = _kind(dequantize(chunk, block_size, type_size, dtype=torch.float32))
        if kind:
            return kind
    return None

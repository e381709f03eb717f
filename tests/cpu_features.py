"""What this CPU's oneDNN runs, for the tests of paths that exist only where it does."""

from __future__ import annotations

import pytest
import torch


def fused_bf16_convolution_runs() -> bool:
    """Whether oneDNN's fused convolution (``torch.ops.mkldnn._convolution_pointwise``) runs in bfloat16 here: it
    needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT and raises on other CPUs (an AVX2-only AMD EPYC, Zen 3)."""
    op = getattr(torch.ops.mkldnn, "_convolution_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    x = torch.zeros(1, 8, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
    weight = torch.zeros(8, 8, 1, 1, dtype=torch.bfloat16)
    try:
        op(x, weight, None, [0, 0], [1, 1], [1, 1], 1, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return True


FUSED_BF16 = fused_bf16_convolution_runs()
needs_fused_bf16 = pytest.mark.skipif(
    not FUSED_BF16, reason="oneDNN's fused bf16 convolution does not run on this CPU (AVX512BW/VL/DQ or AVX-NE-CONVERT)"
)

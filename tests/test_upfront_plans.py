"""Every plan a run cannot meet is refused before any work (issue 48 item 7).

``flowlift upscale in4096.png --scale 4 --vae mage --max-memory 11GB`` refused the 16384^2 decode's memory plan only
after the 4096^2 encode, 263 s in. The pipeline now makes the whole plan (passes and decode) before its encode.
"""

from __future__ import annotations

import pytest
import torch

from builders import save_tiny_unet as tiny_upscaler
from flowlift.errors import FlowliftError
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy


def test_a_decode_the_budget_cannot_hold_is_refused_before_the_encode(tmp_path, shared, single_thread_torch):
    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    pipeline = FlowUpscalerPipeline(
        str(weights),
        str(shared / "models" / "taef2"),
        device="cpu",
        dtype=torch.float32,
        memory=MemoryPolicy(max_memory="400MB"),
    )
    encoded: list[tuple[int, ...]] = []
    encode = pipeline.vae.encode
    pipeline.vae.encode = lambda x, **kwargs: encoded.append(tuple(x.shape)) or encode(x, **kwargs)
    pipeline.upscale_image(torch.rand(1, 3, 64, 64), num_passes=3, output_type="pt")  # 512^2: the plan holds
    assert encoded == [(1, 3, 64, 64)]
    with pytest.raises(FlowliftError, match=r"too small to decode a 2048x2048 image .*the tiled decode needs about"):
        pipeline.upscale_image(torch.rand(1, 3, 256, 256), num_passes=3, output_type="pt")
    assert encoded == [(1, 3, 64, 64)]  # the 256^2 input was never encoded


def _released_sizes():
    """Parameter bytes of the released architectures (built on the meta device: nothing allocated)."""
    from flowlift.models.mage_vae import MageVAEConfig, MageVAEModel
    from flowlift.models.upscaler_unet import FlowUpscalerUNet

    with torch.device("meta"):
        unet, mage = FlowUpscalerUNet(), MageVAEModel(MageVAEConfig(), encoder=True)
    return sum(p.numel() for p in unet.parameters()), sum(p.numel() for p in mage.parameters())


def test_docs_vae_memory_example_is_what_the_command_prints():
    """docs/vae.md's 16384² Mage example ("10GB refused, 11GB tiled" held only for a decoder-only count) is the
    planner's own line for the whole run's weights in float32, and bfloat16 plans both budgets."""
    from pathlib import Path

    from flowlift.upscale.memory_plan import plan_upscale_memory as plan_upscale

    unet, mage = _released_sizes()
    doc = (Path(__file__).resolve().parents[1] / "docs" / "vae.md").read_text()

    def plan(budget: int, dtype: torch.dtype, size: int):
        return plan_upscale(
            4096,
            4096,
            2,
            budget,
            base_channels=384,
            unet_dtype=dtype,
            vae_kind="mage",
            weight_bytes=(unet + mage) * size,
            vae_dtype=dtype,
            spatial_factor=8,
        )

    for budget in (10 * 10**9, 11 * 10**9):
        with pytest.raises(FlowliftError) as refused:
            plan(budget, torch.float32, 4)
        if budget == 11 * 10**9:
            assert f"flowlift upscale: in4096.png: {refused.value}\n" in doc
    assert plan(12 * 10**9, torch.float32, 4).vae_tiled
    for budget in (10 * 10**9, 11 * 10**9):
        decode = plan(budget, torch.bfloat16, 2).stage_peaks["decode"]
        assert f"the tiled decode then needs {decode / 2**30:.2f} GiB" in doc

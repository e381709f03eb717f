"""Every plan a run cannot meet is refused before any work (issue 48 item 7).

``flowlift upscale in4096.png --scale 4 --vae mage --max-memory 11GB`` refused the 16384^2 decode's memory plan only
after the 4096^2 encode, 263 s in. The pipeline now makes the whole plan (passes and decode) before its encode.
"""

from __future__ import annotations

import pytest
import torch

from app_helpers import tiny_upscaler
from flowlift.errors import FlowliftError
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy


def test_a_decode_the_budget_cannot_hold_is_refused_before_the_encode(tmp_path, shared, single_thread_torch):
    weights = tiny_upscaler(tmp_path / "flow_upscaler.safetensors")
    pipeline = FlowUpscalerPipeline(str(weights), str(shared / "models" / "taef2"), device="cpu", dtype=torch.float32,
                                    memory=MemoryPolicy(max_memory="400MB"))  # fmt: skip
    encoded: list[tuple[int, ...]] = []
    encode = pipeline.vae.encode
    pipeline.vae.encode = lambda x, **kwargs: encoded.append(tuple(x.shape)) or encode(x, **kwargs)
    pipeline.upscale_image(torch.rand(1, 3, 64, 64), num_passes=3, output_type="pt")  # 512^2: the plan holds
    assert encoded == [(1, 3, 64, 64)]
    with pytest.raises(FlowliftError, match=r"too small to decode a 2048x2048 image .*the tiled decode needs about"):
        pipeline.upscale_image(torch.rand(1, 3, 256, 256), num_passes=3, output_type="pt")
    assert encoded == [(1, 3, 64, 64)]  # the 256^2 input was never encoded

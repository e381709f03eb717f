"""TAEF2's tiled decode in bfloat16, handed back in float32: written straight into the float32 frame (no bfloat16
frame beside it), with the pixels of the bfloat16 frame converted afterwards, bit for bit."""

from __future__ import annotations

import pytest
import torch

import flowlift.models.taef2 as taef2
from flowlift.limits import LATENT_CHANNELS, decode_peak_bytes
from flowlift.measure.tiled_inference import _PeakTensorMemory
from flowlift.models.vae import TAEF2VAE, taef2_from_state_dicts


@pytest.fixture(scope="module")
def states(shared):
    folder = shared / "models" / "taef2"
    return [
        (torch.load(str(folder / f"taef2_{part}.pth"), map_location="cpu", weights_only=True), part)
        for part in ("encoder", "decoder")
    ]


@pytest.fixture
def small_bands(monkeypatch):
    """Bands of 16 and tiles of 8 latent px, so that a 256-512 px frame is many bands (the defaults' 1024 px band
    would make the band's working set grow with these frames)."""
    monkeypatch.setattr(taef2, "DEFAULT_DECODE_BAND", 16)
    monkeypatch.setattr(taef2, "DEFAULT_DECODE_TILE", 8)
    monkeypatch.setattr(taef2, "cpu_has_feature", lambda feature: False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_float32_answer_is_the_models_frame_widened_bit_for_bit(states, dtype, small_bands):
    vae = taef2_from_state_dicts(states, device="cpu", dtype=dtype)
    z = torch.randn(2, 32, 24, 40, generator=torch.Generator().manual_seed(3))
    own = vae.model.decode_tiled(z.to(dtype).contiguous(memory_format=torch.channels_last))
    assert own.dtype == dtype
    answer = vae.decode(z, tiled=True)
    assert answer.dtype == torch.float32 and answer.is_contiguous()
    assert torch.equal(answer, own.float())


def _tracked_peak(vae: TAEF2VAE, side: int) -> int:
    z = torch.randn(1, 32, side // 8, side // 8, generator=torch.Generator().manual_seed(side))
    tracker = _PeakTensorMemory()
    with torch.no_grad(), tracker:
        vae.decode(z, tiled=True)
    return tracker.peak


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_tiled_decode_grows_with_the_frame_as_the_plan_says(states, dtype, small_bands):
    """In bfloat16 the adapter converted the model's bfloat16 frame to float32 at the end: both frames at once, 22.4
    tracked bytes a pixel more for every pixel more, where the plan counted 7 (a bfloat16 image and latent) and the
    float32 latent (2). Written band by band into the float32 frame: 15.9 (float32: 19.8), within the plan's
    float32 image, the latent's copies and the latent-resolution stage's 64-channel output."""
    vae = taef2_from_state_dicts(states, device="cpu", dtype=dtype)
    sides = (256, 512)
    small, large = (_tracked_peak(vae, side) for side in sides)
    more = sides[1] ** 2 - sides[0] ** 2
    growth = (large - small) / more
    planned = (
        decode_peak_bytes("taef2", sides[1], sides[1], dtype=dtype, tiled=True)
        - decode_peak_bytes("taef2", sides[0], sides[0], dtype=dtype, tiled=True)
    ) / more
    # the plan counts the caller's float32 latent beside the decode (memory_plan's latent_bytes): 2 bytes a pixel
    assert growth <= planned + 4 * LATENT_CHANNELS / 64, (growth, planned)

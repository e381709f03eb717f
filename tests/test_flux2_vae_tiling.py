"""The FLUX.2 VAE's tiles in bounded memory (flowlift.models.flux2_tiling): diffusers' tiled result bit for bit,
holding the result and a tile, not every tile of the frame."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLFlux2

from flowlift.limits import decode_peak_bytes, encode_peak_bytes
from flowlift.measure.tiled_inference import _PeakTensorMemory
from flowlift.models.vae import Flux2VAE


@pytest.fixture(scope="module")
def model() -> AutoencoderKLFlux2:
    """A small random FLUX.2 VAE whose tiles are 32 px (4 latent px, a stride of 3, 8 px blended)."""
    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, layers_per_block=1, sample_size=32,
        mid_block_add_attention=False,
    )  # fmt: skip
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return vae.eval()


def _diffusers_tiled(model, fn):
    model.use_tiling = True
    try:
        return fn()
    finally:
        model.use_tiling = False


# latent (height, width, batch): edge tiles shorter than the blend, one side within a tile, a batch
SHAPES = [(8, 6, 2), (26, 14, 1), (4, 10, 1), (18, 18, 2), (40, 22, 1)]


@pytest.mark.parametrize("slicing", [False, True])
def test_the_bounded_tiles_are_diffusers_tiles_bit_for_bit(model, slicing, single_thread_torch):
    from flowlift.models.flux2_tiling import decode_tiled, encode_tiled

    model.use_slicing = slicing
    try:
        for h, w, b in SHAPES:
            z = torch.randn(b, 32, h, w, generator=torch.Generator().manual_seed(h))
            expected = _diffusers_tiled(model, lambda z=z: (model.decode(z).sample.float() + 1) / 2)
            assert torch.equal(decode_tiled(model, z), expected), (h, w, b)
            x = torch.rand(b, 3, 8 * h, 8 * w, generator=torch.Generator().manual_seed(w))
            moments = _diffusers_tiled(model, lambda x=x: model.encode(x * 2 - 1).latent_dist.mode())
            assert torch.equal(encode_tiled(model, x), moments), (h, w, b)
    finally:
        model.use_slicing = False


def test_bfloat16_tiles_are_diffusers_tiles_bit_for_bit(model, single_thread_torch):
    from flowlift.models.flux2_tiling import decode_tiled, encode_tiled

    half = AutoencoderKLFlux2.from_config(model.config).eval()
    half.load_state_dict(model.state_dict())
    half.to(torch.bfloat16)
    z = torch.randn(1, 32, 10, 6, generator=torch.Generator().manual_seed(1))
    expected = _diffusers_tiled(half, lambda: (half.decode(z.bfloat16()).sample.float() + 1) / 2)
    assert torch.equal(decode_tiled(half, z.bfloat16()), expected)
    x = torch.rand(1, 3, 80, 48, generator=torch.Generator().manual_seed(2))
    # flowlift's adapter makes 2x - 1 in float32 and rounds it once, per tile as for the whole frame
    moments = _diffusers_tiled(half, lambda: half.encode((x * 2 - 1).bfloat16()).latent_dist.mode())
    assert torch.equal(encode_tiled(half, x, dtype=torch.bfloat16), moments)


def _tracked(fn) -> int:
    tracker = _PeakTensorMemory()
    with torch.no_grad(), tracker:
        fn()
    return tracker.peak


def test_the_tiled_decode_and_encode_grow_with_the_frame_as_the_plan_says(model, single_thread_torch):
    """diffusers' tiled decode kept every decoded tile (1.78 frames at 25% overlap), their cropped rows and the
    concatenated frame in the VAE's dtype, then flowlift's float32 (x + 1) / 2 of it: 47 tracked bytes a pixel more
    for every pixel more, where the plan costs the tiled decode 16 (float32 image and latents) beside a fixed tile.
    The bounded executor's growth is within the plan's (tracked tensors; the fixed part is the tile's)."""
    vae = Flux2VAE(model)
    sides = (256, 512)
    decodes, encodes = [], []
    for side in sides:
        z = torch.randn(1, 32, side // 8, side // 8, generator=torch.Generator().manual_seed(side))
        x = torch.rand(1, 3, side, side, generator=torch.Generator().manual_seed(side))
        decodes.append(_tracked(lambda z=z: vae.decode(z, tiled=True)))
        encodes.append(_tracked(lambda x=x: vae.encode(x, tiled=True)))
    more = sides[1] ** 2 - sides[0] ** 2
    decode_planned, encode_planned = (
        (estimate("flux2", sides[1], sides[1], tiled=True) - estimate("flux2", sides[0], sides[0], tiled=True)) / more
        for estimate in (decode_peak_bytes, encode_peak_bytes)
    )
    decode_growth, encode_growth = (decodes[1] - decodes[0]) / more, (encodes[1] - encodes[0]) / more
    assert decode_growth <= decode_planned == 16, decode_growth
    # the tracker counts the caller's image once more (a view of it is a new tensor to it): 12 bytes a pixel
    assert encode_growth - 12 <= encode_planned, encode_growth


def test_the_adapter_tiles_only_past_one_tile_and_reports_each(model):
    vae = Flux2VAE(model)
    z = torch.randn(1, 32, 4, 4)  # one tile: the whole frame, one decoder run
    seen: list[tuple[int, int]] = []
    whole = vae.decode(z, tiled=True, on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)] and torch.equal(whole, vae.decode(z, tiled=False))
    seen.clear()
    tall = torch.randn(1, 32, 10, 4)  # rows at 0, 3, 6, 9; the side within one tile is still split by the stride
    vae.decode(tall, tiled=True, on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(done, 8) for done in range(1, 9)]

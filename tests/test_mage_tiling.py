"""Mage-VAE's exact tiled encode/decode (flowlift.models.mage_tiling): equal to the whole frame, tiles
really run, and the working set is bounded by the tile, not the frame (tensor sizes recorded by a
dispatch hook on every op the executor runs; never process memory)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flowlift.errors import FlowliftError
from flowlift.models.mage_tiling import (
    RELEASED_SUMS_PIXEL_TILE,
    MageTiling,
    decode_steps,
    decode_tile_numel,
    decode_tiled,
    encode_steps,
    encode_tile_numel,
    encode_tiled,
    tile_grid,
)
from flowlift.models.mage_vae_files import mage_from_state_dict
from mage_files import NARROW, released_state

pytestmark = pytest.mark.usefixtures("single_thread_torch")

#: Small tiles so that small frames span several: 1/16-resolution tiles of one 32-position window.
SMALL = MageTiling(tile=32, pixel_tile=16)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def vae():
    adapter = mage_from_state_dict(released_state(NARROW, seed=3))
    adapter.tiling = SMALL
    return adapter


# (batch, codec rows, codec cols): several tiles, non-square, sides not multiples of the 32 window
# (the edge windows are replicate-padded), a frame smaller than one tile, batch > 1.
SIZES = [(1, 70, 45), (2, 33, 64), (1, 5, 7), (2, 40, 97)]


@pytest.mark.parametrize("batch,h,w", SIZES)
def test_tiled_decode_equals_the_whole_frame(vae, batch, h, w):
    torch.manual_seed(h * w)
    z = torch.randn(batch, 128, h, w)
    with torch.no_grad():
        whole = vae.model.decoder(z)
        tiled = decode_tiled(vae.model.decoder, z, tiling=SMALL)
    assert relative(tiled, whole) <= 1e-5
    for i in range(batch):  # every sample, not only the batch as a whole
        assert relative(tiled[i], whole[i]) <= 1e-5


@pytest.mark.parametrize("batch,h,w", SIZES)
def test_tiled_encode_equals_the_whole_frame(vae, batch, h, w):
    torch.manual_seed(h + w)
    x = torch.rand(batch, 3, 16 * h, 16 * w) * 2 - 1
    with torch.no_grad():
        whole = vae.model.encoder(x)
        tiled = encode_tiled(vae.model.encoder, x, tiling=SMALL)
    assert relative(tiled, whole) <= 1e-5
    for i in range(batch):
        assert relative(tiled[i], whole[i]) <= 1e-5


def test_a_float32_codec_runs_its_released_sums_on_cache_sized_pixel_tiles():
    """Float32's unfused per-pixel path takes 8-position pixel tiles by default (its intermediates stay in the L3
    cache: 1.8x less CPU time than on 32, docs/cpu.md), half dtypes the fused path's 32; either equals the frame."""
    f32 = mage_from_state_dict(released_state(NARROW, seed=3))
    assert f32.tiling == MageTiling.for_dtype(torch.float32) == MageTiling(pixel_tile=RELEASED_SUMS_PIXEL_TILE)
    assert RELEASED_SUMS_PIXEL_TILE == 8
    assert MageTiling.for_dtype(torch.bfloat16) == MageTiling.for_dtype(torch.float16) == MageTiling()
    torch.manual_seed(0)
    z = torch.randn(1, 128, 21, 19)
    with torch.no_grad():
        whole = f32.model.decoder(z)
        tiled = decode_tiled(f32.model.decoder, z, tiling=replace(SMALL, pixel_tile=RELEASED_SUMS_PIXEL_TILE))
    assert relative(tiled, whole) <= 1e-5


def test_deeper_chains_cycle_their_stores():
    """Three blocks per chain (and three 768-wide head blocks): the double buffers really alternate."""
    deep = mage_from_state_dict(
        released_state(replace(NARROW, encoder_head_blocks=3, encoder_blocks=3, decoder_blocks=3), seed=5)
    )
    torch.manual_seed(6)
    z, x = torch.randn(1, 128, 40, 35), torch.rand(1, 3, 16 * 40, 16 * 35) * 2 - 1
    with torch.no_grad():
        assert relative(decode_tiled(deep.model.decoder, z, tiling=SMALL), deep.model.decoder(z)) <= 1e-5
        assert relative(encode_tiled(deep.model.encoder, x, tiling=SMALL), deep.model.encoder(x)) <= 1e-5


def test_the_adapter_tiles_when_asked_and_equals_its_whole_frame(vae):
    torch.manual_seed(1)
    latents = torch.randn(2, 32, 2 * 37, 2 * 50)  # codec 37 x 50: 2 x 2 tiles
    seen = []
    tiled = vae.decode(latents, tiled=True, on_tile=lambda done, total: seen.append((done, total)))
    whole = vae.decode(latents, tiled=False)
    assert relative(tiled, whole) <= 1e-5
    total = 2 * decode_steps(vae.model.decoder, 37, 50, SMALL)
    assert seen == [(i, total) for i in range(1, total + 1)]
    images = torch.rand(1, 3, 16 * 37, 16 * 50)
    assert relative(vae.encode(images, tiled=True), vae.encode(images, tiled=False)) <= 1e-5


def test_a_tile_decoded_alone_differs_from_the_frame(vae):
    """The control: without the frame's statistics a tile is not the frame's crop (globals matter)."""
    torch.manual_seed(2)
    z = torch.randn(1, 128, 64, 64)
    with torch.no_grad():
        whole = vae.model.decoder(z)
        alone = vae.model.decoder(z[:, :, :32, :32])
    assert relative(alone, whole[:, :, : 32 * 16, : 32 * 16]) > 1e-3


def _count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_tiles_really_run(vae):
    """Forward hooks count the per-tile calls of one layer of each kind against the tile grid."""
    z = torch.randn(1, 128, 70, 45)
    decoder = mage_from_state_dict(released_state(NARROW, seed=3)).model.decoder
    conv_in = _count_calls(decoder.y_embedder.decoder.conv_in)
    attention = _count_calls(decoder.y_embedder.decoder.block[1].q)
    gate_conv = _count_calls(decoder.blocks[0].conv1)  # both passes of a DiCo block run it
    pixel = _count_calls(decoder.dec_net)
    seen = []
    with torch.no_grad():
        decode_tiled(decoder, z, lambda done, total: seen.append(total), tiling=SMALL)
    tiles = len(tile_grid(70, 45, 32))
    assert tiles == 6  # 3 rows (32, 32, 6) x 2 columns (32, 13)
    assert conv_in[0] == tiles and attention[0] == tiles and gate_conv[0] == 2 * tiles
    assert pixel[0] == (2 + 2 + 1) * (2 + 1)  # 16-position pixel tiles inside each 32 tile
    assert len(seen) == seen[-1] == decode_steps(decoder, 70, 45, SMALL)
    encoder = vae.model.encoder
    embed = _count_calls(encoder.patch_cond_embed)
    with torch.no_grad():
        encode_tiled(encoder, torch.zeros(1, 3, 16 * 70, 16 * 45), tiling=SMALL)
    # The patch embedding feeds the first head block's two passes, with a halo: once per tile each.
    assert embed[0] == 2 * tiles
    assert encode_steps(encoder, 70, 45, SMALL) == 2 * (len(encoder.head_blocks) + len(encoder.blocks)) * tiles


def test_tiles_must_follow_the_attention_grid(vae):
    with pytest.raises(FlowliftError, match="tile must be a multiple of the window"):
        decode_tiled(vae.model.decoder, torch.zeros(1, 128, 40, 40), tiling=MageTiling(tile=48))


@pytest.mark.parametrize(
    ("keywords", "field"),
    [
        ({"tile": "128"}, "tile"),  # was a TypeError in check()
        ({"tile": 128.0}, "tile"),
        ({"tile": 0}, "tile"),
        ({"pixel_tile": 2.5}, "pixel_tile"),  # was held, a float tile grid
        ({"pixel_tile": True}, "pixel_tile"),
        ({"whole_tiles": -1}, "whole_tiles"),
        ({"whole_tiles": 2.5}, "whole_tiles"),
    ],
)
def test_a_tiling_checks_its_sides_when_it_is_made(keywords, field):
    with pytest.raises(FlowliftError) as caught:
        MageTiling(**keywords)
    assert str(caught.value).startswith(field), caught.value
    assert MageTiling(tile=64, pixel_tile=8, whole_tiles=0) == MageTiling(64, 8, 0)


def _allocations(fn) -> list[int]:
    from builders import Allocations

    with torch.no_grad(), Allocations() as record:
        fn()
    return record.sizes


#: Small tiles for the memory tests: 16-position tiles (two 8-position attention windows, see
#: ``small_window``) and 4-position pixel tiles, so that the frame's stores outgrow every tile tensor.
NARROW_PIXELS = MageTiling(tile=16, pixel_tile=4)


@pytest.fixture(scope="module")
def small_window(vae):
    """The narrow decoder with 8-position attention windows (a window's softmax weights are window**4)."""
    decoder = copy.deepcopy(vae.model.decoder)
    cod = decoder.y_embedder.decoder
    cod.window = 8
    for block in cod.block:
        if hasattr(block, "window"):
            block.window = 8
    return decoder


@pytest.mark.parametrize("h,w", [(48, 80), (80, 112)])
def test_the_decode_working_set_is_bounded_by_the_tile(small_window, h, w):
    """Besides the output image and three (C, h, w) stores, nothing the decode allocates outgrows a tile."""
    decoder = small_window
    z = torch.randn(1, 128, h, w)
    record: list[torch.Tensor] = []
    sizes = _allocations(lambda: record.append(decode_tiled(decoder, z, tiling=NARROW_PIXELS)))
    bound = 4 * decode_tile_numel(replace(NARROW, attention_window=8), NARROW_PIXELS)
    store, image = 4 * NARROW.hidden * h * w, 4 * 3 * 256 * h * w
    large = sorted(s for s in sizes if s > bound)
    assert large == [store] * 3 + [image]
    assert max(s for s in sizes if s <= bound) > bound // 4  # the bound is tight, not vacuous
    # The same frame whole: many tensors beyond the bound, and the same image (another window size).
    whole: list[torch.Tensor] = []
    whole_sizes = [s for s in _allocations(lambda: whole.append(decoder(z))) if s > bound]
    assert len(whole_sizes) > 20 and max(whole_sizes) > image
    assert relative(record[0], whole[0]) <= 1e-5


def test_the_encode_working_set_is_bounded_by_the_tile(vae):
    encoder = vae.model.encoder
    h, w = 128, 160
    x = torch.rand(1, 3, 16 * h, 16 * w)
    sizes = _allocations(lambda: encode_tiled(encoder, x, tiling=SMALL))
    bound = 4 * encode_tile_numel(NARROW, SMALL)
    head, hidden = 4 * NARROW.encoder_head * h * w, 4 * NARROW.hidden * h * w
    out = 4 * 128 * h * w
    large = sorted(s for s in sizes if s > bound)
    # Two 384-wide (here: hidden) stores, one 768-wide (encoder_head) store, the output latent.
    assert large == sorted([hidden, hidden, head, out])
    assert max(s for s in sizes if s <= bound) > bound // 4
    # The same frame whole: its MLPs alone allocate (4 C_head, h, w) tensors, far beyond the bound.
    whole = [s for s in _allocations(lambda: encoder(x)) if s > bound]
    assert len(whole) > 10 and max(whole) >= 4 * head


# --------------------------------------------------------------------------------------------------
# The memory planner costs a Mage decode as Mage
# --------------------------------------------------------------------------------------------------


def test_the_planner_knows_a_mage_vae(vae):
    from flowlift.limits import vae_kind

    assert vae_kind(vae) == "mage"


def test_a_tiled_mage_decode_is_costed_with_its_stores():
    """Frame-sized terms: output, latent and its patchified copy per image, 4.5 values/px of one image."""
    from flowlift.limits import DECODE_TILE_BYTES, decode_peak_bytes

    side = 16384
    pixels = side * side
    one = decode_peak_bytes("mage", side, side, tiled=True)
    assert one == int(4 * pixels * (3 + 0.5 + 0.5 + 4.5) + DECODE_TILE_BYTES["mage"])
    # A batch of two: twice the images and latents, but the stores of one sample only.
    two = decode_peak_bytes("mage", side, side, batch=2, tiled=True)
    assert two - one == int(4 * pixels * 4)
    # bf16: the image stays float32 (MageVAE.decode keeps the float32 pixels its last layer computes).
    half = decode_peak_bytes("mage", side, side, dtype=torch.bfloat16, tiled=True)
    assert half == int(pixels * (4 * 3 + 2 * (0.5 + 0.5 + 4.5)) + DECODE_TILE_BYTES["mage"])
    # Not the FLUX.2 VAE's figures any more (which are the default for unknown kinds).
    assert one != decode_peak_bytes("flux2", side, side, tiled=True)
    assert decode_peak_bytes("mage", side, side, tiled=False) != decode_peak_bytes("flux2", side, side, tiled=False)


def test_the_planner_tiles_a_16k_mage_decode_within_its_stated_budget():
    from flowlift.errors import FlowliftError
    from flowlift.limits import decode_peak_bytes
    from flowlift.upscale.memory_plan import plan_upscale_memory

    # A 4096x4096 input upscaled 4x: a 16384x16384 output (a 2048x2048 FLUX.2 latent).
    weights = 207 << 20  # the folded decoder in float32
    budget = 10 << 30
    plan = plan_upscale_memory(4096, 4096, 2, budget, vae_kind="mage", weight_bytes=weights)
    assert plan.vae_tiled
    latent = 4 * 32 * 2048 * 2048
    assert plan.stage_peaks["decode"] == weights + latent + decode_peak_bytes("mage", 16384, 16384, tiled=True)
    assert plan.stage_peaks["decode"] < budget
    with pytest.raises(FlowliftError, match="too small to decode a 16384x16384"):
        plan_upscale_memory(4096, 4096, 2, 8 << 30, vae_kind="mage", weight_bytes=weights)


def test_a_frame_of_few_tiles_runs_its_dico_blocks_whole(vae):
    """Up to ``whole_tiles`` tiles' area, each DiCo block runs once over the frame (its MLP half in bands):
    conv1 once per block, not twice per tile; the same image as the tiled passes and the whole frame."""
    z = torch.randn(1, 128, 70, 45)
    decoder = vae.model.decoder
    whole_frame, tiled_passes = replace(SMALL, whole_tiles=4), replace(SMALL, whole_tiles=0)
    assert whole_frame.dico_band(70, 45) == 16 and tiled_passes.dico_band(70, 45) is None
    calls, seen = _count_calls(decoder.blocks[0].conv1), []
    with torch.no_grad():
        banded = decode_tiled(decoder, z, lambda done, total: seen.append(total), tiling=whole_frame)
        assert calls[0] == 1
        tiled = decode_tiled(decoder, z, tiling=tiled_passes)
        assert calls[0] == 1 + 2 * 6
        whole = decoder(z)
    assert len(seen) == seen[-1] == decode_steps(decoder, 70, 45, whole_frame)
    assert relative(banded, whole) <= 1e-5 and relative(tiled, whole) <= 1e-5
    x = torch.rand(1, 3, 16 * 40, 16 * 50)
    encoder = vae.model.encoder
    with torch.no_grad():
        encoded = [encode_tiled(encoder, x, tiling=replace(SMALL, whole_tiles=k)) for k in (2, 0)]
        assert relative(encoded[0], encoder(x)) <= 1e-5 and relative(encoded[1], encoder(x)) <= 1e-5


def test_the_stores_take_the_channels_last_layout_of_the_input(vae):
    """A channels-last latent (as MageVAE.decode passes it) gets channels-last (C, h, w) stores: an NCHW store
    made every tile read and write a transposing copy."""
    decoder = vae.model.decoder
    h, w = 40, 50
    z = torch.randn(1, 128, h, w).contiguous(memory_format=torch.channels_last)
    stores: list[torch.Tensor] = []

    class Stores(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (1, NARROW.hidden, h, w) and "empty" in str(func):
                stores.append(out)
            return out

    with torch.no_grad(), Stores():
        decode_tiled(decoder, z, tiling=SMALL)
    assert len(stores) == 3
    assert all(s.is_contiguous(memory_format=torch.channels_last) for s in stores)


def test_the_colour_stage_after_a_bf16_mage_decode_is_costed_on_its_float32_image():
    """MageVAE.decode hands back float32 pixels in any dtype (issue 47): stage 2 on the device holds that image
    and no other copy (less than the decode itself held, so it never needs the host path)."""
    from flowlift.upscale.memory_plan import colour_stage_bytes, plan_upscale_memory

    weights, bf16 = 207 << 20, torch.bfloat16
    roomy = plan_upscale_memory(1024, 1024, 2, 64 << 30, vae_kind="mage", vae_dtype=bf16, weight_bytes=weights)
    assert not roomy.colour_on_host
    assert roomy.stage_peaks["colour"] == weights + colour_stage_bytes(4096, 4096, vae_dtype=torch.float32)
    assert colour_stage_bytes(4096, 4096, vae_dtype=torch.float32) < colour_stage_bytes(4096, 4096, vae_dtype=bf16)
    assert roomy.stage_peaks["colour"] < roomy.stage_peaks["decode"]

"""Tiled refine (issue 30): the layout, the blend weights, exactness against the untiled loop, and the tiles the
tiny random FLUX.2 transformer really runs (position ids, batches, references, seams, metadata).

Tolerances: a tile covering the frame is the untiled call, bit for bit (``torch.equal``); a pointwise velocity
through any layout differs from the untiled result only by the blend's float32 rounding (asserted 2e-6 on values
of order 1); batched tiles against one tile per call, the batched matmuls' rounding (1e-5).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from flowlift.errors import FlowliftError, FlowliftWarning
from flowlift.flux2.img2img import gaussian_flow_velocity
from flowlift.flux2.latents import patchify
from flowlift.refine.loop import refine_latents
from flowlift.refine.refiner import Flux2Refiner
from flowlift.refine.request import HiresSettings
from flowlift.refine.settings import DEFAULT_TILE_SIZE, SamplingSettings
from flowlift.refine.tiled_velocity import TiledVelocity, partition_weights, tiled_for_frame
from flowlift.refine.tiling import (
    TileRequest,
    parse_tile_batch,
    parse_tile_overlap,
    parse_tile_size,
    resolve_tile_size,
    tile_layout,
    tile_starts,
)
from tiny_flux2 import AsUpscaler, Spy, prompt_embeds, tiny_transformer, tiny_vae

S = 128  # px: 16x16 latents, 8x8 tokens
EMB = prompt_embeds()


@pytest.fixture(scope="module")
def vae():
    from flowlift.models.vae_loading import load_vae

    return load_vae(tiny_vae(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def image():
    y, x = torch.meshgrid(torch.linspace(0, 1, S), torch.linspace(0, 1, S), indexing="ij")
    noise = 0.2 * torch.rand(1, 3, S, S, generator=torch.Generator().manual_seed(7))
    return (torch.stack([x, y, 0.5 * (x + y)])[None] * 0.8 + noise).clamp(0, 1)


# ------------------------------------------------------------------------------------------ the layout


@pytest.mark.parametrize(
    "length,tile,overlap",
    [
        (4096, 1024, 128),
        (8192, 1024, 128),
        (16384, 1024, 128),
        (1104, 1024, 128),
        (2048, 1024, 0),
        (128, 80, 32),
        (3072, 768, 256),
        (1040, 1024, 0),
        (4096, 1024, 512),
    ],
)
def test_tiles_cover_the_frame_on_the_patch_grid(length, tile, overlap):
    starts = tile_starts(length, tile, overlap)
    assert starts[0] == 0 and starts[-1] + tile == length
    assert all(s % 16 == 0 for s in starts)  # whole 2x2 patches of the 8x latent
    steps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(0 < step <= tile - overlap for step in steps)  # every shared edge at least `overlap` wide
    fewer = len(starts) - 1  # and no layout with one tile less would do
    assert (fewer - 1) * (tile - overlap) + tile < length


def test_weights_sum_to_one_and_are_exactly_one_where_a_tile_is_alone():
    for length, tile, overlap in [(512, 128, 16), (1024, 128, 0), (138 * 8, 128, 16), (64, 24, 8), (200, 24, 2)]:
        starts = list(range(0, length - tile + 1, tile - overlap))
        if starts[-1] + tile < length:
            starts.append(length - tile)
        weights = partition_weights(length, starts, tile)
        total = torch.zeros(length, dtype=torch.float64)
        covered = torch.zeros(length, dtype=torch.int64)
        for start, weight in zip(starts, weights, strict=True):
            assert bool((weight > 0).all())
            total[start : start + tile] += weight
            covered[start : start + tile] += 1
        assert torch.allclose(total, torch.ones(length, dtype=torch.float64), rtol=0, atol=1e-12)
        for start, weight in zip(starts, weights, strict=True):
            alone = covered[start : start + tile] == 1
            assert bool((weight[alone] == 1.0).all())  # exactly 1: r / r
            assert float(weight.diff().abs().max()) <= 1.5 / max(overlap, 1) + 1e-12  # smooth: the ramp's slope


def test_knobs_domains_are_one_line_errors():
    assert parse_tile_size("auto") == "auto" and parse_tile_size("OFF") == "off" and parse_tile_size("1024") == 1024
    assert parse_tile_overlap("0") == 0 and parse_tile_batch("auto") == "auto" and parse_tile_batch(3) == 3
    for bad, parse in [
        ("1000", parse_tile_size),
        ("16", parse_tile_size),
        ("big", parse_tile_size),
        (True, parse_tile_size),
        ("-16", parse_tile_overlap),
        ("20", parse_tile_overlap),
        ("0", parse_tile_batch),
        ("many", parse_tile_batch),
    ]:
        with pytest.raises(FlowliftError) as caught:
            parse(bad)
        assert "\n" not in str(caught.value)
    with pytest.raises(FlowliftError, match="smaller than the tile"):
        TileRequest.parse(256, 256)
    with pytest.raises(FlowliftError) as caught:  # only the tile set: the tile is blamed, the overlap the default
        TileRequest.parse(32)
    assert str(caught.value) == (
        "tile_size 32 px must be larger than the tile overlap (tile_overlap, 128 px by default); give a tile_size "
        "above 128 or a smaller tile_overlap"
    )
    assert caught.value.fields[:2] == ("tile_size", "tile_overlap")
    with pytest.raises(FlowliftError, match="smaller than the tile"):
        TileRequest.parse("auto", DEFAULT_TILE_SIZE)  # auto's tile is 1024 px
    assert TileRequest.parse("off", 4096).size == "off"


def test_auto_tiles_above_4_mp_only():
    assert resolve_tile_size(2048, 2048, "auto") is None  # 4 MP exactly: FLUX.2's maximum, one call
    assert resolve_tile_size(2064, 2048, "auto") == DEFAULT_TILE_SIZE
    assert resolve_tile_size(4096, 4096, "off") is None
    assert resolve_tile_size(1024, 1024, 512) == 512 and resolve_tile_size(1024, 512, 1024) is None
    assert resolve_tile_size(1024, 1024, "auto", planned=512) == 512  # the memory plan tiles a small frame
    assert resolve_tile_size(4096, 4096, "auto", planned=None) == DEFAULT_TILE_SIZE
    layout = tile_layout(4096, 4096, DEFAULT_TILE_SIZE, 128)
    assert layout.record() == {"size": [1024, 1024], "overlap": 128, "grid": [5, 5], "batch": 1}


def test_untiled_above_4_mp_costs_one_warning_line():
    def never(x, sigma):  # the layout is decided without a model call
        raise AssertionError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn, record = tiled_for_frame(never, (512, 512), TileRequest.parse("off"))
        assert fn is never and record == {"tile_size": "off"}
        fn, record = tiled_for_frame(never, (512, 512), TileRequest.parse("auto"))
        assert isinstance(fn, TiledVelocity) and record["tiles"]["grid"] == [5, 5]
        tiled_for_frame(never, (256, 256), TileRequest.parse("off"))  # 2048 px: within 4 MP, no warning
    ours = [w for w in caught if issubclass(w.category, FlowliftWarning)]
    assert len(ours) == 1 and "4096x4096 px" in str(ours[0].message) and "4 MP" in str(ours[0].message)
    assert "\n" not in str(ours[0].message)


# ------------------------------------------------------------------------------------- exactness


def test_a_tile_covering_the_frame_is_the_untiled_call_bit_for_bit(vae, image):
    refiner = Flux2Refiner(tiny_transformer(), vae)
    common = dict(strength=0.6, sampling=SamplingSettings(steps=4, seed=3, sampler="heun"), prompt_embeds=EMB)
    off = refiner.img2img(image, tiles=refiner.tiling.replace(size="off"), **common)
    for size in (S, 2 * S, 4096):
        out = refiner.img2img(image, tiles=refiner.tiling.replace(size=size, overlap=64), **common)
        assert torch.equal(out.latents, off.latents) and torch.equal(out.images, off.images)
        assert "tiles" not in out.parameters and out.parameters["tile_size"] == size
    # the combinator itself, on a one-tile layout
    den = refiner.denoiser(prompt_embeds=EMB)
    x = torch.randn(1, 32, S // 8, S // 8, generator=torch.Generator().manual_seed(1))
    one = TiledVelocity(den, tile_layout(S, S, S, 0))
    assert torch.equal(one(x, 0.5), den(x, 0.5)) and one.calls == 1


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_a_pointwise_velocity_gives_the_untiled_result_for_any_tiles(sampler):
    """No spatial coupling: each tile computes the frame's own values, and the weights sum to 1."""

    def pointwise(x, sigma):
        return gaussian_flow_velocity(x, sigma, 0.3, 0.8) + 0.1 * torch.tanh(3 * x)

    h, w = 336, 208  # px
    init = torch.randn(1, 32, h // 8, w // 8, generator=torch.Generator().manual_seed(2))
    mask = (torch.rand(1, 1, h // 8, w // 8, generator=torch.Generator().manual_seed(3)) > 0.5).float()
    sampling = SamplingSettings(steps=5, seed=4, sampler=sampler)
    run = dict(init_latents=init, denoising_start=0.3, sampling=sampling, mask=mask)
    reference = refine_latents(pointwise, **run).latents
    for tile, overlap in [(64, 0), (64, 16), (96, 32), (128, 48), (48, 32), (208, 16), (32, 16)]:
        tiled = TiledVelocity(pointwise, tile_layout(h, w, tile, overlap, batch=3))
        out = refine_latents(tiled, **run).latents
        assert tiled.layout.count > 1
        assert torch.allclose(out, reference, rtol=0, atol=2e-6), (tile, overlap, (out - reference).abs().max())


# ------------------------------------------------------------------------- the tiny transformer's tiles


def test_two_by_two_tiles_run_with_tile_local_ids_and_are_recorded(vae, image):
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae)
    common = dict(strength=0.6, sampling=SamplingSettings(steps=3, seed=3), prompt_embeds=EMB)
    off = refiner.img2img(image, tiles=refiner.tiling.replace(size="off"), **common)
    spy.seen.clear()
    out = refiner.img2img(image, tiles=refiner.tiling.replace(size=80, overlap=32), **common)
    assert out.parameters["tiles"] == {"size": [80, 80], "overlap": 32, "grid": [2, 2], "batch": 1}
    assert out.parameters["tile_size"] == 80 and out.parameters["model_calls"] == 3  # sampler steps
    assert len(spy.seen) == 3 * 4  # four tiles per step
    tokens = 80 // 16
    local = torch.cartesian_prod(torch.arange(1), torch.arange(tokens), torch.arange(tokens), torch.arange(1))
    for call in spy.seen:
        assert call["hidden_states"].shape == (1, tokens * tokens, 128)
        assert torch.equal(call["img_ids"], local)  # every tile sees itself as a whole 80x80 image at (0, 0)
    assert not torch.allclose(out.latents, off.latents)  # the tiles really changed what the model saw
    assert (out.latents - off.latents).abs().max() < 0.2 * (off.latents.abs().max())


def test_batched_tiles_equal_one_tile_per_call(vae, image):
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae, tiles=TileRequest.parse(size=80, overlap=32))
    common = dict(strength=0.6, sampling=SamplingSettings(steps=2, seed=3), prompt_embeds=EMB)
    single = refiner.img2img(image, tiles=refiner.tiling.replace(batch=1), **common)
    for batch, calls_per_step in [(4, 1), (3, 2), (8, 1)]:
        spy.seen.clear()
        out = refiner.img2img(image, tiles=refiner.tiling.replace(batch=batch), **common)
        assert len(spy.seen) == 2 * calls_per_step
        assert spy.seen[0]["hidden_states"].shape[0] == min(batch, 4)
        assert out.parameters["tiles"]["batch"] == min(batch, 4)  # what ran: 8 asked, 4 tiles in the frame
        assert torch.allclose(out.latents, single.latents, rtol=0, atol=1e-5)


@pytest.mark.parametrize("requested", [1, 2, 3, 4, 8, "auto"])
def test_several_images_run_one_tile_of_all_per_call_and_record_what_ran(vae, image, requested):
    """Issue 36 class 12: with two images in one batch each call ran one tile but the metadata said the requested
    tile_batch. It records what ran, the batch equals each image refined alone (1e-5: another batch size of the
    same matmuls), and an explicit tile_batch above 1 costs one warning line."""
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae, tiles=TileRequest.parse(size=80, overlap=32))
    common = dict(strength=0.6, sampling=SamplingSettings(steps=2, seed=3), prompt_embeds=EMB)
    pair = torch.cat([image, image.flip(-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = refiner.img2img(pair, tiles=refiner.tiling.replace(batch=requested), **common)
    assert [call["hidden_states"].shape[0] for call in spy.seen] == [2] * (2 * 4)  # one tile of both, 4 per step
    assert out.parameters["tiles"]["batch"] == 1
    ours = [str(w.message) for w in caught if issubclass(w.category, FlowliftWarning)]
    if isinstance(requested, int) and requested > 1:
        assert ours == [
            f"tile batch {requested}: with 2 images in one batch each transformer call runs one "
            "tile of all 2 (recorded as batch 1)"
        ], ours
    else:
        assert not ours, ours
    # its noise is the first half of the pair's
    first = refiner.img2img(pair[:1], tiles=refiner.tiling.replace(batch=1), **common)
    assert torch.allclose(out.latents[:1], first.latents, rtol=0, atol=1e-5)
    # the velocity of both images at once is each image's alone, at any tiles per call asked
    denoiser = refiner.denoiser(prompt_embeds=EMB)
    x = torch.randn(2, 32, S // 8, S // 8, generator=torch.Generator().manual_seed(1))
    layout = tiled_for_frame(denoiser, (S // 8, S // 8), TileRequest.parse(80, 32, requested), images=2)[0].layout
    both = TiledVelocity(denoiser, layout)(x, 0.5)
    alone = torch.cat([TiledVelocity(denoiser, layout)(x[k : k + 1], 0.5) for k in range(2)])
    assert torch.allclose(both, alone, rtol=0, atol=1e-5)


def test_the_record_says_the_tiles_per_call_that_ran_for_any_frame():
    for height, width, tile, asked in [(640, 640, 256, 16), (640, 640, 256, 3), (256, 640, 256, 5), (256, 256, 256, 4)]:
        layout = tile_layout(height, width, tile, 64, asked)
        inner_calls: list[int] = []

        def inner(x, sigma, seen=inner_calls):
            seen.append(x.shape[0])
            return x

        tiled = TiledVelocity(inner, layout)
        tiled(torch.zeros(1, 4, height // 8, width // 8), 0.5)
        assert layout.record()["batch"] == max(inner_calls) == min(asked, layout.count), (height, width, tile, asked)
        assert tiled.tiles_run == layout.count


def test_edge_ramps_use_the_axis_length_to_refuse_layouts_that_do_not_span_it():
    from flowlift.refine.tiled_velocity import edge_ramps

    assert len(edge_ramps(40, [0, 12, 24], 16)) == 3
    for length, starts, tile in [
        (48, [0, 12, 24], 16),  # the last tile ends before the axis
        (32, [0, 12, 24], 16),  # and past it
        (40, [4, 12, 24], 16),  # the first starts inside
        (40, [0, 24, 12, 24], 16),  # out of order
        (64, [0, 24, 48], 16),  # a gap between tiles
        (40, [], 16),
    ]:
        with pytest.raises(ValueError):
            edge_ramps(length, starts, tile)
        with pytest.raises(ValueError):
            partition_weights(length, starts, tile)


def test_reference_images_go_to_every_tile(vae, image):
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae)
    reference = torch.rand(1, 3, 32, 48, generator=torch.Generator().manual_seed(5))
    refiner.img2img(
        image,
        strength=0.5,
        sampling=SamplingSettings(steps=2),
        prompt_embeds=EMB,
        reference_images=[reference],
        tiles=TileRequest.parse(80, 32, 2),
    )
    ref_tokens = (32 // 16) * (48 // 16)
    assert len(spy.seen) == 2 * 2
    for call in spy.seen:
        assert call["hidden_states"].shape == (2, 25 + ref_tokens, 128)
        ids = call["img_ids"]
        assert torch.equal(ids[25:, 0], torch.full((ref_tokens,), 10))  # t = 10: the reference, in every tile call
        assert int(ids[:25, 1].max()) == 4  # tile-local image ids


def seam_ratio(change: torch.Tensor) -> float:
    """Worst column/row step of a refine's change over its median, on the token grid.

    ``d = patchify(change)``; the step between token columns ``c`` and ``c + 1`` is the RMS over channels of the
    row-mean of ``d[..., c + 1] - d[..., c]`` (a seam is a jump shared by the rows of a tile; the model's
    pixel-to-pixel roughness averages out along them); rows likewise; the ratio is the largest step over the
    median step, the worse of columns and rows.
    """
    d = patchify(change)
    cols = (d[..., 1:] - d[..., :-1]).mean(dim=2).pow(2).mean(dim=(0, 1)).sqrt()
    rows = (d[..., 1:, :] - d[..., :-1, :]).mean(dim=3).pow(2).mean(dim=(0, 1)).sqrt()
    return max(float(cols.max() / cols.median()), float(rows.max() / rows.median()))


def test_seams_stay_at_the_untiled_level_with_overlap_and_rise_without(vae):
    """The tiny transformer with its attention outputs scaled up 100x: its spatial coupling -- what tiles change --
    then outweighs the per-token path (at 1x tiling moves the result 0.3 %, below any seam measure)."""
    transformer = tiny_transformer()
    with torch.no_grad():
        transformer.transformer_blocks[0].attn.to_out[0].weight.mul_(100)
        transformer.single_transformer_blocks[0].attn.to_out.weight[:, :32].mul_(100)  # the attention half
    refiner = Flux2Refiner(transformer, vae)
    side = 256
    y, x = torch.meshgrid(torch.linspace(-1, 1, side // 8), torch.linspace(-1, 1, side // 8), indexing="ij")
    init = torch.stack([x, y] * 16)[None] + 0.3 * torch.randn(
        1, 32, side // 8, side // 8, generator=torch.Generator().manual_seed(7)
    )
    den = refiner.denoiser(prompt_embeds=EMB)

    def change(tile, overlap):
        fn = den if tile is None else TiledVelocity(den, tile_layout(side, side, tile, overlap))
        return (
            refine_latents(
                fn, init_latents=init, denoising_start=0.5, sampling=SamplingSettings(steps=4, seed=1)
            ).latents
            - init
        )

    untiled = seam_ratio(change(None, 0))
    overlapped = [seam_ratio(change(160, 64)), seam_ratio(change(192, 128))]
    abutting = seam_ratio(change(128, 0))  # 2x2 tiles meeting at 128 px, no overlap
    assert max(overlapped) < 1.1 * untiled, (untiled, overlapped)
    assert abutting > 1.5 * untiled, (untiled, abutting)


def test_hires_and_txt2img_tile_and_record_both_passes(vae):
    spy = Spy(tiny_transformer())
    refiner = Flux2Refiner(spy, vae, tiles=TileRequest.parse(size=64, overlap=32))

    def upscale(latents):
        return torch.nn.functional.interpolate(latents, scale_factor=2, mode="nearest")

    settings = HiresSettings(base_size=(96, 48), base_steps=2, scale=2, refine_strength=0.3)
    out = refiner.hires(AsUpscaler(upscale), settings, sampling=SamplingSettings(steps=3), prompt_embeds=EMB)
    assert out.images.shape[-2:] == (96, 192)
    assert out.parameters["base_tiles"] == {"size": [48, 64], "overlap": 32, "grid": [1, 2], "batch": 1}
    assert out.parameters["tiles"] == {"size": [64, 64], "overlap": 32, "grid": [2, 5], "batch": 1}
    assert len(spy.seen) == 2 * 2 + 3 * 10

"""FlowUpscalerPipeline with the real TAEF2 and a randomly initialised small Flow Upscaler UNet."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from door_helpers import UnusedVAE
from flowlift.errors import FlowliftError
from flowlift.limits import passes_for_scale
from flowlift.measure.metrics import drift_at_input_scale
from flowlift.upscale.colorfix import LOWFREQ_FACTOR, area_downsample, lowband_grid
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy
from flowlift.upscale.sizes import MAX_OUTPUT_SIDE, allowed_passes, pad_to_multiple, pass_generator


@pytest.fixture(scope="module")
def pipe(unet, vae):
    return FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def photo(shared):
    """A real photo at an odd size (37 x 21), small enough for three passes on the CPU."""
    image = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    return image.resize((37, 21), Image.Resampling.BOX)


class ZeroVelocity(torch.nn.Module):
    """A tiny stand-in model: v = 0, so x0 is the noise itself."""

    def forward(self, sample, timestep, latents_small):
        return torch.zeros_like(sample)


def test_constants():
    assert MAX_OUTPUT_SIDE == 16384 and LOWFREQ_FACTOR == 8
    assert FlowUpscalerPipeline.MAX_OUTPUT_SIDE == 16384 and FlowUpscalerPipeline.LOWFREQ_FACTOR == 8
    assert [passes_for_scale(s) for s in (2, 4, 8)] == [1, 2, 3]
    # the one rule is "the fewest 2x passes that reach the scale", so it also serves a scale between powers of two
    assert [passes_for_scale(s) for s in (1, 1.5, 3, 5, 6.0, 16)] == [1, 1, 2, 3, 3, 4]
    # a latent step that does the fraction in [1, 2) last (SesquiLSR): one pass fewer unless a power of two
    assert [passes_for_scale(s, fraction_last=True) for s in (1.5, 2, 3, 4, 6, 8)] == [0, 1, 1, 2, 2, 3]
    for bad in (0.99, 0, -2, float("nan"), float("inf"), True, "2"):
        with pytest.raises(FlowliftError, match="scale must be a finite number of at least 1"):
            passes_for_scale(bad)


@pytest.mark.parametrize("passes", [1, 2, 3])
def test_output_size_is_exact_multiple_of_odd_input(pipe, photo, passes):
    out = pipe.upscale_image(photo, num_passes=passes, seed=3)
    assert isinstance(out, Image.Image) and out.mode == "RGB"
    assert out.size == (37 * 2**passes, 21 * 2**passes)


def test_resample_mode_returns_multiple_of_16(pipe, photo):
    image = photo.resize((41, 27), Image.Resampling.BICUBIC)
    out = pipe.upscale_image(image, num_passes=1, resize_mode="resample", output_type="pt")
    assert tuple(out.shape) == (1, 3, 2 * 32, 2 * 48)
    latents, size = pipe.encode_image(photo, return_size=True)
    assert tuple(latents.shape) == (1, 32, 32 // 8, 48 // 8) and size == (21, 37)


def test_padding_keeps_the_original_pixels():
    image = torch.rand(1, 3, 21, 37)
    padded = pad_to_multiple(image)
    assert tuple(padded.shape) == (1, 3, 32, 48)
    assert torch.equal(padded[..., :21, :37], image)
    assert torch.equal(padded[..., 21, :37], image[..., 19, :])  # reflection, no repeated edge row


def test_upscale_latents_shapes_and_chaining(pipe):
    latents = torch.randn(2, 32, 4, 6, generator=torch.Generator().manual_seed(1))
    one = pipe.upscale_latents(latents, num_passes=1, seed=5)
    two = pipe.upscale_latents(latents, num_passes=2, seed=5)
    three = pipe.upscale_latents(latents[:1], num_passes=3, seed=5)
    assert tuple(one.shape) == (2, 32, 8, 12) and tuple(two.shape) == (2, 32, 16, 24)
    assert tuple(three.shape) == (1, 32, 32, 48) and three.dtype == torch.float32
    # chaining: pass 2 is conditioned on pass 1's output, so (stage 1 at strength 1) its low band is
    # pass 1's output's low band on the same grid
    grid = lowband_grid(*two.shape[-2:])
    torch.testing.assert_close(area_downsample(two, grid), area_downsample(one, grid), atol=1e-5, rtol=0)
    assert not torch.equal(three[0, :, ::4, ::4], two[0, :, ::2, ::2])


def test_one_step_and_stage1(pipe, unet):
    latents = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(2))
    noise = torch.randn(1, 32, 16, 16, generator=pass_generator(7, 0))
    with torch.no_grad():
        raw = noise - unet(noise, torch.full((1,), 1000.0), latents)
    off = pipe.upscale_latents(latents, 1, seed=7, color_fix=False)
    torch.testing.assert_close(off, raw, atol=1e-5, rtol=0)
    zero = pipe.upscale_latents(latents, 1, seed=7, transplant_strength=0.0)
    torch.testing.assert_close(zero, raw, atol=1e-5, rtol=0)
    full = pipe.upscale_latents(latents, 1, seed=7)
    grid = lowband_grid(16, 16)
    assert (area_downsample(raw, grid) - area_downsample(latents, grid)).abs().max() > 0.1
    torch.testing.assert_close(area_downsample(full, grid), area_downsample(latents, grid), atol=1e-5, rtol=0)
    half = pipe.upscale_latents(latents, 1, seed=7, transplant_strength=0.5)
    torch.testing.assert_close(half - raw, 0.5 * (full - raw), atol=1e-5, rtol=0)


def test_determinism(pipe, photo):
    a = pipe.upscale_image(photo, num_passes=2, seed=11)
    b = pipe.upscale_image(photo, num_passes=2, seed=11)
    c = pipe.upscale_image(photo, num_passes=2, seed=12)
    assert a.tobytes() == b.tobytes()
    assert a.tobytes() != c.tobytes()


def test_pass_streams_are_distinct_and_deterministic():
    def draw(seed, index):
        return torch.randn(64, generator=pass_generator(seed, index))

    assert torch.equal(draw(0, 1), draw(0, 1))
    streams = [draw(s, p) for s in (0, 1, 2) for p in (0, 1, 2)]
    for i in range(len(streams)):
        for j in range(i):
            assert not torch.equal(streams[i], streams[j])
    with pytest.raises(FlowliftError):
        pass_generator(-1, 0)


def test_stage2_in_the_pipeline_pins_colour(pipe, photo):
    fixed = pipe.upscale_image(photo, num_passes=1, seed=1)
    raw = pipe.upscale_image(photo, num_passes=1, seed=1, color_fix=False)
    d_fixed, d_raw = drift_at_input_scale(fixed, photo), drift_at_input_scale(raw, photo)
    # a random UNet drifts enormously; stage 2 still brings colour back to the input's at input scale
    assert d_raw["cast_max"] > 5
    assert d_fixed["cast_max"] < 0.5 and abs(d_fixed["c_mean_change_pct"]) < 1.0
    # (halving is tested on small, realistic drifts in test_colorfix; this drift is far from linear)
    half = pipe.upscale_image(photo, num_passes=1, seed=1, color_fix_strength=0.5)
    d_half = drift_at_input_scale(half, photo)
    assert d_fixed["cast_max"] < d_half["cast_max"] < d_raw["cast_max"]


def test_alpha_is_resized_and_kept(pipe, photo):
    rgba = photo.copy()
    alpha = Image.fromarray(np.tile(np.linspace(0, 255, 37, dtype=np.uint8), (21, 1)), "L")
    rgba.putalpha(alpha)
    out = pipe.upscale_image(rgba, num_passes=1)
    assert out.mode == "RGBA" and out.size == (74, 42)
    out_alpha = np.asarray(out.getchannel("A"), dtype=np.float64)
    assert out_alpha[:, 0].mean() < 10 and out_alpha[:, -1].mean() > 245


def test_the_cap_is_said_as_its_value_never_as_the_constant_name():
    """The sizes' lines said ``MAX_OUTPUT_SIDE=16384`` / ``(MAX_OUTPUT_SIDE)``, a Python name: now the cap a side."""
    from flowlift.upscale.latent_fraction import fraction_passes
    from flowlift.upscale.sizes import dropped_passes_message, no_pass_fits, over_cap_refusal

    lines = [dropped_passes_message(8192, 16, 3, 1), no_pass_fits(16384, 16)]
    lines.append(over_cap_refusal("scale 8", 4096, 16, 3, 1))
    with pytest.raises(FlowliftError) as caught:
        fraction_passes(16, 12000, "pad", (36000, 48))
    lines.append(str(caught.value))
    for line in lines:
        assert "the 16384 px cap a side" in line and "MAX_OUTPUT_SIDE" not in line, line


def test_max_output_side_drops_passes_with_a_warning():
    pipe = FlowUpscalerPipeline(ZeroVelocity(), UnusedVAE(), device="cpu", dtype=torch.float32)
    latents = torch.zeros(1, 32, 4, 1024)  # an 8192 px wide image: only one pass fits under 16384
    with pytest.warns(UserWarning, match="the 16384 px cap a side; running 1 pass"):
        out = pipe.upscale_latents(latents, num_passes=3)
    assert tuple(out.shape) == (1, 32, 8, 2048)
    with pytest.raises(FlowliftError, match="16384x32 image cannot be upscaled"):  # no pass fits: refused
        pipe.upscale_latents(torch.zeros(1, 32, 4, 2048), num_passes=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.upscale_latents(torch.zeros(1, 32, 4, 1024), num_passes=1)  # exactly at the cap: no warning
    assert allowed_passes(100, 5000, 3) == 1 and allowed_passes(16, 16, 3) == 3 and allowed_passes(20000, 1, 1) == 0


def test_chunked_execution_matches_plain(unet, vae):
    latents = torch.randn(1, 32, 6, 8, generator=torch.Generator().manual_seed(4))
    plain_pipe = FlowUpscalerPipeline(unet, vae, device="cpu", memory=MemoryPolicy(chunked=False))
    plain = plain_pipe.upscale_latents(latents, 1, seed=2)
    chunked = FlowUpscalerPipeline(unet, vae, device="cpu", memory=MemoryPolicy(chunked=True, chunk_rows=4))
    torch.testing.assert_close(chunked.upscale_latents(latents, 1, seed=2), plain, atol=1e-4, rtol=0)


def test_missing_weights_say_where_and_how(vae, tmp_path):
    with pytest.raises(FlowliftError, match="flow_upscaler.safetensors.*upscaler PATH"):
        FlowUpscalerPipeline(tmp_path / "nothing-here", vae, device="cpu")
    with pytest.raises(FlowliftError, match="HF_HUB_OFFLINE.*upscaler PATH"):
        FlowUpscalerPipeline("TensorForger/NoSuchRepoCached", vae, device="cpu")


def test_loads_saved_weights_and_records_their_file(unet, vae, tmp_path):
    from flowlift.models.upscaler_weights import save_upscaler

    path = save_upscaler(unet, tmp_path / "flow_upscaler.safetensors")
    loaded = FlowUpscalerPipeline(tmp_path, vae, device="cpu")
    assert loaded.upscaler_path == path and loaded.model_files()["upscaler"] == [path]
    latents = torch.randn(1, 32, 8, 8)
    reference = FlowUpscalerPipeline(unet, vae, device="cpu").upscale_latents(latents, 1)
    torch.testing.assert_close(loaded.upscale_latents(latents, 1), reference, atol=1e-5, rtol=0)


def test_bare_vae_module_is_wrapped(unet, vae):
    from flowlift.models.vae import TAEF2VAE

    wrapped = FlowUpscalerPipeline(unet, vae.model, device="cpu")
    assert isinstance(wrapped.vae, TAEF2VAE) and wrapped.vae.model is vae.model
    with pytest.raises(FlowliftError):
        FlowUpscalerPipeline(unet, object(), device="cpu")


def test_latent_only_pipeline_with_strip_progress_and_memory_budget(unet):
    """vae=None upscales latents; on_strip sees every strip of chunked passes; a tiny budget chunks."""
    latents = torch.randn(1, 32, 8, 6, generator=torch.Generator().manual_seed(4))
    plain = FlowUpscalerPipeline(unet, vae=None, memory=MemoryPolicy(chunked=False)).upscale_latents(latents, 2, seed=9)
    seen: list[tuple[int, int]] = []
    pipe = FlowUpscalerPipeline(
        unet, vae=None, memory=MemoryPolicy(chunk_budget_bytes=1, chunk_rows=3), on_strip=lambda *a: seen.append(a)
    )
    chunked = pipe.upscale_latents(latents, 2, seed=9)
    torch.testing.assert_close(chunked, plain, rtol=0, atol=1e-4)
    totals = sorted({total for _, total in seen})
    assert len(totals) == 2 and len(seen) == sum(totals)  # two passes, every strip reported once
    with pytest.raises(FlowliftError, match="without a VAE"):
        pipe.upscale_image(torch.rand(1, 3, 16, 16), 1)


def test_decode_tile_progress_reaches_the_caller(unet, vae, photo):
    """on_decode_tile sees every tile of the VAE's tiled decode; it only observes (same pixels)."""
    tiled = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, memory=MemoryPolicy(vae_tiled=True))
    seen: list[tuple[int, int]] = []
    stages: list[str] = []
    hooked = tiled.upscale_image(
        photo, 2, seed=1, output_type="pt", callback=stages.append, on_decode_tile=lambda *a: seen.append(a)
    )
    plain = tiled.upscale_image(photo, 2, seed=1, output_type="pt")
    assert torch.equal(hooked, plain)
    assert seen and seen == [(done, seen[0][1]) for done in range(1, seen[0][1] + 1)]
    assert stages == ["encode", "pass 1/2", "pass 2/2", "decode", "color fix"]

    class PlainDecode:  # a VAE without tile progress (e.g. another front-end's adapter): one tile
        spatial_factor = 8

        def encode(self, images, tiled=None):
            return vae.encode(images, tiled=tiled)

        def decode(self, latents, tiled=None):
            return vae.decode(latents, tiled=tiled)

    seen.clear()
    FlowUpscalerPipeline(unet, PlainDecode(), device="cpu", dtype=torch.float32).upscale_image(
        photo, 1, on_decode_tile=lambda *a: seen.append(a)
    )
    assert seen == [(1, 1)]

"""SesquiLSR in row bands under ``max_memory`` (flowlift/models/sesqui_bands.py): the banded forward equals the
whole-frame one to float32 rounding at every band height, factor and batch; the tracked peak of either stays within
its estimate and the banded one is a fraction of the whole; the memory plan runs SesquiLSR whole, in bands or
refuses in one line, and plans the decode at SesquiLSR's size, not at one more 2x pass; the pipeline under a budget
that forces bands gives the unbudgeted image.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from builders import save_tiny_unet
from flowlift.errors import FlowliftError
from flowlift.limits import model_bytes
from flowlift.measure.tiled_inference import _PeakTensorMemory
from flowlift.models.sesqui_bands import (
    banded_peak_bytes,
    frame_statistics,
    rows_for_budget,
    sesqui_banded,
    whole_peak_bytes,
)
from flowlift.models.sesqui_lsr import SesquiLSR, sample_statistics
from flowlift.upscale import memory_plan
from flowlift.upscale.memory_plan import StageChoices, plan_latent_upscaler, plan_upscale_memory
from sesqui_reference import save_random_sesqui


@pytest.fixture(scope="module")
def model():
    """A random SesquiLSR whose layers all matter (weights N(0, 0.05): the released zero-initialised taps and gains
    would leave the resampling's rows and the rank gains untested)."""
    torch.manual_seed(0)
    network = SesquiLSR().eval().requires_grad_(False)
    for parameter in network.parameters():
        parameter.normal_(0, 0.05)
    return network


@pytest.mark.parametrize(
    ("size", "target", "batch"),
    [
        ((20, 28), (30, 42), 1),
        ((20, 28), (40, 56), 2),
        ((21, 27), (21, 27), 1),
        ((16, 24), (23, 47), 1),
        ((3, 5), (6, 7), 1),
    ],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 64])
def test_bands_equal_the_whole_frame(model, size, target, batch, rows):
    raw = torch.randn(batch, 32, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole, banded = model(raw, target), sesqui_banded(model, raw, target, rows)
    assert banded.shape == whole.shape == (batch, 32, *target)
    # the statistics summed in float64 over bands where the whole frame sums in float32: ~1 ulp of values ~5
    assert (banded - whole).abs().max() <= 2e-6, (banded - whole).abs().max()
    # the band edges are where a wrong halo or reflection would show: every row is checked above, and the rows
    # differ from a shifted copy (a band placed one row off would not pass)
    assert (whole[:, :, 1:] - whole[:, :, :-1]).abs().max() > 1e-2


def test_frame_statistics_are_the_samples_statistics():
    x = torch.randn(3, 128, 17, 9, generator=torch.Generator().manual_seed(2)) * 3 + 1
    mean, spread = frame_statistics(x, rows=4)
    expected_mean, expected_spread = sample_statistics(x)
    assert mean.shape == spread.shape == (3, 1, 1, 1)
    assert torch.allclose(mean, expected_mean, atol=1e-6) and torch.allclose(spread, expected_spread, rtol=1e-6)


def _tracked_peak(fn) -> int:
    tracker = _PeakTensorMemory()
    with torch.no_grad(), tracker:
        fn()
    return tracker.peak


@pytest.mark.parametrize("target", [(48, 48), (72, 72), (96, 96), (72, 54)])
def test_the_estimates_bound_the_tracked_peaks_and_bands_save_most_of_it(model, target):
    raw = torch.randn(1, 32, 48, 48, generator=torch.Generator().manual_seed(3))
    whole = _tracked_peak(lambda: model(raw, target))
    assert whole <= whole_peak_bytes(1, 48, 48)
    assert whole >= 0.8 * whole_peak_bytes(1, 48, 48)  # and not a loose bound: the plan would waste the budget
    for rows in (1, 6):
        banded = _tracked_peak(lambda rows=rows: sesqui_banded(model, raw, target, rows))
        assert banded <= banded_peak_bytes(1, 48, 48, target, rows), rows
    assert banded_peak_bytes(1, 48, 48, target, 2) < 0.3 * whole


def test_rows_for_budget_is_the_most_rows_that_fit():
    target = (300, 200)
    for budget in (15 * 10**7, 3 * 10**8, 6 * 10**8):
        rows = rows_for_budget(budget, 1, 200, 150, target)
        assert rows >= 1
        assert banded_peak_bytes(1, 200, 150, target, rows) <= budget < banded_peak_bytes(1, 200, 150, target, rows + 1)
    assert rows_for_budget(banded_peak_bytes(1, 200, 150, target, 0), 1, 200, 150, target) == 0
    assert rows_for_budget(10**12, 1, 200, 150, target) == 400  # never more than the grid's rows


def test_the_plan_runs_sesquilsr_whole_in_bands_or_refuses():
    passed, target = (256, 384), (384, 576)
    whole = plan_latent_upscaler(passed, target, 10**12, 1, 0)[1]
    assert plan_latent_upscaler(passed, target, whole, 1, 0) == (None, whole)
    rows, peak = plan_latent_upscaler(passed, target, whole - 1, 1, 0)
    assert rows is not None and peak <= whole - 1
    fewer, half = plan_latent_upscaler(passed, target, whole // 2, 1, 0)
    assert fewer is not None and fewer < rows and half <= whole // 2
    with pytest.raises(FlowliftError) as refused:  # below the two stored frames
        plan_latent_upscaler(passed, target, whole // 10, 1, 0)
    line = str(refused.value)
    assert "\n" not in line and "SesquiLSR from 384x256 to 576x384 latents" in line and "one-row bands" in line


def test_the_decode_is_planned_at_sesquilsrs_size_not_one_more_pass():
    # 512x512 px, one pass to 128x128 latents, SesquiLSR to 192x192: the decode makes 1536x1536 px, not 2048x2048
    sizes = {"num_passes": 1, "budget_bytes": 10**12, "vae_kind": "flux2"}
    with_fraction = plan_upscale_memory(512, 512, choices=StageChoices(latent_fraction=(192, 192)), **sizes)
    one_more_pass = plan_upscale_memory(512, 512, **{**sizes, "num_passes": 2})
    assert len(with_fraction.passes) == 1 and with_fraction.latent_upscaler == "whole frame"
    assert with_fraction.stage_peaks["decode"] < one_more_pass.stage_peaks["decode"]
    assert "latent upscaler" in with_fraction.stage_peaks and "SesquiLSR whole frame" in with_fraction.describe()
    plain = plan_upscale_memory(512, 512, **sizes)
    assert plain.latent_upscaler == "" and "SesquiLSR" not in plain.describe()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """A tiny FLUX.2 VAE folder (BN statistics), a tiny Flow Upscaler and a random SesquiLSR file: their paths."""
    from tiny_flux2 import tiny_vae

    folder = tmp_path_factory.mktemp("models")
    tiny_vae().save_pretrained(folder / "vae")
    unet = save_tiny_unet(folder / "flow_upscaler.safetensors", seed=0, cond_dim=32)
    return str(unet), str(folder / "vae"), f"sesqui:{save_random_sesqui(folder)}"


def _photo():
    return Image.fromarray((torch.rand(64, 96, 3, generator=torch.Generator().manual_seed(0)) * 255).byte().numpy())


def test_the_pipeline_under_a_budget_that_forces_bands_gives_the_unbudgeted_image(tiny_models, monkeypatch):
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.settings import MemoryPolicy

    unet, vae, spec = tiny_models
    image = _photo()

    def run(max_memory):
        pipeline = FlowUpscalerPipeline(
            str(unet), str(vae), device="cpu", dtype=torch.float32, latent_upscaler=spec,
            memory=MemoryPolicy(max_memory=max_memory),
        )  # fmt: skip
        return pipeline, pipeline.upscale_image(image, num_passes=1, output_type="pt", output_size=(288, 192))

    plain, expected = run(None)
    # the encode's and decode's estimates are the real FLUX.2 VAE's (tiled ones hold ~2 GB whatever the frame): for the
    # tiny one, 16 float32 values per pixel, so that a budget around SesquiLSR's plan fits the other stages
    monkeypatch.setattr(memory_plan, "decode_peak_bytes", lambda kind, h, w, *, batch=1, dtype=None, tiled: 64 * h * w)
    monkeypatch.setattr(memory_plan, "encode_peak_bytes", lambda kind, h, w, *, batch=1, dtype=None, tiled: 64 * h * w)
    # 3x: one pass to 16x24 latents, SesquiLSR to 24x36; a budget under its whole-frame plan
    weights = sum(model_bytes(m) for m in (plain.upscaler, plain.vae, plain.sesqui))
    whole = plan_latent_upscaler((16, 24), (24, 36), 10**12, 1, weights)[1]
    budgeted, result = run(whole - 1)
    plan = budgeted.last_plan
    assert plan.latent_upscaler == "bands" and plan.latent_upscaler_rows is not None
    assert len(plan.passes) == 1 and "pass 2" not in plan.stage_peaks  # the fraction is no UNet pass
    assert f"SesquiLSR {plan.latent_upscaler_rows}-row bands" in plan.describe()
    assert result.shape == expected.shape == (1, 3, 192, 288)
    # float32 rounding of the bands (2e-6 in the latents, above) grown by the decode and stage 2's Lab conversion (its
    # cube root is steep near black): measured 1.6e-4 on an AVX2 AMD EPYC, under 1e-4 on AVX512 CPUs; 5e-4 is an
    # eighth of one 8-bit step
    assert (result - expected).abs().max() <= 5e-4, (result - expected).abs().max()
    # a budget under SesquiLSR's two stored frames (the pipeline keeps the resampled float32 frame off it): one line
    with pytest.raises(FlowliftError, match=r"too small for SesquiLSR from 24x16 to 36x24 latents"):
        run(weights + 3 * 288 * 192 * 4 + 2**20)


def test_without_max_memory_sesquilsr_bands_by_size_as_the_unet_chunks(tiny_models, monkeypatch):
    from flowlift.models import sesqui_bands
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.settings import MemoryPolicy

    unet, vae, spec = tiny_models
    banded_rows = []
    real = sesqui_bands.sesqui_banded
    monkeypatch.setattr(sesqui_bands, "sesqui_banded", lambda *a, rows: banded_rows.append(rows) or real(*a, rows=rows))

    def run(memory):
        pipeline = FlowUpscalerPipeline(
            unet, vae, device="cpu", dtype=torch.float32, latent_upscaler=spec, memory=memory
        )
        return pipeline.upscale_image(_photo(), num_passes=1, output_type="pt", output_size=(288, 192))

    expected = run(None)  # the CPU's default budget (1 GiB) holds this whole frame
    assert banded_rows == []
    # a chunking budget (ComfyUI's nodes pass a share of the free memory) under its whole frame: bands, never a refusal
    result = run(MemoryPolicy(chunk_budget_bytes=whole_peak_bytes(1, 16, 24) // 2))
    assert banded_rows == [16]  # the fewest rows worth running (the budget would allow fewer)
    # float32: SesquiLSR's bands within ~5e-7, carried by stage 2's clipped iterations to ~1e-4
    assert (result - expected).abs().max() <= 2e-4, (result - expected).abs().max()


def test_rows_by_size_whole_while_it_fits_else_at_least_16_rows():
    from flowlift.upscale.memory_plan import MIN_LATENT_UPSCALER_ROWS, latent_upscaler_rows_by_size

    target = (384, 384)
    assert latent_upscaler_rows_by_size((256, 256), target, 1, "cpu", whole_peak_bytes(1, 256, 256)) is None
    roomy = latent_upscaler_rows_by_size((256, 256), target, 1, "cpu", whole_peak_bytes(1, 256, 256) - 1)
    assert MIN_LATENT_UPSCALER_ROWS < roomy < 512
    assert latent_upscaler_rows_by_size((256, 256), target, 1, "cpu", 1) == MIN_LATENT_UPSCALER_ROWS
    assert latent_upscaler_rows_by_size((4, 6), (6, 9), 1, "cpu", 1) == 8  # never more rows than the grid has
    # the CPU's default budget is the UNet's (1 GiB): a 1.5x fraction to 2160x1440 px whole, to 8K in bands
    assert latent_upscaler_rows_by_size((120, 180), (180, 270), 1, "cpu") is None
    assert latent_upscaler_rows_by_size((360, 640), (540, 960), 1, "cpu") is not None


def test_the_hires_fractions_budget_runs_sesquilsr_in_bands_or_refuses(tmp_path, monkeypatch, model):
    # the hires fix's SesquiLSR (FractionalUpscaler.to_size) under the budget its latent-only pipeline was given
    from types import SimpleNamespace

    from flowlift.models import sesqui_bands
    from flowlift.models.sesqui_lsr import sesqui_upscale_latents
    from flowlift.upscale.latent_source import FractionalUpscaler
    from flowlift.upscale.pipeline import FlowUpscalerPipeline
    from flowlift.upscale.settings import MemoryPolicy

    unet = save_tiny_unet(tmp_path / "flow_upscaler.safetensors", seed=0, cond_dim=32)
    generator = torch.Generator().manual_seed(4)
    vae = SimpleNamespace(
        bn_mean=torch.randn(128, generator=generator), bn_std=torch.rand(128, generator=generator) + 0.5
    )
    latents = torch.randn(1, 32, 24, 32, generator=generator)
    expected = sesqui_upscale_latents(model, latents, (36, 48), vae.bn_mean, vae.bn_std)
    banded_rows = []
    real = sesqui_bands.sesqui_banded
    monkeypatch.setattr(sesqui_bands, "sesqui_banded", lambda *a, rows: banded_rows.append(rows) or real(*a, rows=rows))

    def to_size(budget):
        pipeline = FlowUpscalerPipeline(
            str(unet), None, device="cpu", dtype=torch.float32, memory=MemoryPolicy(max_memory=budget)
        )
        return FractionalUpscaler(pipeline, model, vae, "sesqui:unused").to_size(latents, (36, 48))

    weights = sum(model_bytes(m) for m in (FlowUpscalerPipeline(str(unet), None, device="cpu").upscaler, model))
    whole = plan_latent_upscaler((24, 32), (36, 48), 10**12, 1, weights)[1]
    assert torch.equal(to_size(whole), expected) and banded_rows == []  # it fits: the whole frame, bit for bit
    result = to_size(weights + (whole - weights) // 2)
    assert len(banded_rows) == 1 and banded_rows[0] >= 1
    assert (result - expected).abs().max() <= 1e-5, (result - expected).abs().max()
    with pytest.raises(FlowliftError, match="one-row bands"):
        to_size(weights + 2**20)

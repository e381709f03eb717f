"""Issue 13 on the CPU: the max_memory planner's choices, budgeted / offloaded pipelines == plain,
noise per image (batch == one by one, bit for bit), compiled UNet == eager, its per-shape cache and
its eager fallback. The CUDA-only parts (pinned stores, side stream, CUDA graphs) are exercised by
``benchmarks/bench_gpu.py --device cuda``; their CPU twins run here."""

from __future__ import annotations

import warnings

import pytest
import torch
from PIL import Image

from door_helpers import UnusedVAE
from flowlift.errors import FlowliftError
from flowlift.limits import parse_memory
from flowlift.upscale import memory_plan as M
from flowlift.upscale import pass_plan as P
from flowlift.upscale.chunked import budget as B
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy
from flowlift.upscale.sizes import pass_generator

GIB = 2**30


@pytest.fixture(scope="module")
def photos(shared):
    names = ["Wine_by_Jakkub_Mede.png"]
    base = Image.open(shared / "images" / "photos" / names[0]).convert("RGB")
    return [base.resize((40, 24), Image.Resampling.BOX), base.crop((100, 80, 500, 320)).resize((40, 24))]


# -- parse_memory and the plan (pure) -----------------------------------------------------------


def test_parse_memory_units_and_errors():
    assert parse_memory("6GB") == 6 * 10**9
    assert parse_memory("6 GiB") == 6 * GIB
    assert parse_memory("512MiB") == 512 * 2**20
    assert parse_memory("1.5g") == 1_500_000_000
    assert parse_memory(3 * GIB) == 3 * GIB
    for bad in ("six GB", "6XB", "-1GB", "12", True, ""):
        with pytest.raises(FlowliftError):
            parse_memory(bad)


def full_size_plan(budget: str, vae: str = "taef2"):
    """The issue's case: a 2048x1366 photo (model input 2048x1376) to x8, bf16, 59M-parameter UNet."""
    return M.plan_upscale_memory(
        1376,
        2048,
        3,
        parse_memory(budget),
        unet_dtype=torch.bfloat16,
        vae_kind=vae,
        vae_dtype=torch.bfloat16,
        weight_bytes=(118 << 20) + ((2 << 20) if vae == "taef2" else (168 << 20)),
    )


def test_plan_picks_plain_chunked_offload_and_host_colour_by_budget():
    big = full_size_plan("80GB")
    assert [p.mode for p in big.passes] == ["plain", "plain", "plain"]
    six = full_size_plan("6GB")
    assert [p.mode for p in six.passes] == ["plain", "plain", "offload"]
    assert six.vae_tiled and not six.colour_on_host
    # TAEF2's tiled decode holds the float32 16384x11008 image (2 GiB): the colour fix, on that frame, fits beside it
    four = full_size_plan("4GB")
    assert [p.mode for p in four.passes] == ["plain", "chunked", "offload"]
    assert four.vae_tiled and not four.colour_on_host
    for plan in (big, six, four):  # every stage's estimate within the budget
        assert plan.peak_bytes <= plan.budget_bytes
        assert max(plan.stage_peaks.values()) == plan.peak_bytes
    # strips grow with the budget
    assert six.passes[2].strip_rows > four.passes[2].strip_rows
    assert "offload" in six.describe() and "tiled" in six.describe()


def test_plan_refuses_budgets_that_cannot_fit_in_one_line():
    for vae in ("taef2", "flux2"):  # TAEF2's tiled decode: about 3.56 GiB
        with pytest.raises(FlowliftError, match="decode"):
            full_size_plan("3GB", vae=vae)
    with pytest.raises(FlowliftError, match="weights"):
        full_size_plan("100MB")
    with pytest.raises(FlowliftError, match="UNet pass"):
        P.plan_unet_pass(2048, 2048, 10**9, dtype=torch.bfloat16, fixed_bytes=10**9 - 1000)


def test_plan_unet_pass_boundaries():
    sizes = {"batch": 1, "base_channels": 64, "dtype": torch.float32}
    plain = B.plain_peak_bytes(128, 128, **sizes)
    assert P.plan_unet_pass(128, 128, plain, **sizes).mode == "plain"
    chunked = P.plan_unet_pass(128, 128, plain - 1, **sizes)
    assert chunked.mode == "chunked" and chunked.peak_bytes <= plain - 1
    stores = B.chunked_store_bytes(128, 128, **sizes)
    per_row = B.strip_bytes_per_row(128, **sizes)
    offload = P.plan_unet_pass(128, 128, stores + 5 * per_row, **sizes)
    # the stores do not fit with 8 rows of strip on the device; offloaded, the whole budget is strips
    assert offload.mode == "offload" and offload.strip_rows == (stores + 5 * per_row) // per_row - 2


# -- the pipeline under a budget (CPU: the plan's paths, exact) -----------------------------------


def budget_for(pipe: FlowUpscalerPipeline, image_hw: tuple[int, int], passes: int, want: str) -> int:
    """The smallest whole-MB budget at which the plan's last pass runs ``want``."""
    pipe.max_memory = None
    low, high = 10**6, 10**10
    while high - low > 10**5:
        mid = (low + high) // 2
        pipe.max_memory = mid
        try:
            mode = pipe.plan_memory(*image_hw, passes).passes[-1].mode
        except FlowliftError:
            mode = "none"
        order = ["none", "offload", "chunked", "plain"]
        if order.index(mode) >= order.index(want):
            high = mid
        else:
            low = mid
    pipe.max_memory = None
    return high


def test_budgeted_pipeline_equals_plain(unet, vae, photos, monkeypatch):
    # tiny images: scale the UNet's frame counts up so that the UNet decides the budget
    from flowlift import limits
    from flowlift.upscale import pipeline_plans

    monkeypatch.setattr(limits, "DECODE_TILE_BYTES", dict.fromkeys(limits.DECODE_TILE_BYTES, 0))  # what decode reads
    monkeypatch.setattr(M, "COLOUR_STRIP_BYTES", 0)
    monkeypatch.setattr(B, "PLAIN_PEAK_FRAMES", 1e5)
    monkeypatch.setattr(B, "CHUNKED_STORE_FRAMES", 2e3)
    monkeypatch.setattr(B, "STRIP_ROW_FRAMES", 200.0)
    # a CPU run keeps its stores in the memory the budget bounds, so its plan never offloads them; the offload
    # plan's strips run here as on a GPU (the executor's stores stay on the CPU either way)
    monkeypatch.setattr(pipeline_plans, "stores_can_leave", lambda device, offload_device=None: True)
    plain = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)
    reference = plain.upscale_image(photos[0], num_passes=2, seed=5, output_type="pt")
    for want in ("chunked", "offload"):
        budget = budget_for(plain, (32, 48), 2, want)
        memory = MemoryPolicy(max_memory=budget)
        pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, memory=memory)
        out = pipe.upscale_image(photos[0], num_passes=2, seed=5, output_type="pt")
        assert pipe.last_plan.passes[-1].mode == want
        assert pipe.last_plan.passes[-1].strip_rows < 16  # strips, not the whole frame
        assert (out - reference).abs().max().item() <= 1e-4, want


def test_colour_stage_on_the_host_equals_device(unet, vae, photos, monkeypatch):
    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, memory=MemoryPolicy(max_memory="10GB"))
    reference = pipe.upscale_image(photos[0], num_passes=1, seed=2, output_type="pt")
    assert not pipe.last_plan.colour_on_host
    monkeypatch.setattr(M, "COLOUR_STRIP_BYTES", 10**12)  # stage 2 on the device can no longer fit
    out = pipe.upscale_image(photos[0], num_passes=1, seed=2, output_type="pt")
    assert pipe.last_plan.colour_on_host
    assert torch.equal(out, reference)


# -- noise per image: a batch equals one by one ---------------------------------------------------


def test_batch_equals_one_by_one(unet, vae, photos):
    """Noise per image is bit-identical; the outputs equal one-by-one runs to float rounding (<= 1e-4;
    measured ~3e-6 in the velocity): a batch's matrix products and convolutions sum in another order
    than a single image's (the kernels are not batch-invariant)."""
    from flowlift.files.images import to_tensor

    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)
    batch = torch.cat([to_tensor(p) for p in photos])
    together = pipe.upscale_image(batch, num_passes=1, seed=[3, 4], output_type="pt")
    for i, photo in enumerate(photos):
        alone = pipe.upscale_image(photo, num_passes=1, seed=3 + i, output_type="pt")
        assert (together[i : i + 1] - alone).abs().max().item() <= 1e-4, i
    same_seed = pipe.upscale_latents(torch.zeros(2, 32, 4, 6), seed=7, color_fix=False)
    alone = pipe.upscale_latents(torch.zeros(1, 32, 4, 6), seed=7, color_fix=False)
    assert (same_seed[1:] - alone).abs().max().item() <= 1e-4
    # a batch of one draws what a single image always drew: randn(1, ...) from the pass's stream
    expected = torch.randn((1, 32, 8, 12), generator=pass_generator(7, 0))
    zero = FlowUpscalerPipeline(lambda s, t, c: torch.zeros_like(s), UnusedVAE(), device="cpu", dtype=torch.float32)
    assert torch.equal(zero.upscale_latents(torch.zeros(1, 32, 4, 6), seed=7, color_fix=False), expected)
    with pytest.raises(FlowliftError, match="seeds"):
        pipe.upscale_latents(torch.zeros(2, 32, 4, 6), seed=[1, 2, 3])


# -- compiled UNet ------------------------------------------------------------------------------


def test_compiled_unet_compiles_once_per_shape(unet):
    from torch._dynamo.testing import CompileCounter

    from flowlift.upscale.unet_runner import CompiledUNet

    counter = CompileCounter()
    lines: list[str] = []
    compiled = CompiledUNet(unet, backend=counter, report=lines.append)
    t = torch.tensor([1000.0, 1000.0])
    with torch.inference_mode():
        for _ in range(3):
            compiled(torch.randn(2, 32, 16, 16), t, torch.randn(2, 32, 8, 8))
        assert counter.frame_count == 1
        compiled(torch.randn(1, 32, 16, 24), t[:1], torch.randn(1, 32, 8, 12))
        compiled(torch.randn(1, 32, 16, 24), t[:1], torch.randn(1, 32, 8, 12))
    assert counter.frame_count == 2
    assert len(lines) == 2 and all("compiled the UNet" in line for line in lines)
    assert len(compiled.compile_seconds) == 2


def test_compiled_unet_equals_eager(unet):
    """Through dynamo and AOT autograd (``aot_eager``: fast on 2 CPU cores); inductor itself in
    ``test_inductor_compiled_unet_equals_eager`` (opt-in: minutes of C++ compilation on a small CPU)."""
    from flowlift.upscale.unet_runner import CompiledUNet

    compiled = CompiledUNet(unet, backend="aot_eager", report=lambda _line: None)
    sample, small, t = torch.randn(1, 32, 16, 16), torch.randn(1, 32, 8, 8), torch.tensor([1000.0])
    with torch.inference_mode():
        assert (compiled(sample, t, small) - unet(sample, t, small)).abs().max().item() <= 1e-4
    assert compiled.fallback_reason is None


@pytest.mark.skipif(
    not __import__("os").environ.get("FLOWLIFT_SLOW_TESTS"), reason="set FLOWLIFT_SLOW_TESTS=1 (inductor compile)"
)
def test_inductor_compiled_unet_equals_eager(unet):
    from flowlift.upscale.unet_runner import CompiledUNet

    compiled = CompiledUNet(unet, report=lambda _line: None)
    sample, small, t = torch.randn(1, 32, 16, 16), torch.randn(1, 32, 8, 8), torch.tensor([1000.0])
    with torch.inference_mode():
        assert (compiled(sample, t, small) - unet(sample, t, small)).abs().max().item() <= 1e-4
    assert compiled.fallback_reason is None


def test_compile_failure_falls_back_to_eager_with_one_warning(unet, vae, photos):
    from flowlift.upscale.unet_runner import CompiledUNet

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32)
    reference = pipe.upscale_image(photos[0], num_passes=1, seed=1, output_type="pt")
    pipe.compiled_upscaler = CompiledUNet(unet, backend=broken_backend, report=lambda _line: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = pipe.upscale_image(photos[0], num_passes=1, seed=1, output_type="pt")
        second = pipe.upscale_image(photos[0], num_passes=1, seed=1, output_type="pt")
    messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert len(messages) == 1 and "running the UNet eagerly" in messages[0], messages
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert "no compiler here" in pipe.compiled_upscaler.fallback_reason


def test_compile_option_wires_the_compiled_unet(unet, vae):
    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, compile=True)
    assert pipe.compiled_upscaler is not None and pipe.compiled_upscaler.model is unet
    assert pipe._velocity_model((1, 32, 8, 8)) is pipe.compiled_upscaler
    with pytest.raises(FlowliftError, match="torch module"):
        FlowUpscalerPipeline(lambda s, t, c: s, vae, device="cpu", dtype=torch.float32, compile=True)

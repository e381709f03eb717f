"""Where a UNet pass's stores wait under ``max_memory`` (flowlift.upscale.pass_plan): the plan's ``offload`` mode
counted them as off the device, but on a CPU run, or with an ``offload_device`` that is the compute device itself,
the executor keeps them on the device the budget bounds. Such a run took taller strips than the budget held, silently;
it now counts the stores, and an explicit choice that cannot fit is one line naming both knobs."""

from __future__ import annotations

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.upscale import memory_plan as M
from flowlift.upscale.chunked import budget as B
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy


def test_stores_leave_the_device_only_for_other_memory():
    from flowlift.upscale.pass_plan import stores_can_leave

    assert stores_can_leave("cuda:0") and stores_can_leave("cuda:0", "cpu") and stores_can_leave("cuda:0", "cuda:1")
    assert not stores_can_leave("cpu") and not stores_can_leave("cpu", "cpu")  # a CPU run: its host is its device
    assert not stores_can_leave("cuda:1", "cuda:1") and stores_can_leave("cpu", "meta")


def test_stores_that_stay_on_the_device_are_counted_or_refused_naming_both_knobs():
    from flowlift.upscale.pass_plan import StoreSite

    budget = 10**9  # a 2048² input's pass: offloaded in 87-row strips where the stores can leave the device
    offloaded = M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2").passes[0]
    assert (offloaded.mode, offloaded.strip_rows) == ("offload", 87)
    stores = B.chunked_store_bytes(512, 512)
    kept = M.StageChoices(stores=StoreSite(can_leave=False, offload_device="cpu"))
    with pytest.raises(FlowliftError) as refused:  # the stores alone are more than the budget
        M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2", choices=kept)
    line = str(refused.value)
    assert refused.value.fields == ("max_memory", "offload_device", "offload_device") and "\n" not in line
    assert "even with its stores on offload_device=cpu, the device the budget bounds, with one-row strips" in line
    assert line.endswith("drop offload_device to let the plan offload them to the host"), line
    roomy = M.plan_upscale_memory(2048, 2048, 1, 3 * 10**9, vae_kind="taef2", choices=kept).passes[0]
    assert roomy.mode == "chunked" and stores < roomy.peak_bytes <= 3 * 10**9
    # a CPU run without the knob: the same count, a refusal that names no knob it did not set
    cpu = M.StageChoices(stores=StoreSite(can_leave=False))
    with pytest.raises(FlowliftError, match="a CPU run has no other memory to offload them to") as refused:
        M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2", choices=cpu)
    assert refused.value.fields == ("max_memory",)
    # chunk_rows and offload_device together: held, counted, refused in one line naming both
    both = M.StageChoices(chunk_rows=40, stores=StoreSite(can_leave=False, offload_device="cpu"))
    with pytest.raises(FlowliftError) as refused:  # 1 GB of stores + 42 rows of 9.4 MB + 0.15 GB of latents
        M.plan_upscale_memory(2048, 2048, 1, int(1.4e9), vae_kind="taef2", choices=both)
    assert refused.value.fields == ("max_memory", "chunk_rows", "offload_device", "chunk_rows", "offload_device")
    line = str(refused.value)
    assert "in strips of chunk_rows=40 rows" in line and "offload_device=cpu, the device the budget bounds" in line
    assert line.endswith("lower chunk_rows to at most 23; drop offload_device to let the plan offload them to the host")
    held = M.plan_upscale_memory(2048, 2048, 1, 3 * 10**9, vae_kind="taef2", choices=both).passes[0]
    assert (held.mode, held.strip_rows) == ("chunked", 40) and held.peak_bytes > stores
    fits = M.StageChoices(chunk_rows=23, stores=both.stores)  # the height the line gives fits
    assert M.plan_upscale_memory(2048, 2048, 1, int(1.4e9), vae_kind="taef2", choices=fits).passes[0].mode == "chunked"


def test_a_cpu_pipelines_plan_counts_the_stores_its_offload_device_keeps(unet, vae, monkeypatch):
    """A CPU pipeline under a budget planned its passes ``offload`` (stores off the device, uncounted), and its
    ``offload_device="cpu"`` kept them in the very memory the budget bounds: strips from the whole budget beside
    stores the plan never counted."""
    from flowlift import limits
    from flowlift.upscale import pipeline_plans

    # tiny images: scale the UNet's frame counts up so that the UNet decides the budget (as tests/test_gpu_speed.py)
    monkeypatch.setattr(limits, "DECODE_TILE_BYTES", dict.fromkeys(limits.DECODE_TILE_BYTES, 0))
    monkeypatch.setattr(M, "COLOUR_STRIP_BYTES", 0)
    monkeypatch.setattr(B, "PLAIN_PEAK_FRAMES", 1e5)
    monkeypatch.setattr(B, "CHUNKED_STORE_FRAMES", 2e3)
    monkeypatch.setattr(B, "STRIP_ROW_FRAMES", 200.0)

    pipe = FlowUpscalerPipeline(unet, vae, device="cpu", dtype=torch.float32, memory=MemoryPolicy(max_memory="1GB"))
    with monkeypatch.context() as gpu:  # the least budget at which a GPU run (stores off the device) offloads
        gpu.setattr(pipeline_plans, "stores_can_leave", lambda device, offload=None: True, raising=False)
        low, high = 10**6, 10**9
        while high - low > 10**4:
            pipe.max_memory = (low + high) // 2
            low, high = (low, pipe.max_memory) if _last_pass(pipe) != "none" else (pipe.max_memory, high)
        pipe.max_memory = high
        assert _last_pass(pipe) == "offload"
    base = int(unet.config.get("base_channels", 384))
    stores = B.chunked_store_bytes(16, 24, base_channels=base)  # the last pass's sample: 4x the 4x6 latent
    for offload_device in ("cpu", None):
        pipe.offload_device = offload_device
        try:
            plan = pipe.plan_memory(32, 48, 2)
        except FlowliftError as refused:  # the stores do not fit beside a strip: one line, the knob named
            assert ("offload_device" in refused.fields) == (offload_device is not None), refused.fields
            assert "\n" not in str(refused)
            continue
        last = plan.passes[-1]
        assert last.mode == "chunked" and stores < last.peak_bytes <= high, (offload_device, plan.describe())


def _last_pass(pipeline: FlowUpscalerPipeline) -> str:
    try:
        return pipeline.plan_memory(32, 48, 2).passes[-1].mode
    except FlowliftError:
        return "none"

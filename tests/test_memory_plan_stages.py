"""``--max-memory`` is the budget of the whole upscale (the memory-plan sweep).

The VAE encode is a stage of the plan (it ran by the VAE's own size rule, 792 MiB of tensors for a 1024² TAEF2
encode under a 677 MiB budget); a resampled final frame counts only in the colour stage, on the device, and every
message quotes the caller's own budget; a refusal says what the smaller VAE mode really needs; explicit modes
(``chunked``, ``vae_tiled``) are held and checked against the budget.
"""

from __future__ import annotations

import pytest
import torch

from builders import save_tiny_unet
from flowlift.errors import FlowliftError
from flowlift.limits import format_bytes
from flowlift.upscale import memory_plan as M
from flowlift.upscale.pipeline import FlowUpscalerPipeline
from flowlift.upscale.settings import MemoryPolicy

MIB = 2**20


@pytest.fixture(scope="module")
def unet_file(tmp_path_factory):
    return str(save_tiny_unet(tmp_path_factory.mktemp("unet") / "flow_upscaler.safetensors"))


def _pipeline(unet_file, shared, budget, **memory):
    return FlowUpscalerPipeline(
        unet_file,
        str(shared / "models" / "taef2"),
        device="cpu",
        dtype=torch.float32,
        memory=MemoryPolicy(max_memory=budget, **memory),
    )


def test_the_encode_is_planned_and_runs_tiled_within_the_budget(unet_file, shared, single_thread_torch):
    from flowlift.measure.tiled_inference import _PeakTensorMemory

    budget = int(693 * MIB)  # the 2048² tiled decode's 692.5 MiB fits, not the whole-frame encode
    pipeline = _pipeline(unet_file, shared, budget)
    plan = pipeline.plan_memory(1024, 1024, 1)
    assert "encode" in plan.stage_peaks and plan.encode_tiled and "VAE encode tiled" in plan.describe()
    assert plan.peak_bytes <= budget
    tiled: list[object] = []
    encode = pipeline.vae.encode
    pipeline.vae.encode = lambda x, **kwargs: tiled.append(kwargs.get("tiled")) or encode(x, **kwargs)
    image = torch.rand(1, 3, 1024, 1024)
    tracker = _PeakTensorMemory()
    with tracker:
        pipeline.encode_image(image)
    assert tiled == [True]  # the VAE's own rule encodes 1024² whole (792 MiB of tensors)
    weights = M.model_bytes(pipeline.upscaler) + M.model_bytes(pipeline.vae)
    assert tracker.peak <= plan.stage_peaks["encode"] - weights, (tracker.peak, plan.stage_peaks["encode"])


def test_an_encode_no_mode_fits_is_refused_before_it_runs():
    with pytest.raises(
        FlowliftError, match=r"too small to encode a 2048x2048 image \(batch 1\): even the tiled encode"
    ):
        M.plan_upscale_memory(2048, 2048, 1, 200 * MIB, vae_kind="taef2")


def test_the_final_frame_counts_only_in_the_colour_stage_and_messages_quote_the_callers_budget():
    # 48x64 -> x4 (192x256), then resampled to 3x (144x192): the same budget holds as for the plain x4
    budget = 51509004
    plain = M.plan_upscale_memory(48, 64, 2, budget, vae_kind="taef2", weight_bytes=0)
    three = M.plan_upscale_memory(48, 64, 2, budget, vae_kind="taef2", choices=M.StageChoices(final_size=(192, 144)))
    assert three.budget_bytes == budget and three.describe().startswith(f"max_memory {format_bytes(budget)}:")
    for stage in ("encode", "pass 1", "pass 2", "decode"):
        assert three.stage_peaks[stage] == plain.stage_peaks[stage]
    roomy = {"vae_kind": "taef2", "choices": M.StageChoices(final_size=(192, 144))}  # stage 2 on the device
    on_device = M.plan_upscale_memory(48, 64, 2, 10**10, **roomy)
    assert (
        on_device.stage_peaks["colour"]
        == M.plan_upscale_memory(48, 64, 2, 10**10, vae_kind="taef2").stage_peaks["colour"] + 3 * 144 * 192 * 4
    )
    # a final frame too big for the device moves stage 2 (and the resample) to the host, not the other stages
    big = M.plan_upscale_memory(48, 64, 2, budget, vae_kind="taef2", choices=M.StageChoices(final_size=(4096, 4096)))
    assert big.colour_on_host and big.stage_peaks["decode"] == plain.stage_peaks["decode"]
    with pytest.raises(FlowliftError) as refused:  # the caller's own figure, never one with the frame taken off
        M.plan_upscale_memory(2400, 2400, 2, 10**9, vae_kind="taef2", choices=M.StageChoices(final_size=(9000, 9000)))
    assert str(refused.value).startswith(f"max_memory {format_bytes(10**9)} ")


def test_a_refusal_names_what_the_smaller_vae_mode_needs():
    # 16x16 -> 32x32: the whole-frame decode (~0.8 MB) is far below the tiled one's fixed tile (600 MiB)
    with pytest.raises(FlowliftError) as refused:
        M.plan_upscale_memory(16, 16, 1, 400_000, base_channels=8, vae_kind="taef2")
    line = str(refused.value)
    assert "too small to decode a 32x32 image" in line and "even the whole-frame decode needs about 0.8 MiB" in line
    assert M.plan_vae_stage("decode", (5, 9), 10, "x") == (False, 5)
    assert M.plan_vae_stage("decode", (12, 9), 10, "x") == (True, 9)


def test_forced_modes_are_held_and_checked_against_the_budget(unet_file, shared):
    whole_only = M.StageChoices(vae_tiled=False)
    with pytest.raises(FlowliftError) as refused:  # tiling would fit: the forced whole-frame encode does not
        M.plan_upscale_memory(1024, 1024, 1, int(676.9 * MIB), vae_kind="taef2", choices=whole_only)
    assert refused.value.fields == ("max_memory", "vae_tiled=False", "vae_tiled=False")
    assert "whole-frame VAE encode of a 1024x1024 image (batch 1) that vae_tiled=False forces" in str(refused.value)
    assert "drop vae_tiled=False" in str(refused.value)
    plain = M.plan_upscale_memory(64, 64, 1, 10**12, vae_kind="taef2", choices=M.StageChoices(vae_tiled=True))
    assert plain.encode_tiled and plain.vae_tiled  # held even where the whole frame fits
    with pytest.raises(FlowliftError, match=r"whole-frame UNet pass .* that chunked=False forces"):
        M.plan_upscale_memory(2048, 2048, 1, 10**9, vae_kind="taef2", choices=M.StageChoices(chunked=False))
    chunked = M.plan_upscale_memory(64, 64, 1, 10**12, vae_kind="taef2", choices=M.StageChoices(chunked=True))
    assert chunked.passes[0].mode == "chunked"
    # the pipeline hands its policy's explicit modes to the plan
    pipeline = _pipeline(unet_file, shared, int(676.9 * MIB), vae_tiled=False)
    with pytest.raises(FlowliftError, match="vae_tiled=False forces"):
        pipeline.plan_memory(1024, 1024, 1)


def test_an_explicit_chunk_rows_is_held_and_checked_against_the_budget(unet_file, shared):
    """``MemoryPolicy(max_memory=..., chunk_rows=N)`` ran strips of N rows whatever the budget said: a strip height
    the budget cannot hold ran past it, silently. The plan now holds N (on the device where the stores fit beside
    the strips, else offloaded) and refuses a height over the budget in one line naming ``chunk_rows``."""
    budget = 10**9  # a 2048² input's pass: the plan's own strips are offloaded 87 rows here
    planned = M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2").passes[0]
    assert (planned.mode, planned.strip_rows) == ("offload", 87)
    held = M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2", choices=M.StageChoices(chunk_rows=8))
    assert (held.passes[0].mode, held.passes[0].strip_rows) == (
        "offload",
        8,
    ) and "UNet offload(8 rows)" in held.describe()
    assert held.passes[0].peak_bytes < planned.peak_bytes <= budget
    roomy = M.plan_upscale_memory(
        2048, 2048, 1, 10**12, vae_kind="taef2", choices=M.StageChoices(chunked=True, chunk_rows=8)
    )
    assert (roomy.passes[0].mode, roomy.passes[0].strip_rows) == ("chunked", 8)  # stores on the device where they fit
    with pytest.raises(FlowliftError) as refused:
        M.plan_upscale_memory(2048, 2048, 1, budget, vae_kind="taef2", choices=M.StageChoices(chunk_rows=400))
    assert refused.value.fields == ("max_memory", "chunk_rows", "chunk_rows")
    line = str(refused.value)
    assert line.startswith(f"max_memory {format_bytes(budget)} is too small for the UNet pass to a 512x512 latent")
    assert "in strips of chunk_rows=400 rows" in line and line.endswith("lower chunk_rows to at most 87")
    # a height past the frame's rows is the whole frame's strip, not more (a 16x16-latent pass here)
    forced = {"vae_kind": "taef2", "choices": M.StageChoices(chunked=True, chunk_rows=10**6)}
    whole = {"vae_kind": "taef2", "choices": M.StageChoices(chunked=True, chunk_rows=16)}
    tall, exact = (M.plan_upscale_memory(64, 64, 1, 10**12, **kw).passes[0] for kw in (forced, whole))
    assert tall.peak_bytes == exact.peak_bytes and tall.strip_rows == 10**6
    # the pipeline hands its policy's chunk_rows to the plan
    assert (
        _pipeline(unet_file, shared, 10**12, chunked=True, chunk_rows=5).plan_memory(64, 64, 1).passes[0].strip_rows
        == 5
    )


def test_a_forced_chunked_pass_follows_the_plans_strips():
    from builders import tiny_unet
    from flowlift.upscale.chunked.executor import ChunkedExecutor
    from flowlift.upscale.pass_plan import UNetPassPlan
    from flowlift.upscale.unet_runner import velocity_model

    unet = tiny_unet()
    plan = UNetPassPlan("offload", 32, 32, 5, 0)
    model = velocity_model(unet, (1, 32, 32, 32), device=torch.device("cpu"), dtype=torch.float32, chunked=True,
                           pass_plan=plan)  # fmt: skip
    assert isinstance(model, ChunkedExecutor) and model.chunk == 5 and str(model.offload_device) == "cpu"


def test_a_batchs_refusals_name_the_command_lines_options(unet_file, shared, tmp_path, capsys):
    """A refusal the plan makes for one input of a batch printed ``max_memory ... that vae_tiled=False forces ...:
    drop vae_tiled=False``, the Python API's words, where the user typed ``--max-memory`` and ``--no-vae-tiling``."""
    from PIL import Image

    from flowlift.commands.cli import main
    from flowlift.errors import said

    for name in ("a", "b"):
        Image.new("RGB", (512, 512), (90, 120, 30)).save(tmp_path / f"{name}.png")
    common = [str(tmp_path / "a.png"), str(tmp_path / "b.png"), "-o", str(tmp_path / "out")]
    common += ["--upscaler", unet_file, "--vae", str(shared / "models" / "taef2"), "--device", "cpu"]
    assert main(["upscale", *common, "--max-memory", "300MB", "--no-vae-tiling", "--dtype", "float32"]) == 1
    lines = capsys.readouterr().err.splitlines()
    refusals = [line for line in lines if "is too small" in line]
    assert len(refusals) == 2, lines
    for line in refusals:
        assert "--max-memory 300 MB (286.1 MiB) is too small for the whole-frame VAE" in line, line
        assert "that --no-vae-tiling forces" in line and line.endswith("drop --no-vae-tiling to let the plan choose")
        assert "max_memory" not in line and "vae_tiled" not in line
    assert main(["upscale", *common, "--max-memory", "20MB", "--dtype", "float32"]) == 1
    err = capsys.readouterr().err
    assert err.count("--max-memory 20 MB (19.1 MiB) is too small to encode a 512x512 image") == 2, err
    # a budget below the models' weights fails the run once, before any input is read (it printed one line per input)
    assert main(["upscale", *common, "--max-memory", "1MB", "--dtype", "float32"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "loading" not in line]
    assert len(lines) == 1 and lines[0].startswith(
        "flowlift upscale: error: --max-memory 1 MB (1.0 MiB) does not even hold"
    ), lines
    with pytest.raises(FlowliftError, match=r"^max_memory 1 MB \(1.0 MiB\) does not even hold the model weights"):
        _pipeline(unet_file, shared, 10**6)
    # the door's words last as long as its run: the Python API speaks its own again
    whole_only = M.StageChoices(vae_tiled=False)
    with pytest.raises(FlowliftError) as refused:
        M.plan_upscale_memory(1024, 1024, 1, int(676.9 * MIB), vae_kind="taef2", choices=whole_only)
    line = said(refused.value)
    assert line.startswith("max_memory 676.9 MiB is too small") and line.endswith(
        "drop vae_tiled=False to let the plan choose"
    )


def test_a_budget_is_said_as_it_was_given():
    """``--max-memory 300MB`` came back as ``286.1 MiB`` alone: a figure the user never typed."""
    from flowlift.limits import format_bytes, parse_memory

    assert format_bytes(parse_memory("300MB")) == "300 MB (286.1 MiB)"
    assert format_bytes(parse_memory("6GB")) == "6 GB (5.59 GiB)"
    assert format_bytes(parse_memory("512MiB")) == "512.0 MiB" and format_bytes(parse_memory("6GiB")) == "6.00 GiB"
    assert format_bytes(12_345_678) == "11.8 MiB"  # a computed size: binary units only


class _ElsewhereTensor(torch.Tensor):
    """A CPU tensor that says it is on another device: the host copy's device path, run on a CPU."""

    @property
    def device(self) -> torch.device:
        return torch.device("meta")


@pytest.mark.parametrize("shape", [(1, 3, 300, 700), (2, 3, 700, 300), (1, 3, 256, 256), (1, 3, 5, 1000)])
def test_the_host_copy_of_a_decoded_frame_is_exact_at_any_aspect(shape):
    """Stage 2 on the host copies the device's decoded frame in strips of rows; the strips sliced the width, so a
    frame wider than its rows' count (4096x2048 from a GPU under --max-memory) kept columns of uninitialized memory."""
    from flowlift.upscale.image_steps import float32_by_rows, to_host_float32

    images = torch.rand(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for rows in (256, 64, 7):
        assert torch.equal(float32_by_rows(images, rows), images.float()), rows
    elsewhere = to_host_float32(images.as_subclass(_ElsewhereTensor), 64).as_subclass(torch.Tensor)
    assert torch.equal(elsewhere, images.float())

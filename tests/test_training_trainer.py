"""The trainer on a tiny FlowUpscalerUNet and a few real TAEF2-encoded Kodak crops.

Loss falls; checkpoints are in the released layout and load strictly into FlowUpscalerPipeline;
resume retraces the uninterrupted run; gradient accumulation and a 2-process gloo DDP run under
torchrun match one process with the whole batch; validation writes its CSV and plot.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from door_helpers import quiet_train_config
from flowlift.commands.cli import main as cli_main
from flowlift.errors import FlowliftError
from flowlift.training.config import TrainConfig, build_config, parse_assignments
from flowlift.training.objective import flow_matching_loss, interpolate_flow, velocity_target, warmup_cosine
from flowlift.training.trainer import Trainer

# Tiny models: single-threaded torch for this module (conftest.single_thread_torch).
pytestmark = pytest.mark.usefixtures("single_thread_torch")
TINY = {"base_channels": 32, "time_dim": 64, "cond_dim": 64, "dropout": 0.0}
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def taef2_spec(shared):
    return str(shared / "models" / "taef2")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, shared, taef2_spec):
    """8 items: 4 random 128px crops (16x16 target latents) from each of two Kodak images."""
    from flowlift.models.vae_loading import load_vae
    from flowlift.training.datasets import ShardWriting, build_images_dataset

    root = tmp_path_factory.mktemp("train-data")
    vae = load_vae(taef2_spec, device="cpu", dtype=torch.float32)
    kodak = shared / "images" / "kodak"
    writing = ShardWriting(shard_size=3, storage_dtype=torch.float32, progress=False)
    build_images_dataset(
        root,
        [kodak / "kodim08.png", kodak / "kodim21.png"],
        vae,
        crop=128,
        crops_per_image=4,
        batch_size=4,
        writing=writing,
    )
    return root


def _config(dataset, output, **overrides) -> TrainConfig:
    steps = dict(crop=16, steps=6, batch_size=4, lr=2e-3, warmup_steps=2, log_every=1)
    saving = dict(checkpoint_every=3, ema_decay=0.9, resume="auto")
    return quiet_train_config(dataset, output, **{**steps, **saving, **TINY, **overrides})


def _weights(path):
    from flowlift.models.upscaler_weights import load_upscaler

    return load_upscaler(path).state_dict()


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ------------------------------------------------------------------------------------------------
# pure pieces


def test_flow_formulas_and_loss():
    x0, noise = torch.randn(2, 32, 8, 8), torch.randn(2, 32, 8, 8)
    t = torch.tensor([0.0, 0.25])
    x_t = interpolate_flow(x0, noise, t)
    assert torch.allclose(x_t[0], x0[0]) and torch.allclose(x_t[1], 0.75 * x0[1] + 0.25 * noise[1])
    assert torch.equal(velocity_target(x0, noise), noise - x0)
    seen = {}

    def model(sample, timestep, small):
        seen["timestep"] = timestep
        return sample * 0.5

    cond = torch.randn(2, 32, 4, 4)
    loss = flow_matching_loss(model, {"target": x0, "noise": noise, "cond": cond, "t": t})
    assert torch.allclose(seen["timestep"], t * 1000)
    assert torch.allclose(loss, ((0.5 * x_t - (noise - x0)) ** 2).mean())


def test_warmup_cosine_schedule():
    assert warmup_cosine(0, 4, 20) == pytest.approx(0.25)
    assert warmup_cosine(3, 4, 20) == pytest.approx(1.0)
    assert warmup_cosine(4, 4, 20) == pytest.approx(1.0)
    assert warmup_cosine(12, 4, 20) == pytest.approx(0.5)
    assert warmup_cosine(20, 4, 20, min_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(0, 0, 10) == pytest.approx(1.0)


def test_config_file_overrides_and_errors(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('data = "d"\noutput = "o"\nlr = 3e-4\nsteps = 50\nval_images = ["a.png"]\n')
    config = build_config(path, parse_assignments(["steps=7", "ema_warmup=false", "init=none"]))
    assert (config.lr, config.steps, config.ema_warmup, config.init, config.val_images) == (
        3e-4,
        7,
        False,
        None,
        ["a.png"],
    )
    (tmp_path / "run.json").write_text(json.dumps({"data": "d", "output": "o", "batch_size": 3}))
    assert build_config(tmp_path / "run.json").batch_size == 3
    with pytest.raises(FlowliftError, match="unknown training setting"):
        build_config(path, {"learning_rate": "1"})
    with pytest.raises(FlowliftError, match="crop"):
        build_config(path, {"crop": "6"})
    with pytest.raises(FlowliftError, match="integer"):
        build_config(path, {"steps": "many"})


def test_train_cli_errors_are_one_line(tmp_path, capsys):
    code = cli_main(["train", "--data", str(tmp_path / "nothing"), "--output", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dataset" in err[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# training runs


def test_loss_falls_and_checkpoint_loads_strictly_into_pipeline(dataset, tmp_path, taef2_spec):
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import load_upscaler
    from flowlift.models.vae_loading import load_vae
    from flowlift.upscale.pipeline import FlowUpscalerPipeline

    output = tmp_path / "run"
    summary = Trainer(_config(dataset, output, steps=24, lr=3e-3, checkpoint_every=12)).run()
    losses = [loss for _, loss in summary["losses"]]
    assert len(losses) == 24 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.8 * first, (first, last)

    # released layout: exactly the UNet's tensor names and shapes, constructor args in the metadata
    released = output / "flow_upscaler.safetensors"
    reference = FlowUpscalerUNet(base_channels=32, time_dim=64, cond_dim=64).state_dict()
    state = _weights(released)
    assert state.keys() == reference.keys()
    assert all(state[k].shape == reference[k].shape for k in state)
    ckpt = output / "checkpoints" / "step-00000024"
    assert {p.name for p in ckpt.iterdir()} == {
        "flow_upscaler.safetensors",
        "model.safetensors",
        "train_state.pt",
        "run_id",
    }
    assert _max_diff(state, _weights(ckpt / "flow_upscaler.safetensors")) == 0
    assert _max_diff(state, _weights(ckpt / "model.safetensors")) > 0  # EMA differs from raw weights
    torch.load(ckpt / "train_state.pt", weights_only=True)

    upscaler = load_upscaler(released, device="cpu", dtype=torch.float32)
    vae = load_vae(taef2_spec, device="cpu", dtype=torch.float32)
    pipeline = FlowUpscalerPipeline(upscaler, vae, device="cpu", dtype=torch.float32)
    small = torch.randn(1, 32, 8, 8)
    up = pipeline.upscale_latents(small, num_passes=1, seed=0, color_fix=False)
    assert up.shape == (1, 32, 16, 16) and torch.isfinite(up).all()
    # ... and runs this very model: one Euler step x0 = noise - v(noise, 1000, small)
    from flowlift.upscale.sizes import pass_generator

    noise = torch.randn(1, 32, 16, 16, generator=pass_generator(0, 0))
    with torch.no_grad():
        direct = noise - upscaler(noise, torch.full((1,), 1000.0), small)
    assert torch.allclose(up, direct, atol=1e-5)

    with open(output / "train_log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    assert (output / "curves.png").stat().st_size > 0


def test_resume_reproduces_the_uninterrupted_run(dataset, tmp_path):
    whole = Trainer(_config(dataset, tmp_path / "whole", t_sampling="logit_normal")).run()
    first = Trainer(_config(dataset, tmp_path / "split", t_sampling="logit_normal", stop_after=3)).run()
    assert first["step"] == 3 and "weights" not in first
    assert not (tmp_path / "split" / "flow_upscaler.safetensors").exists()
    second = Trainer(_config(dataset, tmp_path / "split", t_sampling="logit_normal")).run()
    assert second["start_step"] == 3 and second["step"] == 6
    steps = [s for s, _ in first["losses"] + second["losses"]]
    assert steps == [s for s, _ in whole["losses"]] == list(range(1, 7))
    for (_, a), (_, b) in zip(first["losses"] + second["losses"], whole["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    split_w = _weights(tmp_path / "split" / "flow_upscaler.safetensors")
    whole_w = _weights(tmp_path / "whole" / "flow_upscaler.safetensors")
    assert _max_diff(split_w, whole_w) < 1e-5
    with open(tmp_path / "split" / "train_log.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, 7))
    # a time limit ends an invocation after the step that runs out of time, with a checkpoint
    timed = Trainer(_config(dataset, tmp_path / "timed", t_sampling="logit_normal", time_limit_s=1e-9)).run()
    assert timed["step"] == 1 and (tmp_path / "timed" / "checkpoints" / "step-00000001").is_dir()
    assert timed["losses"][0][1] == pytest.approx(whole["losses"][0][1], rel=1e-5)
    # a different global batch cannot continue the run
    with pytest.raises(FlowliftError, match="global batch"):
        Trainer(_config(dataset, tmp_path / "split", batch_size=2, steps=8)).run()


def test_grad_accumulation_matches_the_full_batch(dataset, tmp_path):
    full = Trainer(_config(dataset, tmp_path / "full", steps=3, resume="none")).run()
    accum = Trainer(_config(dataset, tmp_path / "accum", steps=3, batch_size=2, grad_accum=2, resume="none")).run()
    for (_, a), (_, b) in zip(full["losses"], accum["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    assert (
        _max_diff(
            _weights(tmp_path / "full" / "flow_upscaler.safetensors"),
            _weights(tmp_path / "accum" / "flow_upscaler.safetensors"),
        )
        < 2e-3
    )


def test_ddp_two_gloo_processes_match_one_process_with_doubled_batch(dataset, tmp_path):
    # with dropout on: masks are per sample (SampleDropout), so the rank layout does not change them
    tiny = {**TINY, "dropout": 0.1}
    common = [
        "--data",
        str(dataset),
        "--crop-latent",
        "16",
        "--steps",
        "3",
        "--lr",
        "2e-3",
        "--resume",
        "none",
        "--set",
        "warmup_steps=1",
        "--set",
        "log_every=1",
        "--set",
        "progress=false",
        "--set",
        "t_sampling=uniform",
    ] + [x for k, v in tiny.items() for x in ("--set", f"{k}={v}")]
    single = Trainer(
        _config(
            dataset,
            tmp_path / "one",
            steps=3,
            lr=2e-3,
            warmup_steps=1,
            resume="none",
            t_sampling="uniform",
            dropout=0.1,
        )
    ).run()
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "flowlift",
        "train",
        *common,
        "--batch-size",
        "2",
        "--output",
        str(tmp_path / "two"),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 2, global batch 4" in result.stdout
    with open(tmp_path / "two" / "train_log.csv", newline="") as f:
        ddp_losses = [float(r["loss"]) for r in csv.DictReader(f)]
    assert ddp_losses == pytest.approx([loss for _, loss in single["losses"]], rel=1e-4)
    one_w = _weights(tmp_path / "one" / "flow_upscaler.safetensors")
    two_w = _weights(tmp_path / "two" / "flow_upscaler.safetensors")
    assert _max_diff(one_w, two_w) < 2e-3


@pytest.mark.parametrize("asked", [True, False])
def test_a_rank_that_ran_ddp_ends_without_the_native_teardown(asked):
    """CI, stop 50: a finished DDP rank aborted in the interpreter's teardown (SIGABRT, "terminate called without
    an active exception"): torch keeps the gloo group's threads past destroy_process_group once DDP ran, and the
    C++ static destructors met them. A rank that asked (training's DistContext.close) ends with os._exit once the
    command returned: its exit status, its unflushed output and its atexit handlers kept, nothing after that run."""
    probe = "\n".join(
        [
            "import atexit, sys",
            "import flowlift.commands.cli as cli, flowlift.devices as devices",
            "atexit.register(lambda: print('atexit ran'))",
            "class Teardown:",
            "    def __del__(self): print('teardown ran')",
            "kept_until_teardown = Teardown()",
            "def command(argv):",
            f"    if {asked}: devices.end_before_native_teardown()",
            "    sys.stdout.write('summary line, not flushed ')",
            "    return 3",
            "cli._main = command",
            "sys.argv = ['flowlift', 'train']",
            "sys.exit(cli.main())",
        ]
    )
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("summary line, not flushed atexit ran")
    assert ("teardown ran" in result.stdout) is not asked


def test_finetune_from_a_checkpoint_and_validation_csv_plot(dataset, tmp_path, shared, taef2_spec):
    base = tmp_path / "base"
    Trainer(_config(dataset, base, steps=8, lr=3e-3)).run()
    tuned = tmp_path / "tuned"
    config = _config(
        dataset,
        tuned,
        steps=2,
        lr=1e-4,
        init=str(base / "flow_upscaler.safetensors"),
        val_every=2,
        val_images=[str(shared / "images" / "kodak" / "kodim15.png")],
        val_count=1,
        val_size=128,
        vae=taef2_spec,
        base_channels=384,
    )  # size comes from the checkpoint
    scratch = Trainer(_config(dataset, tmp_path / "scratch", steps=1, resume="none")).run()
    summary = Trainer(config).run()
    assert summary["losses"][0][1] < scratch["losses"][0][1]
    assert _weights(tuned / "flow_upscaler.safetensors").keys() == _weights(base / "flow_upscaler.safetensors").keys()
    with open(tuned / "val.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} == {"model", "lanczos", "latent-bicubic"}
    assert all(int(r["step"]) == 2 for r in rows)
    for row in rows:
        for key in ("psnr", "ssim", "sharpness", "sharpness_gt", "cast_max", "dC", "psnr_input"):
            assert math.isfinite(float(row[key]))
        assert 10 < float(row["psnr"]) < 60
    assert (tuned / "curves.png").stat().st_size > 0
    with pytest.raises(FlowliftError):
        Trainer(_config(dataset, tmp_path / "bad", init=str(tmp_path / "missing.safetensors"))).run()
    assert not (tmp_path / "bad").exists()


def test_bf16_autocast_and_channels_last_paths(dataset, tmp_path):
    """The GPU settings (bf16 autocast, channels-last) also run on the CPU and track fp32 closely."""
    fp32 = Trainer(_config(dataset, tmp_path / "fp32", steps=2, resume="none")).run()
    bf16 = Trainer(
        _config(dataset, tmp_path / "bf16", steps=2, resume="none", mixed_precision="bf16", channels_last="yes")
    ).run()
    for (_, a), (_, b) in zip(fp32["losses"], bf16["losses"], strict=True):
        assert b == pytest.approx(a, rel=0.05)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "bf16" / "flow_upscaler.safetensors"))
    assert all(v.dtype == torch.float32 for v in weights.values())  # master weights stay fp32


def test_a_run_that_fails_closes_its_shard_files(dataset, tmp_path, monkeypatch):
    """Issue 29: the dataset reader's open shard files are closed however a run ends, a failing step too."""
    import flowlift.training.trainer as trainer

    readers = []

    class RecordedReader(trainer.ShardReader):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            readers.append(self)

    def failing_loss(model, batch):
        assert readers and readers[0]._open, "the step runs with the shard files open"
        raise FlowliftError("this step failed")

    monkeypatch.setattr(trainer, "ShardReader", RecordedReader)
    monkeypatch.setattr(trainer, "flow_matching_loss", failing_loss)
    with pytest.raises(FlowliftError, match="this step failed"):
        Trainer(_config(dataset, tmp_path / "run")).run()
    assert len(readers) == 1 and not readers[0]._open


def test_a_stopped_run_says_where_and_how_it_resumes(dataset, tmp_path, monkeypatch, capsys):
    """Issue 48: ``train`` interrupted said only "interrupted". The first SIGINT/SIGTERM stops after the step with a
    checkpoint; the one line names that checkpoint, the step, and how the same command resumes from it."""
    from flowlift.commands.cli import main
    from flowlift.training import trainer

    entered = trainer.StopRequest.__enter__

    def stop_at_once(self):  # as if SIGINT came during the first step
        entered(self)
        self.requested = True
        return self

    monkeypatch.setattr(trainer.StopRequest, "__enter__", stop_at_once)
    out = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(dataset),
        "--output",
        str(out),
        "--steps",
        "6",
        "--batch-size",
        "4",
        "--crop-latent",
        "16",
        "--set",
        "base_channels=32",
        "--set",
        "time_dim=64",
        "--set",
        "cond_dim=64",
        "--no-progress",
    ]
    assert main(argv) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    where = out / "checkpoints" / "step-00000001"
    assert where.is_dir()
    assert line == (
        f"flowlift train: interrupted: training stopped after step 1 of 6; checkpoint {where} saved: the "
        f"same command resumes from it (--resume auto, the default, takes the latest in {out}; or "
        f"--resume {where})"
    )


def test_a_failure_of_rank_0_alone_stops_every_rank_with_its_line(dataset, tmp_path, shared):
    """Rank 0 prepares the run folder, saves the checkpoints and validates alone; its error (here a truncated
    validation image) left the other rank in the barrier after it, for gloo's 30 minutes under flowlift launch.
    Now every rank fails at that point with rank 0's line."""
    # a JPEG cut in half: its header is whole (every rank's check of --val-images before the run passes it), its
    # pixels are not, which only rank 0's validation reads
    photo = io.BytesIO()
    Image.open(shared / "images" / "kodak" / "kodim03.png").convert("RGB").save(photo, "JPEG")
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(photo.getvalue()[: len(photo.getvalue()) // 2])
    settings = {**TINY, "crop": 0, "warmup_steps": 1, "progress": "false", "val_every": 2, "val_images": str(bad)}
    command = [sys.executable, "-m", "flowlift", "launch", "--nproc-per-node", "2", "--", "train", "--data"]
    command += [str(dataset), "-o", str(tmp_path / "run"), "--steps", "2", "--batch-size", "2"]
    command += ["--vae", str(shared / "models" / "taef2")]
    command += [x for key, value in settings.items() for x in ("--set", f"{key}={value}")]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowlift")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert any(line.startswith("flowlift train: error: rank 0 stopped the run: ") for line in lines), lines
    assert "Traceback" not in result.stderr and "crashed" not in result.stderr, result.stderr[-3000:]

"""Issue 43 class 6: standard streams that are closed or break never fail a run nor lose its outputs.

* stdout whose reader is gone (``| head -1``; here a pipe whose read end is closed before the command starts,
  so that its first write fails, deterministically): the command runs to its end, writes every output and
  exits with 141 (128 + SIGPIPE) without a word;
* stdout on a full device (``> /dev/full``): every output written, one line saying stdout failed, exit 1;
* stderr closed (``2>&-``, which makes Python's ``sys.stderr`` None) with ``--progress``: the bars go nowhere
  and the command succeeds.

Never a traceback. The commands: upscale (its ``wrote`` lines), status, train --print-config, eval, bands, dataset.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from door_helpers import one_crop_dataset_args
from mage_files import released_state, save_released

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, shared):
    """Inputs (two 64x48 images; two 256 px photos for bands), a tiny Flow Upscaler, a narrow Mage-VAE, and a
    complete upscale output folder."""
    from flowlift.commands.cli import main
    from flowlift.models.upscaler_unet import FlowUpscalerUNet
    from flowlift.models.upscaler_weights import save_upscaler

    root = tmp_path_factory.mktemp("streams")
    inputs, photos = root / "inputs", root / "photos"  # small ones to upscale; bands needs 256 px
    inputs.mkdir()
    photos.mkdir()
    rng = np.random.default_rng(0)
    for index in range(2):
        Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(inputs / f"in{index}.png")
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(photos / f"in{index}.png")
    torch.manual_seed(0)
    weights = save_upscaler(
        FlowUpscalerUNet(base_channels=32, time_dim=32, cond_dim=64, dropout=0.0), root / "flow_upscaler.safetensors"
    )
    mage = save_released(root / "mage.safetensors", released_state())
    upscale = ["--upscaler", weights, "--vae", shared / "models" / "taef2", "--device", "cpu", "--passes", "1"]
    done = root / "done"
    assert main([str(a) for a in ["upscale", inputs, "-o", done, *upscale, "--no-progress"]]) == 0
    return {"root": root, "inputs": inputs, "photos": photos, "upscale": upscale, "mage": mage, "done": done}


def commands(setup, out: Path) -> dict[str, tuple[list, list[Path]]]:
    """Command name -> (argv after ``flowlift``, the files it must leave)."""
    inputs, photos, mage = setup["inputs"], setup["photos"], setup["mage"]
    return {
        "upscale": (["upscale", inputs, "-o", out, *setup["upscale"]], [out / "in0_x2.png", out / "in1_x2.png"]),
        "status": (["status", setup["done"]], []),
        "train-print-config": (["train", "--print-config"], []),
        "eval": (["eval", setup["done"], "--reference", inputs, "-o", out], [out / "results.json", out / "table.md"]),
        "bands": (["bands", photos, "--vae", mage, "--device", "cpu", "-o", out], [out / "bands.json"]),
        "dataset": (
            [*one_crop_dataset_args(photos, mage), "-o", out],
            [out / "shard-00000.safetensors"],
        ),
    }


def run(argv: list, stdout, *, close_stderr: bool = False) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )

    def close_fd_2() -> None:
        os.close(2)

    return subprocess.run(
        [sys.executable, "-m", "flowlift", *map(str, argv)],
        stdout=stdout,
        stderr=None if close_stderr else subprocess.PIPE,
        env=env,
        timeout=600,
        preexec_fn=close_fd_2 if close_stderr else None,
    )


NAMES = ["upscale", "status", "train-print-config", "eval", "bands", "dataset"]


@pytest.mark.parametrize("name", NAMES)
def test_a_stdout_whose_reader_is_gone_ends_quietly_with_141_and_every_output(setup, tmp_path, name):
    argv, files = commands(setup, tmp_path / "out")[name]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader went away before the first line: every write to stdout fails with EPIPE
    try:
        result = run(argv, write_end)
    finally:
        os.close(write_end)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 141, err[-3000:]
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err[-3000:]
    assert all(path.is_file() for path in files), (files, err[-3000:])


@pytest.mark.parametrize("name", ["upscale", "status", "train-print-config"])
def test_a_stdout_on_a_full_device_is_one_line_and_every_output(setup, tmp_path, name):
    argv, files = commands(setup, tmp_path / "out")[name]
    with open("/dev/full", "w") as full:
        result = run(argv, full)
    err = result.stderr.decode(errors="replace")
    assert result.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "error" in line]
    assert lines == [f"flowlift {argv[0]}: error: cannot write to standard output: No space left on device"], err
    assert "Traceback" not in err and all(path.is_file() for path in files)


@pytest.mark.parametrize("name", ["upscale", "eval", "bands", "dataset"])
def test_progress_bars_with_stderr_closed_go_nowhere(setup, tmp_path, name):
    argv, files = commands(setup, tmp_path / "out")[name]
    result = run([*argv, "--progress"], subprocess.PIPE, close_stderr=True)
    assert result.returncode == 0, result.stdout.decode(errors="replace")[-3000:]
    assert all(path.is_file() for path in files)
    assert "Traceback" not in result.stdout.decode(errors="replace")  # nothing of stderr's moved to stdout


def test_progress_bar_given_no_stream_or_a_closed_one_writes_nowhere(capsys):
    import io

    from flowlift.console import progress_bar

    closed = io.StringIO()
    closed.close()
    for stream in (None, closed):
        saved, sys.stderr = sys.stderr, None if stream is None else sys.stderr
        try:
            with progress_bar(range(3), desc="x", enabled=True, file=stream) as bar:
                assert list(bar) == [0, 1, 2]
            with progress_bar(range(3), desc="x", enabled=None, file=stream) as bar:
                assert list(bar) == [0, 1, 2]
        finally:
            sys.stderr = saved
    assert capsys.readouterr().out == ""

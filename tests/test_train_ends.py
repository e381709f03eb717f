"""How a training run ends: a stop during its last step, a resume at its last step, SIGHUP, a non-finite step's
message under DDP, validation images checked before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from builders import TINY_UNET
from flowlift.commands.cli import main
from test_hostile import _tiny_dataset

pytestmark = pytest.mark.usefixtures("single_thread_torch")
TINY_SETS = [
    x
    for k, v in {**TINY_UNET, "dropout": 0.0, "crop": 0, "warmup_steps": 0, "log_every": 1}.items()
    for x in ("--set", f"{k}={v}")
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _tiny_dataset(tmp_path_factory.mktemp("ends") / "data", items=4, shard_size=2)


def _train(data: Path, output: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--output", str(output), "--steps", str(steps), "--batch-size", "2"] + [
        *TINY_SETS,
        "--no-progress",
        *extra,
    ]


def test_a_stop_during_the_last_step_finishes_the_run(data, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the last step raised "stopped after step 1 of 1" before the final weights were written, and the
    same command then said "already at step 1 ... nothing to train"."""
    from flowlift.training import trainer

    entered = trainer.StopRequest.__enter__

    def stop_at_once(self):  # as if SIGINT came during the (first and) last step
        entered(self)
        self.requested = True
        return self

    monkeypatch.setattr(trainer.StopRequest, "__enter__", stop_at_once)
    out = tmp_path / "run"
    assert main(_train(data, out, 1)) == 0, capsys.readouterr().err
    assert (out / "flow_upscaler.safetensors").is_file()
    assert "EMA weights: " + str(out / "flow_upscaler.safetensors") in capsys.readouterr().out


def test_a_resume_at_the_last_step_without_final_weights_writes_them(data, tmp_path, capsys):
    """A run stopped after its last checkpoint but before its final weights (a kill, an older flowlift) could never
    get them: the same command said "nothing to train; raise --steps". With them there, that refusal stands."""
    out = tmp_path / "run"
    assert main(_train(data, out, 2)) == 0
    final = out / "flow_upscaler.safetensors"
    written = load_file(final)
    final.unlink()
    capsys.readouterr()
    assert main(_train(data, out, 2)) == 0, capsys.readouterr().err
    again = load_file(final)  # the EMA weights of the checkpoint at step 2: those of the finished run
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said == f"step 2 was the last: nothing left to train; EMA weights: {final}", said
    assert main(_train(data, out, 2)) == 2
    assert "already at step 2" in capsys.readouterr().err


def test_sighup_during_a_step_stops_after_it_with_a_checkpoint(data, tmp_path, monkeypatch, capsys):
    """A closed terminal (SIGHUP) raised in the middle of a step: no checkpoint, where SIGTERM finishes the step and
    saves one. It is a stop as theirs now."""
    import os
    import signal

    from flowlift.training import trainer

    stepped = trainer.Trainer._step

    def hang_up_in_the_first(self, run, batches, step):
        if step == 0:
            os.kill(os.getpid(), signal.SIGHUP)  # delivered to the main thread inside this step
        return stepped(self, run, batches, step)

    monkeypatch.setattr(trainer.Trainer, "_step", hang_up_in_the_first)
    out = tmp_path / "run"
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal's child has it, not nohup's
    try:
        assert main(_train(data, out, 3)) == 130
    finally:
        signal.signal(signal.SIGHUP, previous)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("flowlift train: interrupted: training stopped after step 1 of 3; checkpoint"), line
    assert (out / "checkpoints" / "step-00000001").is_dir()


def test_a_stop_request_leaves_an_ignored_sighup_ignored():
    """nohup's SIG_IGN is the user's choice: the run outlives the terminal."""
    import signal

    from flowlift.training.loop_support import StopRequest

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with StopRequest():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with StopRequest() as stop:
            assert signal.getsignal(signal.SIGHUP) == stop._handle
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_a_non_finite_step_names_another_ranks_data_on_every_rank(tmp_path, grad_accum):
    """Under DDP the gradient is every rank's: rank 0 said "the data of this step is finite; lower the learning
    rate" when the NaN was in rank 1's items, beside rank 1's line naming the shard."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from door_helpers import quiet_train_config
    from flowlift.training.shards import ShardReader, ShardStream, shard_name
    from flowlift.training.trainer import Trainer

    root = _tiny_dataset(tmp_path / "data", items=8, shard_size=2)
    config = quiet_train_config(root, tmp_path / "run", batch_size=1, grad_accum=grad_accum, crop=0, **TINY_UNET)
    clean = ShardReader(root)
    ranks = [ShardStream(clean, micro_batch=1, rank=r, world_size=2, grad_accum=grad_accum) for r in (0, 1)]
    bad = ranks[1].item_at(ranks[1].positions(0, grad_accum - 1)[0])  # rank 1's last item of step 1
    clean.close()
    shard, offset = divmod(bad, 2)
    path = root / shard_name(shard)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors["cond"][offset, 0, 0, 0] = float("nan")  # write_shard refuses it: a file damaged after its build
    save_file(tensors, str(path), metadata=metadata)
    reader = ShardReader(root)
    try:
        lines = {
            Trainer(config)._non_finite_message(
                ShardStream(reader, micro_batch=1, rank=rank, world_size=2, grad_accum=grad_accum), 0
            )
            for rank in (0, 1)
        }
    finally:
        reader.close()
    expected = (
        f"non-finite gradient at step 1: the training data is non-finite ({root / shard_name(shard)}, item {bad}, "
        "tensor 'cond' holds NaN/Inf); rebuild that shard"
    )
    assert lines == {expected}, lines


@pytest.mark.parametrize("given", ["nope.png", "bad.png", "tiny.png"])
def test_validation_images_are_refused_before_the_data_opens_or_the_run_folder_is_made(data, tmp_path, capsys, given):
    """``--val-images nope.png`` was refused after the data, the model and the VAE loaded, leaving an empty run
    folder; the images' headers decide, so they are read first."""
    from PIL import Image

    (tmp_path / "bad.png").write_bytes(b"not an image")
    Image.new("RGB", (8, 40)).save(tmp_path / "tiny.png")
    image = tmp_path / given
    out = tmp_path / "run"
    validation = ["--val-every", "1", "--vae", "no-such-vae", "--val-images", str(image)]
    for folder in (data, tmp_path / "no-data"):  # the data's own refusal would come first if it were opened
        assert main(_train(folder, out, 1, *validation)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and not out.exists(), err
        why = {
            "nope.png": "no such file, folder or matching pattern",
            "bad.png": "not an image file Pillow can read",
            "tiny.png": "validation image of 8x40 pixels is smaller than 16x16",
        }[given]
        assert err.strip().splitlines()[-1] == f"flowlift train: error: --val-images {image}: {why}", err

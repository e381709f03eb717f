"""What a resume continues from: a checkpoint written again (a resume from an earlier one) is swapped in without a
moment where no complete copy of it is on disk, a ``latest`` naming a missing checkpoint says how to go on, and a
resume on other data than the checkpoint's (another ``--data``, a dataset grown since) is one line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builders import TINY_UNET, one_error_line
from door_helpers import quiet_train_config
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.training.checkpoints import (
    EMA_NAME,
    RAW_NAME,
    STATE_NAME,
    checkpoint_dir,
    read_train_state,
    resume_point,
)
from test_hostile import _tiny_dataset

pytestmark = pytest.mark.usefixtures("single_thread_torch")
REPO = Path(__file__).resolve().parents[1]
TINY = {**TINY_UNET, "dropout": 0.0, "crop": 0, "warmup_steps": 0, "log_every": 1}
TINY_SETS = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in (STATE_NAME, EMA_NAME, RAW_NAME))


class Killed(BaseException):
    """The process killed at that point: no handler of flowlift's runs after it (as SIGKILL, a power cut)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _tiny_dataset(tmp_path_factory.mktemp("resume") / "data", items=4, shard_size=2)


def _config(data: Path, output: Path, steps: int, **values):
    return quiet_train_config(data, output, steps=steps, batch_size=2, checkpoint_every=1, **{**TINY, **values})


def _train(data: Path, output: Path, steps: int, batch: int = 2) -> list[str]:
    command = ["train", "--data", str(data), "--output", str(output), "--steps", str(steps), "--batch-size", str(batch)]
    return [*command, *TINY_SETS, "--set", "checkpoint_every=1", "--no-progress"]


def _fail_moves_into(monkeypatch, folder: Path, error: BaseException, times: int | None = None) -> None:
    """``os.replace`` onto ``folder`` raises ``error`` (``times`` times, else always); every other rename runs."""
    real = os.replace
    left = [times]

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == folder and (left[0] is None or left[0] > 0):
            left[0] = None if left[0] is None else left[0] - 1
            raise error
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


def _rewrite_step_2_killed(data: Path, run: Path, resume_from: Path, monkeypatch) -> None:
    """Resume ``run`` from ``resume_from`` (step 1) to step 2, killed as its step-2 checkpoint is moved in."""
    from flowlift.training.trainer import Trainer

    with monkeypatch.context() as patch:
        _fail_moves_into(patch, checkpoint_dir(run, 2), Killed())
        with pytest.raises(Killed):
            Trainer(_config(data, run, 2, resume=str(resume_from))).run()
    (run / ".flowlift-train.lock").unlink(missing_ok=True)  # the lock a killed process's system would have dropped


def test_a_rewrite_killed_between_its_renames_says_how_to_put_its_checkpoint_back(data, tmp_path, monkeypatch, capsys):
    """The rewrite was rmtree(old) then os.replace(new): killed between the two, `latest` named a missing folder and
    the step was lost. Now the old one was set aside first, complete, and `--resume auto` says how to put it back
    rather than falling back to an older checkpoint (whose start would delete it and retrace the steps since)."""
    run = tmp_path / "run"
    assert main(_train(data, run, 2)) == 0
    _rewrite_step_2_killed(data, run, checkpoint_dir(run, 1), monkeypatch)
    assert not checkpoint_dir(run, 2).exists() and (run / "checkpoints" / "latest").read_text() == "step-00000002"
    capsys.readouterr()
    assert main(_train(data, run, 3)) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    move = re.search(r"put it back \(mv (\S+) (\S+)\)", line)
    assert move and Path(move[2]) == checkpoint_dir(run, 2), line
    os.replace(move[1], move[2])
    assert main(_train(data, run, 3)) == 0, capsys.readouterr().err
    assert "trained steps 2->3" in capsys.readouterr().out
    assert is_complete(checkpoint_dir(run, 2)) and is_complete(checkpoint_dir(run, 3))
    assert not list((run / "checkpoints").glob(".*partial"))


def test_latest_naming_a_removed_checkpoint_names_the_newest_complete_one(data, tmp_path, capsys):
    """A `latest` naming a folder that is gone (no copy set aside: removed by hand, perhaps on purpose) is one line
    naming the newest complete checkpoint to resume from; passing it continues the run."""
    run = tmp_path / "run"
    assert main(_train(data, run, 2)) == 0
    shutil.rmtree(checkpoint_dir(run, 2))
    capsys.readouterr()
    assert main(_train(data, run, 3)) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    wanted = (
        f"which is missing; to continue from the newest complete checkpoint pass --resume {checkpoint_dir(run, 1)},"
    )
    assert "names step-00000002, " + wanted in line, line
    assert main([*_train(data, run, 3), "--resume", str(checkpoint_dir(run, 1))]) == 0, capsys.readouterr().err
    assert is_complete(checkpoint_dir(run, 2)) and is_complete(checkpoint_dir(run, 3))


def test_a_killed_rewrite_of_the_only_checkpoint_keeps_it_and_says_how_to_restore_it(
    data, tmp_path, monkeypatch, capsys
):
    """With no other complete checkpoint in the folder, the killed rewrite's old copy is the one left: complete, under
    the hidden name it was set aside to, and the refusal says the one command that puts it back."""
    run = tmp_path / "run"
    assert main(_train(data, run, 2)) == 0
    elsewhere = tmp_path / "kept" / "step-00000001"
    elsewhere.parent.mkdir()
    shutil.move(checkpoint_dir(run, 1), elsewhere)  # the user moved it away: step 2 is the run folder's only one
    _rewrite_step_2_killed(data, run, elsewhere, monkeypatch)
    capsys.readouterr()
    assert main(_train(data, run, 3)) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    move = re.search(r"put it back \(mv (\S+) (\S+)\)", line)
    assert move and Path(move[2]) == checkpoint_dir(run, 2), line
    aside = Path(move[1])
    assert is_complete(aside) and read_train_state(aside)["step"] == 2
    os.replace(aside, move[2])
    assert main(_train(data, run, 3)) == 0, capsys.readouterr().err
    assert "trained steps 2->3" in capsys.readouterr().out


def test_a_rewrite_that_fails_to_move_in_puts_the_old_checkpoint_back(data, tmp_path, monkeypatch):
    """A rename that fails (not a kill) left the step's folder deleted; now the old one is back, nothing partial."""
    from flowlift.training.trainer import Trainer

    run = tmp_path / "run"
    assert main(_train(data, run, 2)) == 0
    final = checkpoint_dir(run, 2)
    before = (final / STATE_NAME).read_bytes()
    with monkeypatch.context() as patch:
        _fail_moves_into(patch, final, OSError(28, "No space left on device"), times=1)
        with pytest.raises(OSError, match="No space left"):
            Trainer(_config(data, run, 2, resume=str(checkpoint_dir(run, 1)))).run()
    assert (final / STATE_NAME).read_bytes() == before
    assert not list((run / "checkpoints").glob(".*partial"))
    assert resume_point(_config(data, run, 3), run) == final


def _grown(source: Path, folder: Path, items: int) -> Path:
    """A copy of dataset ``source`` at ``folder``, rebuilt there with ``items`` items (as a larger ``--num`` does)."""
    shutil.copytree(source, folder)
    return _tiny_dataset(folder, items=items, shard_size=2)


def test_a_resume_on_a_dataset_grown_since_is_refused(data, tmp_path, capsys):
    run, first = tmp_path / "run", _grown(data, tmp_path / "first", 6)
    assert main(_train(first, run, 1)) == 0  # trained on 6 items
    moved = _grown(data, tmp_path / "moved", 6)  # the same data elsewhere: the same run goes on
    assert main(_train(moved, run, 2)) == 0, capsys.readouterr().err
    _tiny_dataset(moved, items=8, shard_size=2)  # the dataset grows where it is
    capsys.readouterr()
    assert main(_train(moved, run, 3)) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    step = checkpoint_dir(run, 2)
    assert line.endswith(
        f"checkpoint {step} was trained on {moved} (6 items), this run's --data is {moved} (8 items): a resumed "
        f"run keeps its data; to continue on new data, train into a new --output with --init {step}"
    ), line
    assert not checkpoint_dir(run, 3).exists()


def test_a_resume_on_other_data_of_the_same_size_is_refused(data, tmp_path, capsys):
    run, other = tmp_path / "run", _tiny_dataset(tmp_path / "other", items=4, shard_size=2, noise=False)
    assert main(_train(data, run, 1)) == 0
    capsys.readouterr()
    assert main(_train(other, run, 2)) == 2
    line = one_error_line(capsys.readouterr().err, "train")
    assert f"this run's --data is {other} (4 items, its dataset.json built with other settings)" in line, line


def test_a_checkpoint_without_a_data_record_is_not_compared(data, tmp_path, capsys):
    """A checkpoint written before the record existed resumes on whatever --data is given, as it did."""
    run = tmp_path / "run"
    assert main(_train(data, run, 1)) == 0
    state_file = checkpoint_dir(run, 1) / STATE_NAME
    state = torch.load(state_file, weights_only=True)
    state.pop("data", None)
    torch.save(state, state_file)
    assert main(_train(_grown(data, tmp_path / "more", 6), run, 2)) == 0, capsys.readouterr().err


class _Gathered:
    """A rank of a DDP group whose ranks' values were ``values`` (what ``DistContext.gather`` returns)."""

    def __init__(self, values: list) -> None:
        self.values = values

    def gather(self, value: object) -> list:
        return self.values


def test_ranks_reading_different_data_fail_alike_on_every_rank():
    from flowlift.training.data_identity import agreed_identity, dataset_identity

    manifest = {"kind": "test", "num_items": 4, "shard_size": 2}
    ours, theirs = dataset_identity(manifest, "a"), dataset_identity({**manifest, "num_items": 6}, "b")
    assert agreed_identity(_Gathered([ours, dict(ours, path="copy")]), ours) == ours  # a copy of the same data
    lines = set()
    for mine in (ours, theirs):  # rank 0 and rank 1: each sees every rank's identity, so both say the same
        with pytest.raises(FlowliftError) as error:
            agreed_identity(_Gathered([ours, theirs]), mine)
        lines.add(str(error.value))
    assert lines == {"rank 1 reads b (6 items), rank 0 reads a (4 items): give every rank the same dataset"}


def test_a_ddp_resume_on_grown_data_is_refused_by_every_rank(data, tmp_path, capsys):
    """Every rank compares the same identity with the same checkpoint: each refuses with the line, none waits."""
    run, more = tmp_path / "run", _grown(data, tmp_path / "more", 4)
    assert main(_train(more, run, 1, 4)) == 0  # one process, global batch 4
    _tiny_dataset(more, items=6, shard_size=2)
    command = [sys.executable, "-m", "flowlift", "launch", "--nproc-per-node", "2", "--", *_train(more, run, 2, 2)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("flowlift train: error:")]
    assert lines and all("was trained on" in line and "(4 items)" in line for line in lines), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "rank 0 stopped the run" not in result.stderr

"""A checkpoint's write is never cut short: a second stop signal during it (a held-down Ctrl-C, Ctrl-C then a
scheduler's SIGTERM) waits until it is whole, a failing write leaves nothing behind, and a later run sweeps the
temporary of a killed ``latest`` pointer write."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from flowlift.commands.cli import main
from flowlift.files.atomic import open_temporary
from flowlift.training import checkpoints
from flowlift.training.checkpoints import checkpoint_dir, is_complete
from test_train_resume import _config, _train, data  # noqa: F401 - data: the module's tiny dataset fixture

pytestmark = pytest.mark.usefixtures("single_thread_torch")


def _hidden(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("."))


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signals")
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_stop_signal_during_a_checkpoint_write_waits_for_it(data, tmp_path, monkeypatch, second):  # noqa: F811
    """Both signals land while the training state is written: the first asks for a stop, the second one used to
    interrupt the write at once, losing the stop's checkpoint and leaving its partial folder."""
    real_save, calls = checkpoints.torch.save, []

    def save(obj, path, *args, **kwargs):
        if not calls:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), second)
        calls.append(path)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.torch, "save", save)
    run = tmp_path / "run"
    assert main(_train(data, run, 5)) == 130
    assert is_complete(checkpoint_dir(run, 1)) and not checkpoint_dir(run, 2).exists()
    assert (run / "checkpoints" / "latest").read_text() == "step-00000001"
    assert _hidden(run) == []


def test_a_checkpoint_write_that_fails_leaves_nothing(data, tmp_path, monkeypatch):  # noqa: F811
    """Only non-finite weights removed the partial folder; a full disk (any other error) left it behind."""
    from flowlift.training.trainer import Trainer

    def save(obj, path, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", save)
    run = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        Trainer(_config(data, run, 2)).run()
    assert not checkpoint_dir(run, 1).exists() and _hidden(run) == []


def test_a_killed_pointer_writes_temporary_is_swept_by_the_next_run(data, tmp_path):  # noqa: F811
    """A run killed while writing `checkpoints/latest` leaves the pointer's temporary folder; only
    `--resume none --overwrite` swept it, a resumed run kept it for good."""
    run = tmp_path / "run"
    assert main(_train(data, run, 1)) == 0
    folder, descriptor = open_temporary(run / "checkpoints" / "latest")  # as a killed write leaves it
    os.close(descriptor)  # the killed process's lock is gone with it
    assert folder.exists()
    assert main(_train(data, run, 2)) == 0
    assert not folder.exists() and _hidden(run) == []
    assert is_complete(checkpoint_dir(run, 2))

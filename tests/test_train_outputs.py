"""Issue 36.1: ``flowlift train``'s writers follow the one replace rule (flowlift.training.run_files).

At every fixed name a run writes (config.json, train_log.csv, val.csv, curves.png,
flow_upscaler.safetensors, checkpoints/latest, checkpoints/ itself): a link, a FIFO or a folder is
one line and exit 2, ``--overwrite`` or not, checked before the data or a model loads (the data
folder given does not exist: a later check would name it), and nothing is written through it; a
regular file flowlift did not write is replaced only with ``--overwrite``; an empty file and a
run's own files are replaced. ``--resume none --overwrite`` removes only what runs of flowlift made
under checkpoints/, and nothing at all when the command then fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from builders import TINY_UNET, put_kind, snapshot
from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.files.atomic import append_text
from test_hostile import _tiny_dataset

pytestmark = pytest.mark.usefixtures("single_thread_torch", "fifo_alarm")
#: Every fixed file name a run writes under --output.
FILE_NAMES = [
    "config.json",
    "train_log.csv",
    "val.csv",
    "curves.png",
    "flow_upscaler.safetensors",
    "checkpoints/latest",
]
TINY_SETS = [
    x
    for k, v in {
        **TINY_UNET,
        "dropout": 0.0,
        "crop": 0,
        "progress": "false",
        "warmup_steps": 1,
        "checkpoint_every": 1,
        "log_every": 1,
    }.items()
    for x in ("--set", f"{k}={v}")
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _tiny_dataset(tmp_path_factory.mktemp("train") / "data", items=4, shard_size=2)


def _train(data: Path | str, output: Path, *extra: str, steps: int = 2) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--output",
        str(output),
        "--steps",
        str(steps),
        "--batch-size",
        "2",
        *TINY_SETS,
        *extra,
    ]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("flowlift train: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _make(path: Path, kind: str, victim: Path) -> str:
    """Put ``kind`` at ``path``; the words of the refusal (train names itself in them)."""
    words = put_kind(path, kind, victim)
    return f"{words} train" if kind == "foreign file" else words


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "folder", "foreign file"])
@pytest.mark.parametrize("name", FILE_NAMES)
def test_a_special_or_foreign_file_at_any_fixed_name_is_one_line_before_any_work(
    tmp_path, capsys, name, kind, overwrite
):
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    out = tmp_path / "run"
    words = _make(out / name, kind, victim)
    before = snapshot(tmp_path)
    flag = ["--overwrite", "--resume", "none"] if overwrite else []
    if overwrite and kind == "foreign file":
        return  # replaced: see the next test (it needs real data)
    assert main(_train(tmp_path / "no-such-data", out, *flag)) == 2
    line = _one_line(capsys)
    assert words in line and name.split("/")[-1] in line and "no-such-data" not in line, line
    assert snapshot(tmp_path) == before  # nothing written, nothing through the link, the FIFO never opened


@pytest.mark.parametrize("name", FILE_NAMES)
def test_a_foreign_file_is_replaced_only_with_overwrite_and_an_empty_one_always(tmp_path, capsys, data, name):
    out = tmp_path / "run"
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("the user's own notes\n")
    assert main(_train(data, out)) == 2
    assert "use --overwrite" in _one_line(capsys)
    assert main(_train(data, out, "--overwrite", "--resume", "none")) == 0, capsys.readouterr().err
    (out / name).write_bytes(b"")  # empty: debris, replaced without --overwrite (a resume goes on)
    if name == "checkpoints/latest":
        return  # an empty pointer is a dangling resume (an error of its own, test_hostile)
    assert main(_train(data, out, steps=3)) == 0, capsys.readouterr().err


def test_a_runs_own_files_are_replaced_on_resume_and_the_log_appends(tmp_path, capsys, data):
    out = tmp_path / "run"
    assert main(_train(data, out, steps=2)) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints",
        "config.json",
        "curves.png",
        "flow_upscaler.safetensors",
        "train_log.csv",
    ]
    from flowlift.files.image_outputs import read_metadata

    assert read_metadata(out / "curves.png")["Software"] == "flowlift train"
    assert main(_train(data, out, steps=4)) == 0, capsys.readouterr().err
    rows = (out / "train_log.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss") and [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4"]
    # a resume with --overwrite over a log that is not flowlift's: replaced (none of its rows kept), no traceback
    (out / "train_log.csv").write_text("date,mood\nmonday,fine\n")
    assert main(_train(data, out, "--overwrite", steps=5)) == 0, capsys.readouterr().err
    rows = (out / "train_log.csv").read_text().splitlines()
    assert rows[0].startswith("step,loss") and [r.split(",")[0] for r in rows[1:]] == ["5"]


@pytest.mark.parametrize("kind", ["link", "fifo", "file"])
@pytest.mark.parametrize("where", ["checkpoints", "checkpoints/step-00000001"])
def test_checkpoints_folder_and_step_names_must_be_real_folders(tmp_path, capsys, data, kind, where):
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    out = tmp_path / "run"
    target = out / where
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        target.symlink_to(victim, target_is_directory=True)
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("a file")
    before = snapshot(tmp_path)
    for flag in ([], ["--resume", "none", "--overwrite"]):
        assert main(_train(data, out, *flag)) == 2
        line = _one_line(capsys)
        assert target.name in line and "Traceback" not in line, line
        assert snapshot(tmp_path) == before and list(victim.iterdir()) == []


def _run_with_neighbours(data: Path, out: Path, capsys) -> dict[str, object]:
    """A finished run, then a user's notes and another tool's checkpoints beside its checkpoints."""
    assert main(_train(data, out, steps=2)) == 0, capsys.readouterr().err
    root = out / "checkpoints"
    (root / "notes.txt").write_text("which run was best")
    (root / "other-tool").mkdir()
    (root / "other-tool" / "epoch=3.ckpt").write_bytes(b"another tool's weights")
    (root / "epoch=1.ckpt").write_bytes(b"another tool's weights")
    (root / ".hidden-step-00000001.partial").mkdir()  # a look-alike that is no checkpoint folder
    return {k: v for k, v in snapshot(root).items() if not k.startswith("step-") and k != "latest"}


def test_resume_none_overwrite_removes_only_flowlifts_checkpoints(tmp_path, capsys, data):
    out = tmp_path / "run"
    neighbours = _run_with_neighbours(data, out, capsys)
    old_latest = (out / "checkpoints" / "step-00000002" / "run_id").read_text()
    assert main(_train(data, out, "--resume", "none", "--overwrite", steps=1)) == 0, capsys.readouterr().err
    root = out / "checkpoints"
    kept = {k: v for k, v in snapshot(root).items() if not k.startswith("step-") and k != "latest"}
    assert kept == neighbours  # the user's notes and the other tool's checkpoints, byte for byte
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000001"]  # the old run's step 2 is gone
    assert (root / "step-00000001" / "run_id").read_text() != old_latest
    assert (root / "latest").read_text() == "step-00000001"


@pytest.mark.parametrize(
    "failure",
    ["missing data", "empty data", "missing init", "missing val images", "a step folder with the user's file"],
)
def test_resume_none_overwrite_removes_nothing_when_the_command_then_fails(tmp_path, capsys, data, shared, failure):
    out = tmp_path / "run"
    _run_with_neighbours(data, out, capsys)
    extra: list[str] = []
    data_arg: Path = data
    if failure == "missing data":
        data_arg = tmp_path / "no-such-data"
    elif failure == "empty data":
        data_arg = tmp_path / "empty"
        data_arg.mkdir()
    elif failure == "missing init":
        extra = ["--init", str(tmp_path / "missing.safetensors")]
    elif failure == "missing val images":
        extra = [
            "--val-every",
            "1",
            "--vae",
            str(shared / "models" / "taef2"),
            "--val-images",
            str(tmp_path / "no-such-photo.png"),
        ]
    else:
        (out / "checkpoints" / "step-00000001" / "notes.txt").write_text("the user's")
    before = snapshot(out)
    assert main(_train(data_arg, out, "--resume", "none", "--overwrite", *extra, steps=1)) == 2
    _one_line(capsys)
    assert snapshot(out) == before


@pytest.mark.parametrize("name", ["flow_upscaler.safetensors", "config.json", "curves.png"])
def test_an_output_is_never_an_input(tmp_path, capsys, data, name):
    out = tmp_path / "run"
    assert main(_train(data, out, steps=2)) == 0, capsys.readouterr().err
    linked = tmp_path / "linked"
    linked.symlink_to(out, target_is_directory=True)
    if name == "config.json":  # a user's own settings file at the run's config name: an input, not the run's
        (out / name).write_text('{"lr": 0.001}')
        given = ["--config", str(linked / name)]
    elif name == "curves.png":
        given = ["--val-images", str(linked / name)]
    else:
        given = ["--init", str(linked / name)]
    before = snapshot(out)
    assert main(_train(data, out, "--resume", "none", "--overwrite", *given, steps=1)) == 2
    line = _one_line(capsys)
    assert "is the input --" in line, line
    assert snapshot(out) == before


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "folder"])
def test_append_never_goes_through_a_link_nor_blocks_on_a_fifo(tmp_path, kind):
    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    log = tmp_path / "train_log.csv"
    words = _make(log, kind, victim)
    with pytest.raises(FlowliftError, match=words):
        append_text(log, "1,0.5\n")
    assert victim.read_text() == "my notes\n" and not (tmp_path / "nowhere.txt").exists()
    fresh = tmp_path / "fresh.csv"
    append_text(fresh, "a\n")
    append_text(fresh, "b\n")
    assert fresh.read_text() == "a\nb\n"


def test_a_link_swapped_in_mid_run_is_refused_at_the_next_line(tmp_path, data, monkeypatch):
    # the log is appended line by line: a link put there after the start is never followed
    from flowlift.training import trainer as trainer_module
    from flowlift.training.config import build_config

    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    out = tmp_path / "run"
    real_append = trainer_module.Trainer._append_log

    def swap_then_append(self, row):
        if row["step"] == 2:
            (out / "train_log.csv").unlink()
            (out / "train_log.csv").symlink_to(victim)
        real_append(self, row)

    monkeypatch.setattr(trainer_module.Trainer, "_append_log", swap_then_append)
    config = build_config(
        None,
        dict(
            data=str(data),
            output=str(out),
            steps=3,
            batch_size=2,
            crop=0,
            progress=False,
            log_every=1,
            warmup_steps=1,
            **TINY_UNET,
            dropout=0.0,
        ),
    )
    with pytest.raises(FlowliftError, match="is a symbolic link"):
        trainer_module.Trainer(config).run()
    assert victim.read_text() == "my notes\n"
    torch.set_num_threads(1)


@pytest.mark.parametrize("kind", ["link", "dangling link", "fifo", "folder"])
def test_the_job_manifest_is_never_appended_through_a_link_or_a_fifo(tmp_path, kind):
    # the other line-by-line writer (upscale's job manifest): the same append, the same refusal
    from flowlift.jobs.manifest import MANIFEST_NAME, Manifest

    victim = tmp_path / "notes.txt"
    victim.write_text("my notes\n")
    out = tmp_path / "out"
    words = _make(out / MANIFEST_NAME, kind, victim)
    manifest = Manifest(out)
    assert words in (manifest.writable_problem() or "")
    with pytest.raises(FlowliftError, match=words):
        manifest.write_record({"type": "job"})
    assert victim.read_text() == "my notes\n" and not (tmp_path / "nowhere.txt").exists()


@pytest.mark.parametrize("spelling", ["same", "linked folder", "dotdot", "hard link"])
def test_a_run_resumes_from_its_own_saved_config(tmp_path, capsys, data, spelling):
    """``--config OUT/config.json --output OUT``: the config is read whole before anything is written, so
    rewriting the run's own config.json (atomically) is allowed, by identity, however it is spelled."""
    out = tmp_path / "run"
    assert main(_train(data, out, steps=2)) == 0, capsys.readouterr().err
    saved = out / "config.json"
    if spelling == "linked folder":
        (tmp_path / "linked").symlink_to(out, target_is_directory=True)
        saved = tmp_path / "linked" / "config.json"
    elif spelling == "dotdot":
        (tmp_path / "elsewhere").mkdir()
        saved = tmp_path / "elsewhere" / ".." / "run" / "config.json"
    elif spelling == "hard link":
        os.link(out / "config.json", tmp_path / "config-copy.json")
        saved = tmp_path / "config-copy.json"
    args = ["train", "--config", str(saved), "--data", str(data), "--output", str(out), "--steps", "3", *TINY_SETS]
    assert main(args) == 0, capsys.readouterr().err
    import json

    assert json.loads((out / "config.json").read_text())["steps"] == 3
    assert (out / "checkpoints" / "step-00000003").is_dir()


def test_an_unreadable_validation_image_names_val_images(tmp_path, capsys, data, shared):
    """It said ``bad.png: not an image file Pillow can read`` without the option that gave the file."""
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    taef2 = str(shared / "models" / "taef2")
    given = ["--val-every", "1", "--vae", taef2, "--val-images", str(bad)]
    assert main(_train(data, tmp_path / "run", *given, steps=1)) == 2
    line = _one_line(capsys)
    assert line == f"flowlift train: error: --val-images {bad}: not an image file Pillow can read", line


def test_a_missing_device_is_named_by_its_option_as_every_command_names_it(tmp_path, capsys, data):
    """train said ``device 'mps' requested, but ...`` where upscale, hires, ... say ``--device mps: device ...``."""
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    assert main(_train(data, tmp_path / "run", "--device", "mps", steps=1)) == 2
    line = _one_line(capsys)
    expected = "--device mps: device 'mps' requested, but MPS is not available on this machine"
    assert line == f"flowlift train: error: {expected}", line

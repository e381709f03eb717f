"""A report is one set: ``flowlift eval``'s four files and ``flowlift bands``' three are put in place together, so a
stop signal (Ctrl-C, SIGTERM, SIGHUP) while they are written leaves the previous report or the new one, never a new
figure beside an old table, and no temporary behind (flowlift.files.atomic_set)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flowlift.measure import report as R
from flowlift.measure.evaluate import EvalReport


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt (Python's own handler), whatever the test runner installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _report(psnr: float) -> EvalReport:
    """A small finished report of one method on two images (what the figures and the table are made from)."""
    crop = np.full((8, 8, 3), 128, np.uint8)
    metrics = {"psnr_input": psnr, "sharpness": 2.0, "psnr_gt": psnr - 5, "ssim_gt": 0.9}
    report = EvalReport(config={"mode": "run", "scale": 2})
    report.results = {"(ground truth)": {"a": {"sharpness": 3.0}, "b": {"sharpness": 4.0}}, "lanczos": {}}
    report.results["lanczos"] = {"a": dict(metrics), "b": dict(metrics)}
    report.crop_columns = ["input", "lanczos", "ground truth"]
    report.crops = {column: {"a": crop, "b": crop} for column in report.crop_columns}
    return report


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def _stop_at_second_write(monkeypatch) -> None:
    """The second file's bytes written anywhere (a temporary or the file itself) raise KeyboardInterrupt."""
    real = Path.write_bytes
    calls = []

    def write_bytes(self, data):
        calls.append(self)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", write_bytes)


def _stop_at_first_rename(monkeypatch, signum: int = signal.SIGINT) -> None:
    """``signum`` sent to this process right after the first rename of a report file."""
    real = os.replace
    renamed = []

    def replace(source, target, **kwargs):
        real(source, target, **kwargs)
        renamed.append(target)
        if len(renamed) == 1:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(os, "replace", replace)


def test_a_stop_while_the_eval_report_is_written_leaves_the_previous_report_whole(tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "report"
    R.write_report(_report(30.0), out)
    before = _files(out)
    assert sorted(before) == ["crops.png", "metrics.png", "results.json", "table.md"]
    _stop_at_second_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        R.write_report(_report(40.0), out)
    assert _files(out) == before  # not the new metrics.png beside the old table, and no temporary


def test_a_stop_while_the_first_eval_report_is_written_leaves_nothing(tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "report"
    _stop_at_second_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        R.write_report(_report(40.0), out)
    assert not out.exists() or list(out.iterdir()) == []  # not a metrics.png alone


def test_a_stop_during_the_renames_is_delivered_once_the_new_report_is_in_place(tmp_path, monkeypatch, python_sigint):
    old, new = tmp_path / "old", tmp_path / "new"
    R.write_report(_report(30.0), old)
    R.write_report(_report(40.0), new)
    out = tmp_path / "report"
    R.write_report(_report(30.0), out)
    _stop_at_first_rename(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        R.write_report(_report(40.0), out)
    written = _files(out)
    assert sorted(written) == sorted(_files(new))  # the whole new set, no temporary
    for name in ("results.json", "table.md"):  # (the PNGs' bytes carry no date, but compare the text files)
        assert written[name] == _files(new)[name] != _files(old)[name]


def test_a_name_left_out_of_a_new_set_goes_with_the_old_set(tmp_path):
    from flowlift.files.atomic_set import atomic_write_set

    atomic_write_set({tmp_path / "a.json": b"1", tmp_path / "b.png": b"2"})
    assert atomic_write_set({tmp_path / "a.json": b"3", tmp_path / "b.png": None}) == [tmp_path / "a.json"]
    assert _files(tmp_path) == {"a.json": b"3"}


def _bands_inputs(tmp_path: Path) -> list[str]:
    """Two small photos: the earlier run measures the first, the later one both (its title, table and figure differ)."""
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        Image.fromarray(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8)).save(tmp_path / name)
    return [str(tmp_path / "a.png"), str(tmp_path / "b.png")]


def test_a_stop_while_the_bands_report_is_written_leaves_the_previous_one_whole(tmp_path, monkeypatch, python_sigint):
    from flowlift.measure.bands_job import BandsRequest, run_bands_report
    from test_bands import IdealVAE, _fake_vae_module

    _fake_vae_module(monkeypatch, IdealVAE)
    images, out = _bands_inputs(tmp_path), tmp_path / "bands"
    run_bands_report(BandsRequest(images=images[:1], vae="fake", output=out))
    before = _files(out)
    assert sorted(before) == ["bands.json", "bands.md", "bands.png"]
    _stop_at_second_write(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_bands_report(BandsRequest(images=images, vae="fake", output=out))
    assert _files(out) == before


def test_a_stop_during_the_bands_renames_is_delivered_after_the_whole_set(tmp_path, monkeypatch, python_sigint):
    import json

    from flowlift.measure.bands_job import BandsRequest, run_bands_report
    from test_bands import IdealVAE, _fake_vae_module

    _fake_vae_module(monkeypatch, IdealVAE)
    images, out = _bands_inputs(tmp_path), tmp_path / "bands"
    run_bands_report(BandsRequest(images=images[:1], vae="fake", output=out))
    _stop_at_first_rename(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_bands_report(BandsRequest(images=images, vae="fake", output=out))
    assert sorted(_files(out)) == ["bands.json", "bands.md", "bands.png"]
    assert sorted(json.loads((out / "bands.json").read_text())["images"]) == ["a", "b"]


@pytest.fixture
def stop_handlers():
    """Every stop signal raises KeyboardInterrupt, as the command line's handler does (SIGHUP too, unless nohup)."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_every_stop_signal_during_the_renames_waits_for_the_whole_new_report(
    tmp_path, monkeypatch, stop_handlers, signum
):
    """SIGHUP (a closed terminal) stops a command as SIGINT and SIGTERM do, but was not held for the renames: the
    new results.json stood beside the old table and figures."""
    new = tmp_path / "new"
    R.write_report(_report(40.0), new)
    out = tmp_path / "report"
    R.write_report(_report(30.0), out)
    _stop_at_first_rename(monkeypatch, signum)
    with pytest.raises(KeyboardInterrupt):
        R.write_report(_report(40.0), out)
    written = _files(out)
    assert sorted(written) == sorted(_files(new))
    for name in ("results.json", "table.md"):
        assert written[name] == _files(new)[name], name


def test_a_sighup_nohup_ignores_stays_ignored_through_the_renames(tmp_path, monkeypatch):
    from flowlift.files.atomic_set import atomic_write_set

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        _stop_at_first_rename(monkeypatch, signal.SIGHUP)
        atomic_write_set({tmp_path / "a.json": b"1", tmp_path / "b.png": b"2"})  # no stop: nohup asked for none
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert _files(tmp_path) == {"a.json": b"1", "b.png": b"2"}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_flowlift_bands_stopped_during_its_renames_exits_130_with_the_whole_new_report(
    tmp_path, monkeypatch, capsys, signum
):
    """The command line's own handlers (``flowlift bands -o DIR --overwrite`` over an earlier report): 130, and
    the folder holds the new report's three files, none of the old one's."""
    import json

    from flowlift.commands.cli import INTERRUPTED, main
    from test_bands import IdealVAE, _fake_vae_module

    _fake_vae_module(monkeypatch, IdealVAE)
    images, out = _bands_inputs(tmp_path), tmp_path / "bands"
    assert main(["bands", images[0], "--vae", "fake", "-o", str(out), "--no-progress"]) == 0
    before = _files(out)
    _stop_at_first_rename(monkeypatch, signum)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal's child has it (the runner may nohup)
    try:
        status = main(["bands", *images, "--vae", "fake", "-o", str(out), "--overwrite", "--no-progress"])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert status == INTERRUPTED
    assert capsys.readouterr().err.rstrip().splitlines()[-1] == "flowlift bands: interrupted"
    after = _files(out)
    assert sorted(after) == ["bands.json", "bands.md", "bands.png"]
    assert sorted(json.loads(after["bands.json"])["images"]) == ["a", "b"]
    assert all(after[name] != before[name] for name in after), "an old file beside the new ones"

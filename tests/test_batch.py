"""flowlift.jobs.batch: planning, resume and one-line failures, without any model."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowlift.errors import FlowliftError
from flowlift.jobs.batch import Job, pending, plan_jobs, run_jobs


def _touch(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


def test_plan_next_to_inputs_skips_previous_results_and_refuses_collisions(tmp_path):
    a, a_out = _touch(tmp_path / "a.png"), _touch(tmp_path / "a_x2.png")
    jobs = plan_jobs([a, a_out], None, lambda p: f"{p.stem}_x2.png")
    assert jobs[0] == Job(a, tmp_path / "a_x2.png")
    assert jobs[1].output is None and jobs[1].note.startswith("skipped, it is the output of")
    assert not jobs[1].refused

    other = tmp_path / "sub"
    other.mkdir()
    b1, b2 = _touch(tmp_path / "b.png"), _touch(other / "b.png")
    jobs = plan_jobs([b1, b2], str(tmp_path / "out"), lambda p: f"{p.stem}_x2.png")
    assert jobs[0].output == tmp_path / "out" / "b_x2.png"
    assert jobs[1].refused and "also the output of" in jobs[1].note

    jobs = plan_jobs([a], str(a), lambda p: "unused.png")
    assert jobs[0].refused and "would overwrite the input" in jobs[0].note
    with pytest.raises(FlowliftError, match="names one file but 2 inputs"):
        plan_jobs([a, b1], str(tmp_path / "one.png"), lambda p: "x.png")


def test_an_output_that_appears_during_the_run_is_judged_again(tmp_path, capsys):
    """A user's picture saved at an output name while earlier images ran was replaced without --overwrite (the rule
    ran once, before the loop); a finished image there now is skipped, a user's other file refused and kept."""
    from PIL import Image

    sources = [_touch(tmp_path / f"{name}.png") for name in ("a", "b", "c")]
    out = tmp_path / "out"
    out.mkdir()
    jobs = [
        Job(job.source, job.output, expected_size=(4, 4))
        for job in plan_jobs(sources, str(out), lambda p: f"{p.stem}_x2.png")
    ]
    users = out / "b_x2.png"

    def process(source: Path, output: Path) -> None:
        if source.stem == "a":  # meanwhile, the user saves a picture of another size at b's name, c's is made whole
            Image.new("RGB", (3, 3), (200, 0, 0)).save(users)
            Image.new("RGB", (4, 4)).save(out / "c_x2.png")
        output.write_bytes(b"result")

    mine = users.read_bytes() if users.exists() else None
    result = run_jobs(jobs, process, command="test", progress=False)
    err = capsys.readouterr().err
    assert mine is None and (result.done, result.skipped, result.failed) == (1, 1, 1), err
    assert users.read_bytes()[:4] == b"\x89PNG" and "b_x2.png exists and was not written by flowlift" in err
    assert "appeared during the run" in err and (out / "c_x2.png").read_bytes()[:4] == b"\x89PNG"
    # --overwrite: the user asked for every output to be replaced
    assert (
        run_jobs(jobs, lambda s, o: o.write_bytes(b"result"), command="test", overwrite=True, progress=False).done == 3
    )


def test_run_jobs_counts_resume_and_keeps_going(tmp_path, capsys):
    sources = [_touch(tmp_path / f"{name}.png") for name in ("ok", "bad", "done")]
    out = tmp_path / "out"
    jobs = plan_jobs(sources, str(out), lambda p: f"{p.stem}_x2.png")
    out.mkdir()
    from PIL import Image

    Image.new("RGB", (2, 2)).save(out / "done_x2.png")  # a finished output must open as an image
    assert [job.source.name for job in pending(jobs)] == ["ok.png", "bad.png"]

    def process(source: Path, output: Path) -> None:
        if source.stem == "bad":
            raise FlowliftError(f"{source}: not an image\nsecond line never shown")
        output.write_bytes(b"result")

    result = run_jobs(jobs, process, command="test", progress=False)
    err = capsys.readouterr().err.splitlines()
    assert (result.total, result.done, result.skipped, result.failed, result.exit_code) == (3, 1, 1, 1, 1)
    assert f"flowlift test: {sources[1]}: not an image" in err
    assert not any("second line" in line for line in err)
    assert any("done_x2.png exists" in line for line in err)
    assert err[-1] == "flowlift test: 1 of 3 image(s) failed"

    # a programming error is not a per-image failure: it propagates
    with pytest.raises(ZeroDivisionError):
        run_jobs(jobs[:1], lambda s, o: 1 / 0, command="test", overwrite=True, progress=False)


def test_planning_removes_nothing_and_the_run_clears_killed_runs_debris(tmp_path):
    """Issue 29: a plan is data (it writes and removes nothing); a killed run's temporary file goes when a
    run starts, and only then."""
    import os
    import subprocess
    import sys

    from flowlift.jobs.batch import Target, plan_targets

    source = _touch(tmp_path / "a.png")
    killed = (
        "import os, signal, sys; from flowlift.files.atomic import atomic_output\n"
        "with atomic_output(sys.argv[1]) as tmp:\n    os.kill(os.getpid(), signal.SIGKILL)"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    assert subprocess.run([sys.executable, "-c", killed, str(tmp_path / "a_x2.png")], env=env).returncode == -9
    (debris,) = [path for path in tmp_path.iterdir() if path.name.startswith(".a_x2.")]  # a killed run's own
    before = sorted(tmp_path.iterdir())
    jobs = plan_jobs([source], None, lambda p: f"{p.stem}_x2.png")
    jobs += plan_targets([Target(source, tmp_path / "a_x2.jpg")])
    assert sorted(tmp_path.iterdir()) == before and debris.exists()
    run_jobs(jobs[:1], lambda s, o: o.write_bytes(b"result"), command="test", progress=False)
    assert not debris.exists() and (tmp_path / "a_x2.png").read_bytes() == b"result"


def test_refused_is_what_the_planner_decided_not_how_the_note_reads(tmp_path):
    from flowlift.jobs.batch import Target, plan_targets

    a = _touch(tmp_path / "a.png")
    assert Job.refusal(a, "skipped by nobody: this input is refused").refused
    assert not Job.skip(a, "a reference, left alone").refused
    jobs = plan_targets([Target(a, None, "skipped-looking problem"), Target(a, tmp_path / "b.png", "too large")])
    assert [job.refused for job in jobs] == [True, True]
    assert [job.note for job in jobs] == ["skipped-looking problem", "too large"]

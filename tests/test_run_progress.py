"""flowlift.progress: one progress model for every door, its stages by name and an honest time left.

A fake clock drives :class:`~flowlift.progress.RunProgress` through whole runs (a long model load, then stages whose
true speed differs from the planned work by up to 1.2x either way, on a machine of unknown speed): the time left in
the last quarter of the run is within 1.5x of the truth (or within 2 s, the display's grain at the very end) when
the last stage is slow and when it is fast, and it falls over that quarter (a small rise is held back, a rise
past 1.25x, a stage truly slower than planned, is shown rather than hidden).
"""

from __future__ import annotations

import pytest

from flowlift.progress import (
    LOAD,
    RunProgress,
    Stage,
    StageParts,
    active,
    report_stage,
    report_step,
    running,
    stage_kind,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drive(stages: list[tuple[str, float, float, int]], load_s: float = 60.0, poll_s: float = 0.5):
    """Run ``(name, planned work, true seconds, steps)`` stages on a fake clock; returns the run's length and the
    (time, true time left, estimate) of every poll, every ``poll_s`` and after every report."""
    clock = FakeClock()
    run = RunProgress(clock=clock)
    run.plan([(name, work) for name, work, _, _ in stages])
    start = clock.now
    timeline: list[tuple[float, str, int, int]] = []  # (time, event, done, total)
    t = load_s
    timeline.append((0.0, "load", 0, 0))
    for name, _, seconds, steps in stages:
        timeline.append((t, f"begin {name}", 0, 0))
        for i in range(1, steps + 1):
            timeline.append((t + seconds * i / steps, "step", i, steps))
        t += seconds
        timeline.append((t, f"finished {name}", 0, 0))
    end = t
    polls: list[tuple[float, float, float | None]] = []
    events = iter(timeline)
    pending = next(events)
    now = 0.0
    while now <= end:
        while pending is not None and pending[0] <= now:
            clock.now = start + pending[0]
            kind, done, total = pending[1], pending[2], pending[3]
            if kind == "load":
                run.loading("the Flow Upscaler (1.2 GB)")
            elif kind.startswith("begin "):
                run.begin(kind[6:])
            elif kind.startswith("finished "):
                run.finished(kind[9:])
            else:
                run.step(done, total)
            polls.append((pending[0], end - pending[0], run.state().left))
            pending = next(events, None)
        clock.now = start + now
        polls.append((now, end - now, run.state().left))
        now += poll_s
    return end, polls


def check_last_quarter(end: float, polls: list[tuple[float, float, float | None]]) -> None:
    last = [(t, truth, left) for t, truth, left in polls if t >= 0.75 * end and truth > 0]
    assert last
    previous = None
    for t, truth, left in last:
        assert left is not None, f"no time left at {t:.1f} s"
        close = truth / 1.5 <= left <= 1.5 * truth or abs(left - truth) <= 2.0
        assert close, f"at {t:.1f} s of {end:.1f} s: about {left:.1f} s left, truly {truth:.1f} s"
        if previous is not None:
            assert left <= 1.3 * previous + 1e-6, f"at {t:.1f} s the time left rose from {previous:.1f} to {left:.1f} s"
        previous = left


# The stages of a 4x upscale of one image: work = megapixels produced times a planned cost per megapixel; the true
# seconds are the work at an unknown speed (7 s per unit here), off by up to 1.2x per stage kind.
SPEED = 7.0


def upscale_stages(decode_work: float, decode_factor: float, fix_factor: float):
    return [
        ("encode", 1.0, 1.0 * SPEED * 1.1, 1),
        ("pass 1/2", 4.0, 4.0 * SPEED * 0.9, 1),
        ("pass 2/2", 16.0, 16.0 * SPEED * 0.95, 1),
        ("decode", decode_work, decode_work * SPEED * decode_factor, 24),
        ("color fix", 2.5, 2.5 * SPEED * fix_factor, 1),
        ("writing", 0.3, 0.3 * SPEED, 1),
    ]


def test_time_left_when_the_last_stage_is_slow():
    """A heavy decode (Mage at 16K) 1.2x slower per unit than planned, then the colour fix 1.2x slower too."""
    end, polls = drive(upscale_stages(decode_work=60.0, decode_factor=1.2, fix_factor=1.2))
    check_last_quarter(end, polls)


def test_time_left_when_the_last_stage_is_fast():
    """A light decode (TAEF2) 1.2x faster than planned and a colour fix 1.2x faster: no stale "34 s left"."""
    end, polls = drive(upscale_stages(decode_work=3.0, decode_factor=1 / 1.2, fix_factor=1 / 1.2))
    check_last_quarter(end, polls)


def test_refine_steps_slow_at_the_end():
    """A refine: encode, 28 steps, then a long decode 1.2x slower per unit than the steps' speed predicts."""
    stages = [
        ("encode", 1.0, 7.0, 1),
        ("steps", 28.0, 28 * 6.0, 28),
        ("decode", 20.0, 20 * 7.2, 8),
        ("writing", 0.2, 1.0, 1),
    ]
    end, polls = drive(stages, load_s=120.0)
    check_last_quarter(end, polls)


def test_loading_is_named_and_never_extrapolated():
    """From the first second the run says what loads; the time left waits for this run's own first measured work."""
    clock = FakeClock()
    run = RunProgress(clock=clock)
    run.plan([("encode", 1.0), ("decode", 4.0)])
    run.loading("Mage-VAE (mage_vae.safetensors, 1.3 GB)")
    clock.now += 100.0
    state = run.state()
    assert state.what() == "loading Mage-VAE (mage_vae.safetensors, 1.3 GB)"
    assert state.left is None and state.elapsed == pytest.approx(100.0)
    run.begin("encode")
    clock.now += 2.0
    run.finished("encode")
    state = run.state()
    assert state.stage == "decode" and state.loading is None
    assert state.left == pytest.approx(8.0)  # 4 units at this run's 2 s per unit; the 100 s load not counted
    assert state.fraction == pytest.approx(0.2)
    run.step(1, 4)
    assert run.state().what() == "decode, tile 1/4"
    assert "about" in run.state().line() and "(20%)" in run.state().line() or "(40%)" in run.state().line()


def test_groups_name_each_image_of_a_batch():
    clock = FakeClock()
    run = RunProgress(clock=clock)
    run.plan([("a.png: encode", 1.0), ("a.png: decode", 1.0), ("b.png: encode", 1.0), ("b.png: decode", 1.0)])
    run.group = "a.png"
    run.begin("encode")
    clock.now += 1.0
    run.finished("encode")
    run.finished("decode")
    run.group = "b.png"
    assert run.state().stage == "b.png: encode"
    assert run.state().fraction == pytest.approx(0.5)


def test_reports_reach_the_active_run_only():
    report_stage("encode")  # no active run: nothing happens
    report_step(1, 2)
    assert active() is None
    run = RunProgress(clock=FakeClock())
    with running(run):
        assert active() is run
        report_stage("steps")
        report_step(3, 28)
    assert active() is None
    assert run.state().what() == "steps, step 3/28"
    assert stage_kind("x.png: pass 2/3") == "pass" and Stage("load x", 0.0, LOAD).kind == LOAD
    with pytest.raises(ValueError):
        Stage("bad", float("nan"))


def test_a_stage_that_overruns_slows_the_estimate_of_the_rest():
    """A stage without steps (an untiled decode) running 3x its estimate: the machine is slower than measured (another
    process took a core), so the stages after it are estimated at the slower speed, not at the first stages'."""
    clock = FakeClock()
    run = RunProgress(clock=clock)
    run.plan([("encode", 1.0), ("decode", 1.0), ("color fix", 1.0)])
    run.begin("encode")
    clock.now += 1.0
    run.finished("encode")
    assert run.state().left == pytest.approx(2.0)
    clock.now += 3.0  # the decode, planned at 1 s, still running after 3 s
    assert run.state().left == pytest.approx(2.0)  # the colour fix at (1 + 3) s / 2 units, not at 1 s per unit


def test_stage_parts_show_the_share_of_the_planned_work_not_of_the_parts():
    """A node's bar (ComfyUI's and InvokeAI's) over weighted parts: after the encode of a 4x upscale the bar is at
    the encode's share of the work, strips move within the running part, a callback past the last part stays at
    1, and work of the wrong length (or none) weighs the parts equally."""
    parts = StageParts(3, [1.0, 4.0, 16.0])
    assert parts.fraction == 0.0 and parts.name(parts.done) == "stage 1/3"
    parts.finished()
    assert parts.fraction == pytest.approx(1 / 21)
    parts.strip(1, 2)
    assert parts.fraction == pytest.approx(3 / 21)
    parts.finished()
    assert parts.fraction == pytest.approx(5 / 21) and parts.name(parts.done) == "stage 3/3"
    parts.finished()
    parts.finished()  # a stage the plan did not count: the bar stays full
    assert parts.fraction == pytest.approx(1.0)
    for work in (None, [1.0, 2.0, 3.0]):
        equal = StageParts(2, work)
        equal.finished()
        assert equal.fraction == pytest.approx(0.5)


def test_an_image_nodes_stages_are_the_upscale_stages_the_host_does_not_write():
    """ComfyUI's and InvokeAI's image nodes weigh encode, the passes, decode and colour fix as every door does; the
    host writes the image, so no writing stage: a 4x upscale's bar has 5 parts, the second pass 4x the first."""
    from flowlift.upscale import stages

    work = stages.node_stage_work(2, 0.39)
    assert work == [w for name, w in stages.upscale_stages(2, 0.39) if name != "writing"] and len(work) == 5
    assert work[2] == pytest.approx(4 * work[1])

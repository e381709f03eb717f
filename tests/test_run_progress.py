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


def test_an_asked_size_plans_each_stage_at_the_pixels_it_makes():
    """Any output size (scale 3, a long side, a size): the passes make their 4**i, the decode the passes' output, the
    colour fix (after resampling the decoded frame) and the writing the asked size; with SesquiLSR sizing the
    latents the decode makes the asked size and carries SesquiLSR's own work (it runs between the last pass's
    report and the decode's). Before, every stage after the passes was planned at the passes' output: a 3x through
    SesquiLSR planned its decode at 4 input megapixels where it decodes 9, and its time left fell short by the
    SesquiLSR and most of the decode."""
    from flowlift.upscale.stages import (
        LATENT_UPSCALER_PER_PASS,
        RESAMPLE_SECONDS_PER_MP,
        SECONDS_PER_MP,
        upscale_stages,
    )

    pixels = dict(upscale_stages(2, 1.0, 9.0))  # 3x in pixels: 2 passes (4x), resampled down to 9 input MP
    assert pixels["pass 2/2"] == pytest.approx(4 * pixels["pass 1/2"])
    assert pixels["decode"] == pytest.approx(16 * SECONDS_PER_MP["decode"])
    assert pixels["color fix"] == pytest.approx(9 * SECONDS_PER_MP["color fix"] + 16 * RESAMPLE_SECONDS_PER_MP)
    assert pixels["writing"] == pytest.approx(9 * SECONDS_PER_MP["writing"])
    latent = dict(upscale_stages(1, 1.0, 9.0, latent_fraction=True))  # 3x through SesquiLSR: 1 pass, then 1.5x
    assert list(latent) == ["encode", "pass 1/1", "decode", "color fix", "writing"]
    sesqui = 9 * LATENT_UPSCALER_PER_PASS * SECONDS_PER_MP["pass"]
    assert sesqui > 0 and latent["decode"] == pytest.approx(9 * SECONDS_PER_MP["decode"] + sesqui)
    assert latent["color fix"] == pytest.approx(9 * SECONDS_PER_MP["color fix"])  # SesquiLSR sized it: no resample
    assert dict(upscale_stages(2, 1.0)) == dict(upscale_stages(2, 1.0, 16.0))  # a power of two: as before


def test_the_commands_plan_reads_the_output_size_and_the_latent_upscaler_from_the_header(tmp_path):
    """``OutputSizes.planned_image`` (the command line's and the app's plan): the passes that run, the input's and the
    output's megapixels, and whether SesquiLSR has work, from the image's header; an unreadable one plans 1 MP."""
    from PIL import Image

    from flowlift.upscale.asked_size import AskedSize
    from flowlift.upscale.output_sizes import OutputSizes

    path = tmp_path / "p.png"
    Image.new("RGB", (64, 48)).save(path)
    two = OutputSizes(1, "pad").planned_image(path)
    assert (two.passes, two.input_megapixels, two.output_megapixels, two.latent_fraction) == (
        1,
        pytest.approx(64 * 48 / 1e6),
        pytest.approx(128 * 96 / 1e6),
        False,
    )
    pixels = OutputSizes(AskedSize(scale=3), "pad").planned_image(path)
    assert (pixels.passes, pixels.output_megapixels, pixels.latent_fraction) == (2, pytest.approx(0.027648), False)
    latent = OutputSizes(AskedSize(scale=3), "pad", fraction_last=True).planned_image(path)
    assert (latent.passes, latent.output_megapixels, latent.latent_fraction) == (1, pytest.approx(0.027648), True)
    assert latent.stages()[-3][0] == "decode" and latent.stages()[-3][1] > pixels.stages()[-3][1] * 9 / 16
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    unreadable = OutputSizes(1, "pad")
    assert unreadable.planned_image(broken).input_megapixels == 1.0 and unreadable.input_size(broken) is None
    assert OutputSizes(1, "pad").input_size(path) == (64, 48)


def test_the_node_packs_weigh_their_parts_as_the_command_plans_them():
    """ComfyUI's and InvokeAI's nodes take their bars' weights from ``flowlift.upscale.node_choices``: an image node
    asked for 3x through SesquiLSR plans its decode at the asked size with SesquiLSR's work; a latent node's passes
    weigh 1 : 4 (not equally: its bar stood at half after the first of two passes, a fifth of the work), then
    SesquiLSR's part on the megapixels its latents decode to."""
    from flowlift.upscale import node_choices, stages

    passes, size = node_choices.image_plan(3.0, 64, 48, fraction_last=True)
    image = node_choices.image_stage_work(passes, size, 64, 48, 2, fraction_last=True)
    planned = stages.PlannedImage("x", passes, 2 * 64 * 48 / 1e6, 2 * 192 * 144 / 1e6, latent_fraction=True)
    assert passes == 1 and image == pytest.approx([w for name, w in planned.stages() if name != "writing"])
    assert node_choices.image_stage_work(2, None, 64, 48) == stages.node_stage_work(2, 64 * 48 / 1e6)
    whole = node_choices.latent_stage_work(2, None, 32, 48)
    assert len(whole) == 2 and whole[1] == pytest.approx(4 * whole[0])
    passes, size = node_choices.latent_plan(3.0, 32, 48, fraction_last=True)
    parts = node_choices.latent_stage_work(passes, size, 32, 48)
    assert (passes, size, len(parts)) == (1, (96, 144), 2)
    fraction_mp = 96 * 144 * 64 / 1e6
    assert parts[1] == pytest.approx(fraction_mp * stages.LATENT_UPSCALER_PER_PASS * stages.SECONDS_PER_MP["pass"])

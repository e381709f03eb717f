"""The app's bar reads :mod:`flowlift.progress`: every report is ``(fraction, description)`` naming the stage (and
its steps), and the time left once this request measured its own speed; nothing is learned across requests."""

from __future__ import annotations

import pytest

from flowlift.app.progress import describe, request_progress
from flowlift.progress import running
from flowlift.refine.stages import refine_stages
from flowlift.upscale.stages import PlannedImage, UpscaleStages, upscale_stages


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_request_reports_at_once_then_names_every_stage_and_tile():
    reports: list[tuple[float, str]] = []
    run = request_progress(lambda fraction, text: reports.append((fraction, text)))
    clock = FakeClock()
    run.clock, run.started = clock, 0.0
    run.loading(None)
    assert reports == [(0.0, "starting")]  # the bar from the click, before any model loads
    run.loading("the Flow Upscaler (flow_upscaler.safetensors, 2 MB) and VAE taef2 (once per server)")
    assert reports[-1][1].startswith("loading the Flow Upscaler")
    stages = UpscaleStages(run)
    with running(run), stages.image(PlannedImage("photo.png", 1, 0.5)):
        clock.now = 2.0
        stages.stage("encode")
        clock.now = 6.0
        stages.stage("pass 1/1")
        for tile in range(1, 5):
            clock.now += 1.0
            stages.decode_tile(tile, 4)
        stages.stage("decode")
        clock.now += 0.2
        stages.stage("color fix")
    texts = [text for _, text in reports]
    assert "photo.png: pass 1/1, about" in " | ".join(texts)
    assert any(text.startswith("photo.png: decode, tile 2/4, about ") for text in texts)
    assert all(" left" in text for text in texts[4:])  # once the encode is measured, always a time left
    fractions = [fraction for fraction, _ in reports]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)


def test_a_failed_image_leaves_the_plan():
    run = request_progress(lambda fraction, text: None)
    stages = UpscaleStages(run)
    stages.expect([PlannedImage("a.png", 1, 1.0), PlannedImage("b.png", 1, 1.0)])
    with pytest.raises(ValueError), stages.image(PlannedImage("a.png", 1, 1.0)):
        raise ValueError("broken")
    assert {stage.name.split(":")[0] for stage in run.stages} == {"b.png"}


def test_stage_work_follows_the_pixels():
    stages = dict(upscale_stages(2, 1.0))
    assert list(stages) == ["encode", "pass 1/2", "pass 2/2", "decode", "color fix", "writing"]
    assert stages["pass 2/2"] == pytest.approx(4 * stages["pass 1/2"])
    refine = dict(refine_stages("p.png", 1.0, 4.0, 4, upscale=True))
    assert list(refine) == ["p.png: encode", "p.png: upscale", "p.png: steps", "p.png: decode", "p.png: writing"]
    assert dict(refine_stages("p.png", 1.0, 1.0, 8, upscale=False))["p.png: steps"] == pytest.approx(
        2 * dict(refine_stages("p.png", 1.0, 1.0, 4, upscale=False))["p.png: steps"]
    )


def test_describe_without_a_measurement_says_no_time():
    run = request_progress(lambda fraction, text: None)
    run.plan([("encode", 1.0)])
    run.begin("encode")
    assert describe(run.state()) == "encode"

"""``flowlift app``'s progress maths: stage weights, the time left, one bar over stages and decode tiles."""

from __future__ import annotations

import pytest

from flowlift.app.progress import (
    EtaProgress,
    UpscaleProgress,
    format_duration,
    remaining_seconds,
    stage_weights,
)


def test_stage_weights_follow_the_pixels_each_stage_makes():
    weights = dict(stage_weights(2))
    assert list(weights) == ["encode", "pass 1/2", "pass 2/2", "decode", "color fix", "saving"]
    assert sum(weights.values()) == pytest.approx(1.0)
    assert weights["pass 2/2"] == pytest.approx(4 * weights["pass 1/2"])  # twice the sides: four times the pixels
    assert weights["decode"] == pytest.approx(weights["pass 2/2"])  # same output pixels, same cost per pixel
    assert weights["color fix"] == pytest.approx(weights["decode"] / 10)


def test_remaining_seconds_extrapolates_the_rate_so_far():
    assert remaining_seconds(0.25, 10.0) == pytest.approx(30.0)
    assert remaining_seconds(0.5, 4.0) == pytest.approx(4.0)
    assert remaining_seconds(0.01, 10.0) is None  # too little done to say
    assert remaining_seconds(0.5, 0.2) is None  # too early to say
    assert remaining_seconds(1.0, 10.0) is None
    durations = [format_duration(s) for s in (0.2, 4.0, 59.5, 125.0, 3725.0)]
    assert durations == ["1 s", "4 s", "1 min 00 s", "2 min 05 s", "1 h 02 min"]


def test_eta_progress_appends_the_time_left_from_its_own_start():
    now = [100.0]
    lines: list[tuple[float, str]] = []
    eta = EtaProgress(lambda fraction, text: lines.append((fraction, text)), clock=lambda: now[0])
    eta(0.0, "photo.png: encode")
    now[0] = 110.0
    eta(0.25, "photo.png: pass 1/2")
    assert lines == [(0.0, "photo.png: encode"), (0.25, "photo.png: pass 1/2, about 30 s left")]


def test_one_bar_over_stages_and_decode_tiles():
    lines: list[tuple[float, str]] = []
    bar = UpscaleProgress(lambda fraction, text: lines.append((fraction, text)), "photo.png", 2, base=0.5, span=0.5)
    bar.start()
    for stage in ("encode", "pass 1/2", "pass 2/2"):
        bar.stage(stage)
    for tile in range(1, 5):
        bar.decode_tile(tile, 4)
    bar.stage("decode")
    bar.stage("color fix")
    fractions = [fraction for fraction, _ in lines]
    assert fractions == sorted(fractions) and fractions[0] == 0.5 and fractions[-1] < 1.0
    texts = [text for _, text in lines]
    assert texts[0] == "photo.png: encode"
    assert texts[1] == "photo.png: encode done, pass 1/2"
    assert "photo.png: decode, tile 3/4" in texts
    assert texts[-1] == "photo.png: color fix done, saving"
    weights = dict(stage_weights(2))
    before_decode = 0.5 + 0.5 * (weights["encode"] + weights["pass 1/2"] + weights["pass 2/2"])
    assert lines[5][0] == pytest.approx(before_decode + 0.5 * weights["decode"] * 2 / 4)  # start, 3 stages, tile 2/4


def test_dropped_passes_replan_the_bar():
    """The 16K cap may run fewer passes than asked: the pipeline's 'pass 1/1' re-plans the stages."""
    lines: list[tuple[float, str]] = []
    bar = UpscaleProgress(lambda fraction, text: lines.append((fraction, text)), "big.png", 3)
    bar.start()
    bar.stage("encode")
    bar.stage("pass 1/1")
    bar.decode_tile(1, 2)
    weights = dict(stage_weights(1))
    assert lines[-1][0] == pytest.approx(weights["encode"] + weights["pass 1/1"] + weights["decode"] / 2)
    assert lines[-2][1] == "big.png: pass 1/1 done, decode"

"""Stage 2 on any upscaled image (flowlift.upscale.colorfix_image) and the `flowlift colorfix` command."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.images import tensor_to_uint8, to_tensor
from flowlift.measure.metrics import drift_at_input_scale
from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.colorfix_image import color_fix_array, color_fix_image, integer_scale


def _lab_drift(rgb: torch.Tensor) -> torch.Tensor:
    """benchmarks/bench_colorfix.py --drift: a cast (+1.5 a*, -2 b*), +15% chroma, L* x1.1 around 50, +2."""
    from kornia.color import lab_to_rgb, rgb_to_lab

    lab = rgb_to_lab(rgb)
    light = (lab[:, :1] - 50.0) * 1.1 + 52.0
    colour = lab[:, 1:] * 1.15 + torch.tensor([1.5, -2.0]).view(1, 2, 1, 1)
    return lab_to_rgb(torch.cat([light, colour], 1))


def make_drifted_pair(shared) -> tuple[np.ndarray, np.ndarray]:
    """(reference 64 px wide, its Lanczos 4x upscale given the synthetic drift), uint8 HWC."""
    photo = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    small = photo.resize((64, round(64 * photo.height / photo.width)), Image.Resampling.BOX)
    big = small.resize((small.width * 4, small.height * 4), Image.Resampling.LANCZOS)
    return np.asarray(small), tensor_to_uint8(_lab_drift(to_tensor(big)))[0]


@pytest.fixture(scope="module")
def drifted_pair(shared):
    return make_drifted_pair(shared)


def test_color_fix_image_removes_drift_exactly_as_stage2(drifted_pair):
    reference, drifted = drifted_pair
    before = drift_at_input_scale(drifted, reference)
    assert before["cast_max"] > 3 and before["c_mean_change_pct"] > 5 and before["l_std_change"] > 1
    fixed = np.asarray(color_fix_image(Image.fromarray(drifted), Image.fromarray(reference)))
    # the pipeline's stage 2 on the same pixels
    stage2 = tensor_to_uint8(lab_lowband_transplant(to_tensor(drifted), to_tensor(reference), 1.0))[0]
    assert np.array_equal(fixed, stage2)
    after = drift_at_input_scale(fixed, reference)
    assert after == drift_at_input_scale(stage2, reference)
    assert after["cast_max"] <= 0.05, after
    assert abs(after["c_mean_change_pct"]) <= 0.5 and abs(after["l_std_change"]) <= 0.05, after
    half = drift_at_input_scale(color_fix_array(drifted, reference, 0.5), reference)
    assert 0.4 < half["cast_r"] / before["cast_r"] < 0.6


def test_color_fix_image_keeps_the_upscaled_alpha(drifted_pair):
    reference, drifted = drifted_pair
    alpha = np.linspace(0, 255, drifted.shape[0] * drifted.shape[1]).reshape(drifted.shape[:2]).astype(np.uint8)
    rgba = Image.fromarray(np.dstack([drifted, alpha]), "RGBA")
    ref_rgba = Image.fromarray(np.dstack([reference, np.zeros(reference.shape[:2], np.uint8)]), "RGBA")
    out = color_fix_image(rgba, ref_rgba)
    assert out.mode == "RGBA" and np.array_equal(np.asarray(out)[..., 3], alpha)
    assert np.array_equal(np.asarray(out)[..., :3], color_fix_array(drifted, reference))


def test_a_cancel_raised_from_the_strip_callback_stops_the_fix(drifted_pair):
    # InvokeAI's Colour Fix checked its cancel only before the fix: color_fix_image took no strip callback
    reference, drifted = drifted_pair
    calls = []

    class Cancelled(Exception):
        pass

    def cancel_on_the_second() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise Cancelled

    counted = []
    fixed = color_fix_image(Image.fromarray(drifted), Image.fromarray(reference), on_strip=lambda: counted.append(1))
    assert len(counted) >= 3 and np.array_equal(np.asarray(fixed), color_fix_array(drifted, reference))
    with pytest.raises(Cancelled):  # mid-fix: a strip of the transplant's iterations is still to come
        color_fix_image(Image.fromarray(drifted), Image.fromarray(reference), on_strip=cancel_on_the_second)
    assert len(calls) == 2


@pytest.mark.parametrize(
    "size,ref,message",
    [
        ((633, 422), (192, 128), r"not an integer multiple .*3\.3x by 3\.3x"),
        ((384, 384), (192, 128), r"2x by 3x"),
        ((192, 128), (192, 128), r"reference's own size"),
        ((190, 128), (192, 128), r"not an integer multiple"),
    ],
)
def test_integer_scale_refuses_what_stage2_cannot_fix(size, ref, message):
    with pytest.raises(FlowliftError, match=message) as info:
        integer_scale(size, ref)
    assert "\n" not in str(info.value)


def test_integer_scale_infers_the_factor():
    assert integer_scale((768, 512), (192, 128)) == 4
    assert integer_scale((6, 3), (2, 1)) == 3
    with pytest.raises(FlowliftError, match="strength"):
        color_fix_array(np.zeros((8, 8, 3), np.uint8), np.zeros((4, 4, 3), np.uint8), 1.5)

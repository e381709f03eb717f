"""Stage 2's element-wise pieces (flowlift.upscale.colorfix_lab): exact selects, powers, the lerp upsampling and the
block means against the torch operations they replace (issue 47)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flowlift.upscale.colorfix import lab_lowband_transplant
from flowlift.upscale.colorfix_lab import (
    F_IN,
    F_OUT,
    SRGB_IN,
    SRGB_OUT,
    above,
    affine,
    block_mean,
    linear_phases,
    power,
    upsample_rows,
)


@pytest.mark.parametrize("threshold", [SRGB_IN, F_IN, F_OUT, SRGB_OUT, 0.0])
def test_above_is_torch_where_bit_for_bit(threshold):
    """The float-weight lerp picks each branch exactly: at the threshold itself, one float32 step either side, and
    anywhere else (a blend ``low + w (high - low)`` would round the upper branch)."""
    gen = torch.Generator().manual_seed(1)
    edge = torch.tensor(threshold, dtype=torch.float32)
    near = torch.stack([edge, torch.nextafter(edge, edge + 1), torch.nextafter(edge, edge - 1)])
    value = torch.cat([near, torch.rand(4001, generator=gen) * 0.4 - 0.1]).view(1, 4, 1001)
    high = torch.randn(value.shape, generator=gen) * 3
    low = torch.randn(value.shape, generator=gen) / 7
    expected = torch.where(value > threshold, high, low)
    assert torch.equal(above(value, threshold, high, low.clone()), expected)
    out = torch.empty(1, 4, 2002)[:, :, ::2]  # a strided destination
    assert torch.equal(above(value, threshold, high, low.clone(), out=out), expected)
    assert torch.equal(out, expected)


def test_power_and_affine_are_the_formulas():
    """On the ranges stage 2 takes its powers over (above each branch's threshold), to float32 rounding."""
    cases = (
        (2.4, -2.4 * math.log(1.055), (SRGB_IN + 0.055)),
        (1.0 / 3.0, 0.0, F_IN),
        (1.0 / 2.4, math.log(1.055), SRGB_OUT),
    )
    for exponent, log_scale, lowest in cases:
        x = torch.linspace(lowest, 1.0, 10001, dtype=torch.float64)
        got = power(x.float(), exponent, log_scale).double()
        expected = x**exponent * math.exp(log_scale)
        assert ((got - expected).abs() / expected).max() < 1e-6
    x = torch.rand(1000, dtype=torch.float64)
    assert torch.allclose(affine(x.clone(), 7.787, 4 / 29), 7.787 * x + 4 / 29, rtol=0, atol=1e-15)


@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 8])
def test_linear_phases_are_pytorchs_taps(s):
    """Phase ``j`` of an integer factor samples the input at ``k + (j + 1/2) / s - 1/2`` (PyTorch's
    ``align_corners=False`` source index), with the padded start index for a negative offset."""
    for j, (offset, weight) in enumerate(linear_phases(s)):
        d = (j + 0.5) / s - 0.5
        assert 0.0 <= weight < 1.0
        assert offset - 1 + weight == pytest.approx(d)


@pytest.mark.parametrize(
    ("s_h", "s_w", "h", "w"), [(4, 4, 9, 7), (2, 8, 5, 3), (3, 5, 4, 6), (8, 2, 1, 1), (1, 1, 3, 4)]
)
def test_upsample_rows_is_bilinear_upsampling(s_h, s_w, h, w):
    """Every strip of rows (the first and last, with the edge clamping, included) equals ``F.interpolate``: to
    float64 rounding in float64, to float32 rounding in float32."""
    gen = torch.Generator().manual_seed(0)
    coarse = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64)
    full = F.interpolate(coarse, scale_factor=(s_h, s_w), mode="bilinear", align_corners=False)
    full32 = F.interpolate(coarse.float(), scale_factor=(s_h, s_w), mode="bilinear", align_corners=False)
    for k0, k1 in [(0, h), (0, 1), (h - 1, h), (0, (h + 1) // 2), ((h + 1) // 2, h)]:
        if k1 <= k0:
            continue
        rows = slice(k0 * s_h, k1 * s_h)
        assert (upsample_rows(coarse, k0, k1, s_h, s_w) - full[:, :, rows]).abs().max() < 1e-12
        assert (upsample_rows(coarse.float(), k0, k1, s_h, s_w) - full32[:, :, rows]).abs().max() < 2e-6


@pytest.mark.parametrize(("s_h", "s_w"), [(4, 4), (2, 3), (1, 5), (8, 1), (1, 1)])
def test_block_mean_is_avg_pool(s_h, s_w):
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(2, 3, 5 * s_h, 7 * s_w, generator=gen, dtype=torch.float64)
    assert (block_mean(x, s_h, s_w) - F.avg_pool2d(x, (s_h, s_w))).abs().max() < 1e-15
    low = torch.zeros(2, 3, 9, 7)
    got = block_mean(x.float(), s_h, s_w, out=low[:, :, 2:7])  # into rows of a larger map, as stage 2 does
    assert got.data_ptr() == low[:, :, 2:7].data_ptr()
    assert (low[:, :, 2:7] - F.avg_pool2d(x.float(), (s_h, s_w))).abs().max() < 1e-6
    assert not low[:, :, :2].any() and not low[:, :, 7:].any()


def test_stage2_keeps_a_nan_visible():
    """A NaN in the decoded frame stays NaN through the exact selects (never a plausible finite colour)."""
    out = torch.rand(1, 3, 32, 32)
    out[0, 1, 5, 7] = float("nan")
    assert torch.isnan(lab_lowband_transplant(out, torch.rand(1, 3, 8, 8))).any()


@pytest.mark.parametrize("iterations", [1, 2, 3])
def test_stage2_in_place_equals_a_new_tensor(iterations):
    """In place, ``f`` is kept in the output's memory and the result written over it strip by strip: the same bits
    as into a new tensor, at every iteration count (the first corrected step is then the last one too)."""
    gen = torch.Generator().manual_seed(3)
    out = torch.rand(1, 3, 96, 80, generator=gen) * 1.1 - 0.05
    reference = torch.rand(1, 3, 24, 20, generator=gen)
    expected = lab_lowband_transplant(out, reference, 1.0, iterations, strip_pixels=1000)
    frame = out.clone()
    result = lab_lowband_transplant(frame, reference, 1.0, iterations, strip_pixels=1000, inplace=True)
    assert result.data_ptr() == frame.data_ptr()
    assert torch.equal(result, expected)

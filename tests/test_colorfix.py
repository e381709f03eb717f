"""Both colour-drift stages: exact low-band transplants (flowlift.upscale.colorfix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.images import to_tensor
from flowlift.measure.metrics import drift_at_input_scale
from flowlift.upscale.colorfix import (
    area_downsample,
    area_matrix,
    integer_area_tridiagonal,
    lab_lowband_transplant,
    latent_lowband_transplant,
    linear_matrix,
    linear_taps,
    lowband_grid,
    solve_tridiagonal,
)


@pytest.mark.parametrize("sizes", [(64, 48, 8, 6), (60, 44, 7, 5), (1024, 40, 256, 10), (5, 3, 5, 3)])
def test_linear_matrix_is_pytorch_bilinear(sizes):
    big_h, big_w, h, w = sizes
    coarse = torch.randn(2, 3, h, w, dtype=torch.float64)
    expected = F.interpolate(coarse, size=(big_h, big_w), mode="bilinear", align_corners=False)
    ours = linear_matrix(big_h, h) @ coarse @ linear_matrix(big_w, w).T
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)


def test_area_matrix_is_adaptive_average():
    x = torch.randn(1, 4, 44, 60, dtype=torch.float64)
    torch.testing.assert_close(area_downsample(x, (5, 7)), F.adaptive_avg_pool2d(x, (5, 7)), atol=1e-12, rtol=0)
    # integer factors are block means
    block = area_matrix(4, 16)
    assert torch.equal(block[1, 4:8], torch.full((4,), 0.25, dtype=torch.float64))
    assert block[1].sum() == 1 and block[1, :4].abs().sum() == 0


@pytest.mark.parametrize("n, factor", [(1, 2), (2, 4), (7, 2), (9, 8), (6, 3)])
def test_tridiagonal_bands_equal_dense_product(n, factor):
    dense = area_matrix(n, n * factor) @ linear_matrix(n * factor, n)
    bands = integer_area_tridiagonal(n, factor)
    rebuilt = torch.diag(bands[:, 1]) + torch.diag(bands[1:, 0], -1) + torch.diag(bands[:-1, 2], 1)
    torch.testing.assert_close(rebuilt, dense, atol=1e-15, rtol=0)
    rhs = torch.randn(n, 3, 2, dtype=torch.float64)
    expected = torch.linalg.solve(dense, rhs.reshape(n, -1)).reshape(rhs.shape)
    torch.testing.assert_close(solve_tridiagonal(bands, rhs, dim=0), expected)
    # along another axis too
    rhs_t = rhs.movedim(0, -1).contiguous()
    torch.testing.assert_close(solve_tridiagonal(bands, rhs_t, dim=-1), expected.movedim(0, -1))


def test_linear_taps_clamp_at_edges():
    i0, i1, w1 = linear_taps(8, 2)
    assert i0.tolist() == [0, 0, 0, 0, 0, 0, 1, 1] and i1.tolist() == [1] * 8
    matrix = linear_matrix(8, 2)
    # the first two rows clamp onto sample 0, the last two onto sample 1; rows sum to 1
    assert matrix[:2].tolist() == [[1.0, 0.0]] * 2 and matrix[-2:].tolist() == [[0.0, 1.0]] * 2
    torch.testing.assert_close(matrix.sum(1), torch.ones(8, dtype=torch.float64))


# -- stage 1 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 32, 48, 64), (1, 32, 44, 60), (1, 32, 12, 4)])
def test_stage1_full_strength_pins_low_band(shape):
    gen = torch.Generator().manual_seed(0)
    output = torch.randn(shape, generator=gen)
    cond = torch.randn(shape[0], shape[1], shape[2] // 2, shape[3] // 2, generator=gen) + 0.5
    grid = lowband_grid(shape[2], shape[3])
    before = (area_downsample(output, grid) - area_downsample(cond, grid)).abs().max()
    fixed = latent_lowband_transplant(output, cond, 1.0, strip_rows=7)
    after = (area_downsample(fixed, grid) - area_downsample(cond, grid)).abs().max()
    assert before > 0.3
    assert after < 1e-5
    # the correction lives in the low band: the high band (output minus its projection) is unchanged
    half = latent_lowband_transplant(output, cond, 0.5)
    mean_low = 0.5 * (area_downsample(output, grid) + area_downsample(cond, grid))
    torch.testing.assert_close(area_downsample(half, grid), mean_low, atol=1e-5, rtol=0)
    torch.testing.assert_close(half - output, 0.5 * (fixed - output), atol=1e-5, rtol=0)


def _inside_cell_rows(n_fine: int, factor: int) -> torch.Tensor:
    """Fine rows whose neighbours lie between the same two coarse sample centres (bilinear is linear there)."""
    centre = (factor - 1) / 2
    rows = torch.arange(1, n_fine - 1)
    return rows[torch.floor((rows - 1 - centre) / factor) == torch.floor((rows + 1 - centre) / factor)]


def _second_difference(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return x[..., rows + 1, :] - 2 * x[..., rows, :] + x[..., rows - 1, :]


def test_stage1_zero_strength_is_identity_and_correction_is_smooth():
    output = torch.randn(1, 32, 64, 64)
    cond = torch.randn(1, 32, 32, 32)
    assert torch.equal(latent_lowband_transplant(output, cond, 0.0), output)
    delta = latent_lowband_transplant(output, cond, 1.0) - output
    # the correction is bilinear from the 8x8 grid: no second differences between coarse centres
    rows = _inside_cell_rows(64, 8)
    assert len(rows) > 30
    assert _second_difference(delta, rows).abs().max() < 1e-5
    assert _second_difference(output, rows).abs().mean() > 1


def test_stage1_rejects_mismatched_batches():
    with pytest.raises(ValueError):
        latent_lowband_transplant(torch.zeros(2, 32, 8, 8), torch.zeros(1, 32, 4, 4))


# -- stage 2 -----------------------------------------------------------------------------------------


def _lab_drift(rgb: torch.Tensor) -> torch.Tensor:
    """A colour cast, +15% chroma and a tone stretch (x1.1 around L=50, +2), applied in L*a*b*."""
    from kornia.color import lab_to_rgb, rgb_to_lab

    lab = rgb_to_lab(rgb)
    light = (lab[:, :1] - 50.0) * 1.1 + 52.0
    colour = lab[:, 1:] * 1.15 + torch.tensor([1.5, -2.0]).view(1, 2, 1, 1)
    return lab_to_rgb(torch.cat([light, colour], 1))


@pytest.fixture(scope="module")
def synthetic_drift(shared):
    photo = Image.open(shared / "images" / "photos" / "Wine_by_Jakkub_Mede.png").convert("RGB")
    small = photo.resize((192, round(192 * photo.height / photo.width)), Image.Resampling.BOX)
    big = small.resize((small.width * 4, small.height * 4), Image.Resampling.LANCZOS)
    reference = to_tensor(small)
    return reference, _lab_drift(to_tensor(big))


def _to_uint8(t: torch.Tensor) -> np.ndarray:
    return (t[0].permute(1, 2, 0).clamp(0, 1).numpy() * 255).round().astype(np.uint8)


def test_stage2_meets_model_card_figures(synthetic_drift):
    reference, drifted = synthetic_drift
    ref8 = _to_uint8(reference)
    before = drift_at_input_scale(_to_uint8(drifted), ref8)
    assert before["cast_max"] > 3 and before["c_mean_change_pct"] > 5 and before["l_std_change"] > 1
    fixed = lab_lowband_transplant(drifted, reference, 1.0)
    assert fixed.shape == drifted.shape and fixed.min() >= 0 and fixed.max() <= 1
    after = drift_at_input_scale(_to_uint8(fixed), ref8)
    assert after["cast_max"] <= 0.05, after
    assert abs(after["c_mean_change_pct"]) <= 0.5, after
    assert abs(after["c_p99_change"]) <= 0.6, after
    assert abs(after["l_std_change"]) <= 0.05, after
    assert abs(after["l_p5_change"]) <= 0.05 and abs(after["l_p95_change"]) <= 0.05, after
    # detail above the reference's Nyquist is the output's: the L*a*b* change is bilinear from the
    # reference grid, so it has no second differences between coarse centres (except where clipped)
    from kornia.color import rgb_to_lab

    change = rgb_to_lab(fixed) - rgb_to_lab(drifted)
    rows = _inside_cell_rows(change.shape[-2], 4)
    assert torch.quantile(_second_difference(change, rows).abs().flatten(), 0.99) < 1e-3
    assert _second_difference(rgb_to_lab(drifted), rows).abs().mean() > 0.1

    half = lab_lowband_transplant(drifted, reference, 0.5)
    mid = drift_at_input_scale(_to_uint8(half), ref8)
    for key in ("cast_r", "cast_g", "c_mean_change_pct", "l_std_change", "l_p95_change"):
        assert mid[key] == pytest.approx(before[key] / 2, rel=0.15, abs=0.05), (key, mid[key], before[key])


def test_stage2_zero_strength_is_clamp_only(synthetic_drift):
    reference, drifted = synthetic_drift
    out = drifted * 1.2 - 0.1
    assert torch.equal(lab_lowband_transplant(out, reference, 0.0), out.clamp(0, 1))


def test_stage2_strips_do_not_change_the_result(synthetic_drift):
    reference, drifted = synthetic_drift
    crop_ref, crop = reference[..., :24, :40], drifted[..., :96, :160]
    whole = lab_lowband_transplant(crop, crop_ref, 1.0)
    strips = lab_lowband_transplant(crop, crop_ref, 1.0, strip_pixels=160 * 12)
    torch.testing.assert_close(strips, whole, atol=1e-5, rtol=0)
    target = crop.clone()
    inplace = lab_lowband_transplant(target, crop_ref, 1.0, strip_pixels=160 * 12, inplace=True)
    assert inplace is target
    torch.testing.assert_close(inplace, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("iterations", [1, 2, 6])
def test_stage2_in_place_equals_a_new_tensor_bit_for_bit(synthetic_drift, iterations):
    """In place, stage 2 keeps f(clamp(output)) in the output's memory after its first corrected step and starts
    every later one from it (issue 47): the same values as converting the output at every step, to the bit,
    out-of-range pixels included, whatever the iterations and the strips."""
    reference, drifted = synthetic_drift
    out = (drifted[..., :96, :160] * 1.3 - 0.15).contiguous()
    ref = reference[..., :24, :40]
    fresh = lab_lowband_transplant(out, ref, 0.8, iterations, strip_pixels=160 * 12)
    target = out.clone()
    assert lab_lowband_transplant(target, ref, 0.8, iterations, strip_pixels=160 * 12, inplace=True) is target
    assert torch.equal(target, fresh)


def test_stage2_rejects_an_output_smaller_than_the_reference():
    with pytest.raises(ValueError, match="smaller than the reference"):
        lab_lowband_transplant(torch.rand(1, 3, 30, 40), torch.rand(1, 3, 32, 10))


def _exact_area(n_out: int, n_in: int) -> torch.Tensor:
    """An independent dense exact-area matrix: row j integrates [j r, (j + 1) r) of the input, r = n_in / n_out."""
    ratio = n_in / n_out
    rows = [
        [max(0.0, min(p + 1, (j + 1) * ratio) - max(p, j * ratio)) / ratio for p in range(n_in)] for j in range(n_out)
    ]
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("size", [(60, 90), (41, 61), (40, 61), (100, 150), (120, 170)])
def test_stage2_off_the_integer_ratios_pins_the_mean_and_the_low_band(size):
    # flowlift upscale --scale 1.5 / 3 / --size: the output is any size at or above the reference's. The cast must
    # go: after an exact area downsample back, the mean matches the reference within 0.1/255 (it was 0.15-0.2 off).
    from flowlift.upscale.colorfix import box_linear_tridiagonal, linear_matrix

    gen = torch.Generator().manual_seed(3)
    reference = F.avg_pool2d(F.pad(torch.rand(1, 3, 40, 60, generator=gen), (2, 2, 2, 2), mode="reflect"), 5, 1)
    output = F.interpolate(reference, size=size, mode="bicubic", antialias=True).clamp(0, 1)
    output = (0.8 * output + 0.15 + 0.05 * torch.rand(output.shape, generator=gen)).clamp(0, 1)
    result = lab_lowband_transplant(output, reference, strip_pixels=1000)  # several strips
    assert result.shape == output.shape and torch.isfinite(result).all()
    back = _exact_area(40, size[0]) @ result.double() @ _exact_area(60, size[1]).T
    assert (back - reference.double()).mean(dim=(0, 2, 3)).abs().max() * 255 <= 0.1
    assert (output.mean(dim=(0, 2, 3)) - reference.mean(dim=(0, 2, 3))).abs().max() * 255 > 10  # there was a cast
    # the solve's matrix is D U with D the exact area downsample (tridiagonal at every ratio >= 1)
    for n_coarse, n_fine in ((10, 15), (7, 10), (50, 103), (97, 101)):
        bands = box_linear_tridiagonal(n_coarse, n_fine)
        full = torch.diag(bands[:, 1]) + torch.diag(bands[1:, 0], -1) + torch.diag(bands[:-1, 2], 1)
        assert torch.allclose(full, _exact_area(n_coarse, n_fine) @ linear_matrix(n_fine, n_coarse), atol=1e-12)


@pytest.mark.parametrize("strength", [float("nan"), float("inf"), -0.5, 1.5])
def test_both_stages_refuse_a_strength_outside_0_1_nan_included(strength):
    # A NaN strength passed the `strength == 0` shortcut and turned every pixel NaN: a black image.
    with pytest.raises(FlowliftError, match=r"lab_lowband_transplant: strength must be a number in \[0, 1\]"):
        lab_lowband_transplant(torch.rand(1, 3, 16, 16), torch.rand(1, 3, 8, 8), strength)
    with pytest.raises(FlowliftError, match=r"latent_lowband_transplant: strength must be a number in \[0, 1\]"):
        latent_lowband_transplant(torch.rand(1, 32, 16, 16), torch.rand(1, 32, 8, 8), strength)


def test_stage2_conversions_equal_kornias():
    """colorfix_lab's sRGB <-> L*a*b* (white folded into the matrices, the correction added in f) is kornia's
    rgb_to_lab / lab_to_rgb(clip=True) to float32 rounding, both branches of every piecewise function included."""
    from kornia.color import lab_to_rgb as kornia_lab_to_rgb
    from kornia.color import rgb_to_lab as kornia_rgb_to_lab

    from flowlift.upscale.colorfix_lab import LabStep, lab_to_rgb, rgb_to_lab

    gen = torch.Generator().manual_seed(0)
    rgb = torch.rand(2, 3, 24, 20, generator=gen)
    rgb[0, :, :4] = torch.rand(3, 4, 20, generator=gen) * 0.02  # the linear branches (dark: below 0.04045)
    rgb[1, :, :2] = torch.tensor([0.0, 1.0, 0.5]).view(3, 1, 1)  # the gamut's corners
    lab = kornia_rgb_to_lab(rgb)
    assert (rgb_to_lab(rgb) - lab).abs().max() < 2e-4  # L*a*b* units (L in 0..100)
    shifted = lab + torch.randn(lab.shape, generator=gen) * torch.tensor([8.0, 20.0, 20.0]).view(1, 3, 1, 1)
    assert (lab_to_rgb(shifted.clone()) - kornia_lab_to_rgb(shifted, clip=True)).abs().max() < 2e-5
    # T(c) strip by strip (the correction upsampled in f per strip) against kornia on the whole frame
    coarse = torch.randn(2, 3, 6, 5, generator=gen) * 4
    up = F.interpolate(coarse, scale_factor=4, mode="bilinear", align_corners=False)
    expected = kornia_lab_to_rgb(kornia_rgb_to_lab(rgb) + up, clip=True)
    step = LabStep(coarse, 4, 4)
    strips = torch.cat([step(rgb, r0, min(24, r0 + 8)) for r0 in range(0, 24, 8)], dim=2)
    assert (strips - expected).abs().max() < 2e-5


def test_stage2_runs_in_one_cpu_thread_and_restores_the_count(monkeypatch):
    """Stage 2's element-wise strips run in one intra-op thread on the CPU (no barrier spinning on a shared
    machine); the caller's thread count is back afterwards, also when a strip callback raises."""
    import flowlift.upscale.colorfix_lab as colorfix_lab

    seen = []
    step = colorfix_lab.LabStep.__call__
    monkeypatch.setattr(
        colorfix_lab.LabStep, "__call__", lambda *a, **k: seen.append(torch.get_num_threads()) or step(*a, **k)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, ref = torch.rand(1, 3, 32, 32), torch.rand(1, 3, 8, 8)
        lab_lowband_transplant(out, ref)
        assert set(seen) == {1} and torch.get_num_threads() == 2

        def stop():
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            lab_lowband_transplant(out, ref, on_strip=stop)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)

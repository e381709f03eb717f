import math

import numpy as np
import pytest
import torch
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.measure import metrics as M


def _photo_like(h: int = 48, w: int = 64, seed: int = 0) -> np.ndarray:
    """A smooth colourful float image well inside (0, 1) so +-shifts do not clip."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / np.array([h, w])[:, None, None]
    img = np.stack([0.3 + 0.4 * x, 0.25 + 0.3 * y, 0.5 - 0.2 * x * y], axis=2)
    return np.clip(img + 0.02 * rng.standard_normal((h, w, 3)), 0.05, 0.95)


def test_constant_shift_gives_cast_and_keeps_chroma():
    ref = np.full((32, 40, 3), 0.5)
    out = ref + 5 / 255
    d = M.drift_at_input_scale(out, ref)
    for c in "rgb":
        assert d[f"cast_{c}"] == pytest.approx(5.0, abs=1e-9)
    assert d["cast_max"] == pytest.approx(5.0, abs=1e-9)
    # a grey shifted to a lighter grey stays achromatic: chroma unchanged
    assert abs(d["dC"]) < 1e-3 and abs(d["c_p99_change"]) < 1e-3
    assert d["c_mean_change_pct"] == 0.0  # grey reference: defined as 0
    assert d["l_std_change"] == pytest.approx(0.0, abs=1e-9)
    assert d["l_p5_change"] > 1.0 and d["l_p95_change"] == pytest.approx(d["l_p5_change"])
    assert d["psnr_input"] == pytest.approx(20 * math.log10(255 / 5), abs=1e-6)


def test_shift_on_colour_image_cast_and_identity():
    ref = _photo_like()
    shifted = ref + np.array([3, -2, 1]) / 255
    d = M.drift_at_input_scale(shifted, ref)
    assert [d["cast_r"], d["cast_g"], d["cast_b"]] == pytest.approx([3, -2, 1], abs=1e-9)
    assert d["cast_max"] == pytest.approx(3, abs=1e-9)
    same = M.drift_at_input_scale(ref, ref)
    assert all(same[k] == 0 for k in same if k != "psnr_input") and same["psnr_input"] == math.inf


def test_chroma_scaling_is_measured_in_lab():
    ref = _photo_like()
    lab = M.lab(ref)
    boosted = lab.copy()
    boosted[..., 1:] *= 1.10  # +10% chroma, same L
    from skimage.color import lab2rgb

    out = lab2rgb(boosted)
    d = M.drift_at_input_scale(out, ref)
    assert d["c_mean_change_pct"] == pytest.approx(10.0, abs=0.05)
    c = M.chroma(lab)
    assert d["dC"] == pytest.approx(0.10 * c.mean(), rel=5e-3)
    assert d["c_p99_change"] == pytest.approx(0.10 * np.percentile(c, 99), rel=5e-3)
    assert abs(d["l_std_change"]) < 0.02


def test_tone_stretch_changes_l_statistics():
    ref = _photo_like()
    lab = M.lab(ref)
    stretched = lab.copy()
    mean = lab[..., 0].mean()
    stretched[..., 0] = mean + 1.2 * (lab[..., 0] - mean)
    from skimage.color import lab2rgb

    d = M.drift_at_input_scale(lab2rgb(stretched), ref)
    l_r = lab[..., 0]
    assert d["l_std_change"] == pytest.approx(0.2 * l_r.std(), rel=1e-2)
    p5, p95 = np.percentile(l_r, [5, 95])
    assert d["l_p5_change"] == pytest.approx(0.2 * (p5 - mean), rel=1e-2)
    assert d["l_p95_change"] == pytest.approx(0.2 * (p95 - mean), rel=1e-2)


def test_drift_area_downsamples_the_output():
    ref = _photo_like(16, 24)
    # an exact 4x nearest upscale area-downsamples back to the reference
    up = np.repeat(np.repeat(ref, 4, axis=0), 4, axis=1)
    d = M.drift_at_input_scale(up, ref)
    assert d["psnr_input"] > 100 and abs(d["cast_r"]) < 1e-4
    # exactly: the blocks are the reference's pixels, so inf (a float32 downsample measured 159 dB)
    u8 = (ref * 255).round().astype(np.uint8)
    for factor in (2, 4, 8):
        blocks = np.repeat(np.repeat(u8, factor, axis=0), factor, axis=1)
        assert M.drift_at_input_scale(blocks, u8)["psnr_input"] == math.inf
    # a checkerboard of +-0.1 on the 4x output averages out at input scale
    checker = (np.indices(up.shape[:2]).sum(axis=0) % 2 * 2 - 1)[..., None] * 0.04
    d2 = M.drift_at_input_scale(up + checker, ref)
    assert d2["psnr_input"] > 100
    assert M.area_resize(up, (24, 16)).shape == (16, 24, 3)


def test_uint8_pil_and_tensor_inputs_agree():
    ref8 = (np.arange(20 * 30 * 3) % 251).astype(np.uint8).reshape(20, 30, 3)
    out8 = np.clip(ref8.astype(int) + 2, 0, 255).astype(np.uint8)
    d_np = M.drift_at_input_scale(out8, ref8)
    d_pil = M.drift_at_input_scale(Image.fromarray(out8), Image.fromarray(ref8))
    tensor = torch.from_numpy(out8).permute(2, 0, 1)[None].float() / 255
    d_t = M.drift_at_input_scale(tensor, ref8)
    for k in d_np:
        assert d_pil[k] == pytest.approx(d_np[k]) and d_t[k] == pytest.approx(d_np[k], abs=1e-4)


def test_psnr_of_known_noise():
    rng = np.random.default_rng(1)
    a = np.full((64, 64, 3), 0.5)
    signs = rng.choice([-1.0, 1.0], size=a.shape)
    b = a + 0.01 * signs  # every error exactly 0.01 -> mse 1e-4 -> 40 dB
    assert M.psnr(a, b) == pytest.approx(40.0, abs=1e-9)
    assert M.psnr(a, a) == math.inf
    with pytest.raises(FlowliftError):
        M.psnr(a, a[:10])


def test_ssim_and_fidelity():
    img = _photo_like(64, 64)
    assert M.ssim(img, img) == pytest.approx(1.0)
    rng = np.random.default_rng(2)
    noisy = np.clip(img + 0.1 * rng.standard_normal(img.shape), 0, 1)
    f = M.fidelity(noisy, img)
    assert 0 < f["ssim_gt"] < 0.9 and f["psnr_gt"] == pytest.approx(M.psnr(noisy, img))
    with pytest.raises(FlowliftError):
        M.ssim(img[:5, :5], img[:5, :5])


def test_laplacian_of_known_patterns():
    # checkerboard 0/1: each pixel's 4 neighbours are the opposite value -> |lap| = 4 * 255
    checker = (np.indices((16, 16)).sum(axis=0) % 2).astype(np.float64)
    img = np.repeat(checker[..., None], 3, axis=2)
    assert M.sharpness(img) == pytest.approx(4 * 255)
    assert M.hf_energy(img) == pytest.approx((4 * 255) ** 2)  # lap = +-1020, mean 0
    # a linear ramp has zero Laplacian everywhere except possibly reflected borders
    ramp = np.repeat(np.linspace(0, 1, 32)[None, :, None], 3, axis=2).repeat(8, axis=0)
    assert M.sharpness(ramp, box=(1, 1, 30, 6)) == pytest.approx(0, abs=1e-9)
    # a single bright pixel: lap = -4v at it, +v at its 4 neighbours
    dot = np.zeros((9, 9, 3))
    dot[4, 4] = 1.0
    lap = M.laplacian(dot)
    assert lap[4, 4] == pytest.approx(-4 * 255) and lap[3, 4] == pytest.approx(255)
    assert M.sharpness(dot) == pytest.approx(8 * 255 / 81)
    d = M.detail(img)
    assert set(d) == {"sharpness", "hf_energy"}


def test_grey_levels_of_quantized_gradient():
    ramp = np.linspace(0, 1, 200)
    for n in (4, 17):
        q = np.round(ramp * (n - 1)) / (n - 1)
        img = np.repeat(np.repeat(q[None, :, None], 3, axis=2), 10, axis=0)
        levels, sigma = M.grey_levels(img)
        assert levels == n
        assert sigma == pytest.approx(np.rint(q * 255).std())
    # box: a flat patch has one level and sigma 0
    img = np.repeat(np.repeat(ramp[None, :, None], 3, axis=2), 10, axis=0)
    img[:, :50] = 0.3
    assert M.grey_levels(img, box=(0, 0, 50, 10)) == (1, 0.0)
    assert M.grey_levels(img)[0] > 100
    d = M.detail(img, box=(0, 0, 50, 10))
    assert d["levels"] == 1 and d["grey_sigma"] == 0.0
    with pytest.raises(FlowliftError, match="not inside"):
        M.grey_levels(img, box=(190, 0, 20, 5))


def test_pixel_agreement():
    a = np.zeros((10, 10, 3), dtype=np.uint8)
    b = a.copy()
    b[0, :5] = [3, 0, 0]  # 5 of 100 pixels differ, in one channel by 3
    r = M.pixel_agreement(a, b)
    assert r["identical_pct"] == pytest.approx(95.0)
    assert r["l1"] == pytest.approx(5 * 3 / 300)
    same = M.pixel_agreement(a, a.astype(np.float64) / 255)
    assert same == {"l1": 0.0, "identical_pct": 100.0}
    with pytest.raises(FlowliftError):
        M.pixel_agreement(a, a[:5])


def test_bad_inputs_raise_one_line_errors():
    with pytest.raises(FlowliftError, match="RGB"):
        M.drift_at_input_scale(np.zeros((4, 4)), np.zeros((4, 4, 3)))
    with pytest.raises(FlowliftError, match="NaN"):
        M.as_float_rgb(np.full((4, 4, 3), np.nan))
    with pytest.raises(FlowliftError, match="batch"):
        M.as_float_rgb(torch.zeros(2, 3, 4, 4))


@pytest.mark.parametrize("shave", [2.5, "2", True, -1, None])
def test_a_shave_that_is_no_whole_number_of_pixels_is_refused_by_name(shave):
    """``shave=2.5`` was cut to 2, ``"2"`` and ``True`` read as 2 and 1: a PSNR-Y over another border than asked."""
    img = np.random.default_rng(0).random((32, 32, 3))
    for metric in (M.psnr_y, M.ssim_y):
        with pytest.raises(FlowliftError, match=r"^shave must be an integer >= 0 \(px\)") as caught:
            metric(img, img, shave)
        assert caught.value.fields == ("shave",)
    with pytest.raises(FlowliftError, match="^shave must be"):
        M.fidelity(img, img, shave=shave)
    assert M.psnr_y(img, img, np.int64(2)) == M.psnr_y(img, img, 2)  # numpy's integers are integers


@pytest.mark.parametrize("box", ["x", "0,0,8,8", (0, 0, 8), (0, 0, 8.5, 8), (0, -1, 8, 8)])
def test_a_box_that_is_no_box_is_refused_by_name(box):
    """``box="x"`` was a ValueError from ``int()``, ``(0, 0, 8.5, 8)`` a crop of 8 px: the request's rule
    (:func:`flowlift.measure.metrics.check_box`) holds at every metric that takes a box."""
    img = np.random.default_rng(0).random((32, 32, 3))
    for metric in (M.sharpness, M.hf_energy, M.grey_levels, M.detail):
        with pytest.raises(FlowliftError, match="^box must be x,y,w,h") as caught:
            metric(img, box=box)
        assert caught.value.fields == ("box",)


@pytest.mark.parametrize("size", [(16.7, 16), ("16", 16), (True, 16), (0, 0), (-16, 16), (16,), 16, (16, 16, 3), None])
def test_a_size_that_is_no_width_and_height_is_refused_by_name(size):
    """``(16.7, 16)`` was cut to 16 px, ``("16", 16)`` and ``(16, 16, 3)`` taken; ``(0, 0)``, ``(-16, 16)``,
    ``(16,)`` and ``16`` escaped as ZeroDivisionError, cv2.error, IndexError and TypeError."""
    img = np.random.default_rng(0).random((32, 32, 3))
    with pytest.raises(FlowliftError, match=r"^size must be \(width, height\): two integers in \[1, 16384\]") as hit:
        M.area_resize(img, size)
    assert hit.value.fields == ("size",)


def test_area_resize_takes_width_then_height_and_numpy_integers():
    img = np.random.default_rng(0).random((32, 48, 3))
    assert M.area_resize(img, (np.int64(24), 16)).shape == (16, 24, 3)
    assert M.area_resize(img, [12, 8]).shape == (8, 12, 3)
    with pytest.raises(FlowliftError, match="^size must be"):
        M.area_resize(img, (10**9, 10**9))  # was cv2.error: insufficient memory

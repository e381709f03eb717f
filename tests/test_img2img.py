import pytest
import torch

from flowlift.flux2.img2img import InpaintMerger, denoise, gaussian_flow_velocity, prepare_start_latents
from flowlift.flux2.latents import bn_std as make_bn_std
from flowlift.flux2.latents import denormalize, normalize, seeded_noise
from flowlift.flux2.schedule import DEFAULT_MU, flux2_sigmas

# BN statistics shaped like the real FLUX.2 VAE's: running_var 2.91...3.47 -> bn_std ~1.77.
BN_MEAN = torch.linspace(-0.4, 0.3, 128)
BN_STD = make_bn_std(torch.linspace(2.91, 3.47, 128), 1e-4)


def _raw_init(shape=(2, 32, 16, 16), seed=1):
    return seeded_noise(shape, seed) * 2.0 + 0.5


@pytest.mark.parametrize("t0", [0.2, 0.5, 0.85, 1.0])
def test_noise_keeps_unit_scale(t0):
    init = _raw_init((4, 32, 32, 32))
    noise = seeded_noise(init.shape, 2)
    start = prepare_start_latents(init, noise, t0, BN_MEAN, BN_STD)
    noise_term = start - (1 - t0) * normalize(init, BN_MEAN, BN_STD)
    assert torch.allclose(noise_term, t0 * noise, atol=1e-5)
    assert noise_term.std().item() == pytest.approx(t0, rel=0.02)


@pytest.mark.parametrize("t0", [0.2, 0.5, 0.85, 1.0])
def test_differs_from_normalizing_the_raw_mixture_by_exactly_the_noise_rescale(t0):
    init = _raw_init()
    noise = seeded_noise(init.shape, 3)
    correct = prepare_start_latents(init, noise, t0, BN_MEAN, BN_STD)
    buggy = normalize(t0 * noise + (1 - t0) * init, BN_MEAN, BN_STD)
    expected_gap = t0 * (noise - normalize(noise, BN_MEAN, BN_STD))
    assert torch.allclose(correct - buggy, expected_gap, atol=1e-5)
    assert (correct - buggy).abs().max() > 0.1 * t0


def test_add_noise_false_and_no_bn_fallback():
    init = _raw_init()
    noise = seeded_noise(init.shape, 4)
    assert torch.allclose(
        prepare_start_latents(init, noise, 0.7, BN_MEAN, BN_STD, add_noise=False), normalize(init, BN_MEAN, BN_STD)
    )
    assert torch.equal(prepare_start_latents(init, noise, 0.7), 0.7 * noise + 0.3 * init)
    assert torch.equal(prepare_start_latents(init, noise, 0.7, add_noise=False), init)
    with pytest.raises(ValueError):
        prepare_start_latents(init, noise, 0.7, bn_mean=BN_MEAN)


def test_128_channel_patchified_init_latents():
    from flowlift.flux2.latents import patchify

    init = _raw_init()
    noise = seeded_noise(init.shape, 5)
    a = prepare_start_latents(init, noise, 0.4, BN_MEAN, BN_STD)
    b = prepare_start_latents(patchify(init), patchify(noise), 0.4, BN_MEAN, BN_STD)
    assert torch.allclose(patchify(a), b, atol=1e-6)


# --- the analytic oracle: posterization measured without weights ------------------------------
DATA_MEAN, DATA_STD = 0.3, 0.8
# Above 4300 tokens the empirical mu does not depend on the step count; below, diffusers' interpolation
# in the step count extrapolates below 0 at thousands of steps (refused). The fixed mu has no such limit.
SEQ_LEN = 16384  # a 2048 px image


def _oracle_img2img(strength, start_builder, steps=2000, seed=0, mu=DEFAULT_MU, schedule="respaced"):
    """img2img of Gaussian 'images' with the exact velocity; returns the output latents."""
    shape = (1, 32, 32, 32)
    clean_normalized = DATA_MEAN + DATA_STD * seeded_noise(shape, seed)
    init_raw = denormalize(clean_normalized, BN_MEAN, BN_STD)
    noise = seeded_noise(shape, seed + 1000)
    sigmas = flux2_sigmas(steps, SEQ_LEN, denoising_start=1.0 - strength, mu=mu, schedule=schedule)
    x = start_builder(init_raw, noise, float(sigmas[0]))
    return denoise(lambda z, s: gaussian_flow_velocity(z, s, DATA_MEAN, DATA_STD), x, sigmas)


def _correct(init_raw, noise, t0):
    return prepare_start_latents(init_raw, noise, t0, BN_MEAN, BN_STD)


def _buggy(init_raw, noise, t0):
    return normalize(t0 * noise + (1 - t0) * init_raw, BN_MEAN, BN_STD)


@pytest.mark.parametrize("schedule", ["respaced", "clipped"])
@pytest.mark.parametrize("mu", [DEFAULT_MU, "empirical"])
def test_oracle_correct_start_keeps_the_data_distribution_at_every_strength(mu, schedule):
    for strength in (0.3, 0.5, 0.75, 1.0):
        out = _oracle_img2img(strength, _correct, mu=mu, schedule=schedule)
        assert out.mean().item() == pytest.approx(DATA_MEAN, abs=0.02), strength
        assert out.std().item() == pytest.approx(DATA_STD, abs=0.015), strength


def test_oracle_buggy_raw_space_blend_collapses_variance_worse_with_strength():
    stds = [_oracle_img2img(strength, _buggy).std().item() for strength in (0.3, 0.5, 0.75, 1.0)]
    # Measured: 0.74 / 0.61 / 0.48 / 0.45 against the data's 0.80.
    assert stds[0] < DATA_STD - 0.03
    assert stds[-1] < 0.5
    assert all(b < a + 1e-3 for a, b in zip(stds, stds[1:], strict=False))


@pytest.mark.parametrize("mu", [DEFAULT_MU, "empirical"])
def test_strength_one_is_txt2img_bit_for_bit(mu):
    shape = (1, 32, 16, 16)
    init_raw = _raw_init(shape)
    noise = seeded_noise(shape, 9)
    sigmas = flux2_sigmas(9, 64, denoising_start=0.0, mu=mu)  # the img2img window, respaced by default

    def velocity(x, s):
        return gaussian_flow_velocity(x, s, DATA_MEAN, DATA_STD)

    txt2img = denoise(velocity, noise.clone(), flux2_sigmas(9, 64, mu=mu, schedule="clipped"))
    img2img = denoise(velocity, prepare_start_latents(init_raw, noise, float(sigmas[0]), BN_MEAN, BN_STD), sigmas)
    assert torch.equal(txt2img, img2img)


def _square_hole(init_seed: int, noise_seed: int):
    """Seeded (1, 32, 8, 8) init and noise latents, a mask open over [2:6, 2:6], and their InpaintMerger."""
    shape = (1, 32, 8, 8)
    init, noise = seeded_noise(shape, init_seed), seeded_noise(shape, noise_seed)
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., 2:6, 2:6] = 1
    return init, noise, mask, InpaintMerger(init, mask, noise)


def test_inpaint_merge_keeps_known_region_on_the_trajectory_and_exact_at_the_end():
    init, noise, mask, merger = _square_hole(11, 12)
    x = seeded_noise(init.shape, 13)
    merged = merger.merge(x, 0.4)
    assert torch.equal(merged[..., 2:6, 2:6], x[..., 2:6, 2:6])
    assert torch.allclose(merged[..., 0, :], (0.4 * noise + 0.6 * init)[..., 0, :])
    sigmas = flux2_sigmas(6, 16, denoising_start=0.3)
    out = denoise(lambda z, s: gaussian_flow_velocity(z, s, 0.0, 1.0), 0.7 * noise + 0.3 * init, sigmas, merger)
    outside = mask.expand_as(out) == 0
    assert torch.equal(out[outside], init[outside])


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_heun_corrector_input_is_merged(sampler):
    """Every model call -- Euler's, Heun's predictor and corrector -- sees the kept region at
    ``sigma * noise + (1 - sigma) * init`` (Heun's corrector input used to be the unmerged Euler guess)."""
    init, noise, mask, merger = _square_hole(31, 32)
    sigmas = flux2_sigmas(20, 16, denoising_start=0.3)
    steps = len(sigmas) - 1
    assert steps >= 3
    calls = []

    def velocity(z, s):
        calls.append((z.clone(), s))
        return gaussian_flow_velocity(z, s, 0.5, 2.0)  # far from the init's statistics: off-trajectory shows

    start = float(sigmas[0])
    denoise(velocity, start * noise + (1 - start) * init, sigmas, merger, sampler=sampler)
    kept = mask.expand(init.shape) == 0
    assert len(calls) == (steps if sampler == "euler" else 2 * steps - 1)
    for z, s in calls:
        expected = s * noise + (1 - s) * init
        torch.testing.assert_close(z[kept], expected[kept], atol=1e-6, rtol=0)


def test_heun_differs_from_euler_and_is_more_accurate():
    shape = (1, 32, 32, 32)
    noise = seeded_noise(shape, 21)
    sigmas = flux2_sigmas(8, SEQ_LEN)

    def velocity(x, s):
        return gaussian_flow_velocity(x, s, DATA_MEAN, DATA_STD)

    reference = denoise(velocity, noise, flux2_sigmas(3000, SEQ_LEN))
    euler = denoise(velocity, noise, sigmas, sampler="euler")
    heun = denoise(velocity, noise, sigmas, sampler="heun")
    assert not torch.equal(euler, heun)
    assert (heun - reference).abs().mean() < (euler - reference).abs().mean()
    with pytest.raises(ValueError):
        denoise(velocity, noise, sigmas, sampler="dpm")


def test_callback_sees_every_step():
    seen = []
    denoise(lambda z, s: z * 0, torch.zeros(1), [1.0, 0.5, 0.0], callback=lambda i, s, sn, x: seen.append((i, s, sn)))
    assert seen == [(0, 1.0, 0.5), (1, 0.5, 0.0)]

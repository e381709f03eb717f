"""img2img / inpaint / outpaint / hires wiring on tiny random diffusers FLUX.2 components.

The real model cannot run here, so these tests pin the *wiring*: the exact sigmas and timesteps the
transformer sees, the exact start latents, the inpaint merge noise, the sampler, and the endpoints.
Each one-line breakage listed in docs/refine.md makes at least one of them fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.img2img import gaussian_flow_velocity
from flowlift.flux2.latents import denormalize, normalize, pack, patchify, unpack, unpatchify
from flowlift.refine.canvas import latent_mask
from flowlift.refine.loop import denoising_start_for, latent_noise, refine_latents
from flowlift.refine.refiner import Flux2Refiner
from flowlift.refine.request import HiresSettings
from flowlift.refine.settings import SamplingSettings
from tiny_flux2 import AsUpscaler, Spy, prompt_embeds, tiny_transformer, tiny_vae
from tiny_flux2 import DiffusersHelpers as P

H, W = 64, 96  # 8x12 latents, 4x6 = 24 tokens


@pytest.fixture(scope="module")
def vae():
    from flowlift.models.vae_loading import load_vae

    return load_vae(tiny_vae(), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def transformer():
    return tiny_transformer()


@pytest.fixture
def spy(transformer):
    return Spy(transformer)


@pytest.fixture
def refiner(spy, vae):
    return Flux2Refiner(spy, vae, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def image():
    y, x = torch.meshgrid(torch.linspace(0, 1, H), torch.linspace(0, 1, W), indexing="ij")
    g = torch.Generator().manual_seed(7)
    img = torch.stack([x, y, 0.5 * (x + y)])[None] * 0.8 + 0.2 * torch.rand(1, 3, H, W, generator=g)
    return img.clamp(0, 1)


EMB = prompt_embeds()


# --------------------------------------------------------------------------- independent references


def _mu(seq: int, steps: int) -> float:
    """diffusers 0.42.1 ``compute_empirical_mu`` (pipeline_flux2.py), transcribed."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if seq > 4300:
        return float(a2 * seq + b2)
    m_200, m_10 = a2 * seq + b2, a1 * seq + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def _scheduler_sigmas(steps: int, seq: int) -> list[float]:
    """The full shifted schedule of diffusers' FlowMatchEulerDiscreteScheduler (as Flux2Pipeline sets it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=_mu(seq, steps))
    return [float(s) for s in sched.sigmas]


def _expected_sigmas(steps: int, seq: int, denoising_start: float) -> list[float]:
    """Full shifted schedule (mu from the FULL step count), then clipped to start at 1 - denoising_start."""
    t0 = 1.0 - denoising_start
    full = _scheduler_sigmas(steps, seq)
    return [t0] + [s for s in full if 0.0 < s < t0 - 1e-7] + [0.0]


def _tokens_to_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    return unpatchify(unpack(tokens[:, : (h // 2) * (w // 2)], h // 2, w // 2))


def _model_inputs(spy: Spy, h: int = H // 8, w: int = W // 8) -> list[torch.Tensor]:
    return [_tokens_to_latents(call["hidden_states"], h, w) for call in spy.seen]


# --------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("strength,strength_map", [(0.6, "linear"), (0.5, "canvas"), (1.0, "linear")])
def test_img2img_runs_shifted_full_mu_schedule_with_sigma_timesteps(refiner, spy, image, strength, strength_map):
    """diffusers parity: with ``mu="empirical"`` and ``schedule="clipped"`` img2img runs the diffusers
    scheduler's own sigmas below t0."""
    steps = 9
    out = refiner.img2img(
        image,
        strength=strength,
        strength_map=strength_map,
        sampling=SamplingSettings(steps=steps, seed=3, mu="empirical", schedule="clipped"),
        prompt_embeds=EMB,
    )
    ds = denoising_start_for(strength, strength_map)
    assert ds == pytest.approx(1 - strength if strength_map == "linear" else 1 - strength**0.2)
    expected = _expected_sigmas(steps, (H // 16) * (W // 16), ds)
    np.testing.assert_allclose(out.parameters["sigmas"], expected, atol=2e-6)
    # the transformer is called once per Euler step, with timestep = sigma in [0, 1] (never sigma*1000)
    seen = [float(call["timestep"][0]) for call in spy.seen]
    np.testing.assert_allclose(seen, expected[:-1], atol=2e-6)
    assert max(seen) <= 1.0
    if strength < 1:
        linear = np.linspace(1 - ds, 0, len(expected))
        assert np.abs(np.array(expected) - linear).max() > 0.05  # shifted, not the linear ramp


def test_mu_comes_from_full_schedule_not_the_clipped_one():
    seq, steps, ds = 24, 12, 0.55
    expected = _expected_sigmas(steps, seq, ds)
    n_clipped = len(expected) - 1
    wrong_full = _scheduler_sigmas(n_clipped, seq)  # what a mu from the clipped step count gives
    assert _mu(seq, steps) != pytest.approx(_mu(seq, n_clipped))
    res = refine_latents(
        lambda x, s: torch.zeros_like(x),
        init_latents=torch.zeros(1, 32, 8, 12),
        denoising_start=ds,
        sampling=SamplingSettings(steps=steps, mu="empirical", schedule="clipped"),
    )
    np.testing.assert_allclose(res.sigmas, expected, atol=2e-6)
    clipped_wrong = [1 - ds] + [s for s in wrong_full if 0 < s < 1 - ds] + [0.0]
    assert len(clipped_wrong) != len(res.sigmas) or not np.allclose(res.sigmas, clipped_wrong, atol=1e-4)


def test_start_latents_normalize_only_the_init_and_keep_unit_noise(refiner, spy, vae, image):
    assert float(vae.bn_std.mean()) > 1.7  # FLUX.2-like: dividing noise by bn_std would be a big error
    out = refiner.img2img(image, strength=0.7, sampling=SamplingSettings(steps=6, seed=11), prompt_embeds=EMB)
    t0 = out.parameters["t0"]
    assert t0 == pytest.approx(0.7)
    noise = latent_noise((1, 32, H // 8, W // 8), 11)
    init = normalize(vae.encode_raw(image), vae.bn_mean, vae.bn_std)
    first = _model_inputs(spy)[0]
    torch.testing.assert_close(first, t0 * noise + (1 - t0) * init, rtol=0, atol=1e-5)
    # the noise part of the start latents has unit scale
    recovered = (first - (1 - t0) * init) / t0
    assert recovered.std().item() == pytest.approx(1.0, abs=0.08)


@pytest.mark.parametrize("mu", [2.02, "empirical"])
def test_strength_one_is_txt2img_bit_for_bit(refiner, spy, image, mu):
    sampling = SamplingSettings(steps=5, seed=21, mu=mu)  # respaced: the default
    a = refiner.img2img(image, strength=1.0, sampling=sampling, prompt_embeds=EMB)
    b = refiner.txt2img(height=H, width=W, sampling=sampling, prompt_embeds=EMB)
    assert torch.equal(a.latents, b.latents)
    assert torch.equal(a.images, b.images)
    assert a.parameters["sigmas"] == b.parameters["sigmas"] and len(b.parameters["sigmas"]) == 6
    c = refiner.img2img(
        image,
        strength=1.0,
        strength_map="canvas",
        sampling=SamplingSettings(steps=5, seed=21, mu=mu),
        prompt_embeds=EMB,
    )
    assert torch.equal(c.latents, b.latents)


def test_strength_zero_returns_the_vae_round_trip(refiner, spy, vae, image):
    out = refiner.img2img(image, strength=0.0, sampling=SamplingSettings(steps=5, seed=1), prompt_embeds=EMB)
    assert spy.seen == []
    assert torch.equal(out.images, vae.decode(vae.encode(image)).clamp(0, 1))


def test_heun_is_honoured_in_img2img_and_inpaint(refiner, spy, image):
    mask = torch.zeros(1, 1, H, W)
    mask[..., 16:48, 32:80] = 1
    for kwargs in ({}, {"mask": mask}):
        spy.seen.clear()
        euler = refiner.img2img(
            image,
            strength=0.8,
            sampling=SamplingSettings(steps=6, seed=2, sampler="euler"),
            prompt_embeds=EMB,
            **kwargs,
        )
        n = len(euler.parameters["sigmas"]) - 1
        assert len(spy.seen) == n
        spy.seen.clear()
        heun = refiner.img2img(
            image, strength=0.8, sampling=SamplingSettings(steps=6, seed=2, sampler="heun"), prompt_embeds=EMB, **kwargs
        )
        assert heun.parameters["sigmas"] == euler.parameters["sigmas"]  # same shifted, clipped schedule
        assert len(spy.seen) == 2 * n - 1  # Heun: two evaluations per step, Euler on the last step to 0
        assert heun.parameters["sampler"] == "heun"
        assert not torch.allclose(heun.latents, euler.latents, atol=1e-4)
    with pytest.raises(FlowliftError, match="sampler must be one of euler, heun"):
        refiner.img2img(image, strength=0.5, sampling=SamplingSettings(sampler="dpm++"), prompt_embeds=EMB)


def test_inpaint_merge_uses_the_start_noise(refiner, spy, vae, image):
    mask = torch.zeros(1, 1, H, W)
    mask[..., 8:40, 24:72] = 1.0
    out = refiner.inpaint(image, mask, strength=0.85, sampling=SamplingSettings(steps=7, seed=5), prompt_embeds=EMB)
    sigmas = out.parameters["sigmas"]
    noise = latent_noise((1, 32, H // 8, W // 8), 5)
    init = vae.encode(image)
    keep = latent_mask(mask) == 0
    assert keep.any() and (~keep).any()
    inputs = _model_inputs(spy)
    assert len(inputs) == len(sigmas) - 1
    for x, sigma in zip(inputs, sigmas[:-1], strict=True):
        expected = sigma * noise + (1 - sigma) * init  # same seed, same unit scale as the start latents
        torch.testing.assert_close(x[keep.expand_as(x)], expected[keep.expand_as(x)], rtol=0, atol=1e-5)
    # at the end the kept region is the init latents exactly; the masked region was regenerated
    final = out.latents
    assert torch.equal(final[keep.expand_as(final)], init[keep.expand_as(init)])
    assert not torch.allclose(final[~keep.expand_as(final)], init[~keep.expand_as(init)], atol=1e-2)


def test_outpaint_keeps_the_original_latents_exactly(refiner, spy, vae, image):
    out = refiner.outpaint(
        image, left=16, right=10, bottom=16, sampling=SamplingSettings(steps=4, seed=9), prompt_embeds=EMB
    )
    p = out.parameters
    assert (p["left"], p["top"], p["right"], p["bottom"]) == (16, 0, 16, 16)  # rounded up to 16 px
    assert out.images.shape == (1, 3, H + 16, W + 32)
    original = vae.encode(image)
    region = out.latents[:, :, 0 : H // 8, 2 : 2 + W // 8]
    assert torch.equal(region, original)
    border = out.latents[:, :, H // 8 :, :]
    canvas = vae.encode(torch.nn.functional.pad(image, (16, 16, 0, 16), mode="replicate"))
    assert not torch.allclose(border, canvas[:, :, H // 8 :, :], atol=1e-2)
    with pytest.raises(FlowliftError, match="multiples of 16"):
        refiner.outpaint(image[..., :40, :], left=16, prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="border"):
        refiner.outpaint(image, prompt_embeds=EMB)


def test_txt2img_matches_the_diffusers_klein_loop(refiner, transformer):
    """flowlift txt2img == Flux2KleinPipeline's denoising loop (scheduler, noise, ids, timestep/1000)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.utils.torch_utils import randn_tensor

    steps, seed = 6, 123
    out = refiner.txt2img(
        height=H, width=W, sampling=SamplingSettings(steps=steps, seed=seed, mu="empirical"), prompt_embeds=EMB
    )

    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    shape = (1, 128, H // 16, W // 16)
    latents = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    ids = P._prepare_latent_ids(latents)
    latents = P._pack_latents(latents)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=_mu(latents.shape[1], steps))
    sched.set_begin_index(0)
    for t in sched.timesteps:
        noise_pred = transformer(
            hidden_states=latents,
            timestep=t.expand(1) / 1000,
            guidance=None,
            encoder_hidden_states=EMB,
            txt_ids=P._prepare_text_ids(EMB),
            img_ids=ids,
            return_dict=False,
        )[0]
        latents = sched.step(noise_pred, t, latents, return_dict=False)[0]
    reference = unpatchify(latents.permute(0, 2, 1).reshape(shape))
    torch.testing.assert_close(out.latents, reference, rtol=0, atol=2e-5)


@pytest.mark.parametrize("mu", [2.02, "empirical"])
def test_gaussian_oracle_keeps_data_variance_at_every_strength(mu):
    """End to end through refine_latents with the exact Gaussian velocity as a stand-in transformer.

    Data N(0.3, 0.8^2) in normalized space, FLUX.2-like BN stats (bn_std 1.77), raw init latents as
    the VAE emits them. The pipeline's img2img keeps mean and std at every strength, under the fixed
    and the empirical mu; the buggy raw-space blend (noise / bn_std) collapses the variance, more with
    strength.
    """
    import flowlift.flux2.img2img as img2img_module

    mean, std = 0.3, 0.8
    g = torch.Generator().manual_seed(0)
    data = mean + std * torch.randn(1, 32, 32, 32, generator=g)
    bn_mean, bn_std = 0.5 * torch.randn(128, generator=g), torch.full((128,), 1.77)
    raw = denormalize(data, bn_mean, bn_std)

    def velocity(x, sigma):
        return gaussian_flow_velocity(x, sigma, mean, std)

    def run(strength, sampler="heun", steps=100):
        return refine_latents(
            velocity,
            init_latents=raw,
            bn_mean=bn_mean,
            bn_std=bn_std,
            denoising_start=1 - strength,
            sampling=SamplingSettings(steps=steps, seed=1, sampler=sampler, mu=mu),
        ).latents

    for strength in (0.3, 0.5, 0.75, 1.0):
        out = run(strength)
        assert out.mean().item() == pytest.approx(mean, abs=0.02), strength
        assert out.std().item() == pytest.approx(std, abs=0.015), strength
    # 200 steps: at 256 tokens the empirical mu extrapolates below 0 past ~260 steps (refused)
    assert run(0.5, "euler", 200).std().item() == pytest.approx(std, abs=0.015)

    # the posterization bug, measured: blend in raw space, normalize the mixture
    def buggy(init_latents, noise, t0, bn_mean=None, bn_std=None, add_noise=True):
        return normalize(t0 * noise + (1 - t0) * init_latents, bn_mean, bn_std)

    original = img2img_module.prepare_start_latents
    img2img_module.prepare_start_latents = buggy
    try:
        stds = [run(s).std().item() for s in (0.5, 1.0)]
    finally:
        img2img_module.prepare_start_latents = original
    assert stds[0] < std - 0.1 and stds[1] < stds[0]


def test_cfg_and_reference_images_reach_the_model(refiner, spy, vae, image):
    neg = prompt_embeds(tokens=3, seed=4)
    refiner.img2img(
        image,
        strength=0.5,
        sampling=SamplingSettings(steps=4, seed=0),
        prompt_embeds=EMB,
        negative_prompt_embeds=neg,
        cfg_scale=3.0,
    )
    encoders = [call["encoder_hidden_states"].shape[1] for call in spy.seen]
    assert encoders[:2] == [5, 3] and len(encoders) == 2 * (len(encoders) // 2)
    spy.seen.clear()
    ref = image[..., :32, :48]
    out = refiner.img2img(
        image, strength=0.5, sampling=SamplingSettings(steps=4, seed=0), prompt_embeds=EMB, reference_images=[ref]
    )
    call = spy.seen[0]
    n = (H // 16) * (W // 16)
    assert call["hidden_states"].shape[1] == n + 2 * 3
    assert call["img_ids"][n:, 0].tolist() == [10] * 6
    torch.testing.assert_close(call["hidden_states"][:, n:], pack(patchify(vae.encode(ref))))  # clean, no noise
    assert out.parameters["reference_images"] == 1


def test_hires_chain_upscales_then_refines_at_low_strength(refiner, spy, vae, image):
    calls = []

    def upscale(latents):
        calls.append(latents.shape)
        return torch.nn.functional.interpolate(latents, scale_factor=2, mode="nearest")

    out = refiner.hires(
        AsUpscaler(upscale),
        HiresSettings(scale=2, refine_strength=0.3),
        images=image,
        sampling=SamplingSettings(steps=10, seed=4, mu="empirical", schedule="clipped"),
        prompt_embeds=EMB,
    )
    assert calls == [(1, 32, H // 8, W // 8)]
    assert out.images.shape == (1, 3, 2 * H, 2 * W)
    expected = _expected_sigmas(10, (H // 8) * (W // 8), 0.7)
    np.testing.assert_allclose(out.parameters["sigmas"], expected, atol=2e-6)
    assert [float(c["timestep"][0]) for c in spy.seen] == pytest.approx(expected[:-1], abs=2e-6)
    # the refine pass starts from the upscaled latents with unit noise at t0 = 0.3
    up = upscale(vae.encode(image))
    noise = latent_noise(up.shape, 4)
    first = _model_inputs(spy, 2 * H // 8, 2 * W // 8)[0]
    torch.testing.assert_close(first, 0.3 * noise + 0.7 * up, rtol=0, atol=1e-5)
    with pytest.raises(FlowliftError, match="upscaler returned"):
        refiner.hires(
            AsUpscaler(lambda z: z),
            HiresSettings(scale=2, refine_strength=0.3),
            images=image,
            sampling=SamplingSettings(steps=2),
            prompt_embeds=EMB,
        )


def test_hires_from_txt2img(refiner, spy):
    out = refiner.hires(
        AsUpscaler(lambda z: torch.nn.functional.interpolate(z, scale_factor=2, mode="bilinear")),
        HiresSettings(base_size=(32, 32), base_steps=3, refine_strength=0.25),
        sampling=SamplingSettings(steps=8, seed=0),
        prompt_embeds=EMB,
    )
    assert out.images.shape == (1, 3, 64, 64)
    assert out.parameters["base"] == "txt2img" and out.parameters["base_steps"] == 3
    assert len(spy.seen) == 3 + len(out.parameters["sigmas"]) - 1


def test_odd_sizes_are_padded_and_cropped_back(refiner, image):
    img = image[..., :50, :70]
    out = refiner.img2img(img, strength=0.4, sampling=SamplingSettings(steps=3, seed=0), prompt_embeds=EMB)
    assert out.images.shape == (1, 3, 50, 70)
    assert out.latents.shape == (1, 32, 8, 10)


def test_bad_inputs(refiner, image):
    with pytest.raises(FlowliftError, match="strength"):
        refiner.img2img(image, strength=1.5, prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="strength_map"):
        refiner.img2img(image, strength=0.5, strength_map="cubic", prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="mask size"):
        refiner.img2img(image, strength=0.5, mask=torch.ones(1, 1, 8, 8), prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="prompt"):
        refiner.img2img(image, strength=0.5)
    with pytest.raises(FlowliftError, match="^height must be a multiple of 16 px"):
        refiner.txt2img(height=40, width=64, prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="steps"):
        refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=0), prompt_embeds=EMB)
    assert math.isclose(denoising_start_for(0.5, "canvas"), 1 - 0.5**0.2)


def test_bfloat16_transformer_with_float32_sampling(transformer, vae, image):
    """The transformer runs in its own dtype; latents, noise, merge and schedule stay float32."""
    import copy

    spy = Spy(copy.deepcopy(transformer))
    refiner = Flux2Refiner(spy, vae, device="cpu", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, H, W)
    mask[..., :32, :] = 1
    out = refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=4, seed=0), mask=mask, prompt_embeds=EMB)
    assert spy.seen[0]["hidden_states"].dtype == torch.bfloat16
    assert spy.seen[0]["timestep"].dtype == torch.bfloat16
    assert out.latents.dtype == torch.float32 and out.images.dtype == torch.float32
    assert torch.isfinite(out.images).all()
    keep = (latent_mask(mask) == 0).expand_as(out.latents)
    assert torch.equal(out.latents[keep], vae.encode(image)[keep])


def test_prompt_text_goes_through_the_prompt_encoder(transformer, vae, image):
    seen = []

    def encoder(text):
        seen.append(text)
        return prompt_embeds(seed=len(seen))

    refiner = Flux2Refiner(Spy(transformer), vae, prompt_encoder=encoder)
    out = refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=3), prompt="a cat", cfg_scale=2.0)
    assert seen == ["a cat", ""]  # the negative prompt defaults to the empty prompt under CFG
    assert out.parameters["prompt"] == "a cat" and out.parameters["negative_prompt"] == ""
    seen.clear()
    refiner.img2img(
        image, strength=0.5, sampling=SamplingSettings(steps=3), prompt="a cat", negative_prompt="blur", cfg_scale=2.0
    )
    assert seen == ["a cat", "blur"]
    seen.clear()
    refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=3), prompt="ignored", prompt_embeds=EMB)
    assert seen == []  # given embeddings win; no encoder call


# ------------------------------------------------------------------- schedule: mu and respaced windows


def _flux2_sigmas(steps, seq, start, **kwargs):
    from flowlift.flux2.schedule import flux2_sigmas

    return [float(s) for s in flux2_sigmas(steps, seq, start, **kwargs)]


def test_default_schedule_runs_every_step_of_a_low_strength_window(refiner, spy, vae, image):
    """mu 2.02 and the respaced window by default: strength 0.3 at 6 steps runs 6 model calls, on
    ``flux2_sigmas(6, seq, 0.7)``; ``schedule="clipped"`` runs only the full schedule's points below 0.3."""
    seq = (H // 16) * (W // 16)
    out = refiner.img2img(image, strength=0.3, sampling=SamplingSettings(steps=6, seed=3), prompt_embeds=EMB)
    expected = _flux2_sigmas(6, seq, 0.7)
    assert len(expected) == 7 and expected[0] == pytest.approx(0.3) and expected[-1] == 0.0
    np.testing.assert_allclose(out.parameters["sigmas"], expected, atol=1e-6)
    np.testing.assert_allclose([float(c["timestep"][0]) for c in spy.seen], expected[:-1], atol=1e-6)
    p = out.parameters
    assert (p["mu"], p["mu_rule"], p["schedule"], p["model_calls"]) == (2.02, "fixed", "respaced", 6)
    spy.seen.clear()
    clipped = refiner.img2img(
        image, strength=0.3, sampling=SamplingSettings(steps=6, seed=3, schedule="clipped"), prompt_embeds=EMB
    )
    expected_clipped = _flux2_sigmas(6, seq, 0.7, schedule="clipped")
    assert len(expected_clipped) < 7 and clipped.parameters["schedule"] == "clipped"
    np.testing.assert_allclose(clipped.parameters["sigmas"], expected_clipped, atol=1e-6)
    assert len(spy.seen) == len(expected_clipped) - 1
    # inpaint, outpaint and Heun run the same respaced windows
    spy.seen.clear()
    mask = torch.zeros(1, 1, H, W)
    mask[..., 16:48, 32:80] = 1
    heun = refiner.inpaint(
        image, mask, strength=0.3, sampling=SamplingSettings(steps=6, seed=3, sampler="heun"), prompt_embeds=EMB
    )
    assert heun.parameters["sigmas"] == out.parameters["sigmas"] and len(spy.seen) == 2 * 6 - 1
    side = refiner.outpaint(
        image, right=16, strength=0.4, sampling=SamplingSettings(steps=5, seed=3), prompt_embeds=EMB
    )
    assert len(side.parameters["sigmas"]) == 6 and side.parameters["schedule"] == "respaced"


def test_the_refiners_schedule_and_per_call_choices(transformer, vae, image):
    refiner = Flux2Refiner(Spy(transformer), vae, mu="empirical", schedule="clipped")
    seq = (H // 16) * (W // 16)
    out = refiner.img2img(image, strength=0.6, sampling=SamplingSettings(steps=9, seed=0), prompt_embeds=EMB)
    assert (out.parameters["mu_rule"], out.parameters["schedule"]) == ("empirical", "clipped")
    assert out.parameters["mu"] == pytest.approx(_mu(seq, 9), abs=1e-6)
    np.testing.assert_allclose(out.parameters["sigmas"], _expected_sigmas(9, seq, 0.4), atol=2e-6)
    override = refiner.img2img(
        image, strength=0.6, sampling=SamplingSettings(steps=9, seed=0, mu=3.0, schedule="respaced"), prompt_embeds=EMB
    )
    assert (override.parameters["mu"], override.parameters["mu_rule"]) == (3.0, "fixed")
    np.testing.assert_allclose(override.parameters["sigmas"], _flux2_sigmas(9, seq, 0.4, mu=3.0), atol=1e-6)
    txt = refiner.txt2img(height=H, width=W, sampling=SamplingSettings(steps=4, seed=0), prompt_embeds=EMB)
    assert txt.parameters["mu_rule"] == "empirical" and "schedule" not in txt.parameters  # a full window
    hires = refiner.hires(
        AsUpscaler(lambda z: torch.nn.functional.interpolate(z, scale_factor=2)),
        HiresSettings(base_size=(32, 32), base_steps=3),
        sampling=SamplingSettings(steps=4, seed=0),
        prompt_embeds=EMB,
    )
    assert hires.parameters["base_mu"] == pytest.approx(_mu(4, 3), abs=1e-6)  # each pass its own size and steps
    assert hires.parameters["mu"] == pytest.approx(_mu(16, 4), abs=1e-6)


def test_bad_schedule_choices_are_one_line_errors(refiner, transformer, vae, image):
    from flowlift.refine.loading import load_refiner

    with pytest.raises(FlowliftError, match="schedule must be one of respaced, clipped, got 'linear'"):
        Flux2Refiner(transformer, vae, schedule="linear")
    with pytest.raises(FlowliftError, match="mu must be in .* or empirical, got 'auto'"):
        Flux2Refiner(transformer, vae, mu="auto")
    with pytest.raises(FlowliftError, match="mu must be in"):
        load_refiner("no/such-model-anywhere", mu=None)  # checked before any weights are looked for
    with pytest.raises(FlowliftError, match=r"mu must be in \[0, 15\]"):  # the knob's range, at construction
        refiner.img2img(image, strength=0.5, sampling=SamplingSettings(steps=4, mu=-1.0), prompt_embeds=EMB)
    with pytest.raises(FlowliftError, match="finite"):
        refiner.img2img(
            image, strength=0.0, sampling=SamplingSettings(steps=4, mu=float("nan")), prompt_embeds=EMB
        )  # even with no step
    with pytest.raises(FlowliftError, match="empirical"):  # 24 tokens, 300 steps: diffusers' mu extrapolates below 0
        refine_latents(
            lambda x, s: x,
            init_latents=torch.zeros(1, 32, 8, 12),
            denoising_start=0.5,
            sampling=SamplingSettings(steps=300, mu="empirical"),
        )

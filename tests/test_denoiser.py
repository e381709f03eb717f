"""The FLUX.2 transformer wrapper: token layout, position ids, sigma timestep, guidance, CFG, references.

Pinned against a transcription of diffusers' ``Flux2Pipeline`` helpers (``_prepare_latent_ids``,
``_prepare_text_ids``, ``_prepare_image_ids``, ``_patchify_latents``, ``_pack_latents``; the pipeline
classes themselves need ``transformers``, which the test environment does not have), so the wrapper
calls the transformer exactly the way the diffusers pipelines do.
"""

from __future__ import annotations

import pytest
import torch

from flowlift.errors import FlowliftError
from flowlift.flux2.denoiser import (
    Flux2Denoiser,
    cfg_combine,
    latent_position_ids,
    reference_position_ids,
    text_position_ids,
)
from tiny_flux2 import DiffusersHelpers as P
from tiny_flux2 import Spy, prompt_embeds, tiny_transformer


@pytest.fixture(scope="module")
def klein():
    return tiny_transformer(guidance_embeds=False)


@pytest.fixture(scope="module")
def dev():
    return tiny_transformer(guidance_embeds=True, seed=3)


def _latents(seed: int = 0, batch: int = 1, h: int = 8, w: int = 12) -> torch.Tensor:
    return torch.randn(batch, 32, h, w, generator=torch.Generator().manual_seed(seed))


def _diffusers_call(transformer, x, sigma, embeds, guidance=None, refs=()):
    """The transformer call of diffusers' Flux2(Klein)Pipeline, built with the pipeline's helpers."""
    patches = P._patchify_latents(x)
    tokens = P._pack_latents(patches)
    ids = P._prepare_latent_ids(patches)
    n = tokens.shape[1]
    if refs:
        ref_patches = [P._patchify_latents(r) for r in refs]
        ref_ids = P._prepare_image_ids(ref_patches)
        ref_tokens = torch.cat([P._pack_latents(r) for r in ref_patches], dim=1)
        tokens = torch.cat([tokens, ref_tokens.expand(tokens.shape[0], -1, -1)], dim=1)
        ids = torch.cat([ids, ref_ids.expand(ids.shape[0], -1, -1)], dim=1)
    batch = x.shape[0]
    embeds = embeds.expand(batch, -1, -1)
    t = torch.full((batch,), sigma * 1000.0)
    out = transformer(
        hidden_states=tokens,
        timestep=t / 1000,
        guidance=None if guidance is None else torch.full([1], guidance).expand(batch),
        encoder_hidden_states=embeds,
        txt_ids=P._prepare_text_ids(embeds),
        img_ids=ids,
        return_dict=False,
    )[0][:, :n]
    h, w = patches.shape[2:]
    return P._unpatchify_latents(out.permute(0, 2, 1).reshape(batch, 128, h, w))


def test_position_ids_match_diffusers():
    patches = torch.zeros(1, 128, 3, 5)
    assert torch.equal(latent_position_ids(3, 5), P._prepare_latent_ids(patches)[0])
    assert torch.equal(text_position_ids(7), P._prepare_text_ids(torch.zeros(1, 7, 4))[0])
    refs = [torch.zeros(1, 128, 2, 3), torch.zeros(1, 128, 4, 1)]
    ids = reference_position_ids([(2, 3), (4, 1)])
    assert torch.equal(ids, P._prepare_image_ids(refs)[0])
    assert ids[:6, 0].tolist() == [10] * 6 and ids[6:, 0].tolist() == [20] * 4


@pytest.mark.parametrize("sigma", [1.0, 0.731, 0.05])
def test_klein_velocity_equals_diffusers_pipeline_call(klein, sigma):
    x, emb = _latents(batch=2), prompt_embeds()
    den = Flux2Denoiser(klein, emb)
    got = den(x, sigma)
    assert got.shape == x.shape
    torch.testing.assert_close(got, _diffusers_call(klein, x, sigma, emb), rtol=0, atol=1e-6)


def test_dev_velocity_passes_guidance(dev):
    x, emb = _latents(), prompt_embeds()
    got = Flux2Denoiser(dev, emb, guidance=2.5)(x, 0.6)
    torch.testing.assert_close(got, _diffusers_call(dev, x, 0.6, emb, guidance=2.5), rtol=0, atol=1e-6)
    # the guidance value reaches the model: another value gives another velocity
    assert not torch.allclose(got, _diffusers_call(dev, x, 0.6, emb, guidance=4.0), atol=1e-4)
    # dev default guidance is 4.0 (Flux2Pipeline's default)
    torch.testing.assert_close(
        Flux2Denoiser(dev, emb)(x, 0.6), _diffusers_call(dev, x, 0.6, emb, guidance=4.0), rtol=0, atol=1e-6
    )


def test_timestep_is_sigma_not_thousands(klein, dev):
    for model, expect_guidance in ((klein, None), (dev, 4.0)):
        spy = Spy(model)
        Flux2Denoiser(spy, prompt_embeds())(_latents(batch=2), 0.4375)
        (call,) = spy.seen
        assert call["timestep"].tolist() == [0.4375, 0.4375]  # sigma in [0, 1]; the model multiplies by 1000
        if expect_guidance is None:
            assert call["guidance"] is None
        else:
            assert call["guidance"].tolist() == [expect_guidance] * 2
        assert call["hidden_states"].shape == (2, 4 * 6, 128)
        assert call["img_ids"].shape == (24, 4) and call["txt_ids"].shape == (5, 4)


def test_velocity_depends_on_sigma(klein):
    # the model sees the noise level (guards against a constant timestep)
    x, emb = _latents(), prompt_embeds()
    den = Flux2Denoiser(klein, emb)
    assert not torch.allclose(den(x, 0.9), den(x, 0.2), atol=1e-4)


def test_true_cfg(klein):
    x, pos, neg = _latents(), prompt_embeds(seed=1), prompt_embeds(tokens=3, seed=2)
    den = Flux2Denoiser(klein, pos, negative_prompt_embeds=neg, cfg_scale=3.5)
    got = den(x, 0.5)
    assert den.calls == 2
    v_pos = _diffusers_call(klein, x, 0.5, pos)
    v_neg = _diffusers_call(klein, x, 0.5, neg)
    torch.testing.assert_close(got, v_neg + 3.5 * (v_pos - v_neg), rtol=0, atol=1e-5)
    torch.testing.assert_close(cfg_combine(v_pos, v_neg, 1.0), v_pos)
    # cfg 1 runs the model once and ignores the negative prompt
    one = Flux2Denoiser(klein, pos, negative_prompt_embeds=neg, cfg_scale=1.0)
    torch.testing.assert_close(one(x, 0.5), v_pos, rtol=0, atol=1e-6)
    assert one.calls == 1


def test_reference_images_are_clean_tokens_with_t_offsets(klein):
    x, emb = _latents(h=4, w=4), prompt_embeds()
    refs = [_latents(seed=5, h=4, w=6), _latents(seed=6, h=8, w=4)]
    spy = Spy(klein)
    got = Flux2Denoiser(spy, emb, reference_latents=refs)(x, 0.7)
    assert got.shape == x.shape
    torch.testing.assert_close(got, _diffusers_call(klein, x, 0.7, emb, refs=refs), rtol=0, atol=1e-6)
    ids = spy.seen[0]["img_ids"]
    assert ids[:4, 0].tolist() == [0] * 4 and ids[4:10, 0].tolist() == [10] * 6 and ids[10:, 0].tolist() == [20] * 8
    # the reference tokens are the clean latents themselves (no noise mixed in)
    from flowlift.flux2.latents import pack, patchify

    torch.testing.assert_close(spy.seen[0]["hidden_states"][:, 4:10], pack(patchify(refs[0])))
    assert not torch.allclose(got, Flux2Denoiser(klein, emb)(x, 0.7), atol=1e-4)


def test_bad_inputs_raise_one_line(klein, dev):
    with pytest.raises(FlowliftError, match="no guidance embedding"):
        Flux2Denoiser(klein, prompt_embeds(), guidance=3.0)
    with pytest.raises(FlowliftError, match="negative prompt"):
        Flux2Denoiser(klein, prompt_embeds(), cfg_scale=4.0)
    with pytest.raises(FlowliftError, match="expects 32"):
        Flux2Denoiser(dev, torch.zeros(1, 4, 64))
    with pytest.raises(FlowliftError, match="reference latents"):
        Flux2Denoiser(klein, prompt_embeds(), reference_latents=[torch.zeros(1, 16, 4, 4)])(_latents(), 0.5)

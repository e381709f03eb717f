import pytest
import torch

from flowlift.flux2 import latents as L


def test_patchify_channel_order_matches_flux2_convention():
    x = torch.randn(2, 32, 6, 8)
    p = L.patchify(x)
    assert p.shape == (2, 128, 3, 4)
    # channel index c*4 + pi*2 + pj holds pixel (2i+pi, 2j+pj) of channel c
    for c, pi, pj in [(0, 0, 0), (5, 1, 0), (31, 0, 1), (17, 1, 1)]:
        assert torch.equal(p[:, c * 4 + pi * 2 + pj], x[:, c, pi::2, pj::2])
    ref = x.view(2, 32, 3, 2, 4, 2).permute(0, 1, 3, 5, 2, 4).reshape(2, 128, 3, 4)
    assert torch.equal(p, ref)
    assert torch.equal(L.unpatchify(p), x)


def test_pack_unpack_roundtrip_and_order():
    p = torch.randn(2, 128, 3, 5)
    packed = L.pack(p)
    assert packed.shape == (2, 15, 128)
    assert torch.equal(packed[:, 1 * 5 + 2], p[:, :, 1, 2])
    assert torch.equal(L.unpack(packed, 3, 5), p)
    with pytest.raises(ValueError):
        L.unpack(packed, 4, 4)


def test_normalize_both_layouts_and_inverse():
    torch.manual_seed(0)
    mean = torch.randn(128)
    std = L.bn_std(torch.rand(128) * 3 + 0.5, 1e-4)
    raw = torch.randn(1, 32, 8, 10) * 2 + 1
    n32 = L.normalize(raw, mean, std)
    n128 = L.normalize(L.patchify(raw), mean, std)
    assert torch.allclose(L.patchify(n32), n128)
    expected = (L.patchify(raw) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    assert torch.allclose(n128, expected)
    assert torch.allclose(L.denormalize(n32, mean, std), raw, atol=1e-5)
    with pytest.raises(ValueError):
        L.normalize(torch.randn(1, 16, 4, 4), mean, std)


def test_seeded_noise_is_cpu_generated_and_reproducible():
    a = L.seeded_noise((1, 32, 4, 4), 7)
    b = L.seeded_noise((1, 32, 4, 4), 7, dtype=torch.float64)
    c = L.seeded_noise((1, 32, 4, 4), 8)
    assert torch.equal(a, b.float())
    assert not torch.equal(a, c)
    g = torch.Generator().manual_seed(7)
    assert torch.equal(L.seeded_noise((1, 32, 4, 4), g), a)


def test_comfyui_latent_roundtrip():
    x = torch.randn(1, 32, 8, 12)
    latent = L.to_comfyui_latent(x)
    assert latent["samples"].shape == (1, 128, 4, 6)
    assert torch.equal(L.from_comfyui_latent(latent), x)
    with pytest.raises(ValueError):
        L.from_comfyui_latent({"samples": x})

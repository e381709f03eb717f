"""FLUX.2 VAE adapter (tiny random AutoencoderKLFlux2), single-file conversion, load_vae specs."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLFlux2
from safetensors.torch import save_file

from builders import fake_hub_cache
from door_helpers import assert_refuses_misshapen_inputs
from flowlift.errors import FlowliftError
from flowlift.models.flux2_vae_convert import convert_original_flux2_vae, flux2_from_state_dict, infer_flux2_config
from flowlift.models.vae import TAEF2VAE, Flux2VAE
from flowlift.models.vae_loading import load_vae


def tiny_flux2(norm_num_groups: int = 8, seed: int = 0) -> AutoencoderKLFlux2:
    """A tiny AutoencoderKLFlux2 with non-trivial weights and bn statistics."""
    torch.manual_seed(seed)
    model = AutoencoderKLFlux2(
        block_out_channels=(32, 32, 32, 32),
        norm_num_groups=norm_num_groups,
        layers_per_block=1,
        sample_size=32,
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        model.bn.running_mean.copy_(torch.randn(128) * 0.5)
        model.bn.running_var.copy_(torch.rand(128) * 2 + 0.1)
    return model.eval()


def pipeline_normalize(raw: torch.Tensor, model: AutoencoderKLFlux2) -> torch.Tensor:
    """What diffusers' Flux2Pipeline does to VAE latents (patchified, 128 channels)."""
    b, c, h, w = raw.shape
    patched = raw.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)
    mean = model.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(model.bn.running_var.view(1, -1, 1, 1) + model.config.batch_norm_eps)
    return (patched - mean) / std


def patchify_ref(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def to_original_keys(state: dict[str, torch.Tensor], num_up_blocks: int) -> dict[str, torch.Tensor]:
    """diffusers -> original BFL/ComfyUI names, written independently of the module under test."""
    out = {}
    for key, value in state.items():
        new = key
        if key == "bn.num_batches_tracked":
            continue  # the original files carry only the running statistics
        if key.startswith("quant_conv."):
            new = "encoder." + key
        elif key.startswith("post_quant_conv."):
            new = "decoder." + key
        new = new.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        new = new.replace("mid_block.resnets.0", "mid.block_1").replace("mid_block.resnets.1", "mid.block_2")
        if "mid_block.attentions.0." in new:
            new = new.replace("mid_block.attentions.0.", "mid.attn_1.")
            for a, b in (
                ("group_norm", "norm"),
                ("to_q", "q"),
                ("to_k", "k"),
                ("to_v", "v"),
                ("to_out.0", "proj_out"),
            ):
                new = new.replace(f"attn_1.{a}.", f"attn_1.{b}.")
            if value.ndim == 2:
                value = value[:, :, None, None]
        if new.startswith("encoder.down_blocks."):
            parts = new.split(".")
            i, kind = parts[2], parts[3]
            rest = ".".join(parts[5:]) if kind == "downsamplers" else ".".join(parts[4:])
            new = f"encoder.down.{i}.downsample.{rest}" if kind == "downsamplers" else f"encoder.down.{i}.block.{rest}"
        if new.startswith("decoder.up_blocks."):
            parts = new.split(".")
            k, kind = num_up_blocks - 1 - int(parts[2]), parts[3]
            rest = ".".join(parts[5:]) if kind == "upsamplers" else ".".join(parts[4:])
            new = f"decoder.up.{k}.upsample.{rest}" if kind == "upsamplers" else f"decoder.up.{k}.block.{rest}"
        out[new] = value
    return out


@pytest.fixture(scope="module")
def model() -> AutoencoderKLFlux2:
    return tiny_flux2()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    torch.manual_seed(3)
    return torch.rand(2, 3, 64, 48)


def test_encode_normalizes_like_the_flux2_pipeline(model, images):
    vae = load_vae(model)
    assert isinstance(vae, Flux2VAE)
    assert vae.approximate_decode is False and vae.spatial_factor == 8
    latents = vae.encode(images)
    assert latents.shape == (2, 32, 8, 6)
    with torch.no_grad():
        raw = model.encode(images * 2 - 1).latent_dist.mode()
        expected = pipeline_normalize(raw, model)
    torch.testing.assert_close(patchify_ref(latents), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(vae.encode_raw(images), raw, rtol=0, atol=1e-6)
    torch.testing.assert_close(vae.bn_mean, model.bn.running_mean)
    torch.testing.assert_close(vae.bn_std, torch.sqrt(model.bn.running_var + model.config.batch_norm_eps))


def test_decode_inverts_the_normalization(model, images):
    vae = load_vae(model)
    latents = vae.encode(images)
    with torch.no_grad():
        b, c, h, w = latents.shape
        raw = patchify_ref(latents) * torch.sqrt(model.bn.running_var + 1e-4).view(1, -1, 1, 1)
        raw = raw + model.bn.running_mean.view(1, -1, 1, 1)
        raw = raw.view(b, c, 2, 2, h // 2, w // 2).permute(0, 1, 4, 2, 5, 3).reshape(b, c, h, w)
        expected = (model.decode(raw).sample + 1) / 2  # unclamped
    decoded = vae.decode(latents)
    torch.testing.assert_close(decoded, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(vae.decode_raw(raw), expected, rtol=0, atol=1e-5)


def test_save_load_round_trip_through_a_diffusers_folder(tmp_path, model, images):
    model.save_pretrained(tmp_path / "repo" / "vae")
    for spec in (tmp_path / "repo", tmp_path / "repo" / "vae"):
        vae = load_vae(spec)
        assert isinstance(vae, Flux2VAE)
        torch.testing.assert_close(vae.encode(images), load_vae(model).encode(images), rtol=0, atol=0)


def test_single_file_original_keys_round_trip(tmp_path, images):
    # norm_num_groups=32 is what the released VAE uses and what a single file implies.
    model = tiny_flux2(norm_num_groups=32, seed=5)
    original = to_original_keys(model.state_dict(), num_up_blocks=4)
    assert "encoder.down.0.block.0.conv1.weight" in original
    assert "decoder.up.3.block.0.conv1.weight" in original  # decoder order is reversed
    assert original["encoder.mid.attn_1.q.weight"].ndim == 4
    converted = convert_original_flux2_vae(original)
    reference = {k: v for k, v in model.state_dict().items() if k != "bn.num_batches_tracked"}
    assert converted.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(converted[key], value), key
    config = infer_flux2_config(converted)
    assert tuple(config["block_out_channels"]) == tuple(model.config.block_out_channels)
    assert config["decoder_block_out_channels"] is None
    for name in ("layers_per_block", "latent_channels", "norm_num_groups", "use_quant_conv"):
        assert config[name] == model.config[name], name

    path = tmp_path / "flux2-vae.safetensors"
    save_file({f"first_stage_model.{k}": v.contiguous() for k, v in original.items()}, str(path))
    vae = load_vae(path)
    assert isinstance(vae, Flux2VAE)
    torch.testing.assert_close(vae.encode(images), load_vae(model).encode(images), rtol=0, atol=0)


def test_single_file_with_other_group_count(images):
    model = tiny_flux2(norm_num_groups=8, seed=6)
    original = to_original_keys(model.state_dict(), num_up_blocks=4)
    vae = flux2_from_state_dict(original, norm_num_groups=8)
    torch.testing.assert_close(vae.decode(vae.encode(images)), load_vae(model).decode(load_vae(model).encode(images)))


def test_single_file_mismatches_are_clear_errors(tmp_path):
    model = tiny_flux2(norm_num_groups=32, seed=7)
    original = to_original_keys(model.state_dict(), num_up_blocks=4)
    extra = dict(original, **{"encoder.down.0.block.0.bogus.weight": torch.zeros(1)})
    with pytest.raises(FlowliftError, match="1 keys fit no known name: encoder.down.0.block.0.bogus.weight"):
        flux2_from_state_dict(extra)
    missing = dict(original)
    del missing["decoder.mid.attn_1.proj_out.weight"]
    with pytest.raises(FlowliftError, match="missing 1: decoder.mid_block.attentions.0.to_out.0.weight") as info:
        flux2_from_state_dict(missing)
    assert "\n" not in str(info.value)
    misshaped = dict(original)
    misshaped["encoder.conv_out.weight"] = torch.zeros(64, 32, 1, 1)
    with pytest.raises(FlowliftError, match="mis-shaped"):
        flux2_from_state_dict(misshaped)
    corrupt = tmp_path / "flux2-vae.safetensors"
    corrupt.write_bytes(b"\x00" * 64)
    with pytest.raises(FlowliftError, match="cannot read"):
        load_vae(corrupt)


def test_tiling_switch(model, images, monkeypatch):
    import flowlift.models.flux2_tiling as tiling

    vae = load_vae(model)
    seen = []
    original = tiling.encode_tiled
    monkeypatch.setattr(tiling, "encode_tiled", lambda m, x, **kw: seen.append(x.shape) or original(m, x, **kw))
    monkeypatch.setattr(model, "_tiled_encode", lambda x: pytest.fail("diffusers' tiled encode ran"))
    vae.encode(images)  # 64 px < the 2048 px threshold: no tiling
    assert seen == [] and model.use_tiling is False
    vae.encode(images, tiled=True)  # tiny config: 32 px tiles, flowlift's bounded executor of them
    assert len(seen) == 1 and model.use_tiling is False
    monkeypatch.setattr(vae, "auto_tile_side", 32)
    vae.encode(images)
    assert len(seen) == 2
    vae.encode(images, tiled=False)
    assert len(seen) == 2
    model.use_tiling = True  # set on the module by a caller: a whole-frame encode stays whole, and it is restored
    vae.encode(images, tiled=False)
    assert len(seen) == 2 and model.use_tiling is True


def test_tiled_decode_reports_diffusers_tiles(model, images, monkeypatch):
    """Flux2VAE's tile progress counts diffusers' own decoder runs (a hook, not a copy of the decode)."""
    from flowlift.models.vae import diffusers_decode_tiles

    vae = load_vae(model)
    latents = vae.encode(images)  # (2, 32, 8, 6); the tiny config tiles 4 latent px with stride 3
    seen: list[tuple[int, int]] = []
    plain = vae.decode(latents, tiled=True)
    hooked = vae.decode(latents, tiled=True, on_tile=lambda done, total: seen.append((done, total)))
    assert torch.equal(plain, hooked)
    assert seen == [(done, 6) for done in range(1, 7)]  # ceil(8 / 3) * ceil(6 / 3)
    assert not model.decoder._forward_hooks  # removed afterwards
    seen.clear()
    monkeypatch.setattr(model, "use_slicing", True)  # a batch decoded one image at a time
    vae.decode(latents, tiled=True, on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(done, 12) for done in range(1, 13)]
    seen.clear()
    vae.decode(latents, tiled=False, on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 2), (2, 2)]  # untiled, sliced: one decoder run per image
    kwargs = dict(batch=1, tiling=True, slicing=False, tile_latent=64, overlap=0.25)
    assert diffusers_decode_tiles(64, 64, **kwargs) == 1  # no side over one tile: not tiled
    assert diffusers_decode_tiles(128, 65, **kwargs) == 3 * 2  # stride int(64 * 0.75) = 48


def test_bad_inputs(model):
    vae = load_vae(model)
    assert_refuses_misshapen_inputs(vae)


def test_load_vae_specs(shared, tmp_path):
    assert isinstance(load_vae(shared / "models" / "taef2"), TAEF2VAE)
    assert isinstance(load_vae(str(shared / "models" / "taef2" / "taef2_encoder.pth")), TAEF2VAE)
    with pytest.raises(FlowliftError, match="HF_HUB_OFFLINE=1"):
        load_vae("flowlift-tests/no-such-vae-repo")
    with pytest.raises(FlowliftError, match="no such file or folder"):
        load_vae(str(tmp_path / "missing" / "file.safetensors"))
    with pytest.raises(FlowliftError, match="holds no TAEF2 files"):
        load_vae(tmp_path)
    with pytest.raises(FlowliftError, match="must be a name"):
        load_vae(42)
    bad_config = tmp_path / "cfg"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(FlowliftError, match="cannot read"):
        load_vae(bad_config)


def test_hub_specs_resolve_through_the_offline_cache(shared, tmp_path, monkeypatch, model):
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    folder = shared / "models" / "taef2"
    fake_hub_cache(
        cache,
        "madebyollin/taef2",
        {n: (folder / n).read_bytes() for n in ("taef2_encoder.pth", "taef2_decoder.pth")},
    )
    model.save_pretrained(tmp_path / "klein" / "vae")
    klein = {f"vae/{p.name}": p.read_bytes() for p in (tmp_path / "klein" / "vae").iterdir()}
    fake_hub_cache(cache, "black-forest-labs/FLUX.2-klein-4B", klein)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    taef2 = load_vae("taef2")
    assert isinstance(taef2, TAEF2VAE) and taef2.model.encoder is not None
    flux2 = load_vae("flux2")
    assert isinstance(flux2, Flux2VAE)
    torch.testing.assert_close(flux2.bn_mean, model.bn.running_mean)
    assert isinstance(load_vae("black-forest-labs/FLUX.2-klein-4B"), Flux2VAE)


def test_flux2_spec_without_cache_is_one_clear_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(FlowliftError, match="FLUX.2-klein-4B") as info:
        load_vae("flux2")
    assert "\n" not in str(info.value)

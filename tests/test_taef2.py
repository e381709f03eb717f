"""TAEF2: golden vectors from both file layouts, exact tiling, layouts, strict loading."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowlift.errors import FlowliftError
from flowlift.models.taef2 import (
    TAEF2,
    build_decoder,
    detect_layout,
    local_op,
)
from flowlift.models.taef2_tiling import LocalOp, chain_intervals, input_interval, split_axis
from flowlift.models.vae import TAEF2VAE
from flowlift.models.vae_loading import load_vae

GOLDEN_TOL = 1e-4
TILE_TOL = 1e-4


@pytest.fixture(scope="module")
def golden(shared):
    return load_file(str(shared / "golden" / "taef2_coffee_256x384.safetensors"))


@pytest.fixture(scope="module")
def pth_states(shared):
    folder = shared / "models" / "taef2"
    return {
        part: torch.load(str(folder / f"taef2_{part}.pth"), map_location="cpu", weights_only=True)
        for part in ("encoder", "decoder")
    }


@pytest.fixture(scope="module")
def vae(shared) -> TAEF2VAE:
    loaded = load_vae(shared / "models" / "taef2")
    assert isinstance(loaded, TAEF2VAE)
    return loaded


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_golden_from_released_pth_files(vae, golden):
    latent = vae.encode(golden["image_01"], tiled=False)
    assert _max_err(latent, golden["latent"]) <= GOLDEN_TOL
    decoded = vae.decode(golden["latent"], tiled=False)
    assert _max_err(decoded, golden["decoded_01"]) <= GOLDEN_TOL
    # Not clamped: the golden decode leaves [0, 1] and so must ours.
    assert decoded.min() < 0 and decoded.max() > 1
    assert vae.approximate_decode is True and vae.spatial_factor == 8
    assert vae.bn_mean is None and vae.bn_std is None


def test_golden_from_diffusers_layout_safetensors(tmp_path, pth_states, golden):
    # The hub's diffusers layout, written here straight from the description:
    # encoder.layers.{i}.* and decoder.layers.{i-1}.* (the decoder's clamp has no weights).
    state = {}
    for key, value in pth_states["encoder"].items():
        index, rest = key.split(".", 1)
        state[f"encoder.layers.{index}.{rest}"] = value
    for key, value in pth_states["decoder"].items():
        index, rest = key.split(".", 1)
        state[f"decoder.layers.{int(index) - 1}.{rest}"] = value
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(state, str(path))
    assert detect_layout(state) == "diffusers"
    for spec in (path, tmp_path):  # the file, and the folder holding it
        vae = load_vae(spec)
        assert isinstance(vae, TAEF2VAE)
        assert _max_err(vae.encode(golden["image_01"]), golden["latent"]) <= GOLDEN_TOL
        assert _max_err(vae.decode(golden["latent"]), golden["decoded_01"]) <= GOLDEN_TOL


def test_detect_layout(pth_states):
    assert detect_layout(pth_states["encoder"]) == "encoder"
    assert detect_layout(pth_states["decoder"]) == "decoder"
    assert detect_layout({f"encoder.{k}": v for k, v in pth_states["encoder"].items()}) == "flowlift"
    assert detect_layout({"foo.weight": torch.zeros(1)}) == "unknown"
    assert detect_layout({}) == "unknown"


@pytest.mark.parametrize(("band", "tile"), [(9, 5), (64, 64)])
def test_tiled_decode_equals_full_frame(vae, band, tile):
    # Odd sizes, bands and tiles that divide nothing evenly, batch > 1.
    torch.manual_seed(0)
    latents = torch.randn(2, 32, 13, 19) * 1.5
    with torch.no_grad():
        full = vae.model.decode_full(latents)
        tiled = vae.model.decode_tiled(latents, band=band, tile=tile)
    assert full.shape == (2, 3, 104, 152)
    assert _max_err(tiled, full) <= TILE_TOL


@pytest.mark.parametrize(("band", "tile"), [(9, 5), (256, 7)])
def test_tiled_encode_equals_full_frame(vae, band, tile):
    torch.manual_seed(1)
    images = torch.rand(2, 3, 104, 152)
    with torch.no_grad():
        full = vae.model.encode_full(images)
        tiled = vae.model.encode_tiled(images, band=band, tile=tile)
    assert full.shape == (2, 32, 13, 19)
    assert _max_err(tiled, full) <= TILE_TOL


def test_tiled_decode_reports_every_tile_and_changes_nothing(vae):
    """The progress hook of the tiled decode: one call per tile over the batch, same pixels as without it."""
    torch.manual_seed(2)
    latents = torch.randn(2, 32, 13, 19)
    seen: list[tuple[int, int]] = []
    with torch.no_grad():
        plain = vae.model.decode_tiled(latents, band=9, tile=5)
        hooked = vae.model.decode_tiled(latents, band=9, tile=5, on_tile=lambda done, total: seen.append((done, total)))
    assert torch.equal(plain, hooked)
    # per image: rows 13 -> bands of 6 and 7 -> 2 tiles each; columns 19 -> bands 6, 7, 6 -> 2 tiles each:
    # (2 * 2) * (3 * 2) = 24 tiles, 48 for the batch of two
    assert seen == [(done, 48) for done in range(1, 49)]
    seen.clear()
    vae.decode(latents[:1], tiled=False, on_tile=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]  # a whole-frame decode is one tile


def test_tiled_decode_bounds_every_activation(vae):
    """Tiling must really tile: no conv in the local part sees more than a haloed tile."""
    seen: list[tuple[int, int]] = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape[-2:])))
        for m in vae.model.decoder[16:].modules()
        if isinstance(m, torch.nn.Conv2d)
    ]
    try:
        with torch.no_grad():
            vae.model.decode_tiled(torch.randn(1, 32, 24, 24), band=24, tile=8)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen
    # 8x8 latent tiles are 64 px; the 8x stage needs a few pixels of halo on each side.
    assert max(h for h, _ in seen) <= 64 + 16 and max(w for _, w in seen) <= 64 + 16


def test_auto_tiling_switches_by_size(vae, monkeypatch):
    calls = []
    model = vae.model
    monkeypatch.setattr(model, "decode_tiled", lambda z, **kw: calls.append("tiled") or model.decode_full(z))
    latents = torch.randn(1, 32, 4, 6)
    vae.decode(latents)
    assert calls == []  # 32x48 px is far below the threshold
    monkeypatch.setattr(vae, "auto_tile_pixels", 100)
    vae.decode(latents)
    assert calls == ["tiled"]
    vae.decode(latents, tiled=False)
    assert calls == ["tiled"]
    monkeypatch.setattr(vae, "auto_tile_pixels", 10**9)
    vae.decode(latents, tiled=True)
    assert calls == ["tiled", "tiled"]


def test_batch_and_dtype_handling(vae):
    images = torch.rand(3, 3, 32, 48, dtype=torch.float64)
    latents = vae.encode(images)
    assert latents.shape == (3, 32, 4, 6) and latents.dtype == torch.float64
    single = vae.encode(images[1:2])
    assert _max_err(latents[1:2], single) <= 1e-5


def test_bad_inputs_raise_one_line(vae):
    with pytest.raises(FlowliftError, match="multiples of 8"):
        vae.encode(torch.rand(1, 3, 30, 32))
    with pytest.raises(FlowliftError, match=r"\(B, 3, H, W\)"):
        vae.encode(torch.rand(1, 4, 32, 32))
    with pytest.raises(FlowliftError, match="32"):
        vae.decode(torch.rand(1, 16, 4, 4))
    with pytest.raises(FlowliftError, match="float"):
        vae.encode(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))


def test_corrupt_and_mismatched_files(tmp_path, pth_states):
    bad = tmp_path / "taef2_decoder.pth"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(FlowliftError, match="cannot read") as info:
        load_vae(bad)
    assert "\n" not in str(info.value)

    missing = dict(pth_states["decoder"])
    del missing["3.pool.1.weight"]  # the GroupNorm AutoencoderTiny would silently drop
    torch.save(missing, tmp_path / "missing_decoder.pth")
    with pytest.raises(FlowliftError, match="missing 1: decoder.3.pool.1.weight"):
        load_vae(tmp_path / "missing_decoder.pth")

    wrong = dict(pth_states["encoder"])
    wrong["1.conv.0.weight"] = torch.zeros(64, 64, 1, 1)
    torch.save(wrong, tmp_path / "wrong_encoder.pth")
    with pytest.raises(FlowliftError, match="mis-shaped"):
        load_vae(tmp_path / "wrong_encoder.pth")

    save_file({"some.other.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(FlowliftError, match="neither a TAEF2, a FLUX.2 VAE nor a Mage-VAE"):
        load_vae(tmp_path / "other.safetensors")


def test_half_models_and_sibling_files(tmp_path, pth_states, golden):
    torch.save(pth_states["decoder"], tmp_path / "taef2_decoder.pth")
    decoder_only = load_vae(tmp_path / "taef2_decoder.pth")
    assert _max_err(decoder_only.decode(golden["latent"]), golden["decoded_01"]) <= GOLDEN_TOL
    with pytest.raises(FlowliftError, match="no encoder"):
        decoder_only.encode(golden["image_01"])
    torch.save(pth_states["encoder"], tmp_path / "taef2_encoder.pth")
    both = load_vae(tmp_path / "taef2_decoder.pth")  # finds the sibling encoder
    assert both.model.encoder is not None and both.model.decoder is not None


def test_region_maths():
    # same: one row per conv either side, clipped at the frame.
    assert input_interval(LocalOp("same", 3), 10, 20, 100) == (7, 23)
    assert input_interval(LocalOp("same", 3), 1, 99, 100) == (0, 100)
    # down: output j reads 2j-1..2j+1; the start stays even.
    assert input_interval(LocalOp("down"), 5, 8, 100) == (8, 16)
    # up: nearest neighbour.
    assert input_interval(LocalOp("up"), 5, 8, 100) == (2, 4)
    assert split_axis(10, 4) == [(0, 3), (3, 7), (7, 10)]
    ops = [local_op(m) for m in build_decoder()[16:]]
    assert [op.kind for op in ops] == ["up", "same", "same", "same"]
    # The 8x stage needs ceil(5 / 2) = 3 rows of 4x-resolution halo on each side.
    assert chain_intervals(ops, 80, 160, 1000)[0] == (37, 83)


def test_module_spec_and_unknown_module(pth_states):
    model = TAEF2(encoder=False)
    model.decoder.load_state_dict(pth_states["decoder"])
    vae = load_vae(model)
    assert isinstance(vae, TAEF2VAE) and vae.model is model
    with pytest.raises(FlowliftError, match="TAEF2 or MageVAEModel or a diffusers AutoencoderKLFlux2"):
        load_vae(torch.nn.Linear(2, 2))


def test_a_missing_half_names_its_file():
    from flowlift.models.taef2 import TAEF2

    with pytest.raises(FlowliftError, match=r"this TAEF2 has no decoder: .* put taef2_decoder\.pth beside it"):
        TAEF2._need(None, "decoder")

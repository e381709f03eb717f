"""SesquiLSR (flowlift.models.sesqui_lsr): the released layout loads strictly and equals the published network
(tests/sesqui_reference.py) at 1x, 1.5x, 2x and non-uniform factors; bad files and factors are one line."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from flowlift.errors import FlowliftError
from flowlift.models.sesqui_lsr import (
    SesquiLSR,
    latents_from_raw,
    load_sesqui_lsr,
    raw_from_latents,
    sesqui_upscale_latents,
)
from sesqui_reference import random_state, reference_forward, released_layout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    state = random_state(0)
    path = tmp_path_factory.mktemp("sesqui") / "upscaler_Flux2.safetensors"
    save_file(state, str(path))
    return path, state


def test_layout_is_the_released_one():
    model = SesquiLSR()
    layout = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert layout == released_layout()
    assert len(layout) == 80
    assert 3.0e6 < sum(p.numel() for p in model.parameters()) < 3.2e6


@pytest.mark.parametrize(
    "size, target",
    [((6, 8), (6, 8)), ((8, 10), (12, 15)), ((6, 8), (12, 16)), ((8, 6), (10, 12)), ((7, 9), (14, 10))],
    ids=["1x", "1.5x", "2x", "1.25x-by-2x", "2x-by-1.11x"],
)
def test_equals_the_published_network(checkpoint, size, target):
    path, state = checkpoint
    model = load_sesqui_lsr(path, "cpu", torch.float32)
    x = torch.randn(2, 32, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(x, target)
        ref = reference_forward(state, x, target)
    assert ours.shape == (2, 32, *target)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0.1
    rel = (ours - ref).norm() / ref.norm()
    assert rel <= 1e-5, rel
    assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max() * 10


def test_a_wrong_weight_changes_the_output(checkpoint, tmp_path):
    """The comparison can fail: perturbing one resampling-head tensor moves the output away from the reference."""
    path, state = checkpoint
    bad = dict(state)
    bad["upsample.filter_net.2.bias"] = state["upsample.filter_net.2.bias"] + 0.5
    other = tmp_path / "other.safetensors"
    save_file(bad, str(other))
    x = torch.randn(1, 32, 8, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = load_sesqui_lsr(other)(x, (12, 12))
        ref = reference_forward(state, x, (12, 12))
    assert (out - ref).norm() / ref.norm() > 1e-3


def _save(tmp_path, state):
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    return path


def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_missing_tensor_is_one_line_naming_it(checkpoint, tmp_path):
    state = dict(checkpoint[1])
    del state["out_blocks.3.mix.weight"]
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(_save(tmp_path, state))
    assert "missing 1: out_blocks.3.mix.weight" in _one_line(e)


def test_extra_tensor_is_one_line_naming_it(checkpoint, tmp_path):
    state = dict(checkpoint[1]) | {"upsample.tap_offsets": torch.zeros(4)}
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(_save(tmp_path, state))
    assert "unexpected 1: upsample.tap_offsets" in _one_line(e)


def test_misshapen_tensor_is_one_line_naming_it(checkpoint, tmp_path):
    state = dict(checkpoint[1])
    state["head_conv.0.weight"] = torch.zeros(64, 16, 3, 3)  # the 16-channel (FLUX.1) variant's first conv
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(_save(tmp_path, state))
    assert "head_conv.0.weight (64, 16, 3, 3) != (64, 32, 3, 3)" in _one_line(e)


def test_non_finite_tensor_is_one_line_naming_it(checkpoint, tmp_path):
    state = dict(checkpoint[1])
    state["upsample.rank_gain"] = torch.tensor([float("nan"), 0.0])
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(_save(tmp_path, state))
    assert "NaN in `upsample.rank_gain`" in _one_line(e)


def test_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(tmp_path / "upscaler_Flux2.safetensors")
    text = _one_line(e)
    assert "models/ folder" in text and "LoganBooker/SesquiLSR" in text


def test_pickle_files_are_refused(tmp_path):
    path = tmp_path / "w.pth"
    torch.save(random_state(0), path)
    with pytest.raises(FlowliftError) as e:
        load_sesqui_lsr(path)
    assert "safetensors" in _one_line(e)


@pytest.mark.parametrize(
    "target", [(7, 8), (8, 17), (17, 17), (4, 4)], ids=["below-1x", "over-2x-w", "over-2x", "down"]
)
def test_factor_outside_1_to_2_is_one_line(checkpoint, target):
    model = load_sesqui_lsr(checkpoint[0])
    with pytest.raises(FlowliftError) as e:
        model(torch.zeros(1, 32, 8, 8), target)
    assert "[1, 2]" in _one_line(e)


def test_normalized_conversion_round_trips_and_needs_statistics(checkpoint):
    g = torch.Generator().manual_seed(3)
    mean, std = torch.randn(128, generator=g), torch.rand(128, generator=g) + 0.5
    z = torch.randn(1, 32, 8, 8, generator=g)
    raw = raw_from_latents(z, mean, std)
    # patchified channel c*4 + pi*2 + pj holds latent channel c at sub-position (pi, pj)
    assert torch.allclose(raw[0, 5, 1, 0], z[0, 5, 1, 0] * std[5 * 4 + 2] + mean[5 * 4 + 2])
    assert torch.allclose(latents_from_raw(raw, mean, std), z, atol=1e-6)
    model = load_sesqui_lsr(checkpoint[0])
    out = sesqui_upscale_latents(model, z, (12, 12), mean, std)
    expected = latents_from_raw(reference_forward(checkpoint[1], raw, (12, 12)), mean, std)
    assert (out - expected).norm() / expected.norm() <= 1e-5
    with pytest.raises(FlowliftError) as e:
        sesqui_upscale_latents(model, z, (12, 12), None, None)
    assert "BN statistics" in _one_line(e) and "set vae to flux2" in _one_line(e) and "--vae" not in _one_line(e)
    assert e.value.fields == ("vae",) and "set --vae to flux2" in e.value.worded({"vae": "--vae"})
    with pytest.raises(FlowliftError) as e:
        sesqui_upscale_latents(model, z, (12, 11), mean, std)
    assert "even" in _one_line(e)
